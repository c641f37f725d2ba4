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

// runPrefetch measures how well fetching ahead hides fetch latency: one worker,
// a fetch that takes F, a handler that takes H. Handling n pre-filled entries
// ideally takes n*max(F,H)+F: the first fetch, then whichever is slower.
func runPrefetch(ctx context.Context, e *env, n int) error {
	pad := padFor(e.cfg.payload)
	f, h := e.cfg.fetch, e.cfg.handle
	ideal := (time.Duration(n)*max(f, h) + f).Seconds()

	s, err := prefetchStreamq(ctx, e, n, pad, e.cfg.depth)
	if err != nil {
		return fmt.Errorf("streamq depth %d: %w", e.cfg.depth, err)
	}
	d1, err := prefetchStreamq(ctx, e, n, pad, 1)
	if err != nil {
		return fmt.Errorf("streamq depth 1: %w", err)
	}
	s.Depth, s.IdealSeconds, s.Depth1Seconds = e.cfg.depth, ideal, d1.Seconds
	s.IdealRatio = s.Seconds / ideal
	e.out.result(s)
	if !e.out.json {
		d1.System = "streamq depth=1"
		e.out.result(d1)
	}
	b, err := prefetchBaseline(ctx, e, n, pad)
	if err != nil {
		return fmt.Errorf("baseline: %w", err)
	}
	e.out.result(b)
	e.out.ratio(Ratio{Scenario: "prefetch", Ratio: s.JobsPerSec / b.JobsPerSec, IdealRatio: s.IdealRatio})
	return nil
}

// gapClock measures, for a single worker, the idle time between the end of
// one handler and the start of the next: what prefetching should remove.
type gapClock struct{ lastEnd atomic.Int64 }

// begin returns the gap before this handler, in ns (0 for the first).
func (g *gapClock) begin() int64 {
	last := g.lastEnd.Load()
	if last == 0 {
		return 0
	}
	return time.Now().UnixNano() - last
}

func (g *gapClock) end() { g.lastEnd.Store(time.Now().UnixNano()) }

// sleepCtx sleeps for d unless ctx ends first.
func sleepCtx(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// prefetchStreamq: n entries appended first, then one consumer with one
// worker and a ring of the given depth handles them, fetching through a
// Fetcher that sleeps F.
func prefetchStreamq(ctx context.Context, e *env, n int, pad string, depth int) (Result, error) {
	q := e.queue("prefetch", "streamq")
	cl := e.client(0)
	defer cl.Close()
	p, err := streamq.NewProducer[job, struct{}](cl, q, &streamq.ProducerOptions{Logger: e.log})
	if err != nil {
		return Result{}, err
	}
	defer p.Close()
	var next atomic.Int64
	var g errGroup
	for range 16 {
		g.Go(func() error {
			for i := int(next.Add(1) - 1); i < n; i = int(next.Add(1) - 1) {
				if err := p.Enqueue(ctx, jobID(i), job{Seq: i, Pad: pad}); err != nil {
					return fmt.Errorf("Enqueue: %w", err)
				}
			}
			return nil
		})
	}
	if err := g.Wait(); err != nil {
		return Result{}, err
	}

	t := newTracker(n)
	var herr handlerErrors
	fetch := streamq.FetcherFunc(func(ctx context.Context, en streamq.Entry) ([]byte, error) {
		if err := sleepCtx(ctx, e.cfg.fetch); err != nil {
			return nil, err
		}
		return en.Data, nil
	})
	var gaps gapClock
	handler := func(ctx context.Context, m *streamq.Message[job]) (struct{}, error) {
		gap := gaps.begin()
		if err := sleepCtx(ctx, e.cfg.handle); err != nil {
			return struct{}{}, err
		}
		if err := t.mark(m.Payload.Seq, gap); err != nil {
			herr.add(err)
		}
		gaps.end()
		return struct{}{}, nil
	}
	m := e.meter()
	if err := m.start(ctx); err != nil {
		return Result{}, err
	}
	cs, err := startConsumers(ctx, e, q, handler, []streamq.ConsumerOptions{{
		Workers: 1, Prefetch: depth, Fetcher: fetch, DiscardResults: true,
	}})
	if err != nil {
		return Result{}, err
	}
	defer cs.stop()
	if err := finish(ctx, e, m, t, streamKey(q), streamq.DefaultGroup); err != nil {
		return Result{}, err
	}
	if err := cs.stop(); err != nil {
		return Result{}, err
	}
	if err := checkEmpty(ctx, e, streamKey(q)); err != nil {
		return Result{}, err
	}
	if err := firstErr(herr.err(), t.verify(fmt.Sprintf("streamq prefetch depth %d", depth))); err != nil {
		return Result{}, err
	}
	return m.result("prefetch", "streamq", n, "handler gap", t.latencies()), nil
}

// prefetchBaseline is the loop one writes by hand: read a few entries, then
// for each fetch (sleep F) and handle (sleep H) in turn, then XACK+XDEL.
func prefetchBaseline(ctx context.Context, e *env, n int, pad string) (Result, error) {
	b, err := newBaseline(ctx, e, "prefetch")
	if err != nil {
		return Result{}, err
	}
	defer b.cleanup(ctx, e)
	c := e.client(0)
	defer c.Close()
	for i0 := 0; i0 < n; i0 += 100 {
		pipe := c.Pipeline()
		for i := i0; i < min(i0+100, n); i++ {
			payload, err := json.Marshal(job{Seq: i, Pad: pad})
			if err != nil {
				return Result{}, err
			}
			pipe.XAdd(ctx, b.xaddArgs(jobID(i), payload))
		}
		if _, err := pipe.Exec(ctx); err != nil {
			return Result{}, err
		}
	}

	t := newTracker(n)
	var herr handlerErrors
	m := e.meter()
	if err := m.start(ctx); err != nil {
		return Result{}, err
	}
	var gaps gapClock
	stop := b.runConsumers(ctx, e, 1, 16, 100*time.Millisecond, func(msg redis.XMessage, _ redis.Pipeliner) error {
		time.Sleep(e.cfg.fetch)
		j, err := decodeJob(msg)
		if err != nil {
			return err
		}
		gap := gaps.begin()
		time.Sleep(e.cfg.handle)
		if err := t.mark(j.Seq, gap); err != nil {
			herr.add(err)
		}
		gaps.end()
		return nil
	})
	defer stop()
	if err := finish(ctx, e, m, t, b.stream, baselineGroup); err != nil {
		return Result{}, err
	}
	if err := stop(); err != nil {
		return Result{}, err
	}
	if err := checkEmpty(ctx, e, b.stream); err != nil {
		return Result{}, err
	}
	if err := firstErr(herr.err(), t.verify("baseline prefetch")); err != nil {
		return Result{}, err
	}
	return m.result("prefetch", "baseline", n, "handler gap", t.latencies()), nil
}
