package reliability

// The worker programs. The test binary re-executes itself with envWorker set to
// a JSON workerConfig; TestMain then runs one worker instead of the tests.

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"os"
	"os/signal"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/streamq/streamq"
)

// envWorker carries a worker's JSON configuration.
const envWorker = "STREAMQ_RELIABILITY_WORKER"

// Req is the request type of the test queue.
type Req struct {
	N      int64  `json:"n"`
	Poison int    `json:"poison,omitempty"` // poisonNone, poisonRetry or poisonPermanent
	Pad    string `json:"pad,omitempty"`
}

// Resp is the response type of the test queue.
type Resp struct {
	V int64 `json:"v"`
}

// Poison kinds.
const (
	poisonNone      = 0
	poisonRetry     = 1 // the handler always fails: dead-lettered after MaxDeliveries
	poisonPermanent = 2 // the handler fails with Permanent: dead-lettered at once
)

// expected is the handler's answer to n.
func expected(n int64) int64 { return n*3 + 1 }

// idOf names request i of a producer range.
func idOf(prefix string, i int) string { return prefix + strconv.Itoa(i) }

// poisonKind says whether request i of a range is poison, and which kind.
func poisonKind(i, every int) int {
	if every <= 0 || i%every != every-1 {
		return poisonNone
	}
	if (i/every)%2 == 0 {
		return poisonRetry
	}
	return poisonPermanent
}

// reqOf is the request for index i of a producer slot.
func reqOf(slot, i, poisonEvery int) Req {
	return Req{N: int64(slot)<<32 | int64(i), Poison: poisonKind(i, poisonEvery)}
}

// Worker settings shared by every consumer, short enough that recovery happens
// many times within a run.
const (
	workerMinIdle       = 2 * time.Second
	workerClaimInterval = 150 * time.Millisecond
	workerReadBlock     = 200 * time.Millisecond
	workerBackstop      = 500 * time.Millisecond
	workerMaxDeliveries = 6
)

type workerConfig struct {
	Role  string // "consumer" or "producer"
	Addr  string // Redis, through the fault proxy
	Queue string
	Dir   string // where logs of executions and results go

	// Consumer.
	Name    string
	Workers int

	// Producer.
	Slot        int
	Prefix      string
	Count       int
	PoisonEvery int
	Start       int64   // unix nanoseconds: request i is due at Start + i/Rate
	Rate        float64 // requests per second
	Concurrency int
	Attempt     time.Duration // timeout of one Produce + Wait attempt
}

// resultsFile is where producer slot writes the outcome of each of its ids.
func resultsFile(dir string, slot int) string {
	return filepath.Join(dir, fmt.Sprintf("results-p%d.log", slot))
}

// execFile is where a consumer process records each handler execution.
func execFile(dir string, pid int) string {
	return filepath.Join(dir, fmt.Sprintf("exec-%d.log", pid))
}

// producerStats is what a producer process writes at exit.
type producerStats struct {
	Slot          int
	Produced      int64 // ids produced by this process (resumed ones included)
	Resolved      int64
	ProduceErrors int64 // Produce calls that failed (Redis down, cut, stalled): retried
	WaitTimeouts  int64 // attempts whose result did not come in time: produced again
	WaitErrors    int64 // other Wait errors: produced again
}

func workerMain(raw string) int {
	var cfg workerConfig
	if err := json.Unmarshal([]byte(raw), &cfg); err != nil {
		fmt.Fprintln(os.Stderr, "worker: bad config:", err)
		return 2
	}
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	var err error
	switch cfg.Role {
	case "consumer":
		err = runConsumerWorker(cfg, log)
	case "producer":
		err = runProducerWorker(cfg, log)
	default:
		err = fmt.Errorf("unknown role %q", cfg.Role)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "worker:", err)
		return 1
	}
	return 0
}

// runConsumerWorker consumes until SIGTERM. Each handler execution (time,
// request id, delivery count, stream entry id) is appended to the process's
// execution file before the handler does anything else, with
// one write(2) call, so that it survives a SIGKILL of the process.
func runConsumerWorker(cfg workerConfig, log *slog.Logger) error {
	f, err := os.OpenFile(execFile(cfg.Dir, os.Getpid()), os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o644)
	if err != nil {
		return err
	}
	defer f.Close()
	client := redis.NewClient(&redis.Options{Addr: cfg.Addr, PoolSize: 16})
	defer client.Close()

	handler := func(ctx context.Context, m *streamq.Message[Req]) (Resp, error) {
		line := fmt.Sprintf("%d %s %d %s\n", time.Now().UnixNano(), m.ID, m.Deliveries, m.EntryID)
		if _, err := f.WriteString(line); err != nil {
			// Without the record the run cannot be checked: stop here.
			fmt.Fprintln(os.Stderr, "worker: cannot record an execution:", err)
			os.Exit(3)
		}
		t := time.NewTimer(time.Duration(rand.N(10_000)) * time.Microsecond)
		select {
		case <-t.C:
		case <-ctx.Done():
			t.Stop()
			return Resp{}, context.Cause(ctx)
		}
		switch m.Payload.Poison {
		case poisonRetry:
			return Resp{}, errors.New("poison request: this handler always fails")
		case poisonPermanent:
			return Resp{}, streamq.Permanent(errors.New("poison request: permanent failure"))
		}
		return Resp{V: expected(m.Payload.N)}, nil
	}
	c, err := streamq.NewConsumer[Req, Resp](client, cfg.Queue, handler, &streamq.ConsumerOptions{
		Name:                cfg.Name,
		Workers:             cfg.Workers,
		MinIdle:             workerMinIdle,
		ClaimInterval:       workerClaimInterval,
		ReadBlock:           workerReadBlock,
		MaxDeliveries:       workerMaxDeliveries,
		RetryBackoff:        50 * time.Millisecond,
		ShutdownTimeout:     5 * time.Second,
		TrimInterval:        time.Second,
		ConsumerIdleTimeout: 5 * time.Second,
		Logger:              log,
	})
	if err != nil {
		return err
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer stop()
	go watchStarvation(ctx, cfg.Dir)
	return c.Run(ctx)
}

// watchStarvation records the spans during which this process did not run for
// longer than a lease renewal period (CPU starvation, a long GC pause, the
// machine swapping): in such a span the consumer cannot renew its leases, so
// another consumer may legitimately claim its entries. Each span is appended
// to the process's starvation file as "<start ns> <end ns>".
func watchStarvation(ctx context.Context, dir string) {
	const tick = 100 * time.Millisecond
	const limit = workerMinIdle / 3
	f, err := os.OpenFile(starveFile(dir, os.Getpid()), os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o644)
	if err != nil {
		fmt.Fprintln(os.Stderr, "worker: cannot open the starvation file:", err)
		os.Exit(3)
	}
	defer f.Close()
	t := time.NewTicker(tick)
	defer t.Stop()
	last := time.Now()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			now := time.Now()
			if gap := now.Sub(last); gap > limit {
				_, _ = fmt.Fprintf(f, "%d %d\n", last.UnixNano(), now.UnixNano())
			}
			last = now
		}
	}
}

// starveFile is where a consumer process records the spans it did not run.
func starveFile(dir string, pid int) string {
	return filepath.Join(dir, fmt.Sprintf("starve-%d.log", pid))
}

// readResults returns the indexes of a range already resolved in a producer's
// results file (lines "R <id> <v>" and "D <id>"). A torn last line is ignored.
func readResults(path, prefix string) (map[int]bool, error) {
	done := make(map[int]bool)
	f, err := os.Open(path)
	if errors.Is(err, os.ErrNotExist) {
		return done, nil
	}
	if err != nil {
		return nil, err
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) < 2 || (fields[0] != "R" && fields[0] != "D") {
			continue
		}
		if i, err := strconv.Atoi(strings.TrimPrefix(fields[1], prefix)); err == nil {
			done[i] = true
		}
	}
	return done, sc.Err()
}

// runProducerWorker produces every id of its range not yet resolved in its
// results file, on the range's schedule, and appends each outcome there:
// "A <id>" once Produce accepted it (Redis recorded it),
// "R <id> <v>" for a result, "D <id>" for a dead-lettered poison request,
// "X <id> <what>" for anything that must not happen. It exits once every id
// is resolved. A request whose outcome is unknown (an error or a timeout) is
// produced again: that attaches to the queued request or finds its result.
func runProducerWorker(cfg workerConfig, log *slog.Logger) error {
	path := resultsFile(cfg.Dir, cfg.Slot)
	done, err := readResults(path, cfg.Prefix)
	if err != nil {
		return err
	}
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o644)
	if err != nil {
		return err
	}
	defer f.Close()
	write := func(format string, args ...any) {
		if _, err := fmt.Fprintf(f, format+"\n", args...); err != nil {
			fmt.Fprintln(os.Stderr, "worker: cannot record a result:", err)
			os.Exit(3)
		}
	}
	client := redis.NewClient(&redis.Options{Addr: cfg.Addr, PoolSize: 32})
	defer client.Close()
	p, err := streamq.NewProducer[Req, Resp](client, cfg.Queue, &streamq.ProducerOptions{
		BackstopInterval: workerBackstop,
		InflightTTL:      time.Hour,
		Logger:           log,
	})
	if err != nil {
		return err
	}
	defer p.Close()

	stats := producerStats{Slot: cfg.Slot}
	var produced, resolved, produceErrs, waitTimeouts, waitErrs atomic.Int64
	one := func(i int) {
		id := idOf(cfg.Prefix, i)
		req := reqOf(cfg.Slot, i, cfg.PoisonEvery)
		produced.Add(1)
		accepted := false
		for attempt := 1; ; attempt++ {
			ctx, cancel := context.WithTimeout(context.Background(), cfg.Attempt)
			pr, err := p.Produce(ctx, id, req)
			if err != nil {
				cancel()
				if errors.Is(err, streamq.ErrWrongType) {
					write("X %s produce-error %q", id, err.Error())
				}
				produceErrs.Add(1)
				time.Sleep(min(time.Duration(attempt)*50*time.Millisecond, time.Second))
				continue
			}
			if !accepted {
				// Redis has the request now: from here on, losing it is a bug.
				write("A %s", id)
				accepted = true
			}
			if i%4 == 0 {
				// A second submission of an id in flight must attach to its
				// entry (or find its result), never append another one.
				if again, err := p.Produce(ctx, id, req); err == nil &&
					again.EntryID() != "" && pr.EntryID() != "" && again.EntryID() != pr.EntryID() {
					write("X %s produced-twice %s %s", id, pr.EntryID(), again.EntryID())
				}
			}
			resp, err := pr.Wait(ctx)
			cancel()
			switch {
			case err == nil && req.Poison != poisonNone:
				write("X %s poison-request-succeeded", id)
			case err == nil && resp.V != expected(req.N):
				write("X %s wrong-result %d", id, resp.V)
			case err == nil:
				write("R %s %d", id, resp.V)
			case errors.Is(err, streamq.ErrDeadLettered) && req.Poison != poisonNone:
				write("D %s", id)
			case errors.Is(err, streamq.ErrDeadLettered):
				write("X %s dead-lettered %q", id, err.Error())
			case errors.Is(err, streamq.ErrRecordLost):
				// Redis lost the request's record: with appendfsync always that is a bug.
				write("X %s record-lost", id)
				continue
			case errors.Is(err, context.DeadlineExceeded):
				waitTimeouts.Add(1)
				continue
			default:
				// No other error may resolve a promise in a correct run.
				waitErrs.Add(1)
				write("X %s wait-error %q", id, err.Error())
				continue
			}
			resolved.Add(1)
			return
		}
	}

	work := make(chan int)
	var wg sync.WaitGroup
	for range cfg.Concurrency {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range work {
				one(i)
			}
		}()
	}
	start := time.Unix(0, cfg.Start)
	for i := range cfg.Count {
		if done[i] {
			continue
		}
		due := start.Add(time.Duration(float64(i) / cfg.Rate * float64(time.Second)))
		if d := time.Until(due); d > 0 {
			time.Sleep(d) // the range's schedule, not a wait for a condition
		}
		work <- i
	}
	close(work)
	wg.Wait()

	stats.Produced, stats.Resolved = produced.Load(), resolved.Load()
	stats.ProduceErrors, stats.WaitTimeouts, stats.WaitErrors = produceErrs.Load(), waitTimeouts.Load(), waitErrs.Load()
	b, _ := json.Marshal(stats)
	return os.WriteFile(filepath.Join(cfg.Dir, fmt.Sprintf("stats-p%d-%d.json", cfg.Slot, os.Getpid())), b, 0o644)
}
