package main

import (
	"context"
	"encoding/json"
	"fmt"
	"math"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/streamq/streamq"
)

// dedupIDs is the number of request ids the calls of the dedupmodes
// scenario spread over.
const dedupIDs = 100

// The modes' settings in the dedupmodes scenario.
const (
	dedupQuiet    = 50 * time.Millisecond
	dedupMaxWait  = time.Second
	dedupWindow   = 200 * time.Millisecond
	dedupPlainCmd = 4.0 // EVALSHA + GET + XADD + SET: a plain Produce of a new id
)

// runDedupModes measures the flow-control produce options. n calls spread
// over 100 ids, each id owned by one calling goroutine (P producers x
// -callers goroutines), so the last payload of each id is known:
//
//   - "debounce": Produce with Debounce(50ms, 1s), consumers running.
//   - "throttle": Produce with Throttle(200ms), consumers running.
//   - "replace": Produce with Replace, consumers running.
//   - "plain": n/10 Produce calls of new ids, one at a time, no consumer:
//     the commands per call, which must be those of a plain produce
//     (EVALSHA, GET, XADD, SET: 4.00), the modes notwithstanding.
//   - "baseline": a hand-written debounce, one pipeline per call (HSET the
//     payload, ZADD the due time): the produce side only, with no maxWait,
//     no outcome for the callers and no promotion.
//
// jobs/s counts calls; latency: one Produce call. Each mode row adds a line
// with the runs: in all, per id (min, mean, max), and checks them: one run
// per debounce cycle and per throttle window (the calls answered
// DedupNone), each id's last run carrying its last payload (debounce and
// replace), no replace run beyond one per call.
func runDedupModes(ctx context.Context, e *env, n int) error {
	for _, mode := range []string{"debounce", "throttle", "replace"} {
		r, err := dedupModeRun(ctx, e, n, mode)
		if err != nil {
			return fmt.Errorf("%s: %w", mode, err)
		}
		e.out.result(r)
	}
	plain, err := dedupPlainRun(ctx, e, max(n/10, 100))
	if err != nil {
		return fmt.Errorf("plain: %w", err)
	}
	e.out.result(plain)
	if math.Abs(plain.RedisCmdsPerJob-dedupPlainCmd) > 0.05 {
		return fmt.Errorf("a plain Produce of a new id ran %.2f commands, not %.0f", plain.RedisCmdsPerJob, dedupPlainCmd)
	}
	b, err := dedupBaseline(ctx, e, n)
	if err != nil {
		return fmt.Errorf("baseline: %w", err)
	}
	e.out.result(b)
	deb, _ := find(e.out.results, "dedupmodes", "debounce")
	e.out.ratio(Ratio{Scenario: "dedupmodes", System: "debounce", Ratio: deb.JobsPerSec / b.JobsPerSec})
	return nil
}

// dedupRuns records the payload of every run, per id index.
type dedupRuns struct {
	mu   sync.Mutex
	runs [][]int // id -> payload seq of each run, in start order
}

func (d *dedupRuns) add(id, seq int) {
	d.mu.Lock()
	d.runs[id] = append(d.runs[id], seq)
	d.mu.Unlock()
}

func (d *dedupRuns) total() int {
	d.mu.Lock()
	defer d.mu.Unlock()
	t := 0
	for _, r := range d.runs {
		t += len(r)
	}
	return t
}

// dedupID is the request id of id index i.
func dedupID(i int) string { return "d" + strconv.Itoa(i) }

func dedupModeRun(ctx context.Context, e *env, n int, mode string) (Result, error) {
	q := e.queue("dedupmodes", mode)
	pad := padFor(e.cfg.payload)
	runs := &dedupRuns{runs: make([][]int, dedupIDs)}
	var herr handlerErrors
	handler := func(_ context.Context, m *streamq.Message[job]) (int, error) {
		i, err := strconv.Atoi(m.ID[1:])
		if err != nil || i < 0 || i >= dedupIDs {
			herr.add(fmt.Errorf("unexpected request id %q", m.ID))
			return 0, nil
		}
		runs.add(i, m.Payload.Seq)
		return m.Payload.Seq, nil
	}
	cs, err := startConsumers(ctx, e, q, handler, consumerOpts(e, streamq.ConsumerOptions{DiscardResults: true}))
	if err != nil {
		return Result{}, err
	}
	defer cs.stop()
	var opt streamq.ProduceOption
	switch mode {
	case "debounce":
		opt = streamq.Debounce(dedupQuiet, dedupMaxWait)
	case "throttle":
		opt = streamq.Throttle(dedupWindow)
	default:
		opt = streamq.Replace()
	}
	producers := make([]*streamq.Producer[job, int], e.cfg.producers)
	for i := range producers {
		cl := e.client(0)
		defer cl.Close()
		p, err := streamq.NewProducer[job, int](cl, q, &streamq.ProducerOptions{Logger: e.log})
		if err != nil {
			return Result{}, err
		}
		defer p.Close()
		producers[i] = p
	}
	callers := e.cfg.producers * e.cfg.callers
	lastSeq := make([]int, dedupIDs)  // the last payload produced per id
	opened := make([]int, dedupIDs)   // calls answered DedupNone per id
	produced := make([]int, dedupIDs) // calls per id
	lat := make([]int64, n)
	var next atomic.Int64
	m := e.meter()
	if err := m.start(ctx); err != nil {
		return Result{}, err
	}
	var g errGroup
	for c := range callers {
		p := producers[c%len(producers)]
		g.Go(func() error {
			// Caller c owns ids c, c+callers, ...: one call at a time per id.
			var own []int
			for i := c; i < dedupIDs; i += callers {
				own = append(own, i)
			}
			if len(own) == 0 {
				return nil
			}
			for k := 0; ; k++ {
				s := int(next.Add(1) - 1)
				if s >= n {
					return nil
				}
				id := own[k%len(own)]
				t0 := time.Now()
				pr, err := p.Produce(ctx, dedupID(id), job{Seq: s, T: t0.UnixNano(), Pad: pad}, opt)
				if err != nil {
					return fmt.Errorf("Produce: %w", err)
				}
				lat[s] = int64(time.Since(t0))
				if pr.Deduplicated() == streamq.DedupNone {
					opened[id]++
				}
				produced[id]++
				lastSeq[id] = s
				pr.Release()
			}
		})
	}
	if err := g.Wait(); err != nil {
		return Result{}, err
	}
	if err := m.stop(ctx); err != nil {
		return Result{}, err
	}
	// Wait for the last runs: debounced ids run at most maxWait later.
	wctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	if err := waitDedupQuiet(wctx, e, q); err != nil {
		return Result{}, err
	}
	if err := cs.stop(); err != nil {
		return Result{}, err
	}
	if err := herr.err(); err != nil {
		return Result{}, err
	}
	runs.mu.Lock()
	defer runs.mu.Unlock()
	lo, hi, total, ids := math.MaxInt, 0, 0, 0
	for i, r := range runs.runs {
		if produced[i] == 0 {
			continue
		}
		ids++
		total += len(r)
		lo, hi = min(lo, len(r)), max(hi, len(r))
		switch {
		case len(r) == 0:
			return Result{}, fmt.Errorf("%s: %d calls, no run", dedupID(i), produced[i])
		case mode != "replace" && len(r) != opened[i]:
			return Result{}, fmt.Errorf("%s: %d runs for %d cycles or windows opened", dedupID(i), len(r), opened[i])
		case mode != "throttle" && r[len(r)-1] != lastSeq[i]:
			return Result{}, fmt.Errorf("%s: the last run carried payload %d, not the last one produced (%d)", dedupID(i), r[len(r)-1], lastSeq[i])
		case len(r) > produced[i]:
			return Result{}, fmt.Errorf("%s: %d runs for %d calls", dedupID(i), len(r), produced[i])
		}
	}
	res := m.result("dedupmodes", mode, n, "Produce call", lat)
	res.Note = fmt.Sprintf("%d calls over %d ids in %.2f s: %d runs, per id min %d mean %.1f max %d (%.1f calls per run)",
		n, ids, res.Seconds, total, lo, float64(total)/float64(max(ids, 1)), hi, float64(n)/float64(max(total, 1)))
	return res, nil
}

// waitDedupQuiet waits until queue q has nothing scheduled, queued or
// running.
func waitDedupQuiet(ctx context.Context, e *env, q string) error {
	sched := "streamq:{" + q + "}:schedule"
	for {
		s, err := e.admin.ZCard(ctx, sched).Result()
		if err != nil {
			return err
		}
		l, err := e.admin.XLen(ctx, streamKey(q)).Result()
		if err != nil {
			return err
		}
		if s == 0 && l == 0 {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("%d scheduled, %d entries left: %w", s, l, ctx.Err())
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// dedupPlainRun: n Produce calls of new ids, one at a time, no consumer.
func dedupPlainRun(ctx context.Context, e *env, n int) (Result, error) {
	q := e.queue("dedupmodes", "plain")
	pad := padFor(e.cfg.payload)
	cl := e.client(0)
	defer cl.Close()
	p, err := streamq.NewProducer[job, int](cl, q, &streamq.ProducerOptions{Logger: e.log, InflightTTL: 10 * time.Minute})
	if err != nil {
		return Result{}, err
	}
	defer p.Close()
	defer e.admin.Unlink(ctx, streamKey(q))
	warm, err := p.Produce(ctx, jobID(n), job{Seq: n}) // subscription, shard check, script load
	if err != nil {
		return Result{}, err
	}
	warm.Release()
	lat := make([]int64, n)
	m := e.meter()
	if err := m.start(ctx); err != nil {
		return Result{}, err
	}
	for i := range n {
		t0 := time.Now()
		pr, err := p.Produce(ctx, jobID(i), job{Seq: i, T: t0.UnixNano(), Pad: pad})
		if err != nil {
			return Result{}, err
		}
		lat[i] = int64(time.Since(t0))
		pr.Release()
	}
	if err := m.stop(ctx); err != nil {
		return Result{}, err
	}
	t := newTracker(n + 1)
	if err := markStream(ctx, e, streamKey(q), t); err != nil {
		return Result{}, err
	}
	if err := t.verify("streamq plain"); err != nil {
		return Result{}, err
	}
	res := m.result("dedupmodes", "plain", n, "Produce call", lat)
	res.Note = fmt.Sprintf("a plain Produce of a new id: %.2f commands (EVALSHA, GET, XADD, SET: %.0f, as before the modes)", res.RedisCmdsPerJob, dedupPlainCmd)
	return res, nil
}

// dedupBaseline: a hand-written debounce, produce side only: per call one
// pipeline of HSET (the latest payload) and ZADD (due = now + quiet period).
func dedupBaseline(ctx context.Context, e *env, n int) (Result, error) {
	q := e.queue("dedupmodes", "baseline")
	data, sched := "bench:{"+q+"}:data", "bench:{"+q+"}:sched"
	defer e.admin.Unlink(ctx, data, sched)
	pad := padFor(e.cfg.payload)
	lat := make([]int64, n)
	var next atomic.Int64
	m := e.meter()
	if err := m.start(ctx); err != nil {
		return Result{}, err
	}
	callers := e.cfg.producers * e.cfg.callers
	var g errGroup
	for pi := range e.cfg.producers {
		c := e.client(0)
		defer c.Close()
		for k := range e.cfg.callers {
			caller := pi*e.cfg.callers + k
			g.Go(func() error {
				var own []int
				for i := caller; i < dedupIDs; i += callers {
					own = append(own, i)
				}
				if len(own) == 0 {
					return nil
				}
				for j := 0; ; j++ {
					s := int(next.Add(1) - 1)
					if s >= n {
						return nil
					}
					id := dedupID(own[j%len(own)])
					t0 := time.Now()
					payload, err := json.Marshal(job{Seq: s, T: t0.UnixNano(), Pad: pad})
					if err != nil {
						return err
					}
					pipe := c.Pipeline()
					pipe.HSet(ctx, data, id, payload)
					pipe.ZAdd(ctx, sched, redis.Z{Score: float64(t0.Add(dedupQuiet).UnixMilli()), Member: id})
					if _, err := pipe.Exec(ctx); err != nil {
						return err
					}
					lat[s] = int64(time.Since(t0))
				}
			})
		}
	}
	if err := g.Wait(); err != nil {
		return Result{}, err
	}
	if err := m.stop(ctx); err != nil {
		return Result{}, err
	}
	res := m.result("dedupmodes", "baseline", n, "call", lat)
	res.Note = "hand-written debounce, produce side only (HSET + ZADD per call): no maxWait, no outcome to the callers, no promotion"
	return res, nil
}
