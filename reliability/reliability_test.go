package reliability

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/streamq/streamq"
	"github.com/streamq/streamq/internal/faultproxy"
	"github.com/streamq/streamq/internal/keys"
	"github.com/streamq/streamq/internal/redistest"
)

func TestMain(m *testing.M) {
	if raw, ok := os.LookupEnv(envWorker); ok {
		os.Exit(workerMain(raw))
	}
	// go-redis logs to the running tests (t.Log), not to stderr.
	redistest.LogToTests()
	code := m.Run()
	if code != 0 {
		redistest.UncapturedLog(os.Stderr)
	}
	if code == 0 {
		if err := goleak.Find(goleak.IgnoreCurrent()); err != nil {
			fmt.Fprintln(os.Stderr, "goroutine leak:", err)
			code = 1
		}
	}
	os.Exit(code)
}

// profile sizes a reliability run.
type profile struct {
	name        string
	faults      time.Duration // how long the fault schedule runs; production spreads over it
	producers   int
	ids         int // per producer
	poisonEvery int // every n-th id of a range is a poison request
	consumers   int
	workers     int // per consumer
	concurrency int // requests in flight per producer

	consumerKills  int
	producerKills  int
	redisShutdowns int // SHUTDOWN, then restart
	redisKills     int // SIGKILL (appendfsync always), then restart
	cuts           int
	stalls         int
	stallMax       time.Duration
	garbage        int // rounds of raw malformed entries
	invalid        int // rounds of invalid Produce calls

	finish time.Duration // how long producers may take to finish after the schedule
}

var (
	shortProfile = profile{
		name: "short", faults: 50 * time.Second,
		producers: 2, ids: 1500, poisonEvery: 100,
		consumers: 3, workers: 4, concurrency: 64,
		consumerKills: 8, producerKills: 1, redisShutdowns: 1, redisKills: 1,
		cuts: 4, stalls: 2, stallMax: 3 * time.Second, garbage: 3, invalid: 2,
		finish: 90 * time.Second,
	}
	longProfile = profile{
		name: "long", faults: 240 * time.Second,
		producers: 3, ids: 70_000, poisonEvery: 1000,
		consumers: 4, workers: 8, concurrency: 512,
		consumerKills: 30, producerKills: 3, redisShutdowns: 2, redisKills: 2,
		cuts: 14, stalls: 6, stallMax: 4 * time.Second, garbage: 6, invalid: 4,
		finish: 5 * time.Minute,
	}
)

// TestReliability runs producers and consumers as separate processes against
// a real redis-server behind a fault proxy, under a schedule of crashes,
// restarts and network faults, then counts every request id.
func TestReliability(t *testing.T) {
	p := shortProfile
	if os.Getenv("STREAMQ_RELIABILITY") == "long" {
		p = longProfile
	}
	if testing.Short() && p.name == "short" {
		t.Skip("the reliability run takes about a minute; skipped with -short")
	}
	seed := uint64(time.Now().UnixNano())
	if s := os.Getenv("STREAMQ_RELIABILITY_SEED"); s != "" {
		v, err := strconv.ParseUint(s, 10, 64)
		require.NoError(t, err, "STREAMQ_RELIABILITY_SEED")
		seed = v
	}
	t.Logf("profile %s, seed %d (set STREAMQ_RELIABILITY_SEED=%d to replay the schedule)", p.name, seed, seed)
	newRun(t, p, seed).execute()
}

// window is a fault that can make a live consumer lose the lease of the
// entries it holds: its clock span, widened when judging duplicates.
type window struct {
	kind       string
	start, end time.Time
}

// proc is one worker process.
type proc struct {
	label  string
	name   string // consumer name
	cmd    *exec.Cmd
	done   chan struct{}
	err    error // cmd.Wait's; read after done
	killed bool  // set by the test goroutine before the SIGKILL
	termed bool  // set by the test goroutine before the SIGTERM
}

func (p *proc) pid() int { return p.cmd.Process.Pid }

type run struct {
	t    *testing.T
	p    profile
	rng  *rand.Rand
	dir  string
	srv  *redistest.Server
	px   *faultproxy.Proxy
	rdb  *redis.Client // direct, for injection and checks
	k    keys.Keys
	q    string
	seq  int
	born time.Time

	consumers []*proc
	gens      []int
	producers []*proc
	starts    []int64

	killed   map[int]time.Time // consumer pid -> when it was SIGKILLed
	starved  map[int][]window  // consumer pid -> spans it recorded not running
	windows  []window
	counts   map[string]int // faults done, by kind
	garbage  []string       // ids of malformed entries that carry an id
	noID     int            // malformed entries without an id field
	allProcs []*proc
}

func newRun(t *testing.T, p profile, seed uint64) *run {
	r := &run{
		t: t, p: p, rng: rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15)),
		dir: t.TempDir(), q: "reliability", killed: map[int]time.Time{}, counts: map[string]int{},
	}
	var err error
	r.k, err = keys.New(r.q)
	require.NoError(t, err)
	r.srv = redistest.Start(t, redistest.WithAppendOnly("always"))
	r.rdb = r.srv.Client(t)
	r.px, err = faultproxy.New(r.srv.Addr())
	require.NoError(t, err)
	t.Cleanup(func() { _ = r.px.Close() })
	t.Cleanup(r.stopAll) // runs before the proxy and the server are stopped
	t.Cleanup(func() {
		// Runs before t.TempDir is removed: keep the evidence of a failed run.
		if !t.Failed() && os.Getenv("STREAMQ_RELIABILITY_KEEP") == "" {
			return
		}
		keep := filepath.Join(os.TempDir(), fmt.Sprintf("streamq-reliability-%d", seed))
		if err := os.CopyFS(keep, os.DirFS(r.dir)); err != nil {
			t.Logf("cannot keep the run's files: %v", err)
			return
		}
		t.Logf("the run's files (executions, results, worker logs) are kept in %s", keep)
	})
	return r
}

// start launches a worker process.
func (r *run) start(label string, cfg workerConfig) *proc {
	r.t.Helper()
	cfg.Addr, cfg.Queue, cfg.Dir = r.px.Addr(), r.q, r.dir
	raw, err := json.Marshal(cfg)
	require.NoError(r.t, err)
	r.seq++
	logf, err := os.Create(filepath.Join(r.dir, fmt.Sprintf("log-%03d-%s.txt", r.seq, label)))
	require.NoError(r.t, err)
	cmd := exec.Command(os.Args[0])
	cmd.Env = append(os.Environ(), envWorker+"="+string(raw))
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.SysProcAttr = childAttr()
	require.NoError(r.t, cmd.Start())
	p := &proc{label: label, name: cfg.Name, cmd: cmd, done: make(chan struct{})}
	go func() {
		p.err = cmd.Wait()
		_ = logf.Close()
		close(p.done)
	}()
	r.allProcs = append(r.allProcs, p)
	return p
}

func (r *run) startConsumer(slot int, name string) {
	r.consumers[slot] = r.start(name, workerConfig{Role: "consumer", Name: name, Workers: r.p.workers})
}

func (r *run) startProducer(slot int) {
	r.producers[slot] = r.start(fmt.Sprintf("p%d", slot), workerConfig{
		Role: "producer", Slot: slot, Prefix: fmt.Sprintf("p%d-", slot), Count: r.p.ids,
		PoisonEvery: r.p.poisonEvery, Start: r.starts[slot],
		Rate:        float64(r.p.ids) / (0.95 * r.p.faults.Seconds()),
		Concurrency: r.p.concurrency, Attempt: 20 * time.Second,
	})
}

// kill SIGKILLs a worker and waits for it to exit.
func (r *run) kill(p *proc) time.Time {
	r.t.Helper()
	select {
	case <-p.done:
		return time.Now() // already gone; the final checks report it
	default:
	}
	p.killed = true
	at := time.Now()
	require.NoError(r.t, p.cmd.Process.Signal(syscall.SIGKILL))
	<-p.done
	return at
}

// stopAll kills whatever still runs (a failed test); normally nothing does.
func (r *run) stopAll() {
	for _, p := range r.allProcs {
		select {
		case <-p.done:
		default:
			p.killed = true
			_ = p.cmd.Process.Signal(syscall.SIGKILL)
			<-p.done
		}
	}
}

// event is one fault of the schedule, at an offset from the run's start.
type event struct {
	at   time.Duration
	kind string
}

// schedule spreads each kind's n events over the fault period, with jitter.
func (r *run) schedule() []event {
	var evs []event
	add := func(kind string, n int) {
		for k := range n {
			frac := 0.05 + 0.9*(float64(k)+0.2+0.6*r.rng.Float64())/float64(n)
			evs = append(evs, event{at: time.Duration(frac * float64(r.p.faults)), kind: kind})
		}
	}
	add("consumer-kill", r.p.consumerKills)
	add("producer-kill", r.p.producerKills)
	add("cut", r.p.cuts)
	add("stall", r.p.stalls)
	add("garbage", r.p.garbage)
	add("invalid", r.p.invalid)
	// Redis restarts alternate between SHUTDOWN and SIGKILL, evenly spaced.
	nr := r.p.redisShutdowns + r.p.redisKills
	for k := range nr {
		kind := "redis-shutdown"
		if k%2 == 1 && r.p.redisKills > 0 || r.p.redisShutdowns == 0 {
			kind = "redis-kill"
		}
		frac := 0.1 + 0.8*(float64(k)+0.5)/float64(nr)
		evs = append(evs, event{at: time.Duration(frac * float64(r.p.faults)), kind: kind})
	}
	sort.SliceStable(evs, func(i, j int) bool { return evs[i].at < evs[j].at })
	return evs
}

func (r *run) execute() {
	t := r.t
	r.born = time.Now()
	r.consumers = make([]*proc, r.p.consumers)
	r.gens = make([]int, r.p.consumers)
	for i := range r.consumers {
		r.startConsumer(i, fmt.Sprintf("c%d", i))
	}
	r.producers = make([]*proc, r.p.producers)
	r.starts = make([]int64, r.p.producers)
	for i := range r.producers {
		r.starts[i] = r.born.Add(500 * time.Millisecond).UnixNano()
		r.startProducer(i)
	}

	for _, ev := range r.schedule() {
		if d := time.Until(r.born.Add(ev.at)); d > 0 {
			time.Sleep(d) // the fault schedule: faults happen at planned moments
		}
		r.fault(ev.kind)
	}
	t.Logf("fault schedule done after %v: %v", time.Since(r.born).Round(time.Second), r.counts)

	// Producers exit once every id of their range is resolved.
	deadline := time.Now().Add(r.p.finish)
	for i, p := range r.producers {
		select {
		case <-p.done:
		case <-time.After(time.Until(deadline)):
			t.Errorf("producer p%d did not resolve its range within %v after the schedule", i, r.p.finish)
			r.kill(p)
		}
	}
	produced := time.Since(r.born)

	// What is left (poison retries, garbage) drains by itself.
	drained := r.waitDrained(60 * time.Second)
	for _, p := range r.consumers {
		p.termed = true
		_ = p.cmd.Process.Signal(syscall.SIGTERM)
	}
	for _, p := range r.consumers {
		select {
		case <-p.done:
		case <-time.After(30 * time.Second):
			t.Errorf("consumer %s did not exit within 30s of SIGTERM", p.label)
			r.kill(p)
		}
	}
	for _, p := range r.allProcs {
		if !p.killed && p.err != nil {
			t.Errorf("worker %s (pid %d) exited with %v; its log is below", p.label, p.pid(), p.err)
			r.logTail(p)
		}
	}
	t.Logf("producers finished %v after the start; queue drained: %v", produced.Round(time.Second), drained)
	r.verify()
}

// fault performs one fault of the schedule.
func (r *run) fault(kind string) {
	t := r.t
	r.counts[kind]++
	switch kind {
	case "consumer-kill":
		slot := r.rng.IntN(len(r.consumers))
		old := r.consumers[slot]
		r.killed[old.pid()] = r.kill(old)
		time.Sleep(time.Duration(r.rng.IntN(800)) * time.Millisecond) // down for a while
		name := old.name
		if r.rng.IntN(2) == 0 {
			r.gens[slot]++
			name = fmt.Sprintf("c%d-g%d", slot, r.gens[slot])
			r.counts["consumer-restart-new-name"]++
		} else {
			r.counts["consumer-restart-same-name"]++
		}
		r.startConsumer(slot, name)
	case "producer-kill":
		slot := r.rng.IntN(len(r.producers))
		old := r.producers[slot]
		select {
		case <-old.done:
			// Finished its range already; kill another one if any is running.
			for i, p := range r.producers {
				select {
				case <-p.done:
				default:
					slot, old = i, p
				}
			}
		default:
		}
		r.kill(old)
		time.Sleep(500 * time.Millisecond)
		r.startProducer(slot)
	case "redis-shutdown", "redis-kill":
		w := window{kind: kind, start: time.Now()}
		if kind == "redis-kill" {
			r.srv.Kill()
		} else {
			r.srv.Shutdown()
		}
		time.Sleep(time.Duration(300+r.rng.IntN(700)) * time.Millisecond) // down for a while
		r.srv.Restart(t)
		w.end = time.Now()
		r.windows = append(r.windows, w)
	case "cut":
		now := time.Now()
		r.px.Cut()
		r.windows = append(r.windows, window{kind: kind, start: now, end: now})
	case "stall":
		d := 2*time.Second + time.Duration(r.rng.Int64N(int64(r.p.stallMax-2*time.Second)+1))
		now := time.Now()
		r.px.Stall(d)
		r.windows = append(r.windows, window{kind: kind, start: now, end: now.Add(d)})
	case "garbage":
		r.injectGarbage()
	case "invalid":
		r.injectInvalid()
	default:
		t.Fatalf("unknown fault %q", kind)
	}
}

// injectGarbage appends entries no producer wrote: no fields streamq knows,
// an id without a payload, a payload that is not JSON, JSON of the wrong type.
// Each must be dead-lettered with its reason.
func (r *run) injectGarbage() {
	t := r.t
	ctx := context.Background()
	n := r.counts["garbage"]
	add := func(values ...any) {
		// Redis may be restarting: retry until the entry is in.
		require.Eventually(t, func() bool {
			return r.rdb.XAdd(ctx, &redis.XAddArgs{Stream: r.k.Stream, Values: values}).Err() == nil
		}, 30*time.Second, 50*time.Millisecond, "raw XADD")
	}
	add("foo", "bar")
	r.noID++
	for _, g := range []struct{ kind, payload string }{
		{"nop", ""}, {"json", "{not json"}, {"type", `"a string, not an object"`},
	} {
		id := fmt.Sprintf("garbage-%s-%d", g.kind, n)
		if g.kind == "nop" {
			add("id", id)
		} else {
			add("id", id, "p", g.payload)
		}
		r.garbage = append(r.garbage, id)
	}
}

// injectInvalid makes invalid Produce calls through the proxy: each must be
// rejected with its error before anything is written.
func (r *run) injectInvalid() {
	t := r.t
	client := redis.NewClient(&redis.Options{Addr: r.px.Addr()})
	defer client.Close()
	p, err := streamq.NewProducer[Req, Resp](client, r.q, &streamq.ProducerOptions{MaxPayloadBytes: 1024})
	require.NoError(t, err)
	defer p.Close()
	ctx := context.Background()
	_, err = p.Produce(ctx, "", Req{N: 1})
	require.ErrorIs(t, err, streamq.ErrInvalidID)
	_, err = p.Produce(ctx, strings.Repeat("x", streamq.MaxIDLen+1), Req{N: 1})
	require.ErrorIs(t, err, streamq.ErrInvalidID)
	big := fmt.Sprintf("invalid-big-%d", r.counts["invalid"])
	_, err = p.Produce(ctx, big, Req{N: 1, Pad: strings.Repeat("x", 2048)})
	require.ErrorIs(t, err, streamq.ErrPayloadTooLarge)
	require.ErrorIs(t, p.Enqueue(ctx, "", Req{N: 1}), streamq.ErrInvalidID)
	_, err = p.ProduceBatch(ctx, []streamq.Job[Req]{{ID: big + "-ok", Request: Req{N: 1}}, {ID: big, Request: Req{Pad: strings.Repeat("x", 2048)}}})
	require.ErrorIs(t, err, streamq.ErrPayloadTooLarge)
	r.counts["invalid-calls-rejected"] += 5
	// Nothing of them reached Redis (checked after the run: no record beyond the expected ids).
}

// waitDrained waits until the stream is empty and nothing is pending.
func (r *run) waitDrained(timeout time.Duration) bool {
	ctx := context.Background()
	deadline := time.Now().Add(timeout)
	for time.Now().Before(deadline) {
		n, err1 := r.rdb.XLen(ctx, r.k.Stream).Result()
		pend, err2 := r.rdb.XPending(ctx, r.k.Stream, streamq.DefaultGroup).Result()
		if err1 == nil && err2 == nil && n == 0 && pend.Count == 0 {
			return true
		}
		time.Sleep(100 * time.Millisecond) // polling Redis for a condition
	}
	return false
}

func (r *run) logTail(p *proc) {
	matches, _ := filepath.Glob(filepath.Join(r.dir, fmt.Sprintf("log-*-%s.txt", p.label)))
	for _, m := range matches {
		b, _ := os.ReadFile(m)
		lines := strings.Split(strings.TrimSpace(string(b)), "\n")
		r.t.Logf("%s:\n%s", filepath.Base(m), strings.Join(lines[max(0, len(lines)-15):], "\n"))
	}
}

// execution is one handler run, as recorded by a consumer process.
type execution struct {
	at         time.Time
	pid        int
	deliveries int
	entry      string // stream entry id
}

func (r *run) readExecutions() map[string][]execution {
	t := r.t
	out := make(map[string][]execution)
	files, err := filepath.Glob(filepath.Join(r.dir, "exec-*.log"))
	require.NoError(t, err)
	for _, path := range files {
		pid, err := strconv.Atoi(strings.TrimSuffix(strings.TrimPrefix(filepath.Base(path), "exec-"), ".log"))
		require.NoError(t, err)
		f, err := os.Open(path)
		require.NoError(t, err)
		sc := bufio.NewScanner(f)
		for sc.Scan() {
			fields := strings.Fields(sc.Text())
			if len(fields) != 4 {
				t.Errorf("%s: torn execution record %q", path, sc.Text())
				continue
			}
			ns, err1 := strconv.ParseInt(fields[0], 10, 64)
			del, err2 := strconv.Atoi(fields[2])
			if err1 != nil || err2 != nil {
				t.Errorf("%s: bad execution record %q", path, sc.Text())
				continue
			}
			out[fields[1]] = append(out[fields[1]], execution{at: time.Unix(0, ns), pid: pid, deliveries: del, entry: fields[3]})
		}
		require.NoError(t, sc.Err())
		f.Close()
	}
	for _, ex := range out {
		sort.Slice(ex, func(i, j int) bool { return ex[i].at.Before(ex[j].at) })
	}
	return out
}

// explain names the fault that let the execution after prev happen: prev's
// process was killed within MinIdle + 1s after it started, or prev ran while a fault that can cost
// a live consumer its leases was near (it loses them once its entries stay idle
// for MinIdle without renewal). It returns "" when no fault explains it.
//
// The span around a fault is [start - MinIdle - 1s, end + MinIdle + 1s]: an
// entry delivered up to MinIdle before the fault may be claimed during it, and
// after it the consumer needs up to a lease period to renew while the entries
// its ring held during the fault start late.
func (r *run) explain(prev execution) string {
	// A handler takes milliseconds and its outcome is recorded right after, so
	// only a kill soon after the run can have cut it short; a completion delayed
	// longer than that was delayed by another fault, judged below.
	if at, ok := r.killed[prev.pid]; ok && at.After(prev.at) && at.Sub(prev.at) <= workerMinIdle+time.Second {
		return "consumer SIGKILL"
	}
	near := func(w window) bool {
		const slack = time.Second
		return !prev.at.Before(w.start.Add(-workerMinIdle-slack)) && !prev.at.After(w.end.Add(workerMinIdle+slack))
	}
	for _, w := range r.windows {
		if near(w) {
			return w.kind
		}
	}
	for _, w := range r.starved[prev.pid] {
		if near(w) {
			return "consumer starved"
		}
	}
	return ""
}

// readStarvation loads the spans each consumer process recorded as starved.
func (r *run) readStarvation() {
	r.starved = map[int][]window{}
	files, err := filepath.Glob(filepath.Join(r.dir, "starve-*.log"))
	require.NoError(r.t, err)
	for _, path := range files {
		pid, err := strconv.Atoi(strings.TrimSuffix(strings.TrimPrefix(filepath.Base(path), "starve-"), ".log"))
		require.NoError(r.t, err)
		b, err := os.ReadFile(path)
		require.NoError(r.t, err)
		for _, line := range strings.Split(strings.TrimSpace(string(b)), "\n") {
			var a, z int64
			if _, err := fmt.Sscan(line, &a, &z); err == nil {
				r.starved[pid] = append(r.starved[pid], window{kind: "starved", start: time.Unix(0, a), end: time.Unix(0, z)})
			}
		}
	}
}

// describe names a process and the faults near a moment, for failure messages.
func (r *run) describe(pid int, at time.Time) string {
	label := "?"
	for _, p := range r.allProcs {
		if p.pid() == pid {
			label = p.label
		}
	}
	var near []string
	for _, w := range r.windows {
		if w.end.After(at.Add(-10*time.Second)) && w.start.Before(at.Add(10*time.Second)) {
			near = append(near, fmt.Sprintf("%s %v..%v", w.kind, w.start.Sub(r.born).Round(time.Millisecond), w.end.Sub(r.born).Round(time.Millisecond)))
		}
	}
	for kpid, k := range r.killed {
		if k.After(at.Add(-10*time.Second)) && k.Before(at.Add(10*time.Second)) {
			near = append(near, fmt.Sprintf("kill of pid %d at %v", kpid, k.Sub(r.born).Round(time.Millisecond)))
		}
	}
	return fmt.Sprintf("%s (pid %d); faults within 10s: %v", label, pid, near)
}

// verify counts every id.
func (r *run) verify() {
	t := r.t
	ctx := context.Background()
	failures := 0
	fail := func(format string, args ...any) {
		failures++
		if failures <= 30 {
			t.Errorf(format, args...)
		} else {
			t.Fail()
		}
	}

	// The producers' view: every id of every range resolved, nothing impossible seen.
	total, poison := 0, 0
	anomalies := 0
	accepted := map[string]bool{}
	for slot := range r.producers {
		prefix := fmt.Sprintf("p%d-", slot)
		got := map[string]string{}
		f, err := os.Open(resultsFile(r.dir, slot))
		require.NoError(t, err)
		sc := bufio.NewScanner(f)
		for sc.Scan() {
			fields := strings.Fields(sc.Text())
			switch {
			case len(fields) >= 2 && fields[0] == "X":
				anomalies++
				fail("producer p%d saw what must not happen: %s", slot, sc.Text())
			case len(fields) == 2 && fields[0] == "A":
				accepted[fields[1]] = true
			case len(fields) == 3 && fields[0] == "R", len(fields) == 2 && fields[0] == "D":
				got[fields[1]] = sc.Text()
			}
		}
		require.NoError(t, sc.Err())
		f.Close()
		for i := range r.p.ids {
			id := idOf(prefix, i)
			req := reqOf(slot, i, r.p.poisonEvery)
			total++
			want := fmt.Sprintf("R %s %d", id, expected(req.N))
			if req.Poison != poisonNone {
				poison++
				want = "D " + id
			}
			if got[id] != want {
				fail("producer p%d: id %s: got %q, want %q", slot, id, got[id], want)
			}
		}
	}

	// Redis's view: each id's record holds its one result, or its dead letter.
	type expect struct {
		id     string
		poison int
		n      int64
	}
	var all []expect
	for slot := range r.producers {
		for i := range r.p.ids {
			req := reqOf(slot, i, r.p.poisonEvery)
			all = append(all, expect{idOf(fmt.Sprintf("p%d-", slot), i), req.Poison, req.N})
		}
	}
	lost, unsent, wrong := 0, 0, 0
	for chunk := range slices.Chunk(all, 500) {
		names := make([]string, len(chunk))
		for i, e := range chunk {
			names[i] = r.k.Record(e.id)
		}
		vals, err := r.rdb.MGet(ctx, names...).Result()
		require.NoError(t, err)
		for i, v := range vals {
			e := chunk[i]
			s, ok := v.(string)
			switch {
			case !ok && accepted[e.id]:
				lost++
				fail("id %s was accepted by Produce but has no record in Redis: lost", e.id)
			case !ok:
				unsent++
				fail("id %s has no record in Redis and Produce never accepted it", e.id)
			case e.poison != poisonNone:
				if !strings.HasPrefix(s, "L") {
					wrong++
					fail("poison id %s: record %q, want a dead letter", e.id, s)
				}
			default:
				var resp Resp
				if !strings.HasPrefix(s, "R") || json.Unmarshal([]byte(s[1:]), &resp) != nil || resp.V != expected(e.n) {
					wrong++
					fail("id %s: record %q, want its result %d", e.id, s, expected(e.n))
				}
			}
		}
	}
	for _, id := range r.garbage {
		s, err := r.rdb.Get(ctx, r.k.Record(id)).Result()
		if err != nil || !strings.HasPrefix(s, "L") {
			fail("malformed entry %s: record %q (%v), want a dead letter", id, s, err)
		}
	}

	// The dead-letter stream: every poison id and every malformed entry.
	dead, err := r.rdb.XRange(ctx, r.k.DeadLetter, "-", "+").Result()
	require.NoError(t, err)
	deadByID := map[string]int{}
	for _, m := range dead {
		id, _ := m.Values["id"].(string)
		deadByID[id]++
	}
	dupDead := 0
	for _, e := range all {
		n := deadByID[e.id]
		switch {
		case e.poison != poisonNone && n == 0:
			fail("poison id %s is not in the dead-letter stream", e.id)
		case e.poison == poisonNone && n > 0:
			fail("id %s was dead-lettered", e.id)
		case n > 1:
			dupDead += n - 1
		}
	}
	for _, id := range r.garbage {
		if deadByID[id] == 0 {
			fail("malformed entry %s is not in the dead-letter stream", id)
		}
	}
	if deadByID[""] < r.noID {
		fail("%d entries without an id dead-lettered, want %d", deadByID[""], r.noID)
	}

	// Executions: at least one per request; every extra one explained by a fault.
	execs := r.readExecutions()
	r.readStarvation()
	executions, dups, twoEntries := 0, 0, 0
	poisonRuns, poisonIDs := map[int]int{}, map[int]int{}
	causes := map[string]int{}
	for _, e := range all {
		ex := execs[e.id]
		executions += len(ex)
		if len(ex) == 0 {
			fail("id %s has an outcome but no handler ever ran it", e.id)
			continue
		}
		// One stream entry per id: a second entry means the atomic dedup of
		// Produce failed, whatever the faults (no record expired during the run).
		// The exception is a failed attempt retried after a delay: it leaves
		// the stream for the schedule and comes back as a new entry, so an
		// always-failing id has up to MaxDeliveries entries, one per attempt.
		entries := map[string]bool{}
		for _, x := range ex {
			entries[x.entry] = true
		}
		switch {
		case e.poison == poisonRetry && len(entries) > workerMaxDeliveries:
			twoEntries++
			fail("poison id %s was run from %d stream entries, more than its %d attempts", e.id, len(entries), workerMaxDeliveries)
		case e.poison != poisonRetry && len(entries) > 1:
			twoEntries++
			fail("id %s was run from %d stream entries (first %s): deduplication failed", e.id, len(entries), ex[0].entry)
		}
		if e.poison != poisonNone {
			poisonRuns[e.poison] += len(ex)
			poisonIDs[e.poison]++
		}
		if e.poison == poisonRetry {
			// Up to MaxDeliveries runs by design; runs beyond that need a fault.
			if len(ex) > workerMaxDeliveries {
				for _, prev := range ex[:len(ex)-workerMaxDeliveries] {
					if c := r.explain(prev); c == "" {
						fail("poison id %s ran %d times; an extra run is explained by no fault", e.id, len(ex))
					}
				}
			}
			continue
		}
		for j := 1; j < len(ex); j++ {
			dups++
			c := r.explain(ex[j-1])
			if c == "" {
				c = "unexplained"
				fail("id %s ran again at %s by %s after a run at %s by %s that no fault explains",
					e.id, ex[j].at.Sub(r.born), r.describe(ex[j].pid, ex[j].at),
					ex[j-1].at.Sub(r.born), r.describe(ex[j-1].pid, ex[j-1].at))
			}
			causes[c]++
		}
	}

	// Nothing left behind: the stream and the PEL are empty, every record expires.
	n, err := r.rdb.XLen(ctx, r.k.Stream).Result()
	require.NoError(t, err)
	if n != 0 {
		fail("the stream still holds %d entries", n)
	}
	pend, err := r.rdb.XPending(ctx, r.k.Stream, streamq.DefaultGroup).Result()
	require.NoError(t, err)
	if pend.Count != 0 {
		fail("the group still has %d pending entries", pend.Count)
	}
	records, noTTL := 0, 0
	iter := r.rdb.Scan(ctx, 0, r.k.RecordPattern(), 1000).Iterator()
	var batch []string
	checkTTL := func() {
		pipe := r.rdb.Pipeline()
		cmds := make([]*redis.DurationCmd, len(batch))
		for i, k := range batch {
			cmds[i] = pipe.PTTL(ctx, k)
		}
		_, err := pipe.Exec(ctx)
		require.NoError(t, err)
		for i, c := range cmds {
			if c.Val() < 0 {
				noTTL++
				fail("record %s has no TTL (%v)", batch[i], c.Val())
			}
		}
		batch = batch[:0]
	}
	for iter.Next(ctx) {
		records++
		batch = append(batch, iter.Val())
		if len(batch) == 1000 {
			checkTTL()
		}
	}
	require.NoError(t, iter.Err())
	checkTTL()
	if records != total+len(r.garbage) {
		fail("%d record keys, want %d (one per produced id and per malformed entry with an id)", records, total+len(r.garbage))
	}

	var stats producerStats
	files, _ := filepath.Glob(filepath.Join(r.dir, "stats-*.json"))
	for _, f := range files {
		var s producerStats
		b, err := os.ReadFile(f)
		require.NoError(t, err)
		require.NoError(t, json.Unmarshal(b, &s))
		stats.Produced += s.Produced
		stats.ProduceErrors += s.ProduceErrors
		stats.WaitTimeouts += s.WaitTimeouts
		stats.WaitErrors += s.WaitErrors
	}

	t.Logf("faults: %v", r.counts)
	t.Logf("requests: %d ids (%d poison) + %d malformed entries; handler executions: %d",
		total, poison, len(r.garbage)+r.noID, executions)
	t.Logf("poison requests: %d always-failing ones ran %d times (MaxDeliveries=%d each), %d permanent ones ran %d times",
		poisonIDs[poisonRetry], poisonRuns[poisonRetry], workerMaxDeliveries, poisonIDs[poisonPermanent], poisonRuns[poisonPermanent])
	t.Logf("lost (accepted, then no record): %d; never accepted: %d; ids whose record is not their outcome: %d; producer anomalies: %d; records without TTL: %d",
		lost, unsent, wrong, anomalies, noTTL)
	t.Logf("duplicate executions: %d (%.3f%% of ids), by cause: %v; ids run from two stream entries: %d; extra dead-letter entries: %d",
		dups, 100*float64(dups)/float64(max(total, 1)), causes, twoEntries, dupDead)
	t.Logf("producers: %d Produce errors retried, %d attempts timed out and produced again, %d other Wait errors",
		stats.ProduceErrors, stats.WaitTimeouts, stats.WaitErrors)
	if failures > 30 {
		t.Logf("%d failures in all; the first 30 are above", failures)
	}
}
