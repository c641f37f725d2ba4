// Command streamq-bench measures streamq against a hand-written go-redis
// baseline that does the same work, in the same run, on the same server.
//
// Usage:
//
//	go run ./cmd/streamq-bench -scenario NAME [flags]
//
// NAME is one of:
//
//	throughput  fire-and-forget: P producers Enqueue (with -send: Send, then
//	            Flush) from -callers goroutines each,
//	            C consumers with W workers in all run a no-op handler and discard
//	            results. Baseline: P goroutines XADD pipelined in batches of 16,
//	            W goroutines XREADGROUP COUNT 100 and pipeline XACK+XDEL.
//	            Latency: enqueue to handler start (the enqueue time travels in
//	            the payload).
//	rpc         P producers with -callers goroutines each doing Produce + Wait
//	            (dedup and stored results on). Baseline: XADD a request naming a
//	            reply key, W consumer goroutines LPUSH the replies, the caller
//	            BLPOPs its key. Latency: round trip.
//	latency     one request at a time at idle: sequential Produce + Wait round
//	            trips. Baseline: XADD, XREADGROUP BLOCK, LPUSH reply, BLPOP.
//	prefetch    one worker, a Fetcher that sleeps -fetch-ms (a remote store) and
//	            a handler that sleeps -handle-ms, with ring depth -depth and with
//	            depth 1, against ideal = n*max(F,H)+F. Baseline: a plain loop
//	            that fetches then handles each message in turn. Latency: the
//	            idle time of the worker between two handlers (the baseline's
//	            includes its fetch).
//	batch       ProduceBatch of -batch jobs against pipelined XADD batches of the
//	            same size (appending only). Latency: one batch call.
//	drain       batches end to end: each producer calls ProduceBatch with -batch
//	            jobs in a loop, consumers (DiscardResults, no-op handler) drain
//	            them. Baseline: XADD x -batch pipelined, XREADGROUP COUNT 100,
//	            XACK+XDEL pipelined. Latency: produce to handler start.
//	fairness    n jobs of 50 ms wait; a consumer with the default options starts,
//	            a second one 200 ms after the first job started; elapsed against
//	            ideal = 0.2 s + (n*50 ms - 0.2 s)/2, and the jobs each ran.
//	            Baseline: two loops reading one entry per XREADGROUP.
//	delayed     n jobs scheduled with At (ProduceBatch of -batch jobs), due at
//	            times spread evenly over -window starting 2 s later; the
//	            consumers promote and run them. Rows "schedule" (scheduling
//	            rate and cost) and "promote" (from the first due time until
//	            all ran; latency: handler start - due time). No baseline.
//	flow        flows of ten children (ProduceFlow + Wait from P producers with
//	            -callers goroutines each, all on one queue); the parent's
//	            handler reads its children (Message.Children). n counts the
//	            children: jobs/s and Redis CPU are per child, the parents'
//	            cost included. Latency: ProduceFlow to the parent's outcome.
//	            No baseline.
//	multi       n jobs appended first to three queues with weights 6:3:1,
//	            backlogs in the same proportions; then one MultiConsumer per
//	            consumer (-consumers, each with its own client; DiscardResults,
//	            no-op handler) drains them. Rows: "streamq" (the MultiConsumers;
//	            a second line gives each queue's share of the starts while
//	            every queue had work), "streamq-1q" (the same n jobs in one
//	            queue, plain Consumers with the same Workers and Prefetch) and
//	            "baseline" (a stream of n entries drained as in drain). Only
//	            the draining is measured. Two ratio lines: streamq/baseline
//	            (with streamq/streamq-1q) and streamq-1q/baseline.
//	dedupmodes  the flow-control produce options: n calls from P producers
//	            with -callers goroutines each over 100 ids (each id owned by
//	            one goroutine), consumers running: rows "debounce"
//	            (Debounce(50ms, 1s)), "throttle" (Throttle(200ms)) and
//	            "replace" (Replace), each with a line of its runs (in all and
//	            per id), checked: one run per debounce cycle and throttle
//	            window, each id's last run with its last payload (debounce,
//	            replace); "plain" (n/10 plain Produce calls of new ids, one at
//	            a time: must cost 4.00 commands, as before the modes);
//	            "baseline" (a hand-written debounce, produce side only: HSET +
//	            ZADD per call in one pipeline). Latency: one call. Ratio:
//	            debounce/baseline calls/s.
//	fair        fair queuing by key: n jobs appended, then drained, without
//	            keys ("streamq-nokey") and over n/5 keys of 5 jobs each
//	            ("streamq-keyed"); a note gives keyed/nokey jobs/s and
//	            used_memory after each drain. Then key A gets a backlog of n
//	            jobs and keys B..K 10 jobs each: a note gives the worst start
//	            of B..K's jobs in first starts of entries ahead of it after
//	            its produce, beside the bound KeyWindow+(j+1)*(K-1)+j (job
//	            j, 0-based), then in all other starts and ms (one consumer
//	            of all the workers). No go-redis baseline.
//	all         every scenario above, in that order.
//
// Without -redis host:port the program starts its own redis-server on a free
// loopback port (redis-server must be on PATH) and stops it at the end. With
// -redis it uses that server and touches only keys under queue names unique
// to the run; it never flushes anything.
//
// Flags for diagnosis: -breakdown prints each run's INFO commandstats delta
// per job to stderr; -cpuprofile profiles the program; -trace writes an
// execution trace (go tool trace -pprof=sched FILE: where goroutines waited
// to be woken, and how often; the hand-offs per job); -ring and
// -send-concurrency override ConsumerOptions.Prefetch and
// ProducerOptions.Concurrency in throughput and rpc (default: the library's);
// -ring also sets both Prefetch options of multi.
//
// Each run checks that every job was handled (or, for batch, appended) exactly
// once and exits with status 1 saying what was lost or duplicated otherwise.
//
// Output is a table; -json prints one JSON object per measured system (fields
// scenario, system, n, seconds, jobs_per_sec, p50_ms, p99_ms, max_ms,
// redis_cpu_us_per_job, redis_cmds_per_job, client_cpu_us_per_job,
// round_trips_per_job, ...) and then one
// {"scenario":..., "ratio": streamq/baseline jobs_per_sec} line per scenario
// (multi adds "vs_single_queue" to it, and a second line with "system":
// "streamq-1q").
// Redis CPU is the used_cpu_user+used_cpu_sys delta of INFO cpu; commands are
// the delta of the INFO commandstats calls, which count commands run inside
// Lua scripts too. Client CPU is this program's user+sys time (getrusage),
// producers and consumers together. Round trips count, on every connection
// of the systems under test, each burst of writes that follows a read: one
// command or one pipeline and its replies (a blocking read counts one). All
// are divided by the number of jobs.
//
// The client and the server share the machine: absolute figures depend on it,
// so compare the ratios measured in one run.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"runtime/pprof"
	"runtime/trace"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/streamq/streamq/internal/redistest"
)

// config holds the command-line flags.
type config struct {
	scenario   string
	redisAddr  string
	n          int
	producers  int
	workers    int
	consumers  int
	callers    int
	payload    int
	batch      int
	window     time.Duration
	fetch      time.Duration
	handle     time.Duration
	depth      int
	ring       int
	sendConc   int
	json       bool
	send       bool
	cpuprofile string
	trace      string
	verbose    bool
	breakdown  bool
}

// scenario is one named measurement.
type scenario struct {
	name     string
	defaultN int
	run      func(ctx context.Context, e *env, n int) error
}

var scenarios = []scenario{
	{"throughput", 200_000, runThroughput},
	{"few", 30_000, runFew},
	{"rpc", 100_000, runRPC},
	{"latency", 2_000, runLatency},
	{"prefetch", 500, runPrefetch},
	{"batch", 200_000, runBatch},
	{"drain", 200_000, runDrain},
	{"fairness", 60, runFairness},
	{"delayed", 20_000, runDelayed},
	{"flow", 50_000, runFlow},
	{"multi", 90_000, runMulti},
	{"dedupmodes", 20_000, runDedupModes},
	{"fair", 50_000, runFair},
}

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "streamq-bench:", err)
		os.Exit(1)
	}
}

func run() error {
	var cfg config
	flag.StringVar(&cfg.scenario, "scenario", "all", "throughput, few, rpc, latency, prefetch, batch, drain, fairness, delayed, flow, multi, dedupmodes, fair or all")
	flag.StringVar(&cfg.redisAddr, "redis", "", "host:port of a Redis to use; empty starts a private redis-server")
	flag.IntVar(&cfg.n, "n", 0, "jobs per measured run; 0 uses each scenario's default (throughput 200000, few 30000, rpc 100000, latency 2000, prefetch 500, batch 200000, drain 200000, fairness 60, delayed 20000, flow 50000, multi 90000, dedupmodes 20000)")
	flag.IntVar(&cfg.producers, "producers", 4, "producers (each with its own client, like separate processes)")
	flag.IntVar(&cfg.workers, "workers", 8, "handler goroutines in all, spread over -consumers consumers")
	flag.IntVar(&cfg.consumers, "consumers", 2, "consumers (each with its own client)")
	flag.IntVar(&cfg.callers, "callers", 64, "concurrent calling goroutines per producer (throughput, rpc)")
	flag.IntVar(&cfg.payload, "payload", 100, "encoded request size in bytes")
	flag.IntVar(&cfg.batch, "batch", 16, "jobs per batch (batch and delayed scenarios)")
	flag.DurationVar(&cfg.window, "window", 5*time.Second, "spread of the due times (delayed)")
	fetchMS := flag.Float64("fetch-ms", 5, "fetch latency in milliseconds (prefetch)")
	handleMS := flag.Float64("handle-ms", 5, "handler time in milliseconds (prefetch)")
	flag.IntVar(&cfg.depth, "depth", 16, "prefetch ring depth (prefetch)")
	flag.IntVar(&cfg.sendConc, "send-concurrency", 0, "ProducerOptions.Concurrency of each producer in throughput and rpc; 0 keeps the library default")
	flag.IntVar(&cfg.ring, "ring", 0, "ConsumerOptions.Prefetch of each consumer in throughput and rpc (and MultiOptions.Prefetch and ConsumerOptions.Prefetch in multi); 0 keeps the library default")
	flag.BoolVar(&cfg.send, "send", false, "throughput: submit with Producer.Send (no per-call acknowledgement) and Flush, instead of Enqueue")
	flag.BoolVar(&cfg.json, "json", false, "print JSON lines instead of a table")
	flag.StringVar(&cfg.cpuprofile, "cpuprofile", "", "write a CPU profile of the whole program to this file")
	flag.StringVar(&cfg.trace, "trace", "", "write an execution trace of the whole program to this file (go tool trace)")
	flag.BoolVar(&cfg.verbose, "v", false, "show the library's info logs")
	flag.BoolVar(&cfg.breakdown, "breakdown", false, "print the per-command server cost of each run to stderr")
	flag.Parse()
	cfg.fetch = time.Duration(*fetchMS * float64(time.Millisecond))
	cfg.handle = time.Duration(*handleMS * float64(time.Millisecond))
	if err := cfg.validate(); err != nil {
		return err
	}

	var chosen []scenario
	for _, s := range scenarios {
		if cfg.scenario == "all" || cfg.scenario == s.name {
			chosen = append(chosen, s)
		}
	}
	if len(chosen) == 0 {
		return fmt.Errorf("unknown -scenario %q: use throughput, few, rpc, latency, prefetch, batch, drain, fairness, delayed, flow, multi, dedupmodes, fair or all", cfg.scenario)
	}

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()

	addr := cfg.redisAddr
	if addr == "" {
		sctx, cancel := context.WithTimeout(ctx, 20*time.Second)
		proc, err := redistest.StartProcess(sctx)
		cancel()
		if err != nil {
			return fmt.Errorf("start redis-server (or pass -redis host:port): %w", err)
		}
		defer proc.Stop()
		addr = proc.Addr()
	}

	if cfg.cpuprofile != "" {
		f, err := os.Create(cfg.cpuprofile)
		if err != nil {
			return err
		}
		defer f.Close()
		if err := pprof.StartCPUProfile(f); err != nil {
			return err
		}
		defer pprof.StopCPUProfile()
	}
	if cfg.trace != "" {
		f, err := os.Create(cfg.trace)
		if err != nil {
			return err
		}
		defer f.Close()
		if err := trace.Start(f); err != nil {
			return err
		}
		defer trace.Stop()
	}

	level := slog.LevelWarn
	if cfg.verbose {
		level = slog.LevelInfo
	}
	e := &env{
		cfg:   cfg,
		addr:  addr,
		run:   time.Now().Format("150405"),
		log:   slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: level})),
		out:   &printer{w: os.Stdout, json: cfg.json},
		admin: redis.NewClient(&redis.Options{Addr: addr}),
	}
	defer e.admin.Close()
	if err := e.admin.Ping(ctx).Err(); err != nil {
		return fmt.Errorf("redis at %s: %w", addr, err)
	}
	if !cfg.json {
		fmt.Printf("redis %s; producers=%d callers/producer=%d consumers=%d workers=%d payload=%dB\n",
			addr, cfg.producers, cfg.callers, cfg.consumers, cfg.workers, cfg.payload)
	}
	e.out.header()

	var failed []error
	for _, s := range chosen {
		n := s.defaultN
		if cfg.n > 0 {
			n = cfg.n
		}
		if err := s.run(ctx, e, n); err != nil {
			failed = append(failed, fmt.Errorf("%s: %w", s.name, err))
			fmt.Fprintf(os.Stderr, "streamq-bench: %s FAILED: %v\n", s.name, err)
			if ctx.Err() != nil {
				break
			}
		}
	}
	if !cfg.json {
		printTargets(os.Stdout, e.out.results)
	}
	return errors.Join(failed...)
}

func (c *config) validate() error {
	switch {
	case c.producers < 1, c.workers < 1, c.consumers < 1, c.callers < 1:
		return errors.New("-producers, -workers, -consumers and -callers must be at least 1")
	case c.workers < c.consumers:
		return fmt.Errorf("-workers (%d) must be at least -consumers (%d)", c.workers, c.consumers)
	case c.payload < 0 || c.batch < 1 || c.depth < 1:
		return errors.New("-payload must be >= 0, -batch and -depth >= 1")
	case c.window <= 0:
		return errors.New("-window must be positive")
	case c.fetch < 0 || c.handle < 0:
		return errors.New("-fetch-ms and -handle-ms must be >= 0")
	}
	return nil
}

// env is what every scenario shares.
type env struct {
	cfg   config
	addr  string
	run   string        // distinguishes this program run's queue names
	seq   atomic.Int64  // distinguishes queues within the run
	log   *slog.Logger  // the library's logger
	out   *printer      // results
	admin *redis.Client // INFO snapshots, polls and checks
}

// queue returns a queue name used by nothing else.
func (e *env) queue(scenario, system string) string {
	return fmt.Sprintf("bench-%s-%s-%s-%d", e.run, scenario, system, e.seq.Add(1))
}

// client returns a new client, as a separate process would have.
func (e *env) client(pool int) *redis.Client {
	return redis.NewClient(&redis.Options{Addr: e.addr, PoolSize: max(pool, 20), Dialer: countingDialer(nil)})
}

// meter returns a meter reading the server's counters.
func (e *env) meter() *meter {
	m := &meter{c: e.admin}
	if e.cfg.breakdown {
		m.detail = os.Stderr
	}
	return m
}

// workersPer returns the workers of consumer i when W workers are spread over C consumers.
func (e *env) workersPer(i int) int {
	w := e.cfg.workers / e.cfg.consumers
	if i < e.cfg.workers%e.cfg.consumers {
		w++
	}
	return w
}

// target is one of the project's performance goals.
type target struct {
	what  string
	value func(rs []Result) (float64, bool)
	ok    func(v float64) bool
	goal  string
}

func find(rs []Result, scenario, system string) (Result, bool) {
	for _, r := range rs {
		if r.Scenario == scenario && r.System == system {
			return r, true
		}
	}
	return Result{}, false
}

func field(scenario, system string, f func(Result) float64) func([]Result) (float64, bool) {
	return func(rs []Result) (float64, bool) {
		r, ok := find(rs, scenario, system)
		return f(r), ok
	}
}

func ratioOf(scenario string) func([]Result) (float64, bool) {
	return func(rs []Result) (float64, bool) {
		s, ok1 := find(rs, scenario, "streamq")
		b, ok2 := find(rs, scenario, "baseline")
		if !ok1 || !ok2 || b.JobsPerSec == 0 {
			return 0, false
		}
		return s.JobsPerSec / b.JobsPerSec, true
	}
}

// ratioField is streamq's value of f over the baseline's, in one scenario.
func ratioField(scenario string, f func(Result) float64) func([]Result) (float64, bool) {
	return func(rs []Result) (float64, bool) {
		s, ok1 := find(rs, scenario, "streamq")
		b, ok2 := find(rs, scenario, "baseline")
		if !ok1 || !ok2 || f(b) == 0 {
			return 0, false
		}
		return f(s) / f(b), true
	}
}

func redisCPU(r Result) float64  { return r.RedisCPUUsPerJob }
func clientCPU(r Result) float64 { return r.ClientCPUUsPerJob }

// targets are this round's goals (the consumer's committer round).
var targets = []target{
	{"few ratio streamq/baseline", ratioOf("few"), func(v float64) bool { return v >= 0.75 }, ">= 0.75"},
	{"few client CPU streamq/baseline", ratioField("few", clientCPU), func(v float64) bool { return v <= 1.3 }, "<= 1.3"},
	{"few Redis CPU us/job", field("few", "streamq", redisCPU), func(v float64) bool { return v <= 25 }, "<= 25"},
	{"drain ratio streamq/baseline", ratioOf("drain"), func(v float64) bool { return v >= 0.36 }, ">= 0.36"},
	{"drain Redis CPU us/job", field("drain", "streamq", redisCPU), func(v float64) bool { return v <= 12 }, "<= 12"},
	{"drain client CPU streamq/baseline", ratioField("drain", clientCPU), func(v float64) bool { return v <= 2.5 }, "<= 2.5"},
	{"throughput ratio streamq/baseline", ratioOf("throughput"), func(v float64) bool { return v >= 0.4 }, ">= 0.4"},
	{"throughput Redis CPU us/job", field("throughput", "streamq", redisCPU), func(v float64) bool { return v <= 16 }, "<= 16"},
	{"rpc ratio streamq/baseline", ratioOf("rpc"), func(v float64) bool { return v >= 1.1 }, ">= 1.1"},
	{"rpc Redis CPU us/job", field("rpc", "streamq", redisCPU), func(v float64) bool { return v <= 14 }, "<= 14"},
	{"idle pickup p50 ms", field("latency", "streamq", func(r Result) float64 { return r.PickupP50Ms }), func(v float64) bool { return v <= 0.10 }, "<= 0.10"},
	{"latency p99 ms", field("latency", "streamq", func(r Result) float64 { return r.P99Ms }), func(v float64) bool { return v <= 1 }, "<= 1"},
	{"delayed lateness p99 ms", field("delayed", "promote", func(r Result) float64 { return r.P99Ms }), func(v float64) bool { return v <= 20 }, "<= 20"},
	{"prefetch elapsed/ideal", field("prefetch", "streamq", func(r Result) float64 { return r.IdealRatio }), func(v float64) bool { return v <= 1.15 }, "<= 1.15"},
	{"fairness elapsed/ideal", field("fairness", "streamq", func(r Result) float64 { return r.IdealRatio }), func(v float64) bool { return v <= 1.2 }, "<= 1.2"},
}

// printTargets prints where each measured target stands.
func printTargets(w io.Writer, rs []Result) {
	first := true
	for _, t := range targets {
		v, ok := t.value(rs)
		if !ok {
			continue
		}
		if first {
			fmt.Fprintln(w, "\ntargets:")
			first = false
		}
		verdict := "met"
		if !t.ok(v) {
			verdict = "MISSED"
		}
		fmt.Fprintf(w, "  %-36s %10.3f  (goal %s) %s\n", t.what, v, t.goal, verdict)
	}
}
