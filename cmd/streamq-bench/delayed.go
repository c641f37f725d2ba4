package main

import (
	"context"
	"fmt"
	"time"

	"github.com/streamq/streamq"
)

// delayedLead is how long after the run starts the first job is due: the
// scheduling phase is measured on its own, before any job is due.
const delayedLead = 2 * time.Second

// runDelayed schedules n jobs (ProduceBatch of -batch jobs with At) due at
// random times spread over -window, then lets the consumers promote and run
// them. Two rows: "schedule" (jobs/s scheduled, Redis CPU per scheduled job;
// latency: one ProduceBatch call) and "promote" (from the first due time
// until every job ran: jobs/s, Redis CPU per job for promotion, reading and
// completion; latency: handler start - due time, the lateness). There is no
// baseline: a hand-written equivalent would be this design again.
func runDelayed(ctx context.Context, e *env, n int) error {
	q := e.queue("delayed", "streamq")
	pad := padFor(e.cfg.payload)
	t := newTracker(n)
	due := make([]int64, n) // unix ns
	var herr handlerErrors
	handler := func(_ context.Context, m *streamq.Message[job]) (int, error) {
		now := time.Now().UnixNano()
		i := m.Payload.Seq
		if i < 0 || i >= n {
			herr.add(fmt.Errorf("job index %d outside the run", i))
			return 0, nil
		}
		if err := t.mark(i, now-due[i]); err != nil {
			herr.add(err)
		}
		if now < due[i] {
			herr.add(fmt.Errorf("job %d started %v before its due time", i, time.Duration(due[i]-now)))
		}
		return 0, nil
	}
	cs, err := startConsumers(ctx, e, q, handler, consumerOpts(e, streamq.ConsumerOptions{DiscardResults: true}))
	if err != nil {
		return err
	}
	defer cs.stop()
	cl := e.client(0)
	defer cl.Close()
	p, err := streamq.NewProducer[job, int](cl, q, &streamq.ProducerOptions{Logger: e.log, MaxBatchItems: max(e.cfg.batch, 1)})
	if err != nil {
		return err
	}
	defer p.Close()

	first := time.Now().Add(delayedLead)
	window := e.cfg.window
	for i := range due {
		// An even spread, shuffled by a multiplicative step: no two jobs of
		// one batch are due together.
		k := (i * 7919) % n
		due[i] = first.Add(time.Duration(int64(window) * int64(k) / int64(n))).UnixNano()
	}
	m := e.meter()
	if err := m.start(ctx); err != nil {
		return err
	}
	var calls []int64
	batch := make([]streamq.Job[job], 0, e.cfg.batch)
	flush := func() error {
		t0 := time.Now()
		prs, err := p.ProduceBatch(ctx, batch)
		if err != nil {
			return fmt.Errorf("ProduceBatch: %w", err)
		}
		calls = append(calls, int64(time.Since(t0)))
		for _, pr := range prs {
			pr.Release()
		}
		batch = batch[:0]
		return nil
	}
	for i := range n {
		at := time.Unix(0, due[i])
		batch = append(batch, streamq.Job[job]{ID: jobID(i), Request: job{Seq: i, T: due[i], Pad: pad},
			Options: []streamq.ProduceOption{streamq.At(at)}})
		if len(batch) == cap(batch) {
			if err := flush(); err != nil {
				return err
			}
		}
	}
	if len(batch) > 0 {
		if err := flush(); err != nil {
			return err
		}
	}
	if err := m.stop(ctx); err != nil {
		return err
	}
	if time.Now().After(first) {
		return fmt.Errorf("scheduling %d jobs took longer than the %v lead: use a smaller -n", n, delayedLead)
	}
	e.out.result(m.result("delayed", "schedule", n, "batch call", calls))

	// Promotion: from the first due time on.
	time.Sleep(time.Until(first))
	m = e.meter()
	if err := m.start(ctx); err != nil {
		return err
	}
	if err := finish(ctx, e, m, t, streamKey(q), streamq.DefaultGroup); err != nil {
		return err
	}
	if err := cs.stop(); err != nil {
		return err
	}
	if err := checkEmpty(ctx, e, streamKey(q)); err != nil {
		return err
	}
	if err := firstErr(herr.err(), t.verify("streamq delayed")); err != nil {
		return err
	}
	e.out.result(m.result("delayed", "promote", n, "start - due", t.latencies()))
	return nil
}
