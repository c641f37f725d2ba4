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

// fairnessWork and fairnessLate shape the fairness scenario: n jobs of 50 ms
// each are waiting when a first consumer starts; a second one starts 200 ms
// later. Both run with one worker and the default options.
const (
	fairnessWork = 50 * time.Millisecond
	fairnessLate = 200 * time.Millisecond
)

// runFairness measures how a backlog of slow jobs is shared between a
// consumer and one that starts a moment later. Ideally the second takes half
// of what is left when it starts: elapsed = late + (n*work - late)/2. The
// baseline reads one entry per XREADGROUP, the fairest a consumer can be.
func runFairness(ctx context.Context, e *env, n int) error {
	ideal := (fairnessLate + (time.Duration(n)*fairnessWork-fairnessLate)/2).Seconds()
	s, err := fairnessStreamq(ctx, e, n)
	if err != nil {
		return fmt.Errorf("streamq: %w", err)
	}
	s.IdealSeconds, s.IdealRatio = ideal, s.Seconds/ideal
	e.out.result(s)
	b, err := fairnessBaseline(ctx, e, n)
	if err != nil {
		return fmt.Errorf("baseline: %w", err)
	}
	b.IdealSeconds, b.IdealRatio = ideal, b.Seconds/ideal
	e.out.result(b)
	e.out.ratio(Ratio{Scenario: "fairness", Ratio: s.JobsPerSec / b.JobsPerSec, IdealRatio: s.IdealRatio})
	return nil
}

// fairnessStreamq: n jobs produced first; consumer A starts, B 200 ms after
// A's first handler started; both with Workers 1 and the default Prefetch.
func fairnessStreamq(ctx context.Context, e *env, n int) (Result, error) {
	q := e.queue("fairness", "streamq")
	cl := e.client(0)
	defer cl.Close()
	p, err := streamq.NewProducer[job, struct{}](cl, q, &streamq.ProducerOptions{Logger: e.log})
	if err != nil {
		return Result{}, err
	}
	defer p.Close()
	for i := range n {
		if err := p.Enqueue(ctx, jobID(i), job{Seq: i}); err != nil {
			return Result{}, err
		}
	}
	t := newTracker(n)
	var herr handlerErrors
	var byLate atomic.Int64
	firstStart := make(chan struct{})
	var started atomic.Bool
	handler := func(late bool) streamq.Handler[job, struct{}] {
		return func(ctx context.Context, m *streamq.Message[job]) (struct{}, error) {
			if started.CompareAndSwap(false, true) {
				close(firstStart)
			}
			if err := sleepCtx(ctx, fairnessWork); err != nil {
				return struct{}{}, err
			}
			if late {
				byLate.Add(1)
			}
			if err := t.mark(m.Payload.Seq, 0); err != nil {
				herr.add(err)
			}
			return struct{}{}, nil
		}
	}
	m := e.meter()
	if err := m.start(ctx); err != nil {
		return Result{}, err
	}
	a, err := startConsumers(ctx, e, q, handler(false), []streamq.ConsumerOptions{{DiscardResults: true}})
	if err != nil {
		return Result{}, err
	}
	defer a.stop()
	<-firstStart
	if err := sleepCtx(ctx, fairnessLate); err != nil {
		return Result{}, err
	}
	b, err := startConsumers(ctx, e, q, handler(true), []streamq.ConsumerOptions{{DiscardResults: true, Name: "late"}})
	if err != nil {
		return Result{}, err
	}
	defer b.stop()
	if err := finish(ctx, e, m, t, streamKey(q), streamq.DefaultGroup); err != nil {
		return Result{}, err
	}
	if err := firstErr(a.stop(), b.stop(), herr.err(), t.verify("streamq fairness")); err != nil {
		return Result{}, err
	}
	return m.result("fairness", "streamq", n, split(n, byLate.Load()), nil), nil
}

// fairnessBaseline: two hand-written consumers reading one entry at a time.
func fairnessBaseline(ctx context.Context, e *env, n int) (Result, error) {
	b, err := newBaseline(ctx, e, "fairness")
	if err != nil {
		return Result{}, err
	}
	defer b.cleanup(ctx, e)
	pipe := e.admin.Pipeline()
	for i := range n {
		payload, err := json.Marshal(job{Seq: i})
		if err != nil {
			return Result{}, err
		}
		pipe.XAdd(ctx, b.xaddArgs(jobID(i), payload))
	}
	if _, err := pipe.Exec(ctx); err != nil {
		return Result{}, err
	}
	t := newTracker(n)
	var herr handlerErrors
	var byLate atomic.Int64
	firstStart := make(chan struct{})
	var started atomic.Bool
	handle := func(late bool) func(redis.XMessage, redis.Pipeliner) error {
		return func(msg redis.XMessage, _ redis.Pipeliner) error {
			if started.CompareAndSwap(false, true) {
				close(firstStart)
			}
			j, err := decodeJob(msg)
			if err != nil {
				return err
			}
			time.Sleep(fairnessWork)
			if late {
				byLate.Add(1)
			}
			if err := t.mark(j.Seq, 0); err != nil {
				herr.add(err)
			}
			return nil
		}
	}
	m := e.meter()
	if err := m.start(ctx); err != nil {
		return Result{}, err
	}
	stopA := b.runConsumers(ctx, e, 1, 1, 100*time.Millisecond, handle(false))
	defer stopA()
	<-firstStart
	if err := sleepCtx(ctx, fairnessLate); err != nil {
		return Result{}, err
	}
	stopB := b.runConsumersNamed(ctx, e, "late", handle(true))
	defer stopB()
	if err := finish(ctx, e, m, t, b.stream, baselineGroup); err != nil {
		return Result{}, err
	}
	if err := firstErr(stopA(), stopB(), herr.err(), t.verify("baseline fairness")); err != nil {
		return Result{}, err
	}
	return m.result("fairness", "baseline", n, split(n, byLate.Load()), nil), nil
}

// split labels a fairness result with the jobs each consumer ran, in the
// table's latency column (the scenario has no latency figures).
func split(n int, late int64) string { return fmt.Sprintf("ran %d/%d", n-int(late), late) }

// runConsumersNamed runs one baseline consumer loop named name, reading one
// entry at a time, until the returned stop is called.
func (b baseline) runConsumersNamed(ctx context.Context, e *env, name string,
	handle func(m redis.XMessage, pipe redis.Pipeliner) error) (stop func() error) {
	runCtx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	var g errGroup
	c := e.client(0)
	g.Go(func() error {
		defer c.Close()
		return b.consume(runCtx, c, name, 1, 100*time.Millisecond, handle)
	})
	return func() error {
		cancel()
		return g.Wait()
	}
}
