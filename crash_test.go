package streamq

// Crash tests: consumers run as child processes (the test binary re-executes
// itself into TestCrashHelperProcess) and are killed with SIGKILL, the one
// failure a process cannot clean up after. Every request id is accounted for
// afterwards: its caller's result, its record, the handler runs, and an empty
// stream and PEL.

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"sort"
	"strconv"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/streamq/streamq/internal/crashtest"
)

// crashConfig is what a child consumer process is told to do.
type crashConfig struct {
	Addr  string
	Queue string
	// Mode selects the handler:
	//   "block":  record the id in the started set, then block until cancelled.
	//   "work":   count the run, return "r:"+payload.
	//   "poison": like "work", except that the id "poison" records its delivery
	//             count and SIGKILLs the process.
	//   "retrypoison": like "poison", except that the poison's first two
	//             starts fail with RetryAfter (recorded as "r<count>").
	Mode          string
	Name          string
	Workers       int
	Prefetch      int
	MinIdle       time.Duration
	MaxDeliveries int
}

// Bookkeeping keys of the crash tests, in the queue's hash slot.
func startedKey(q string) string     { return "crashtest:{" + q + "}:started" }
func runsKey(q string) string        { return "crashtest:{" + q + "}:runs" }
func poisonSeenKey(q string) string  { return "crashtest:{" + q + "}:poison" }
func streamKey(q string) string      { return "streamq:{" + q + "}:stream" }
func recordKey(q, id string) string  { return "streamq:{" + q + "}:id:" + id }
func sharedAddr(t *testing.T) string { realRedis(t); return shared.proc.Addr() }

// TestCrashHelperProcess is the consumer process of the crash tests. Run by
// go test it returns at once; it works only when crashtest.Start ran it.
func TestCrashHelperProcess(t *testing.T) {
	var cfg crashConfig
	if !crashtest.Config(&cfg) {
		return
	}
	client := redis.NewClient(&redis.Options{Addr: cfg.Addr, PoolSize: 32})
	defer client.Close()
	bg := context.Background()
	handler := func(ctx context.Context, m *Message[string]) (string, error) {
		switch {
		case cfg.Mode == "block":
			if err := client.SAdd(bg, startedKey(cfg.Queue), m.ID).Err(); err != nil {
				return "", err
			}
			<-ctx.Done()
			return "", context.Cause(ctx)
		case cfg.Mode == "retrypoison" && m.ID == "poison" && m.Deliveries <= 2:
			client.RPush(bg, poisonSeenKey(cfg.Queue), fmt.Sprintf("r%d", m.Deliveries))
			return "", RetryAfter(errors.New("retry through the schedule"), 100*time.Millisecond)
		case (cfg.Mode == "poison" || cfg.Mode == "retrypoison") && m.ID == "poison":
			client.RPush(bg, poisonSeenKey(cfg.Queue), m.Deliveries)
			_ = syscall.Kill(os.Getpid(), syscall.SIGKILL)
			time.Sleep(time.Hour)
		}
		if err := client.HIncrBy(bg, runsKey(cfg.Queue), m.ID, 1).Err(); err != nil {
			return "", err
		}
		return "r:" + m.Payload, nil
	}
	c, err := NewConsumer(client, cfg.Queue, handler, &ConsumerOptions{
		Name:          cfg.Name,
		Workers:       cfg.Workers,
		Prefetch:      cfg.Prefetch,
		MinIdle:       cfg.MinIdle,
		ClaimInterval: 100 * time.Millisecond,
		ReadBlock:     100 * time.Millisecond,
		MaxDeliveries: cfg.MaxDeliveries,
		RetryBackoff:  50 * time.Millisecond,
		TrimInterval:  -1,
		Logger:        slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelInfo})),
		holdPrefetch:  true, // the crash scenarios hold a full ring
	})
	if err != nil {
		t.Fatal(err)
	}
	ctx, stop := signal.NotifyContext(bg, syscall.SIGTERM)
	defer stop()
	_ = c.Run(ctx)
}

// produceAll produces ids with payload "p-"+id and returns their promises.
func produceAll(t *testing.T, p *Producer[string, string], ids []string) []*Promise[string] {
	t.Helper()
	prs := make([]*Promise[string], len(ids))
	for i, id := range ids {
		pr, err := p.Produce(context.Background(), id, "p-"+id)
		require.NoError(t, err)
		prs[i] = pr
	}
	return prs
}

func seqIDs(prefix string, n int) []string {
	ids := make([]string, n)
	for i := range ids {
		ids[i] = fmt.Sprintf("%s-%04d", prefix, i)
	}
	return ids
}

// pendingOf returns the PEL size of consumer name in the default group.
func pendingOf(t *testing.T, client *redis.Client, q, name string) int64 {
	t.Helper()
	sum, err := client.XPending(context.Background(), streamKey(q), DefaultGroup).Result()
	if isNoGroup(err) {
		return 0 // the consumer has not created its group yet
	}
	require.NoError(t, err)
	return sum.Consumers[name]
}

// requireDrained checks that the stream and the group's PEL are empty.
func requireDrained(t *testing.T, client *redis.Client, q string) {
	t.Helper()
	ctx := context.Background()
	require.Zero(t, client.XLen(ctx, streamKey(q)).Val(), "stream not empty")
	sum, err := client.XPending(ctx, streamKey(q), DefaultGroup).Result()
	require.NoError(t, err)
	require.Zero(t, sum.Count, "PEL not empty: %+v", sum)
}

// requireResults waits for every promise and checks its result and record.
func requireResults(t *testing.T, client *redis.Client, q string, ids []string, prs []*Promise[string], deadline time.Time) {
	t.Helper()
	ctx, cancel := context.WithDeadline(context.Background(), deadline)
	defer cancel()
	for i, pr := range prs {
		got, err := pr.Wait(ctx)
		require.NoError(t, err, "id %s", ids[i])
		require.Equal(t, "r:p-"+ids[i], got, "id %s", ids[i])
	}
	for _, id := range ids {
		rec, err := client.Get(context.Background(), recordKey(q, id)).Result()
		require.NoError(t, err, "record of %s", id)
		require.Equal(t, `R"r:p-`+id+`"`, rec, "record of %s", id)
	}
}

// countingHandler counts runs and delivery counts per id.
type countingHandler struct {
	mu         sync.Mutex
	runs       map[string]int
	deliveries map[int]int // delivery count seen -> number of calls
}

func newCountingHandler() *countingHandler {
	return &countingHandler{runs: map[string]int{}, deliveries: map[int]int{}}
}

func (h *countingHandler) handle(_ context.Context, m *Message[string]) (string, error) {
	h.mu.Lock()
	h.runs[m.ID]++
	h.deliveries[m.Deliveries]++
	h.mu.Unlock()
	return "r:" + m.Payload, nil
}

// requireOnceEach checks that exactly ids ran, once each.
func (h *countingHandler) requireOnceEach(t *testing.T, ids []string) {
	t.Helper()
	h.mu.Lock()
	defer h.mu.Unlock()
	require.Len(t, h.runs, len(ids))
	for _, id := range ids {
		require.Equal(t, 1, h.runs[id], "runs of %s", id)
	}
}

// waitChildHolds waits until consumer name holds want entries and started
// handlers have recorded themselves.
func waitChildHolds(t *testing.T, client *redis.Client, q, name string, want, started int64) {
	t.Helper()
	eventually(t, 30*time.Second, func() bool {
		return pendingOf(t, client, q, name) == want && client.SCard(context.Background(), startedKey(q)).Val() == started
	}, "child %s never held %d entries with %d handlers started", name, want, started)
}

func TestCrashSIGKILLMidHandlerOtherConsumerCompletesAll(t *testing.T) {
	t.Parallel()
	client := realRedis(t)
	q := queueName(t)
	const n, workers = 500, 8
	const minIdle, claimInterval = time.Second, 100 * time.Millisecond
	p, err := NewProducer[string, string](client, q, &ProducerOptions{Logger: testLogger(t)})
	require.NoError(t, err)
	defer p.Close()
	ids := seqIDs("job", n)
	prs := produceAll(t, p, ids)

	child := crashtest.Start(t, "TestCrashHelperProcess", crashConfig{
		Addr: sharedAddr(t), Queue: q, Mode: "block", Name: "doomed",
		Workers: workers, Prefetch: n, MinIdle: minIdle, MaxDeliveries: 5,
	})
	waitChildHolds(t, client, q, "doomed", n, workers)
	child.Kill()
	killedAt := time.Now()
	require.True(t, child.KilledBy(syscall.SIGKILL))

	h := newCountingHandler()
	c, err := NewConsumer(client, q, h.handle, &ConsumerOptions{
		Name: "survivor", Workers: workers, Prefetch: n, MinIdle: minIdle,
		ClaimInterval: claimInterval, ReadBlock: 100 * time.Millisecond, Logger: testLogger(t),
	})
	require.NoError(t, err)
	runConsumer(t, c)

	requireResults(t, client, q, ids, prs, killedAt.Add(minIdle+claimInterval+30*time.Second))
	elapsed := time.Since(killedAt)
	t.Logf("%d entries held by a SIGKILLed consumer completed by another %v after the kill (MinIdle %v + ClaimInterval %v = %v)",
		n, elapsed.Round(time.Millisecond), minIdle, claimInterval, minIdle+claimInterval)
	h.requireOnceEach(t, ids)
	// A delivery is a handler start: the entries whose handlers the dead
	// consumer started run as their second start, the ones it had merely
	// prefetched as their first. Its reads and lease renewals count nothing.
	require.Equal(t, map[int]int{1: n - workers, 2: workers}, h.deliveries)
	require.EqualValues(t, workers, client.SCard(context.Background(), startedKey(q)).Val())
	requireDrained(t, client, q)
	require.Zero(t, pendingOf(t, client, q, "doomed"))
}

func TestCrashSameNameRestartResumesAtOnce(t *testing.T) {
	t.Parallel()
	client := realRedis(t)
	q := queueName(t)
	const n = 50
	const minIdle = 30 * time.Second // the restart must not wait for it
	p, err := NewProducer[string, string](client, q, &ProducerOptions{Logger: testLogger(t)})
	require.NoError(t, err)
	defer p.Close()
	ids := seqIDs("job", n)
	prs := produceAll(t, p, ids)

	name := "stable-slot-0"
	child := crashtest.Start(t, "TestCrashHelperProcess", crashConfig{
		Addr: sharedAddr(t), Queue: q, Mode: "block", Name: name,
		Workers: 2, Prefetch: n, MinIdle: minIdle, MaxDeliveries: 5,
	})
	waitChildHolds(t, client, q, name, n, 2)
	child.Kill()
	require.True(t, child.KilledBy(syscall.SIGKILL))
	restartedAt := time.Now()

	h := newCountingHandler()
	c, err := NewConsumer(client, q, h.handle, &ConsumerOptions{
		Name: name, Workers: 2, MinIdle: minIdle, ClaimInterval: 100 * time.Millisecond,
		ReadBlock: 100 * time.Millisecond, Logger: testLogger(t),
	})
	require.NoError(t, err)
	runConsumer(t, c)

	requireResults(t, client, q, ids, prs, restartedAt.Add(minIdle/2))
	elapsed := time.Since(restartedAt)
	t.Logf("restarted consumer %q resumed and completed its %d pending entries in %v (MinIdle %v)",
		name, n, elapsed.Round(time.Millisecond), minIdle)
	require.Less(t, elapsed, minIdle)
	h.requireOnceEach(t, ids)
	// The first life started two handlers; the rest it had merely prefetched,
	// so they run as first starts in the second life.
	require.Equal(t, map[int]int{1: n - 2, 2: 2}, h.deliveries)
	requireDrained(t, client, q)
}

// runPoisonLoop produces good messages around one poison message, then keeps
// restarting a child consumer (same name) until every caller has its answer.
// It returns the number of child crashes and the promises.
func runPoisonLoop(t *testing.T, client *redis.Client, q string, cfg crashConfig, good []string) (int, *Promise[string], []*Promise[string]) {
	t.Helper()
	p, err := NewProducer[string, string](client, q, &ProducerOptions{Logger: testLogger(t)})
	require.NoError(t, err)
	t.Cleanup(func() { _ = p.Close() })
	half := len(good) / 2
	before := produceAll(t, p, good[:half])
	poison, err := p.Produce(context.Background(), "poison", "p-poison")
	require.NoError(t, err)
	prs := append(before, produceAll(t, p, good[half:])...)

	allDone := make(chan struct{})
	go func() {
		defer close(allDone)
		<-poison.Done()
		for _, pr := range prs {
			<-pr.Done()
		}
	}()
	deadline := time.After(60 * time.Second)
	crashes := 0
	for {
		child := crashtest.Start(t, "TestCrashHelperProcess", cfg)
		select {
		case <-child.Done():
			require.True(t, child.KilledBy(syscall.SIGKILL), "child ended otherwise: %s", child.Output())
			crashes++
			require.LessOrEqual(t, crashes, 3*cfg.MaxDeliveries, "crash loop does not end")
			continue
		case <-allDone:
			child.Kill()
		case <-deadline:
			child.Kill()
			t.Fatalf("callers still waiting after 60s and %d crashes", crashes)
		}
		break
	}
	return crashes, poison, prs
}

func TestCrashPoisonMessageDeadLetteredAfterMaxDeliveries(t *testing.T) {
	t.Parallel()
	client := realRedis(t)
	ctx := context.Background()
	q := queueName(t)
	const maxDeliveries = 3
	good := seqIDs("good", 1000)
	// One worker and a ring of one: nothing else is in flight when the poison
	// kills the process (TestCrashPoisonSparesPrefetchedNeighbours has a ring).
	cfg := crashConfig{
		Addr: sharedAddr(t), Queue: q, Mode: "poison", Name: "poisoned",
		Workers: 1, Prefetch: 1, MinIdle: 2 * time.Second, MaxDeliveries: maxDeliveries,
	}
	crashes, poison, prs := runPoisonLoop(t, client, q, cfg, good)
	t.Logf("poison message crashed the consumer %d times before it was dead-lettered", crashes)
	require.Equal(t, maxDeliveries, crashes)

	_, err := poison.Wait(ctx)
	require.ErrorIs(t, err, ErrDeadLettered)
	seen, err := client.LRange(ctx, poisonSeenKey(q), 0, -1).Result()
	require.NoError(t, err)
	require.Equal(t, []string{"1", "2", "3"}, seen, "delivery counts seen by the poison's handler")

	admin, err := NewAdmin(client, q, nil)
	require.NoError(t, err)
	dls, err := admin.DeadLetters(ctx, "", 100)
	require.NoError(t, err)
	require.Len(t, dls, 1)
	require.Equal(t, "poison", dls[0].ID)
	require.JSONEq(t, `"p-poison"`, string(dls[0].Payload))
	// Claims and resumes do not count a delivery; handler starts do. So the
	// dead letter records exactly the deliveries the handler saw.
	require.Equal(t, maxDeliveries, dls[0].Deliveries)
	require.Contains(t, dls[0].Error, "MaxDeliveries=3")
	rec := client.Get(ctx, recordKey(q, "poison")).Val()
	require.Equal(t, "L", rec[:1], "record of the poison: %q", rec)

	requireResults(t, client, q, good, prs, time.Now().Add(10*time.Second))
	runs, err := client.HGetAll(ctx, runsKey(q)).Result()
	require.NoError(t, err)
	require.Len(t, runs, len(good))
	// At-least-once: a good entry handled just before the poison whose outcome
	// was not recorded yet when the poison killed the process runs again (how
	// many such entries there are depends on the machine's load). Nothing
	// after the poison is in flight at a crash (a ring of one holds the
	// poison), so those run exactly once; and a crash undoes at most one run
	// of an entry.
	var rerun []string
	for i, id := range good {
		n, err := strconv.Atoi(runs[id])
		require.NoError(t, err, "runs of %s", id)
		require.GreaterOrEqual(t, n, 1, "runs of %s", id)
		if n == 1 {
			continue
		}
		rerun = append(rerun, id)
		require.Less(t, i, len(good)/2, "%s, produced after the poison, ran %d times", id, n)
		require.LessOrEqual(t, n, 1+crashes, "runs of %s", id)
	}
	t.Logf("%d good entries ran again because a crash undid their unrecorded outcome: %v", len(rerun), rerun)
	requireDrained(t, client, q)
}

// TestCrashPoisonSparesPrefetchedNeighbours runs the poison loop with a ring
// deeper than one: the good entries prefetched behind the poison sit in the
// crashing consumer's PEL at every crash. Resuming and claiming do not count a
// delivery, only a handler's start does, so they are not dead-lettered with
// the poison although each restart reads them again.
func TestCrashPoisonSparesPrefetchedNeighbours(t *testing.T) {
	t.Parallel()
	client := realRedis(t)
	ctx := context.Background()
	q := queueName(t)
	const maxDeliveries = 3
	good := seqIDs("good", 200)
	cfg := crashConfig{
		Addr: sharedAddr(t), Queue: q, Mode: "poison", Name: "poisoned",
		Workers: 1, Prefetch: 16, MinIdle: 2 * time.Second, MaxDeliveries: maxDeliveries,
	}
	crashes, poison, prs := runPoisonLoop(t, client, q, cfg, good)
	t.Logf("poison crashed the consumer %d times", crashes)
	_, err := poison.Wait(ctx)
	require.ErrorIs(t, err, ErrDeadLettered)

	var failed []string
	for i, pr := range prs {
		if _, err := pr.Wait(ctx); err != nil {
			failed = append(failed, good[i])
		}
	}
	sort.Strings(failed)
	require.Empty(t, failed, "good messages dead-lettered because they were prefetched behind the poison (%d)", len(failed))
	requireDrained(t, client, q)
}
