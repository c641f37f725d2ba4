package main

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/streamq/streamq"
)

// fairPerKey is how many jobs each key gets in the fair scenario's keyed run.
const fairPerKey = 5

// runFair compares draining n jobs without keys ("streamq-nokey") with the
// same n jobs over n/5 keys of 5 jobs each ("streamq-keyed"): the jobs are
// appended first (ProduceBatch of 500), then the consumers drain them; the
// result lines measure the drain. A note line gives keyed/nokey jobs/s and
// Redis's used_memory after each drain (records expire at once: ResultTTL
// 1 ms); another the same ratio end to end, appends and drain together, with
// Redis and client CPU per job over both (a keyed job is appended to the
// stream during the drain, when its turn comes; an unkeyed one before it).
// Then the fairness figure: key A gets a backlog of n jobs, keys B..K 10
// jobs each once A's jobs run; the note gives the worst start of B..K's jobs
// in first starts of entries ahead of it (a smaller entry id) after its
// produce returned, beside their bound KeyWindow + (j+1)·(K−1) + j (job j,
// 0-based: see TestFairKeysBacklogDoesNotDelayOtherKeys), then in all other
// starts and in ms from the call (entries behind it whose handlers began
// first, and re-deliveries, are not bounded by the policy).
func runFair(ctx context.Context, e *env, n int) error {
	nokey, nokeyAll, memNokey, err := fairDrain(ctx, e, n, false)
	if err != nil {
		return err
	}
	e.out.result(nokey)
	keyed, keyedAll, memKeyed, err := fairDrain(ctx, e, n, true)
	if err != nil {
		return err
	}
	e.out.result(keyed)
	e.out.note("fair       keyed/nokey jobs/s = %.2f (%d keys x %d jobs); used_memory after the drain: nokey %d, keyed %d bytes",
		keyed.JobsPerSec/nokey.JobsPerSec, n/fairPerKey, fairPerKey, memNokey, memKeyed)
	e.out.note("fair       end to end (appends and drain): keyed/nokey jobs/s = %.2f; Redis CPU us/job nokey %.2f, keyed %.2f; client nokey %.2f, keyed %.2f",
		keyedAll.jobsPerSec(n)/nokeyAll.jobsPerSec(n), nokeyAll.redisUs/float64(n), keyedAll.redisUs/float64(n),
		nokeyAll.clientUs/float64(n), keyedAll.clientUs/float64(n))
	return fairBacklog(ctx, e, n)
}

// fairProduce appends n jobs (keyed: key i/fairPerKey... spread i%keys).
func fairProduce(ctx context.Context, p *streamq.Producer[job, struct{}], n int, key func(i int) string, pad string) error {
	batch := make([]streamq.Job[job], 0, 500)
	for i := range n {
		j := streamq.Job[job]{ID: jobID(i), Request: job{Seq: i, T: time.Now().UnixNano(), Pad: pad}}
		if key != nil {
			j.Options = []streamq.ProduceOption{streamq.Key(key(i))}
		}
		batch = append(batch, j)
		if len(batch) == cap(batch) || i == n-1 {
			prs, err := p.ProduceBatch(ctx, batch)
			if err != nil {
				return fmt.Errorf("ProduceBatch: %w", err)
			}
			for _, pr := range prs {
				pr.Release()
			}
			batch = batch[:0]
		}
	}
	return nil
}

// fairSpan is what the appends and the drain of a fair run took together.
type fairSpan struct {
	seconds, redisUs, clientUs float64
}

func (f fairSpan) jobsPerSec(n int) float64 { return float64(n) / f.seconds }

// add adds the span m measured.
func (f *fairSpan) add(m *meter) {
	f.seconds += m.t1.Sub(m.t0).Seconds()
	f.redisUs += m.after.cpuUs - m.before.cpuUs
	f.clientUs += m.cpu1 - m.cpu0
}

// fairDrain appends n jobs (keyed or not), then measures their drain. It
// returns the drain's result, what the appends and the drain took together,
// and Redis's used_memory after the drain.
func fairDrain(ctx context.Context, e *env, n int, keyed bool) (Result, fairSpan, int64, error) {
	system := "streamq-nokey"
	var key func(int) string
	if keyed {
		system = "streamq-keyed"
		keys := max(n/fairPerKey, 1)
		key = func(i int) string { return "key" + strconv.Itoa(i%keys) }
	}
	q := e.queue("fair", system)
	cl := e.client(0)
	defer cl.Close()
	p, err := streamq.NewProducer[job, struct{}](cl, q, &streamq.ProducerOptions{Logger: e.log})
	if err != nil {
		return Result{}, fairSpan{}, 0, err
	}
	defer p.Close()
	var span fairSpan
	pm := e.meter()
	if err := pm.start(ctx); err != nil {
		return Result{}, span, 0, err
	}
	if err := fairProduce(ctx, p, n, key, padFor(e.cfg.payload)); err != nil {
		return Result{}, span, 0, err
	}
	if err := pm.stop(ctx); err != nil {
		return Result{}, span, 0, err
	}
	if pm.detail != nil {
		pm.breakdown(pm.detail, "fair/"+system+" appends", n)
	}
	span.add(pm)
	t := newTracker(n)
	var herr handlerErrors
	handler := func(_ context.Context, m *streamq.Message[job]) (struct{}, error) {
		if err := t.mark(m.Payload.Seq, 0); err != nil {
			herr.add(err)
		}
		return struct{}{}, nil
	}
	m := e.meter()
	if err := m.start(ctx); err != nil {
		return Result{}, span, 0, err
	}
	cs, err := startConsumers(ctx, e, q, handler, consumerOpts(e, streamq.ConsumerOptions{DiscardResults: true, ResultTTL: time.Millisecond}))
	if err != nil {
		return Result{}, span, 0, err
	}
	if err := finish(ctx, e, m, t, streamKey(q), streamq.DefaultGroup); err != nil {
		_ = cs.stop()
		return Result{}, span, 0, err
	}
	if err := cs.stop(); err != nil {
		return Result{}, span, 0, err
	}
	if err := firstErr(herr.err(), t.verify("streamq fair "+system)); err != nil {
		return Result{}, span, 0, err
	}
	left, err := e.admin.Keys(ctx, "streamq:{"+q+"}:keys:*").Result()
	if err != nil {
		return Result{}, span, 0, err
	}
	if len(left) > 0 {
		return Result{}, span, 0, fmt.Errorf("keyed state left after the drain: %v", left)
	}
	_ = e.admin.Del(ctx, streamKey(q)).Err()
	time.Sleep(200 * time.Millisecond) // the records expire (ResultTTL 1 ms)
	mem, err := usedMemoryOf(ctx, e)
	if err != nil {
		return Result{}, span, 0, err
	}
	span.add(m)
	return m.result("fair", system, n, "", nil), span, mem, nil
}

// fairBacklog measures how long other keys' jobs wait behind one key's
// backlog of n jobs.
func fairBacklog(ctx context.Context, e *env, n int) error {
	q := e.queue("fair", "backlog")
	cl := e.client(0)
	defer cl.Close()
	p, err := streamq.NewProducer[job, struct{}](cl, q, &streamq.ProducerOptions{Logger: e.log})
	if err != nil {
		return err
	}
	defer p.Close()
	pad := padFor(e.cfg.payload)
	if err := fairProduce(ctx, p, n, func(int) string { return "A" }, pad); err != nil {
		return err
	}
	// Every start in order: its entry id, and whether it was a re-delivery.
	type startRec struct {
		eid   [2]uint64
		again bool
	}
	var mu sync.Mutex
	starts := int64(0)
	started := map[int64]startRec{}
	startedAt := map[string]int64{}
	startedTime := map[string]time.Time{}
	handler := func(_ context.Context, m *streamq.Message[job]) (struct{}, error) {
		eid, err := parseEntryID(m.EntryID)
		if err != nil {
			return struct{}{}, streamq.Permanent(err)
		}
		mu.Lock()
		starts++
		started[starts] = startRec{eid, m.Deliveries > 1}
		if m.Key != "A" {
			startedAt[m.ID], startedTime[m.ID] = starts, time.Now()
		}
		mu.Unlock()
		return struct{}{}, nil
	}
	// One consumer with all the workers, as the test (the bound counts
	// entries ahead of the job, whichever consumer starts them).
	cs, err := startConsumers(ctx, e, q, handler, []streamq.ConsumerOptions{{DiscardResults: true, Workers: e.cfg.workers}})
	if err != nil {
		return err
	}
	defer cs.stop()
	count := func() int64 { mu.Lock(); defer mu.Unlock(); return starts }
	for count() < int64(min(n/10, 2000)) {
		time.Sleep(time.Millisecond)
	}
	others := strings.Split("B C D E F G H I J K", " ")
	const perKey = 10
	before, at := map[string]int64{}, map[string]time.Time{}
	var prs []*streamq.Promise[struct{}]
	for j := range perKey {
		for _, k := range others {
			id := fmt.Sprint(k, "-", j)
			at[id] = time.Now()
			pr, err := p.Produce(ctx, id, job{Seq: -1, Pad: pad}, streamq.Key(k))
			if err != nil {
				return err
			}
			// Starts are counted from the produce's return: those while the
			// call was on its way to Redis came before the job.
			before[id] = count()
			prs = append(prs, pr)
		}
	}
	wctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	for _, pr := range prs {
		if _, err := pr.Wait(wctx); err != nil {
			return fmt.Errorf("a job of B..K: %w", err)
		}
	}
	mu.Lock()
	defer mu.Unlock()
	keysWithWork := int64(len(others) + 1)
	worstAhead, worstAll, worstBehind, worstAgain, worstMs, over := int64(0), int64(0), int64(0), int64(0), time.Duration(0), 0
	for j := range perKey {
		bound := streamq.DefaultKeyWindow + int64(j+1)*(keysWithWork-1) + int64(j)
		for _, k := range others {
			id := fmt.Sprint(k, "-", j)
			own := started[startedAt[id]].eid
			var ahead, behind, again int64
			for i := before[id] + 1; i < startedAt[id]; i++ {
				s := started[i]
				switch {
				case s.again:
					again++
				case entryIDLess(s.eid, own):
					ahead++
				default:
					behind++
				}
			}
			if ahead > bound {
				over++
			}
			worstAhead, worstAll = max(worstAhead, ahead), max(worstAll, startedAt[id]-before[id]-1)
			worstBehind, worstAgain = max(worstBehind, behind), max(worstAgain, again)
			worstMs = max(worstMs, startedTime[id].Sub(at[id]))
		}
	}
	e.out.note("fair       backlog of %d jobs of key A, 10 jobs of each of keys B..K, one consumer of %d workers: the worst B..K job started after %d first starts of entries ahead of it (bound W+(j+1)*(K-1)+j: %d..%d; %d over it); in all after %d other starts, %d of entries behind it and %d re-deliveries, and %v",
		n, e.cfg.workers, worstAhead, streamq.DefaultKeyWindow+keysWithWork-1, streamq.DefaultKeyWindow+perKey*(keysWithWork-1)+perKey-1,
		over, worstAll, worstBehind, worstAgain, worstMs.Round(time.Millisecond))
	if over > 0 {
		return fmt.Errorf("%d jobs of B..K started later than the bound", over)
	}
	return nil
}

// parseEntryID splits a stream entry id "<ms>-<seq>".
func parseEntryID(id string) ([2]uint64, error) {
	a, b, ok := strings.Cut(id, "-")
	ms, err1 := strconv.ParseUint(a, 10, 64)
	seq, err2 := strconv.ParseUint(b, 10, 64)
	if !ok || err1 != nil || err2 != nil {
		return [2]uint64{}, fmt.Errorf("not an entry id: %q", id)
	}
	return [2]uint64{ms, seq}, nil
}

// entryIDLess reports whether entry id a comes before b in their stream.
func entryIDLess(a, b [2]uint64) bool { return a[0] < b[0] || a[0] == b[0] && a[1] < b[1] }

// usedMemoryOf reads INFO memory's used_memory.
func usedMemoryOf(ctx context.Context, e *env) (int64, error) {
	info, err := e.admin.Info(ctx, "memory").Result()
	if err != nil {
		return 0, err
	}
	for _, line := range strings.Split(info, "\n") {
		if v, ok := strings.CutPrefix(strings.TrimSpace(line), "used_memory:"); ok {
			return strconv.ParseInt(v, 10, 64)
		}
	}
	return 0, fmt.Errorf("INFO memory has no used_memory")
}
