package streamq

import (
	"context"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/streamq/streamq/internal/crashtest"
)

// entryMillis is the server time (Unix ms) in a stream entry id.
func entryMillis(t *testing.T, eid string) int64 {
	t.Helper()
	ms, _, ok := strings.Cut(eid, "-")
	require.True(t, ok, "entry id %q", eid)
	n, err := strconv.ParseInt(ms, 10, 64)
	require.NoError(t, err)
	return n
}

// modeCall is one Produce of a flow-control test and what it got.
type modeCall struct {
	id, payload string
	start, end  time.Time // around Produce
	dedup       Dedup
	entryID     string
	result      string
	answered    time.Time
	err         error
}

// TestDedupModesThrottleSteadyStream: 4 producers call 10 ids every 5 ms
// for 2 s with Throttle(200ms). Counted exactly: each id runs once per
// window-opening call (DedupNone), with that call's payload; windows of one
// id open at least 200 ms apart on the server's clock (the entry ids); every
// caller is answered with the result of a run of its id that was appended
// before its call returned. No consumer crashes here, so each run starts
// exactly once.
func TestDedupModesThrottleSteadyStream(t *testing.T) {
	t.Parallel()
	client := realRedis(t)
	q := queueName(t)
	const (
		window    = 200 * time.Millisecond
		producers = 4
		ids       = 10
		duration  = 2 * time.Second
	)
	var mu sync.Mutex
	runs := map[string][]string{} // id -> payloads run, in order
	c, err := NewConsumer(client, q, func(ctx context.Context, m *Message[string]) (string, error) {
		mu.Lock()
		runs[m.ID] = append(runs[m.ID], m.Payload)
		mu.Unlock()
		return "ran:" + m.Payload, nil
	}, fastOpts(t, "throttle", time.Second))
	require.NoError(t, err)
	runConsumer(t, c)

	var calls []*modeCall
	var wg sync.WaitGroup
	stop := time.Now().Add(duration)
	for pi := range producers {
		p := newStringProducer(t, client, q)
		for ii := range ids {
			wg.Go(func() {
				id := fmt.Sprintf("doc-%d", ii)
				for seq := 0; time.Now().Before(stop); seq++ {
					mc := &modeCall{id: id, payload: fmt.Sprintf("p%d-s%d", pi, seq), start: time.Now()}
					pr, err := p.Produce(context.Background(), id, mc.payload, Throttle(window))
					require.NoError(t, err)
					mc.end, mc.dedup, mc.entryID = time.Now(), pr.Deduplicated(), pr.EntryID()
					wg.Go(func() {
						mc.result, mc.err = pr.Wait(waitCtx(t, 30*time.Second))
						mc.answered = time.Now()
					})
					mu.Lock()
					calls = append(calls, mc)
					mu.Unlock()
					time.Sleep(5 * time.Millisecond)
				}
			})
		}
	}
	wg.Wait()

	openers := map[string][]*modeCall{}
	for _, mc := range calls {
		require.NoError(t, mc.err, "every caller is answered (%s %s)", mc.id, mc.payload)
		if mc.dedup == DedupNone {
			openers[mc.id] = append(openers[mc.id], mc)
		}
	}
	eventually(t, 10*time.Second, func() bool {
		mu.Lock()
		defer mu.Unlock()
		n := 0
		for _, r := range runs {
			n += len(r)
		}
		o := 0
		for _, op := range openers {
			o += len(op)
		}
		return n >= o
	}, "every window's run")
	mu.Lock()
	defer mu.Unlock()
	total := 0
	for ii := range ids {
		id := fmt.Sprintf("doc-%d", ii)
		ops := openers[id]
		ran := runs[id]
		require.Len(t, ran, len(ops), "%s: one run per opened window", id)
		byPayload := map[string]*modeCall{}
		var ms []int64
		for _, op := range ops {
			byPayload[op.payload] = op
			ms = append(ms, entryMillis(t, op.entryID))
		}
		for _, pl := range ran {
			require.Contains(t, byPayload, pl, "%s: a run carries its opener's payload", id)
		}
		sortInt64(ms)
		for j := 1; j < len(ms); j++ {
			require.GreaterOrEqual(t, ms[j]-ms[j-1], window.Milliseconds(), "%s: windows open at least %v apart", id, window)
		}
		total += len(ops)
	}
	for _, mc := range calls {
		op, ok := map[string]*modeCall{}, false
		for _, o := range openers[mc.id] {
			op[o.payload] = o
		}
		var src *modeCall
		src, ok = op[strings.TrimPrefix(mc.result, "ran:")]
		require.True(t, ok, "%s %s: answered with a run of its id: %q", mc.id, mc.payload, mc.result)
		require.False(t, src.start.After(mc.end), "%s %s: answered by a run produced before its call returned", mc.id, mc.payload)
	}
	// The figure: with a call every ~5 ms per producer, each id opens about
	// one window per 200 ms plus a round trip.
	t.Logf("Throttle(%v): %d calls, %d runs over %d ids in %v (%.1f runs per id; at most %d possible)",
		window, len(calls), total, ids, duration, float64(total)/ids, int(duration/window)+1)
	require.LessOrEqual(t, total, ids*(int(duration/window)+1))
}

func sortInt64(s []int64) {
	for i := 1; i < len(s); i++ {
		for j := i; j > 0 && s[j] < s[j-1]; j-- {
			s[j], s[j-1] = s[j-1], s[j]
		}
	}
}

// TestDedupModesDebounceBursts: 8 producers call 100 ids with
// Debounce(50ms, 1s) for 3 s: 3 bursts of 550 ms separated by quiet periods
// of 450 ms. Asserted: each id runs exactly once per debounce cycle (the
// calls answered DedupNone); in each burst at least once and at most once
// per quiet period the calls may have left (exactly once where they left
// none: no call returned 50 ms or more after the start of the one before
// it); the run carries the last payload of its cycle (no caller of the
// cycle whose call started after the run's payload was recorded) and starts
// no sooner than d after that payload's call; every caller is answered,
// with the result of a run of its own burst (or of an earlier burst's run
// when another caller of that run was still unanswered as its call
// started: see below); no cycle's run started later
// than maxWait (+ the promoter's and consumer's latency, bounded at 1 s on a
// loaded machine; the cap itself is checked in Redis by
// TestDedupModesDebounceMaxWait) after it opened.
func TestDedupModesDebounceBursts(t *testing.T) {
	t.Parallel()
	client := realRedis(t)
	q := queueName(t)
	const (
		quiet     = 50 * time.Millisecond
		maxWait   = time.Second
		producers = 8
		ids       = 100
		bursts    = 3
		burstLen  = 550 * time.Millisecond
		period    = 40 * time.Millisecond
		gapLen    = 450 * time.Millisecond
	)
	type run struct {
		payload string
		at      time.Time
	}
	var mu sync.Mutex
	runs := map[string][]run{}
	opts := fastOpts(t, "debounce", time.Second)
	opts.Workers = 16
	c, err := NewConsumer(client, q, func(ctx context.Context, m *Message[string]) (string, error) {
		mu.Lock()
		runs[m.ID] = append(runs[m.ID], run{m.Payload, time.Now()})
		mu.Unlock()
		return "ran:" + m.Payload, nil
	}, opts)
	require.NoError(t, err)
	runConsumer(t, c)

	prods := make([]*Producer[string, string], producers)
	for i := range prods {
		prods[i] = newStringProducer(t, client, q)
	}
	var calls []*modeCall
	var waits sync.WaitGroup
	burstOf := func(payload string) int { b, _ := strconv.Atoi(payload[1:strings.Index(payload, "-")]); return b }
	for b := range bursts {
		begin := time.Now()
		end := begin.Add(burstLen)
		var wg sync.WaitGroup
		for pi, p := range prods {
			for ii := range ids {
				wg.Go(func() {
					id := fmt.Sprintf("doc-%03d", ii)
					// Each producer calls each id every 40 ms, the producers
					// 5 ms apart: a call of each id every 5 ms.
					time.Sleep(time.Duration(pi) * period / producers)
					for seq := 0; time.Now().Before(end); seq++ {
						mc := &modeCall{id: id, payload: fmt.Sprintf("b%d-p%d-s%d", b, pi, seq), start: time.Now()}
						pr, err := p.Produce(context.Background(), id, mc.payload, Debounce(quiet, maxWait))
						require.NoError(t, err)
						mc.end, mc.dedup, mc.entryID = time.Now(), pr.Deduplicated(), pr.EntryID()
						waits.Go(func() {
							mc.result, mc.err = pr.Wait(waitCtx(t, 30*time.Second))
							mc.answered = time.Now()
						})
						mu.Lock()
						calls = append(calls, mc)
						mu.Unlock()
						time.Sleep(time.Until(begin.Add(time.Duration(pi)*period/producers + time.Duration(seq+1)*period)))
					}
				})
			}
		}
		wg.Wait()
		time.Sleep(gapLen)
	}
	waits.Wait()

	mu.Lock()
	defer mu.Unlock()
	byID := map[string][]*modeCall{}
	for _, mc := range calls {
		require.NoError(t, mc.err, "every caller is answered (%s %s)", mc.id, mc.payload)
		byID[mc.id] = append(byID[mc.id], mc)
	}
	exactBursts, gappy, cycles, oneRun, lateAnswers := 0, 0, 0, 0, 0
	var maxOpenToRun time.Duration
	for id, cs := range byID {
		byPayload := map[string]*modeCall{}
		opened := 0
		for _, mc := range cs {
			byPayload[mc.payload] = mc
			if mc.dedup == DedupNone {
				opened++
			}
		}
		ran := runs[id]
		require.Len(t, ran, opened, "%s: one run per debounce cycle", id)
		cycles += opened
		perBurst := make([]int, bursts)
		for _, r := range ran {
			perBurst[burstOf(r.payload)]++
		}
		for b := range bursts {
			if perBurst[b] == 1 {
				oneRun++
			}
			// The calls of burst b, by start: the server saw no 50 ms gap when
			// each next call returned within 50 ms of the previous one's start.
			var bc []*modeCall
			for _, mc := range cs {
				if burstOf(mc.payload) == b {
					bc = append(bc, mc)
				}
			}
			sortCalls(bc)
			// The quiet periods Redis may have seen inside the burst (see
			// possibleQuiet; maxWait, 1 s, cannot end a cycle opened in a
			// 550 ms burst). Each allows one more run: the runs of the
			// burst are at least one and at most one more per possible
			// quiet period, so exactly one where the calls left none.
			possible := possibleQuiet(bc, quiet)
			require.GreaterOrEqual(t, perBurst[b], 1, "%s burst %d", id, b)
			require.LessOrEqual(t, perBurst[b], 1+possible, "%s burst %d: runs beyond one per quiet period", id, b)
			if possible == 0 {
				exactBursts++
			} else {
				gappy++
			}
		}
		// Each caller is answered by a run of its own burst, or by the run
		// of an earlier burst whose outcome another of its callers still
		// waited for when its call started: the call attached to that run
		// while it was queued or running (Debounce's doc: once the wait is
		// over, a produce attaches to the run), or joined a new wait while
		// a caller in its Producer still waited for that run's notice (the
		// limit in Debounce's doc). The gap between bursts leaves the last
		// run of a burst 400 ms to start, be recorded and be told, which a
		// loaded machine can exceed: beside two CPU burners and another
		// test process, "doc-082 b2-p3-s0" was answered by a run of burst 1.
		// A caller that joined a waiting cycle (no entry id) got the run of
		// the last payload: no caller answered with the same run started
		// after that payload's call returned while joining the wait.
		for _, mc := range cs {
			pl := strings.TrimPrefix(mc.result, "ran:")
			src, ok := byPayload[pl]
			require.True(t, ok, "%s %s: answered with %q", id, mc.payload, mc.result)
			if burstOf(pl) < burstOf(mc.payload) {
				require.True(t, slices.ContainsFunc(cs, func(oc *modeCall) bool {
					return oc != mc && oc.result == mc.result && mc.start.Before(oc.answered)
				}), "%s %s: answered by a run of burst %d whose other callers were all answered before its call", id, mc.payload, burstOf(pl))
				lateAnswers++
				continue
			}
			require.Equal(t, burstOf(mc.payload), burstOf(pl), "%s %s: answered by its burst's run", id, mc.payload)
			// Only where the burst had one cycle: see the limit in the doc of
			// Debounce (a producer whose caller still waits for a run's notice
			// answers its next callers of the id with that run).
			if perBurstCycles(cs, burstOf)[burstOf(mc.payload)] == 1 && mc.entryID == "" && mc.start.After(src.end) {
				t.Fatalf("%s: %s joined the wait after %s was recorded, but the run carried %s", id, mc.payload, pl, pl)
			}
		}
		// maxWait: from each cycle's opening call to its run. And the quiet
		// period: a run starts no sooner than d after its payload's call
		// started (Redis recorded that call after its start, and appends
		// the run d after the cycle's last call; one clock: one machine).
		for _, r := range ran {
			src := byPayload[r.payload]
			require.GreaterOrEqual(t, r.at.Sub(src.start), quiet-2*time.Millisecond, "%s: run %s started before its quiet period ended", id, r.payload)
			var opener *modeCall
			for _, mc := range cs {
				if mc.dedup == DedupNone && strings.TrimPrefix(mc.result, "ran:") == r.payload {
					opener = mc
				}
			}
			if opener == nil {
				continue // answered by an earlier run (the limit above)
			}
			d := r.at.Sub(opener.start)
			maxOpenToRun = max(maxOpenToRun, d)
			require.Less(t, d, maxWait+time.Second, "%s: run %s started %v after its cycle opened", id, r.payload, d)
		}
	}
	require.Len(t, byID, ids)
	t.Logf("Debounce(%v, %v): %d calls from %d producers over %d ids in %d bursts: %d runs (one per cycle), "+
		"%d id-bursts without a possible quiet period (exactly one run), %d with one or more (at least one run, at most one per quiet period); "+
		"%d of the %d id-bursts ran exactly once; longest open-to-run %v; %d callers answered by an earlier burst's run, not yet answered to all its callers when they called",
		quiet, maxWait, len(calls), producers, ids, bursts, cycles, exactBursts, gappy, oneRun, ids*bursts, maxOpenToRun, lateAnswers)
}

// possibleQuiet returns how many disjoint periods of d with no call of the
// id Redis may have seen between the first and the last of calls: Redis
// ran each call at some moment between its start and its end, so a period
// is certainly not quiet when it holds the whole of a call. Found from the
// left, 1 ms at a time.
func possibleQuiet(calls []*modeCall, d time.Duration) int {
	if len(calls) < 2 {
		return 0
	}
	from, to := calls[0].start, calls[0].end
	for _, c := range calls {
		from, to = minTime(from, c.start), maxTime(to, c.end)
	}
	n := 0
	for a := from; !a.Add(d).After(to); a = a.Add(time.Millisecond) {
		quietHere := true
		for _, c := range calls {
			if !c.start.Before(a) && !c.end.After(a.Add(d)) {
				quietHere = false
				break
			}
		}
		if quietHere {
			n++
			a = a.Add(d - time.Millisecond)
		}
	}
	return n
}

func minTime(a, b time.Time) time.Time {
	if b.Before(a) {
		return b
	}
	return a
}

func maxTime(a, b time.Time) time.Time {
	if b.After(a) {
		return b
	}
	return a
}

func sortCalls(s []*modeCall) {
	for i := 1; i < len(s); i++ {
		for j := i; j > 0 && s[j].start.Before(s[j-1].start); j-- {
			s[j], s[j-1] = s[j-1], s[j]
		}
	}
}

// TestDedupModesDebounceMaxWait: one id produced every 10 ms for 1.2 s with
// Debounce(50ms, 300ms) never gets 50 ms of quiet, so maxWait alone makes it
// run. In Redis, exactly: while a cycle waits, its due time (Admin.Job's
// Due) is never past its cap (ModeUntil), and the cap is its opening call
// + 300 ms. At the handler: each cycle runs no later than 300 ms + the
// promoter's and consumer's latency (bounded at 1 s on a loaded machine)
// after it opened, and once more after the calls stop, with the last payload.
func TestDedupModesDebounceMaxWait(t *testing.T) {
	t.Parallel()
	client := realRedis(t)
	q := queueName(t)
	var mu sync.Mutex
	var ran []string
	var at []time.Time
	c, err := NewConsumer(client, q, func(ctx context.Context, m *Message[string]) (string, error) {
		mu.Lock()
		ran, at = append(ran, m.Payload), append(at, time.Now())
		mu.Unlock()
		return m.Payload, nil
	}, fastOpts(t, "maxwait", time.Second))
	require.NoError(t, err)
	runConsumer(t, c)
	p := newStringProducer(t, client, q)
	admin, err := NewAdmin(client, q, nil)
	require.NoError(t, err)
	var opens []time.Time
	var openEnd time.Time
	var last *Promise[string]
	// Calls for 1.2 s, and on until the third cycle opened: how many cycles
	// fit in a given time depends on how soon each run is recorded, which a
	// loaded machine delays; the cap (first produce + maxWait) is what is
	// guaranteed, and a cycle that never closes fails the bound below.
	start0 := time.Now()
	end, bound := start0.Add(1200*time.Millisecond), start0.Add(15*time.Second)
	seq, checked := 0, 0
	for ; time.Now().Before(end) || (len(opens) < 3 && time.Now().Before(bound)); seq++ {
		start := time.Now()
		pr := mustProduce(t, p, "doc", fmt.Sprintf("s%d", seq), Debounce(50*time.Millisecond, 300*time.Millisecond))
		if pr.Deduplicated() == DedupNone {
			opens, openEnd = append(opens, start), time.Now()
		}
		last = pr
		info, err := admin.Job(context.Background(), "doc")
		require.NoError(t, err)
		if info.State == JobScheduled && info.Mode == "debounce" {
			checked++
			open := opens[len(opens)-1]
			require.False(t, info.Due.After(info.ModeUntil), "due %v past the cap %v", info.Due, info.ModeUntil)
			// The cap is the cycle's first produce (on the server, between
			// its call's start and end; ms granularity) + maxWait.
			require.False(t, info.ModeUntil.Before(open.Add(300*time.Millisecond-2*time.Millisecond)), "cap %v, opened %v", info.ModeUntil, open)
			require.False(t, info.ModeUntil.After(openEnd.Add(300*time.Millisecond+2*time.Millisecond)), "cap %v, opened by %v", info.ModeUntil, openEnd)
		}
		time.Sleep(10 * time.Millisecond)
	}
	got, err := last.Wait(waitCtx(t, 10*time.Second))
	require.NoError(t, err)
	if last.EntryID() == "" {
		require.Equal(t, fmt.Sprintf("s%d", seq-1), got, "the last call joined a wait: its payload ran")
	} // else it came while a maxWait run was queued or running: attached (Debounce's doc)
	eventually(t, 5*time.Second, func() bool { mu.Lock(); defer mu.Unlock(); return len(ran) >= len(opens) }, "runs")
	mu.Lock()
	defer mu.Unlock()
	require.Len(t, ran, len(opens), "one run per cycle")
	require.GreaterOrEqual(t, len(opens), 3, "15 s of calls with maxWait 300 ms: fewer than 3 cycles")
	for i := range opens {
		require.Less(t, at[i].Sub(opens[i]), 300*time.Millisecond+time.Second, "cycle %d ran %v after it opened", i, at[i].Sub(opens[i]))
	}
	require.Positive(t, checked)
	var longest time.Duration
	for i := range opens {
		longest = max(longest, at[i].Sub(opens[i]))
	}
	t.Logf("Debounce(50ms, 300ms), a call every 10 ms for %v: %d calls, %d runs; due <= cap = first produce + maxWait checked in Redis %d times; longest open-to-run %v",
		time.Since(start0).Round(time.Millisecond), seq, len(ran), checked, longest)
}

// TestDedupModesRefused: the combinations that cannot work are refused
// before anything is written.
func TestDedupModesRefused(t *testing.T) {
	t.Parallel()
	client := realRedis(t)
	q := queueName(t)
	ctx := context.Background()
	p := newStringProducer(t, client, q)
	for name, opts := range map[string][]ProduceOption{
		"throttle+after":    {Throttle(time.Second), After(time.Second)},
		"debounce+at":       {At(time.Now().Add(time.Hour)), Debounce(time.Second, time.Minute)},
		"zero window":       {Throttle(0)},
		"maxWait below d":   {Debounce(time.Second, time.Millisecond)},
		"zero quiet period": {Debounce(0, time.Second)},
	} {
		_, err := p.Produce(ctx, "x", "y", opts...)
		require.ErrorIs(t, err, ErrInvalidOptions, name)
	}
	_, err := p.ProduceBatch(ctx, []Job[string]{{ID: "a", Request: "1"}, {ID: "b", Request: "2", Options: []ProduceOption{Throttle(time.Second)}}})
	require.ErrorIs(t, err, ErrInvalidOptions)
	require.ErrorContains(t, err, "ProduceBatch")
	q2 := NewQueue[string, string](q)
	_, err = p.ProduceFlow(ctx, "parent", "x", []Child{ChildOf(q2, "c1", "y", Debounce(time.Second, time.Second))}, nil)
	require.ErrorIs(t, err, ErrInvalidOptions)
	_, err = p.ProduceFlow(ctx, "parent", "x", []Child{ChildOf(q2, "c1", "y")}, &FlowOptions{Parent: []ProduceOption{Throttle(time.Second)}})
	require.ErrorIs(t, err, ErrInvalidOptions)
	n, err := client.Exists(ctx, "streamq:{"+q+"}:stream", "streamq:{"+q+"}:schedule").Result()
	require.NoError(t, err)
	require.Zero(t, n, "nothing written")
}

// TestDedupModesPlainProduceCommandsUnchanged counts, on a redis-server of
// its own, the commands a plain Produce makes Redis run (INFO commandstats
// counts those a script calls): a new id EVALSHA + GET + XADD + SET, a
// duplicate EVALSHA + GET. The same figures as before the modes existed.
func TestDedupModesPlainProduceCommandsUnchanged(t *testing.T) {
	t.Parallel()
	client := privateRedis(t)
	ctx := context.Background()
	p := newStringProducer(t, client, "plain")
	mustProduce(t, p, "warm", "x").Release() // subscription, shard check, script load
	stats := func() map[string]int64 {
		info, err := client.Info(ctx, "commandstats").Result()
		require.NoError(t, err)
		out := map[string]int64{}
		for _, line := range strings.Split(info, "\n") {
			name, rest, ok := strings.Cut(strings.TrimSpace(line), ":calls=")
			if !ok {
				continue
			}
			n, _, _ := strings.Cut(rest, ",")
			out[strings.TrimPrefix(name, "cmdstat_")], _ = strconv.ParseInt(n, 10, 64)
		}
		return out
	}
	delta := func(fn func()) map[string]int64 {
		before := stats()
		fn()
		after := stats()
		d := map[string]int64{}
		for k, v := range after {
			if v != before[k] && k != "info" {
				d[k] = v - before[k]
			}
		}
		return d
	}
	require.Equal(t, map[string]int64{"evalsha": 1, "get": 1, "xadd": 1, "set": 1},
		delta(func() { mustProduce(t, p, "new", "x").Release() }), "a new id")
	require.Equal(t, map[string]int64{"evalsha": 1, "get": 1},
		delta(func() { mustProduce(t, p, "new", "x").Release() }), "a duplicate")
}

// modeProducerConfig configures TestDedupModesProducerHelperProcess.
type modeProducerConfig struct {
	Addr, Queue string
	IDs         []string
}

// TestDedupModesProducerHelperProcess is the producer process of
// TestDedupModesSurviveSIGKILL: it produces "v1" then "v2" for each id with
// Debounce(400ms, 10s), marks that it did, and waits to be killed.
func TestDedupModesProducerHelperProcess(t *testing.T) {
	var cfg modeProducerConfig
	if !crashtest.Config(&cfg) {
		return
	}
	client, p := helperProducer(t, cfg.Addr, cfg.Queue)
	ctx := context.Background()
	for _, v := range []string{"v1", "v2"} {
		for _, id := range cfg.IDs {
			if _, err := p.Produce(ctx, id, v, Debounce(400*time.Millisecond, 10*time.Second)); err != nil {
				t.Fatal(err)
			}
		}
	}
	producedThenHold(ctx, client, cfg.Queue)
}

// TestDedupModesSurviveSIGKILL: a producer SIGKILLed inside the debounce
// window (its ids still wait in the schedule, nothing has run) loses
// nothing: a consumer process promotes them and starts each once with the
// last payload ("v2"); that consumer is SIGKILLed while every handler runs;
// produces of the running ids now attach (payload "v3" not used); a new
// consumer claims the entries and runs each id once more with "v2" (the
// at-least-once rerun after a consumer crash: at most one start per
// consumer), and every caller gets that outcome. No id runs with "v1" or
// "v3", and none runs a third time.
func TestDedupModesSurviveSIGKILL(t *testing.T) {
	t.Parallel()
	client := realRedis(t)
	ctx := context.Background()
	q := queueName(t)
	ids := seqIDs("deb", 20)
	prod := crashtest.Start(t, "TestDedupModesProducerHelperProcess", modeProducerConfig{Addr: sharedAddr(t), Queue: q, IDs: ids})
	eventually(t, 20*time.Second, func() bool { return client.Exists(ctx, producedKey(q)).Val() == 1 }, "the producer's calls")
	prod.Kill()
	require.True(t, prod.KilledBy(syscall.SIGKILL))
	sched := "streamq:{" + q + "}:schedule"
	require.EqualValues(t, len(ids), client.ZCard(ctx, sched).Val(), "every id waits in the schedule when the producer dies")

	cons := crashtest.Start(t, "TestCrashHelperProcess", crashConfig{
		Addr: sharedAddr(t), Queue: q, Mode: "block", Name: "doomed", Workers: len(ids), Prefetch: len(ids), MinIdle: 500 * time.Millisecond,
	})
	eventually(t, 20*time.Second, func() bool { return client.SCard(ctx, startedKey(q)).Val() == int64(len(ids)) }, "every id started")
	cons.Kill()
	require.True(t, cons.KilledBy(syscall.SIGKILL))

	p := newStringProducer(t, client, q)
	var prs []*Promise[string]
	for _, id := range ids {
		pr := mustProduce(t, p, id, "v3", Debounce(400*time.Millisecond, 10*time.Second))
		require.Equal(t, DedupInflight, pr.Deduplicated(), "%s runs: attached", id)
		require.NotEmpty(t, pr.EntryID())
		prs = append(prs, pr)
	}
	var mu sync.Mutex
	runs := map[string][]string{}
	c, err := NewConsumer(client, q, func(ctx context.Context, m *Message[string]) (string, error) {
		mu.Lock()
		runs[m.ID] = append(runs[m.ID], m.Payload)
		mu.Unlock()
		return "ran:" + m.Payload, nil
	}, fastOpts(t, "rescuer", 500*time.Millisecond))
	require.NoError(t, err)
	runConsumer(t, c)
	for i, pr := range prs {
		got, err := pr.Wait(waitCtx(t, 30*time.Second))
		require.NoError(t, err)
		require.Equal(t, "ran:v2", got, ids[i])
	}
	mu.Lock()
	defer mu.Unlock()
	for _, id := range ids {
		require.Equal(t, []string{"v2"}, runs[id], "%s: one rerun after the consumer crash, with the last payload", id)
	}
	require.Zero(t, client.ZCard(ctx, sched).Val())
}

// perBurstCycles counts the cycles (DedupNone answers) of each burst.
func perBurstCycles(cs []*modeCall, burstOf func(string) int) map[int]int {
	n := map[int]int{}
	for _, mc := range cs {
		if mc.dedup == DedupNone {
			n[burstOf(mc.payload)]++
		}
	}
	return n
}
