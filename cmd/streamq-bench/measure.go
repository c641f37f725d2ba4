package main

import (
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"runtime/pprof"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/redis/go-redis/v9"
)

// Result is one measured system in one scenario: one JSON line with -json, one
// table row otherwise.
type Result struct {
	Scenario   string  `json:"scenario"`
	System     string  `json:"system"` // "streamq" or "baseline"
	N          int     `json:"n"`
	Seconds    float64 `json:"seconds"`
	JobsPerSec float64 `json:"jobs_per_sec"`
	// Latency figures; what they measure depends on the scenario (see Latency).
	Latency string  `json:"latency"`
	P50Ms   float64 `json:"p50_ms"`
	P99Ms   float64 `json:"p99_ms"`
	MaxMs   float64 `json:"max_ms"`
	// Server-side cost: Redis CPU (user+sys) and commands executed, commands
	// run inside scripts included, per job.
	RedisCPUUsPerJob float64 `json:"redis_cpu_us_per_job"`
	RedisCmdsPerJob  float64 `json:"redis_cmds_per_job"`
	// Client-side cost: this program's CPU (user+sys, from getrusage) per
	// job, producers and consumers together, Redis excluded.
	ClientCPUUsPerJob float64 `json:"client_cpu_us_per_job"`
	// Round trips per job on the system's connections (see roundTrips).
	RoundTripsPerJob float64 `json:"round_trips_per_job"`

	// Latency scenario, streamq only: from Produce to the handler's start.
	PickupP50Ms float64 `json:"pickup_p50_ms,omitempty"`
	PickupP99Ms float64 `json:"pickup_p99_ms,omitempty"`

	// Prefetch scenario only.
	Depth         int     `json:"depth,omitempty"`
	IdealSeconds  float64 `json:"ideal_seconds,omitempty"`
	Depth1Seconds float64 `json:"depth1_seconds,omitempty"`
	IdealRatio    float64 `json:"ideal_ratio,omitempty"`

	// Multi scenario, streamq only: the queues' weights and each queue's
	// share of the handler starts while every queue had work (the first
	// QueueSharesStarts starts), with its lowest and highest share over
	// windows of 1,000 starts within them.
	QueueWeights        []int     `json:"queue_weights,omitempty"`
	QueueShares         []float64 `json:"queue_shares,omitempty"`
	QueueSharesStarts   int       `json:"queue_shares_starts,omitempty"`
	QueueShareWindowMin []float64 `json:"queue_share_window_min,omitempty"`
	QueueShareWindowMax []float64 `json:"queue_share_window_max,omitempty"`

	// Note is a line of figures of the scenario's own (dedupmodes: the runs
	// per id), printed under the row.
	Note string `json:"note,omitempty"`
}

// Ratio is the closing line of a scenario: streamq's jobs/s over the baseline's.
// A scenario with a second streamq variant (multi) closes with a second line
// naming that variant's system.
type Ratio struct {
	Scenario   string  `json:"scenario"`
	System     string  `json:"system,omitempty"` // the streamq variant; empty: "streamq"
	Ratio      float64 `json:"ratio"`
	IdealRatio float64 `json:"ideal_ratio,omitempty"` // prefetch: elapsed/ideal
	// VsSingleQueue (multi): the multi-queue consumer's jobs/s over the
	// single-queue consumers' ("streamq-1q").
	VsSingleQueue float64 `json:"vs_single_queue,omitempty"`
}

// serverStats is a snapshot of the counters that give the server-side cost.
type serverStats struct {
	cpuUs float64 // used_cpu_user + used_cpu_sys, in microseconds
	calls int64   // sum of commandstats calls, INFO itself excluded
	cmds  map[string]cmdStat
}

// cmdStat is one command's line of INFO commandstats.
type cmdStat struct {
	calls int64
	usec  int64
}

// snapshot reads INFO cpu and INFO commandstats. Commands called from Lua
// scripts are counted by commandstats as well as the EVALSHA itself.
func snapshot(ctx context.Context, c *redis.Client) (serverStats, error) {
	s := serverStats{cmds: make(map[string]cmdStat)}
	info, err := c.Info(ctx, "cpu", "commandstats").Result()
	if err != nil {
		return s, fmt.Errorf("INFO: %w", err)
	}
	for _, line := range strings.Split(info, "\n") {
		line = strings.TrimSpace(line)
		name, val, ok := strings.Cut(line, ":")
		if !ok {
			continue
		}
		switch {
		case name == "used_cpu_user" || name == "used_cpu_sys":
			f, err := strconv.ParseFloat(val, 64)
			if err != nil {
				return s, fmt.Errorf("INFO %s: %w", name, err)
			}
			s.cpuUs += f * 1e6
		case strings.HasPrefix(name, "cmdstat_") && name != "cmdstat_info":
			// calls=12,usec=34,...
			var st cmdStat
			for _, kv := range strings.Split(val, ",") {
				k, v, _ := strings.Cut(kv, "=")
				switch k {
				case "calls":
					st.calls, err = strconv.ParseInt(v, 10, 64)
				case "usec":
					st.usec, err = strconv.ParseInt(v, 10, 64)
				}
				if err != nil {
					return s, fmt.Errorf("INFO %s: %w", name, err)
				}
			}
			s.cmds[strings.TrimPrefix(name, "cmdstat_")] = st
			s.calls += st.calls
		}
	}
	return s, nil
}

// meter measures one system's run: wall time between start and stop, and
// the server's counters over the same span.
type meter struct {
	c      *redis.Client
	detail io.Writer // when set, result also writes the commandstats breakdown
	before serverStats
	after  serverStats
	t0, t1 time.Time
	// This process's CPU in microseconds at start and stop.
	cpu0, cpu1 float64
	// roundTrips at start and stop.
	rt0, rt1 int64
}

// processCPUUs is the CPU this process used so far (user+sys), in µs.
func processCPUUs() float64 {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	us := func(tv syscall.Timeval) float64 { return float64(tv.Sec)*1e6 + float64(tv.Usec) }
	return us(ru.Utime) + us(ru.Stime)
}

func (m *meter) start(ctx context.Context) error {
	var err error
	m.before, err = snapshot(ctx, m.c)
	m.t0 = time.Now()
	m.cpu0 = processCPUUs()
	m.rt0 = roundTrips.Load()
	return err
}

func (m *meter) stop(ctx context.Context) error {
	m.t1 = time.Now()
	m.cpu1 = processCPUUs()
	m.rt1 = roundTrips.Load()
	var err error
	m.after, err = snapshot(ctx, m.c)
	return err
}

// result builds a Result over the measured span. lat holds latency samples in
// nanoseconds; it is sorted in place.
func (m *meter) result(scenario, system string, n int, latency string, lat []int64) Result {
	secs := m.t1.Sub(m.t0).Seconds()
	r := Result{
		Scenario: scenario,
		System:   system,
		N:        n,
		Seconds:  secs,
		Latency:  latency,
	}
	if secs > 0 {
		r.JobsPerSec = float64(n) / secs
	}
	if n > 0 {
		r.RedisCPUUsPerJob = (m.after.cpuUs - m.before.cpuUs) / float64(n)
		r.RedisCmdsPerJob = float64(m.after.calls-m.before.calls) / float64(n)
		r.ClientCPUUsPerJob = (m.cpu1 - m.cpu0) / float64(n)
		r.RoundTripsPerJob = float64(m.rt1-m.rt0) / float64(n)
	}
	r.P50Ms, r.P99Ms, r.MaxMs = percentiles(lat)
	if m.detail != nil {
		m.breakdown(m.detail, scenario+"/"+system, n)
	}
	return r
}

// breakdown writes, per job, the calls and the usec that commandstats
// attributes to each command over the measured span. The usec of a script
// includes those of the commands it calls.
func (m *meter) breakdown(w io.Writer, label string, n int) {
	type row struct {
		name        string
		calls, usec float64
	}
	var rows []row
	for name, a := range m.after.cmds {
		b := m.before.cmds[name]
		if d := a.calls - b.calls; d > 0 {
			rows = append(rows, row{name, float64(d) / float64(n), float64(a.usec-b.usec) / float64(n)})
		}
	}
	slices.SortFunc(rows, func(a, b row) int { return cmp.Compare(b.usec, a.usec) })
	fmt.Fprintf(w, "  %s commandstats per job:", label)
	for _, r := range rows {
		fmt.Fprintf(w, " %s %.3f calls %.2fus;", r.name, r.calls, r.usec)
	}
	fmt.Fprintln(w)
}

// percentiles returns p50, p99 and max of ns samples, in milliseconds.
func percentiles(ns []int64) (p50, p99, mx float64) {
	if len(ns) == 0 {
		return 0, 0, 0
	}
	slices.Sort(ns)
	at := func(q float64) float64 {
		i := int(q * float64(len(ns)-1))
		return float64(ns[i]) / 1e6
	}
	return at(0.50), at(0.99), float64(ns[len(ns)-1]) / 1e6
}

// tracker counts handler executions per job, so a run can prove that every
// job was handled exactly once, and collects one latency sample per job.
type tracker struct {
	counts  []atomic.Int32
	lat     []atomic.Int64 // ns; written by the job's (first) execution
	handled atomic.Int64
	all     chan struct{} // closed when every job was handled at least once
	once    sync.Once
}

func newTracker(n int) *tracker {
	return &tracker{counts: make([]atomic.Int32, n), lat: make([]atomic.Int64, n), all: make(chan struct{})}
}

// mark records an execution of job i with a latency sample (ns). It returns
// an error for an index outside the run, a sign of a stray entry.
func (t *tracker) mark(i int, latNs int64) error {
	if i < 0 || i >= len(t.counts) {
		return fmt.Errorf("job index %d outside the run (0..%d)", i, len(t.counts)-1)
	}
	if t.counts[i].Add(1) == 1 {
		t.lat[i].Store(latNs)
		if t.handled.Add(1) == int64(len(t.counts)) {
			t.once.Do(func() { close(t.all) })
		}
	}
	return nil
}

// wait blocks until every job was handled or ctx ends.
func (t *tracker) wait(ctx context.Context) error {
	select {
	case <-t.all:
		return nil
	case <-ctx.Done():
		return fmt.Errorf("only %d of %d jobs were handled: %w", t.handled.Load(), len(t.counts), ctx.Err())
	}
}

// latencies returns the collected samples.
func (t *tracker) latencies() []int64 {
	out := make([]int64, 0, len(t.lat))
	for i := range t.lat {
		if t.counts[i].Load() > 0 {
			out = append(out, t.lat[i].Load())
		}
	}
	return out
}

// verify reports lost jobs (never handled) and duplicated ones (handled more
// than once). No faults are injected, so any duplicate is a bug.
func (t *tracker) verify(what string) error {
	var lost, dup []int
	for i := range t.counts {
		switch c := t.counts[i].Load(); {
		case c == 0:
			lost = append(lost, i)
		case c > 1:
			dup = append(dup, i)
		}
	}
	if len(lost) == 0 && len(dup) == 0 {
		return nil
	}
	return fmt.Errorf("%s: %d of %d jobs lost (first: %v), %d duplicated (first: %v)",
		what, len(lost), len(t.counts), head(lost), len(dup), head(dup))
}

func head(v []int) []int { return v[:min(len(v), 5)] }

// waitDrained polls until the group has no pending entries, so the measured
// span ends when the last job is acknowledged, not merely handled.
func waitDrained(ctx context.Context, c *redis.Client, stream, group string) error {
	for {
		p, err := c.XPending(ctx, stream, group).Result()
		if err != nil {
			return fmt.Errorf("XPENDING %s: %w", stream, err)
		}
		if p.Count == 0 {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("%s still has %d pending entries: %w", stream, p.Count, ctx.Err())
		case <-time.After(500 * time.Microsecond):
		}
	}
}

// printer writes results as a table or as JSON lines.
type printer struct {
	w       io.Writer
	json    bool
	results []Result
}

func (p *printer) header() {
	if !p.json {
		fmt.Fprintf(p.w, "%-10s %-16s %8s %8s %11s %-14s %9s %9s %9s %10s %9s %10s %8s\n",
			"scenario", "system", "n", "seconds", "jobs/s", "latency", "p50 ms", "p99 ms", "max ms", "cpu us/job", "cmds/job", "cli us/job", "rt/job")
	}
}

func (p *printer) result(r Result) {
	p.results = append(p.results, r)
	if p.json {
		p.line(r)
		return
	}
	latency := r.Latency
	if latency == "" {
		latency = "-"
	}
	fmt.Fprintf(p.w, "%-10s %-16s %8d %8.3f %11.0f %-14s %9.3f %9.3f %9.3f %10.2f %9.2f %10.2f %8.2f\n",
		r.Scenario, r.System, r.N, r.Seconds, r.JobsPerSec, latency, r.P50Ms, r.P99Ms, r.MaxMs,
		r.RedisCPUUsPerJob, r.RedisCmdsPerJob, r.ClientCPUUsPerJob, r.RoundTripsPerJob)
	if r.PickupP50Ms > 0 {
		fmt.Fprintf(p.w, "%-10s %-16s pickup (Produce to handler start) p50 %.3f ms, p99 %.3f ms\n",
			r.Scenario, r.System, r.PickupP50Ms, r.PickupP99Ms)
	}
	if len(r.QueueShares) > 0 {
		fmt.Fprintf(p.w, "%-10s %-16s %s\n", r.Scenario, r.System, sharesNote(r))
	}
	if r.Note != "" {
		fmt.Fprintf(p.w, "%-10s %-16s %s\n", r.Scenario, r.System, r.Note)
	}
}

// note prints a line of figures that fit no row (tables only).
func (p *printer) note(format string, args ...any) {
	if !p.json {
		fmt.Fprintf(p.w, format+"\n", args...)
	}
}

func (p *printer) ratio(r Ratio) {
	if p.json {
		p.line(r)
		return
	}
	system := r.System
	if system == "" {
		system = "streamq"
	}
	fmt.Fprintf(p.w, "%-10s ratio %s/baseline jobs/s = %.2f", r.Scenario, system, r.Ratio)
	if r.IdealRatio > 0 {
		fmt.Fprintf(p.w, "; elapsed/ideal = %.3f", r.IdealRatio)
	}
	if r.VsSingleQueue > 0 {
		fmt.Fprintf(p.w, "; streamq/streamq-1q jobs/s = %.2f", r.VsSingleQueue)
	}
	fmt.Fprintln(p.w)
}

func (p *printer) line(v any) {
	b, err := json.Marshal(v)
	if err != nil {
		panic(err) // plain structs of numbers and strings
	}
	fmt.Fprintln(p.w, string(b))
}

// compare measures streamq, then the baseline, in the same run, and prints
// both results and the ratio of their jobs/s.
//
// Each system runs under the pprof label system=streamq or system=baseline
// (goroutines it starts inherit it), so a -cpuprofile of a scenario can be
// read for one side: go tool pprof -tagfocus system=streamq ...
func compare(e *env, scenario string, streamqRun, baselineRun func() (Result, error)) error {
	s, err := labeled("streamq", streamqRun)
	if err != nil {
		return fmt.Errorf("streamq: %w", err)
	}
	e.out.result(s)
	b, err := labeled("baseline", baselineRun)
	if err != nil {
		return fmt.Errorf("baseline: %w", err)
	}
	e.out.result(b)
	e.out.ratio(Ratio{Scenario: scenario, Ratio: s.JobsPerSec / b.JobsPerSec})
	return nil
}

// labeled runs f with the pprof label system=name on its goroutine and on
// every goroutine it starts.
func labeled(name string, f func() (Result, error)) (res Result, err error) {
	pprof.Do(context.Background(), pprof.Labels("system", name), func(context.Context) {
		res, err = f()
	})
	return res, err
}
