package main

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/streamq/streamq"
)

// multiWeights are the weights of the multi scenario's queues; each queue's
// backlog is proportional to its weight, so with exact shares all three run
// out together.
var multiWeights = []int{6, 3, 1}

// multiFillBatch is the ProduceBatch size that fills the backlogs (not
// measured).
const multiFillBatch = 256

// multiWindow is the number of starts per window in which the shares'
// spread is measured.
const multiWindow = 1000

// runMulti measures the multi-queue consumer draining a backlog: n jobs
// spread over three queues (weights 6:3:1, backlogs in the same proportions)
// are appended first; then one MultiConsumer per consumer slot (-consumers,
// each with its own client, Workers and Prefetch as a plain consumer's)
// drains them. Beside it, in the same run: the same n jobs in one queue
// drained by plain Consumers with the same Workers and Prefetch
// ("streamq-1q"), and the hand-written baseline consuming a stream of n
// entries (XREADGROUP COUNT 100, pipelined XACK+XDEL). Only the draining is
// measured; the "streamq" row also gives each queue's share of the starts
// while every queue still had work.
func runMulti(ctx context.Context, e *env, n int) error {
	n = max(n, sum(multiWeights)) // every queue gets a job
	pad := padFor(e.cfg.payload)
	s, err := multiStreamq(ctx, e, n, pad, false)
	if err != nil {
		return fmt.Errorf("streamq: %w", err)
	}
	e.out.result(s)
	sep, err := multiStreamq(ctx, e, n, pad, true)
	if err != nil {
		return fmt.Errorf("streamq-3c: %w", err)
	}
	e.out.result(sep)
	one, err := multiSingle(ctx, e, n, pad)
	if err != nil {
		return fmt.Errorf("streamq-1q: %w", err)
	}
	e.out.result(one)
	b, err := multiBaseline(ctx, e, n, pad)
	if err != nil {
		return fmt.Errorf("baseline: %w", err)
	}
	e.out.result(b)
	e.out.ratio(Ratio{Scenario: "multi", Ratio: s.JobsPerSec / b.JobsPerSec, VsSingleQueue: s.JobsPerSec / one.JobsPerSec})
	e.out.ratio(Ratio{Scenario: "multi", System: "streamq-3c", Ratio: sep.JobsPerSec / b.JobsPerSec})
	e.out.ratio(Ratio{Scenario: "multi", System: "streamq-1q", Ratio: one.JobsPerSec / b.JobsPerSec})
	return nil
}

func sum(v []int) int {
	s := 0
	for _, x := range v {
		s += x
	}
	return s
}

// splitByWeight divides n jobs among queues in proportion to weights; the
// last queue takes the rounding.
func splitByWeight(n int, weights []int) []int {
	total := sum(weights)
	out := make([]int, len(weights))
	left := n
	for i, w := range weights[:len(weights)-1] {
		out[i] = n * w / total
		left -= out[i]
	}
	out[len(out)-1] = left
	return out
}

// startLog records which queue each handler start belonged to, in order
// of the starts (over every consumer process).
type startLog struct {
	next  atomic.Int64
	queue []atomic.Int32 // queue index + 1 of the i-th start; 0: not recorded
}

func newStartLog(n int) *startLog { return &startLog{queue: make([]atomic.Int32, n)} }

func (l *startLog) add(queue int) {
	if i := l.next.Add(1) - 1; i < int64(len(l.queue)) {
		l.queue[i].Store(int32(queue + 1))
	}
}

// order returns the queue of each recorded start.
func (l *startLog) order() []int {
	out := make([]int, 0, len(l.queue))
	for i := range min(l.next.Load(), int64(len(l.queue))) {
		if q := l.queue[i].Load(); q > 0 {
			out = append(out, int(q-1))
		}
	}
	return out
}

// backlogShares returns each queue's share of the starts while every queue
// still had work: the starts up to and including the one that took some
// queue's last job (totals[q] jobs in queue q), span of them. Over windows of
// window starts within that span, lo and hi are each queue's lowest and
// highest share (nil when the span holds no full window).
func backlogShares(order, totals []int, window int) (shares []float64, span int, lo, hi []float64) {
	counts := make([]int, len(totals))
	span = len(order)
	for i, q := range order {
		counts[q]++
		if counts[q] == totals[q] {
			span = i + 1
			break
		}
	}
	clear(counts)
	for _, q := range order[:span] {
		counts[q]++
	}
	shares = make([]float64, len(totals))
	if span > 0 {
		for q, c := range counts {
			shares[q] = float64(c) / float64(span)
		}
	}
	for w := 0; w+window <= span; w += window {
		clear(counts)
		for _, q := range order[w : w+window] {
			counts[q]++
		}
		if lo == nil {
			lo, hi = make([]float64, len(totals)), make([]float64, len(totals))
			for q := range lo {
				lo[q] = 1
			}
		}
		for q, c := range counts {
			f := float64(c) / float64(window)
			lo[q], hi[q] = min(lo[q], f), max(hi[q], f)
		}
	}
	return shares, span, lo, hi
}

// fillBacklog appends the jobs first..first+count-1 to queue with
// ProduceBatch calls from -producers producers, and closes them.
func fillBacklog(ctx context.Context, e *env, queue string, first, count int, pad string) error {
	err := e.admin.XGroupCreateMkStream(ctx, streamKey(queue), streamq.DefaultGroup, "0").Err()
	if err != nil {
		return fmt.Errorf("create group: %w", err)
	}
	var next atomic.Int64
	var g errGroup
	for range e.cfg.producers {
		cl := e.client(0)
		p, err := streamq.NewProducer[job, struct{}](cl, queue, &streamq.ProducerOptions{Logger: e.log})
		if err != nil {
			_ = cl.Close()
			g.Go(func() error { return err })
			break
		}
		g.Go(func() error {
			defer cl.Close()
			defer p.Close()
			jobs := make([]streamq.Job[job], 0, multiFillBatch)
			for {
				from, to, ok := batches(&next, multiFillBatch, count)
				if !ok {
					return nil
				}
				jobs = jobs[:0]
				now := time.Now().UnixNano()
				for i := first + from; i < first+to; i++ {
					jobs = append(jobs, streamq.Job[job]{ID: jobID(i), Request: job{Seq: i, T: now, Pad: pad}})
				}
				prs, err := p.ProduceBatch(ctx, jobs)
				if err != nil {
					return fmt.Errorf("ProduceBatch: %w", err)
				}
				for _, pr := range prs {
					pr.Release() // no result is waited for (see runDrain)
				}
			}
		})
	}
	return g.Wait()
}

// multiPrefetch is the Prefetch of a consumer with w workers in the multi
// scenario, for both streamq variants: -ring when set, else the library's
// default (the same for ConsumerOptions and MultiOptions).
func multiPrefetch(e *env, w int) int {
	if e.cfg.ring > 0 {
		return max(e.cfg.ring, w)
	}
	return 0
}

// finishAll waits until every job was handled and every stream's group has
// nothing pending, and stops the meter there.
func finishAll(ctx context.Context, e *env, m *meter, t *tracker, streams ...string) error {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Minute)
	defer cancel()
	if err := t.wait(ctx); err != nil {
		return err
	}
	for _, s := range streams {
		if err := waitDrained(ctx, e.admin, s, streamq.DefaultGroup); err != nil {
			return err
		}
	}
	return m.stop(ctx)
}

// multiStreamq: three queues filled with n jobs in the weights' proportions,
// drained by one MultiConsumer per consumer slot, or, separate
// ("streamq-3c"), by three plain Consumers per slot (what one did without
// MultiConsumer), the slot's workers split by the weights (at least one
// each).
func multiStreamq(ctx context.Context, e *env, n int, pad string, separate bool) (Result, error) {
	system := "streamq"
	if separate {
		system = "streamq-3c"
	}
	sizes := splitByWeight(n, multiWeights)
	queues := make([]string, len(sizes))
	streams := make([]string, len(sizes))
	first := 0
	for k, size := range sizes {
		queues[k] = e.queue("multi", fmt.Sprintf("%s-w%d", system, multiWeights[k]))
		streams[k] = streamKey(queues[k])
		if err := fillBacklog(ctx, e, queues[k], first, size, pad); err != nil {
			return Result{}, err
		}
		first += size
	}
	defer func() {
		for _, s := range streams {
			e.admin.Unlink(context.WithoutCancel(ctx), s)
		}
	}()

	t := newTracker(n)
	starts := newStartLog(n)
	var herr handlerErrors
	handler := func(k int) streamq.Handler[job, struct{}] {
		return func(_ context.Context, m *streamq.Message[job]) (struct{}, error) {
			starts.add(k)
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
	runCtx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	cs := &consumers{cancel: cancel}
	defer cs.stop()
	for i := range e.cfg.consumers {
		cl := e.client(0)
		cs.clients = append(cs.clients, cl)
		w := e.workersPer(i)
		mq := make([]streamq.MultiQueue, len(queues))
		for k, q := range queues {
			o := &streamq.ConsumerOptions{
				Name: fmt.Sprintf("c%d", i), DiscardResults: true, Logger: e.log, ReadBlock: 250 * time.Millisecond,
			}
			if separate {
				o.Workers = max(1, w*multiWeights[k]/sum(multiWeights))
				o.Prefetch = multiPrefetch(e, o.Workers)
			}
			c, err := streamq.NewConsumer(cl, q, handler(k), o)
			if err != nil {
				return Result{}, err
			}
			if separate {
				cs.g.Go(func() error { return c.Run(runCtx) })
			}
			mq[k] = streamq.MultiQueue{Consumer: c, Weight: multiWeights[k]}
		}
		if separate {
			continue
		}
		mc, err := streamq.NewMultiConsumer(&streamq.MultiOptions{Workers: w, Prefetch: multiPrefetch(e, w)}, mq...)
		if err != nil {
			return Result{}, err
		}
		cs.g.Go(func() error { return mc.Run(runCtx) })
	}
	if err := finishAll(ctx, e, m, t, streams...); err != nil {
		return Result{}, err
	}
	if err := cs.stop(); err != nil {
		return Result{}, err
	}
	for _, s := range streams {
		if err := checkEmpty(ctx, e, s); err != nil {
			return Result{}, err
		}
	}
	if err := firstErr(herr.err(), t.verify("streamq multi")); err != nil {
		return Result{}, err
	}
	r := m.result("multi", system, n, "-", nil)
	r.QueueWeights = multiWeights
	r.QueueShares, r.QueueSharesStarts, r.QueueShareWindowMin, r.QueueShareWindowMax = backlogShares(starts.order(), sizes, multiWindow)
	return r, nil
}

// multiSingle: the same n jobs in one queue, drained by plain Consumers with
// the same Workers and Prefetch.
func multiSingle(ctx context.Context, e *env, n int, pad string) (Result, error) {
	q := e.queue("multi", "streamq-1q")
	if err := fillBacklog(ctx, e, q, 0, n, pad); err != nil {
		return Result{}, err
	}
	defer e.admin.Unlink(context.WithoutCancel(ctx), streamKey(q))
	t := newTracker(n)
	var herr handlerErrors
	handler := func(_ context.Context, m *streamq.Message[job]) (struct{}, error) {
		if err := t.mark(m.Payload.Seq, 0); err != nil {
			herr.add(err)
		}
		return struct{}{}, nil
	}
	opts := make([]streamq.ConsumerOptions, e.cfg.consumers)
	for i := range opts {
		w := e.workersPer(i)
		opts[i] = streamq.ConsumerOptions{DiscardResults: true, Workers: w, Prefetch: multiPrefetch(e, w)}
	}
	m := e.meter()
	if err := m.start(ctx); err != nil {
		return Result{}, err
	}
	cs, err := startConsumers(ctx, e, q, handler, opts)
	if err != nil {
		return Result{}, err
	}
	defer cs.stop()
	if err := finishAll(ctx, e, m, t, streamKey(q)); err != nil {
		return Result{}, err
	}
	if err := cs.stop(); err != nil {
		return Result{}, err
	}
	if err := checkEmpty(ctx, e, streamKey(q)); err != nil {
		return Result{}, err
	}
	if err := firstErr(herr.err(), t.verify("streamq single queue")); err != nil {
		return Result{}, err
	}
	return m.result("multi", "streamq-1q", n, "-", nil), nil
}

// multiBaseline: a stream of n entries (appended first, pipelined), drained
// by -workers goroutines with XREADGROUP COUNT 100 and pipelined XACK+XDEL,
// as in the drain scenario.
func multiBaseline(ctx context.Context, e *env, n int, pad string) (Result, error) {
	b, err := newBaseline(ctx, e, "multi")
	if err != nil {
		return Result{}, err
	}
	defer b.cleanup(context.WithoutCancel(ctx), e)
	for from := 0; from < n; from += 1000 {
		pipe := e.admin.Pipeline()
		now := time.Now().UnixNano()
		for i := from; i < min(from+1000, n); i++ {
			payload, err := json.Marshal(job{Seq: i, T: now, Pad: pad})
			if err != nil {
				return Result{}, err
			}
			pipe.XAdd(ctx, b.xaddArgs(jobID(i), payload))
		}
		if _, err := pipe.Exec(ctx); err != nil {
			return Result{}, fmt.Errorf("XADD: %w", err)
		}
	}
	t := newTracker(n)
	var herr handlerErrors
	m := e.meter()
	if err := m.start(ctx); err != nil {
		return Result{}, err
	}
	stop := b.runConsumers(ctx, e, e.cfg.workers, 100, 100*time.Millisecond, func(msg redis.XMessage, _ redis.Pipeliner) error {
		j, err := decodeJob(msg)
		if err != nil {
			return err
		}
		if err := t.mark(j.Seq, 0); err != nil {
			herr.add(err)
		}
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
	if err := firstErr(herr.err(), t.verify("baseline multi")); err != nil {
		return Result{}, err
	}
	return m.result("multi", "baseline", n, "-", nil), nil
}

// sharesNote describes the shares of a multi result for the table.
func sharesNote(r Result) string {
	var b strings.Builder
	ws := make([]string, len(r.QueueWeights))
	for i, w := range r.QueueWeights {
		ws[i] = fmt.Sprint(w)
	}
	fmt.Fprintf(&b, "starts while every queue had work (%d of %d), weights %s:", r.QueueSharesStarts, r.N, strings.Join(ws, ":"))
	for i, s := range r.QueueShares {
		if i > 0 {
			b.WriteString(" /")
		}
		fmt.Fprintf(&b, " %.1f%%", 100*s)
	}
	if r.QueueShareWindowMin != nil {
		fmt.Fprintf(&b, "; per %d starts:", multiWindow)
		for i := range r.QueueShareWindowMin {
			if i > 0 {
				b.WriteString(" /")
			}
			fmt.Fprintf(&b, " %.1f-%.1f%%", 100*r.QueueShareWindowMin[i], 100*r.QueueShareWindowMax[i])
		}
	}
	return b.String()
}
