package main

import (
	"context"
	"encoding/json"
	"fmt"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/streamq/streamq"
)

// runRPC measures request/response: many callers each Produce and Wait.
func runRPC(ctx context.Context, e *env, n int) error {
	pad := padFor(e.cfg.payload)
	return compare(e, "rpc",
		func() (Result, error) { return rpcStreamq(ctx, e, n, pad) },
		func() (Result, error) {
			return rpcBaseline(ctx, e, n, pad, "rpc", e.cfg.producers, e.cfg.callers, e.cfg.workers)
		})
}

// rpcHandler marks each execution and answers with the job's index.
func rpcHandler(t *tracker, herr *handlerErrors) streamq.Handler[job, int] {
	return func(_ context.Context, m *streamq.Message[job]) (int, error) {
		if err := t.mark(m.Payload.Seq, 0); err != nil {
			herr.add(err)
		}
		return m.Payload.Seq, nil
	}
}

// rpcStreamq: P producers with -callers goroutines each doing Produce + Wait;
// consumers store results (the default).
func rpcStreamq(ctx context.Context, e *env, n int, pad string) (Result, error) {
	q := e.queue("rpc", "streamq")
	t := newTracker(n)
	var herr handlerErrors
	cs, err := startConsumers(ctx, e, q, rpcHandler(t, &herr), consumerOpts(e, streamq.ConsumerOptions{}))
	if err != nil {
		return Result{}, err
	}
	defer cs.stop()
	producers := make([]*streamq.Producer[job, int], e.cfg.producers)
	for i := range producers {
		cl := e.client(0)
		defer cl.Close()
		p, err := streamq.NewProducer[job, int](cl, q, &streamq.ProducerOptions{Logger: e.log, Concurrency: e.cfg.sendConc})
		if err != nil {
			return Result{}, err
		}
		defer p.Close()
		producers[i] = p
	}

	rtt := make([]int64, n)
	m := e.meter()
	if err := m.start(ctx); err != nil {
		return Result{}, err
	}
	var next atomic.Int64
	var g errGroup
	for _, p := range producers {
		for range e.cfg.callers {
			g.Go(func() error {
				for {
					i := int(next.Add(1) - 1)
					if i >= n {
						return nil
					}
					t0 := time.Now()
					pr, err := p.Produce(ctx, jobID(i), job{Seq: i, T: t0.UnixNano(), Pad: pad})
					if err != nil {
						return fmt.Errorf("Produce: %w", err)
					}
					wctx, cancel := context.WithTimeout(ctx, time.Minute)
					got, err := pr.Wait(wctx)
					cancel()
					if err != nil {
						return fmt.Errorf("Wait %s: %w", jobID(i), err)
					}
					rtt[i] = int64(time.Since(t0))
					if got != i {
						return fmt.Errorf("job %d got the result of job %d", i, got)
					}
				}
			})
		}
	}
	if err := g.Wait(); err != nil {
		return Result{}, err
	}
	if err := finish(ctx, e, m, t, streamKey(q), streamq.DefaultGroup); err != nil {
		return Result{}, err
	}
	if err := cs.stop(); err != nil {
		return Result{}, err
	}
	if err := checkEmpty(ctx, e, streamKey(q)); err != nil {
		return Result{}, err
	}
	if err := firstErr(herr.err(), t.verify("streamq rpc")); err != nil {
		return Result{}, err
	}
	return m.result("rpc", "streamq", n, "round trip", rtt), nil
}

// rpcBaseline is plain request/response over a stream: a caller XADDs the
// request with a reply key and BLPOPs that key; a consumer reads requests
// (COUNT 100), and per batch pipelines an LPUSH per reply with XACK+XDEL.
// The latency scenario uses it with one producer, one caller, one consumer.
func rpcBaseline(ctx context.Context, e *env, n int, pad, scenario string, producers, callers, consumers int) (Result, error) {
	b, err := newBaseline(ctx, e, scenario)
	if err != nil {
		return Result{}, err
	}
	defer b.cleanup(ctx, e)
	t := newTracker(n)
	var herr handlerErrors
	stop := b.runConsumers(ctx, e, consumers, 100, 100*time.Millisecond, func(m redis.XMessage, pipe redis.Pipeliner) error {
		j, err := decodeJob(m)
		if err != nil {
			return err
		}
		if err := t.mark(j.Seq, 0); err != nil {
			herr.add(err)
		}
		reply, _ := m.Values["r"].(string)
		pipe.LPush(ctx, reply, strconv.Itoa(j.Seq))
		return nil
	})
	defer stop()

	rtt := make([]int64, n)
	m := e.meter()
	if err := m.start(ctx); err != nil {
		return Result{}, err
	}
	var next atomic.Int64
	var g errGroup
	for range producers {
		c := e.client(callers + 4) // every caller holds a connection in BLPOP
		defer c.Close()
		for range callers {
			g.Go(func() error {
				for {
					i := int(next.Add(1) - 1)
					if i >= n {
						return nil
					}
					t0 := time.Now()
					payload, err := json.Marshal(job{Seq: i, T: t0.UnixNano(), Pad: pad})
					if err != nil {
						return err
					}
					reply := b.prefix + "reply:" + jobID(i)
					if err := c.XAdd(ctx, b.xaddArgs(jobID(i), payload, "r", reply)).Err(); err != nil {
						return fmt.Errorf("XADD: %w", err)
					}
					res, err := c.BLPop(ctx, time.Minute, reply).Result()
					if err != nil {
						return fmt.Errorf("BLPOP %s: %w", reply, err)
					}
					rtt[i] = int64(time.Since(t0))
					if res[1] != strconv.Itoa(i) {
						return fmt.Errorf("job %d got the result %q", i, res[1])
					}
				}
			})
		}
	}
	if err := g.Wait(); err != nil {
		return Result{}, err
	}
	if err := finish(ctx, e, m, t, b.stream, baselineGroup); err != nil {
		return Result{}, err
	}
	if err := stop(); err != nil {
		return Result{}, err
	}
	if err := checkEmpty(ctx, e, b.stream); err != nil {
		return Result{}, err
	}
	if err := firstErr(herr.err(), t.verify("baseline "+scenario)); err != nil {
		return Result{}, err
	}
	return m.result(scenario, "baseline", n, "round trip", rtt), nil
}
