package main

import (
	"context"
	"encoding/json"
	"fmt"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/streamq/streamq"
)

// runThroughput measures fire-and-forget jobs end to end: from the first
// append to the last acknowledgement, with a no-op handler.
func runThroughput(ctx context.Context, e *env, n int) error {
	pad := padFor(e.cfg.payload)
	return compare(e, "throughput",
		func() (Result, error) { return throughputStreamq(ctx, e, n, pad, "throughput", e.cfg.callers, 0) },
		func() (Result, error) { return throughputBaseline(ctx, e, n, pad, "throughput", 16) })
}

// runDrain measures batches end to end: producers call ProduceBatch with
// -batch jobs (one calling goroutine each) and release the promises, and
// consumers with DiscardResults and a no-op handler drain them, beside a baseline that XADDs -batch entries
// per pipelined round trip and consumes with XREADGROUP COUNT 100 and
// pipelined XACK+XDEL. (The batch scenario measures appending alone.)
func runDrain(ctx context.Context, e *env, n int) error {
	pad := padFor(e.cfg.payload)
	return compare(e, "drain",
		func() (Result, error) { return throughputStreamq(ctx, e, n, pad, "drain", 1, e.cfg.batch) },
		func() (Result, error) { return throughputBaseline(ctx, e, n, pad, "drain", e.cfg.batch) })
}

// runFew is the throughput scenario with few callers: each producer has one
// calling goroutine that enqueues one job at a time (-callers is ignored),
// beside a baseline whose producers XADD one entry per round trip.
func runFew(ctx context.Context, e *env, n int) error {
	pad := padFor(e.cfg.payload)
	return compare(e, "few",
		func() (Result, error) { return throughputStreamq(ctx, e, n, pad, "few", 1, 0) },
		func() (Result, error) { return throughputBaseline(ctx, e, n, pad, "few", 1) })
}

// throughputStreamq: P producers, each Enqueue-ing (or, with -send, Send-ing)
// from -callers goroutines so that concurrent calls coalesce, or, with batch
// > 0, calling ProduceBatch with batch jobs at a time; C consumers with W
// workers in all, DiscardResults.
func throughputStreamq(ctx context.Context, e *env, n int, pad, scenario string, callers, batch int) (Result, error) {
	q := e.queue(scenario, "streamq")
	t := newTracker(n)
	var herr handlerErrors
	handler := func(_ context.Context, m *streamq.Message[job]) (struct{}, error) {
		if err := t.mark(m.Payload.Seq, sinceNs(m.Payload.T)); err != nil {
			herr.add(err)
		}
		return struct{}{}, nil
	}
	cs, err := startConsumers(ctx, e, q, handler, consumerOpts(e, streamq.ConsumerOptions{DiscardResults: true}))
	if err != nil {
		return Result{}, err
	}
	defer cs.stop()

	producers := make([]*streamq.Producer[job, struct{}], e.cfg.producers)
	for i := range producers {
		cl := e.client(0)
		defer cl.Close()
		p, err := streamq.NewProducer[job, struct{}](cl, q, &streamq.ProducerOptions{Logger: e.log, Concurrency: e.cfg.sendConc})
		if err != nil {
			return Result{}, err
		}
		defer p.Close()
		producers[i] = p
	}

	m := e.meter()
	if err := m.start(ctx); err != nil {
		return Result{}, err
	}
	var next atomic.Int64
	var g errGroup
	for _, p := range producers {
		if batch > 0 {
			g.Go(func() error {
				jobs := make([]streamq.Job[job], 0, batch)
				for {
					from, to, ok := batches(&next, batch, n)
					if !ok {
						return nil
					}
					jobs = jobs[:0]
					for i := from; i < to; i++ {
						jobs = append(jobs, streamq.Job[job]{ID: jobID(i), Request: job{Seq: i, T: time.Now().UnixNano(), Pad: pad}})
					}
					prs, err := p.ProduceBatch(ctx, jobs)
					if err != nil {
						return fmt.Errorf("ProduceBatch: %w", err)
					}
					// The consumers discard results: give up the promises
					// at once, as such a caller does, instead of keeping
					// every job in flight in the producer's map of waiters.
					for _, pr := range prs {
						pr.Release()
					}
				}
			})
			continue
		}
		for range callers {
			g.Go(func() error {
				for {
					i := int(next.Add(1) - 1)
					if i >= n {
						return nil
					}
					j := job{Seq: i, T: time.Now().UnixNano(), Pad: pad}
					if e.cfg.send {
						if err := p.Send(ctx, jobID(i), j); err != nil {
							return fmt.Errorf("Send: %w", err)
						}
						continue
					}
					if err := p.Enqueue(ctx, jobID(i), j); err != nil {
						return fmt.Errorf("Enqueue: %w", err)
					}
				}
			})
		}
	}
	if err := g.Wait(); err != nil {
		return Result{}, err
	}
	for _, p := range producers {
		if err := p.Flush(ctx); err != nil {
			return Result{}, err
		}
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
	if err := firstErr(herr.err(), t.verify("streamq throughput")); err != nil {
		return Result{}, err
	}
	return m.result(scenario, "streamq", n, "enqueue-start", t.latencies()), nil
}

// throughputBaseline: P producer goroutines XADD pipelined in batches of
// pipeline; W consumer goroutines XREADGROUP COUNT 100, then XACK+XDEL
// pipelined.
func throughputBaseline(ctx context.Context, e *env, n int, pad, scenario string, pipeline int) (Result, error) {
	b, err := newBaseline(ctx, e, scenario)
	if err != nil {
		return Result{}, err
	}
	defer b.cleanup(ctx, e)
	t := newTracker(n)
	var herr handlerErrors
	stop := b.runConsumers(ctx, e, e.cfg.workers, 100, 100*time.Millisecond, func(m redis.XMessage, _ redis.Pipeliner) error {
		j, err := decodeJob(m)
		if err != nil {
			return err
		}
		if err := t.mark(j.Seq, sinceNs(j.T)); err != nil {
			herr.add(err)
		}
		return nil
	})
	defer stop()

	m := e.meter()
	if err := m.start(ctx); err != nil {
		return Result{}, err
	}
	var next atomic.Int64
	var g errGroup
	for range e.cfg.producers {
		c := e.client(0)
		defer c.Close()
		g.Go(func() error {
			for {
				i0 := int(next.Add(int64(pipeline))) - pipeline
				if i0 >= n {
					return nil
				}
				pipe := c.Pipeline()
				for i := i0; i < min(i0+pipeline, n); i++ {
					payload, err := json.Marshal(job{Seq: i, T: time.Now().UnixNano(), Pad: pad})
					if err != nil {
						return err
					}
					pipe.XAdd(ctx, b.xaddArgs(jobID(i), payload))
				}
				if _, err := pipe.Exec(ctx); err != nil {
					return fmt.Errorf("XADD: %w", err)
				}
			}
		})
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
	if err := firstErr(herr.err(), t.verify("baseline throughput")); err != nil {
		return Result{}, err
	}
	return m.result(scenario, "baseline", n, "enqueue-start", t.latencies()), nil
}

func firstErr(errs ...error) error {
	for _, err := range errs {
		if err != nil {
			return err
		}
	}
	return nil
}
