package main

import (
	"context"
	"encoding/json"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/streamq/streamq"
)

// runBatch measures appending in batches: ProduceBatch against pipelined XADD.
// Nothing consumes; the check reads the stream back.
func runBatch(ctx context.Context, e *env, n int) error {
	pad := padFor(e.cfg.payload)
	return compare(e, "batch",
		func() (Result, error) { return batchStreamq(ctx, e, n, pad) },
		func() (Result, error) { return batchBaseline(ctx, e, n, pad) })
}

// batchTimes collects the duration of each batch call.
type batchTimes struct {
	mu sync.Mutex
	ns []int64
}

func (b *batchTimes) add(d time.Duration) {
	b.mu.Lock()
	b.ns = append(b.ns, int64(d))
	b.mu.Unlock()
}

// batches hands out [from, to) job ranges of size size until n.
func batches(next *atomic.Int64, size, n int) (from, to int, ok bool) {
	from = int(next.Add(int64(size)) - int64(size))
	return from, min(from+size, n), from < n
}

// batchStreamq: P producers, each calling ProduceBatch with -batch jobs in a loop.
func batchStreamq(ctx context.Context, e *env, n int, pad string) (Result, error) {
	q := e.queue("batch", "streamq")
	stream := streamKey(q)
	defer e.admin.Unlink(ctx, stream)
	var times batchTimes
	m := e.meter()
	var next atomic.Int64
	var g errGroup
	producers := make([]*streamq.Producer[job, struct{}], e.cfg.producers)
	for i := range producers {
		cl := e.client(0)
		defer cl.Close()
		// The records of unconsumed jobs expire soon after the run.
		p, err := streamq.NewProducer[job, struct{}](cl, q, &streamq.ProducerOptions{Logger: e.log, InflightTTL: 10 * time.Minute})
		if err != nil {
			return Result{}, err
		}
		defer p.Close()
		producers[i] = p
	}
	if err := m.start(ctx); err != nil {
		return Result{}, err
	}
	for _, p := range producers {
		g.Go(func() error {
			jobs := make([]streamq.Job[job], 0, e.cfg.batch)
			for {
				from, to, ok := batches(&next, e.cfg.batch, n)
				if !ok {
					return nil
				}
				jobs = jobs[:0]
				now := time.Now().UnixNano()
				for i := from; i < to; i++ {
					jobs = append(jobs, streamq.Job[job]{ID: jobID(i), Request: job{Seq: i, T: now, Pad: pad}})
				}
				t0 := time.Now()
				if _, err := p.ProduceBatch(ctx, jobs); err != nil {
					return fmt.Errorf("ProduceBatch: %w", err)
				}
				times.add(time.Since(t0))
			}
		})
	}
	if err := g.Wait(); err != nil {
		return Result{}, err
	}
	if err := m.stop(ctx); err != nil {
		return Result{}, err
	}
	t := newTracker(n)
	if err := markStream(ctx, e, stream, t); err != nil {
		return Result{}, err
	}
	if err := t.verify("streamq batch"); err != nil {
		return Result{}, err
	}
	return m.result("batch", "streamq", n, "batch call", times.ns), nil
}

// batchBaseline: P goroutines, each pipelining -batch XADDs per round trip.
func batchBaseline(ctx context.Context, e *env, n int, pad string) (Result, error) {
	b, err := newBaseline(ctx, e, "batch")
	if err != nil {
		return Result{}, err
	}
	defer b.cleanup(ctx, e)
	var times batchTimes
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
				from, to, ok := batches(&next, e.cfg.batch, n)
				if !ok {
					return nil
				}
				t0 := time.Now() // encoding included, as in ProduceBatch
				pipe := c.Pipeline()
				now := t0.UnixNano()
				for i := from; i < to; i++ {
					payload, err := json.Marshal(job{Seq: i, T: now, Pad: pad})
					if err != nil {
						return err
					}
					pipe.XAdd(ctx, b.xaddArgs(jobID(i), payload))
				}
				if _, err := pipe.Exec(ctx); err != nil {
					return fmt.Errorf("XADD: %w", err)
				}
				times.add(time.Since(t0))
			}
		})
	}
	if err := g.Wait(); err != nil {
		return Result{}, err
	}
	if err := m.stop(ctx); err != nil {
		return Result{}, err
	}
	t := newTracker(n)
	if err := markStream(ctx, e, b.stream, t); err != nil {
		return Result{}, err
	}
	if err := t.verify("baseline batch"); err != nil {
		return Result{}, err
	}
	return m.result("batch", "baseline", n, "batch call", times.ns), nil
}
