package main

import (
	"context"
	"fmt"
	"time"

	"github.com/streamq/streamq"
)

// latencyWarmup round trips run before the measured ones, so the first
// connections and script loads are not measured.
const latencyWarmup = 100

// runLatency measures round trips at idle: one request at a time.
func runLatency(ctx context.Context, e *env, n int) error {
	pad := padFor(e.cfg.payload)
	return compare(e, "latency",
		func() (Result, error) { return latencyStreamq(ctx, e, n, pad) },
		func() (Result, error) { return rpcBaseline(ctx, e, n, pad, "latency", 1, 1, 1) })
}

// latencyStreamq: one producer, one consumer with one worker, sequential
// Produce + Wait.
func latencyStreamq(ctx context.Context, e *env, n int, pad string) (Result, error) {
	q := e.queue("latency", "streamq")
	t := newTracker(n)
	var herr handlerErrors
	handler := func(_ context.Context, m *streamq.Message[job]) (int, error) {
		if m.Payload.Seq >= 0 { // warm-up jobs have negative indexes
			if err := t.mark(m.Payload.Seq, sinceNs(m.Payload.T)); err != nil { // pickup: Produce to start
				herr.add(err)
			}
		}
		return m.Payload.Seq, nil
	}
	cs, err := startConsumers(ctx, e, q, handler, []streamq.ConsumerOptions{{Workers: 1}})
	if err != nil {
		return Result{}, err
	}
	defer cs.stop()
	cl := e.client(0)
	defer cl.Close()
	p, err := streamq.NewProducer[job, int](cl, q, &streamq.ProducerOptions{Logger: e.log})
	if err != nil {
		return Result{}, err
	}
	defer p.Close()

	roundTrip := func(id string, seq int) (time.Duration, error) {
		t0 := time.Now()
		pr, err := p.Produce(ctx, id, job{Seq: seq, T: t0.UnixNano(), Pad: pad})
		if err != nil {
			return 0, fmt.Errorf("Produce: %w", err)
		}
		wctx, cancel := context.WithTimeout(ctx, time.Minute)
		defer cancel()
		got, err := pr.Wait(wctx)
		if err != nil {
			return 0, fmt.Errorf("Wait %s: %w", id, err)
		}
		if got != seq {
			return 0, fmt.Errorf("job %d got the result of job %d", seq, got)
		}
		return time.Since(t0), nil
	}
	for i := range latencyWarmup {
		if _, err := roundTrip(fmt.Sprintf("w%d", i), -1-i); err != nil {
			return Result{}, err
		}
	}

	rtt := make([]int64, n)
	m := e.meter()
	if err := m.start(ctx); err != nil {
		return Result{}, err
	}
	for i := range n {
		d, err := roundTrip(jobID(i), i)
		if err != nil {
			return Result{}, err
		}
		rtt[i] = int64(d)
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
	if err := firstErr(herr.err(), t.verify("streamq latency")); err != nil {
		return Result{}, err
	}
	r := m.result("latency", "streamq", n, "round trip", rtt)
	r.PickupP50Ms, r.PickupP99Ms, _ = percentiles(t.latencies())
	return r, nil
}
