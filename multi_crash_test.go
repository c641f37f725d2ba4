package streamq

// Crash test of a MultiConsumer: a child process runs one over three queues
// and is SIGKILLed while it holds entries of all three; another consumer
// finishes them, and every start is accounted for.

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"strconv"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/streamq/streamq/internal/crashtest"
)

// multiCrashConfig is what the child MultiConsumer process is told to do.
type multiCrashConfig struct {
	Addr    string
	Queues  [3]string
	Name    string
	Workers int
	MinIdle time.Duration
	// Slow makes the handlers work 20ms and return, instead of blocking.
	Slow bool
}

// multiStartsKey counts the handler starts per id of queue q, over every
// process.
func multiStartsKey(q string) string { return "crashtest:{" + q + "}:starts" }

// multiCrashWeights are the queues' weights, in both processes.
var multiCrashWeights = [3]int{3, 2, 1}

// newCrashMulti returns a MultiConsumer over the three queues of the crash
// test (types multiJob, string and []int) whose handlers record each start
// in Redis, then call then.
func newCrashMulti(t testing.TB, client *redis.Client, cfg multiCrashConfig, logger *slog.Logger,
	then func(ctx context.Context, q int, id string, deliveries int) error) *MultiConsumer {
	bg := context.Background()
	start := func(ctx context.Context, q int, id string, deliveries int) error {
		if err := client.HIncrBy(bg, multiStartsKey(cfg.Queues[q]), id, 1).Err(); err != nil {
			return err
		}
		return then(ctx, q, id, deliveries)
	}
	opts := func() *ConsumerOptions {
		return &ConsumerOptions{
			Name: cfg.Name, MinIdle: cfg.MinIdle, ClaimInterval: 100 * time.Millisecond,
			ReadBlock: 100 * time.Millisecond, RetryBackoff: 50 * time.Millisecond, MaxDeliveries: 5,
			TrimInterval: -1, Logger: logger,
		}
	}
	ca, err := NewConsumer(client, cfg.Queues[0], func(ctx context.Context, m *Message[multiJob]) (multiDone, error) {
		return multiDone{Twice: 2 * m.Payload.N}, start(ctx, 0, m.ID, m.Deliveries)
	}, opts())
	require.NoError(t, err)
	cb, err := NewConsumer(client, cfg.Queues[1], func(ctx context.Context, m *Message[string]) (string, error) {
		return "r:" + m.Payload, start(ctx, 1, m.ID, m.Deliveries)
	}, opts())
	require.NoError(t, err)
	cc, err := NewConsumer(client, cfg.Queues[2], func(ctx context.Context, m *Message[[]int]) (int, error) {
		return len(m.Payload), start(ctx, 2, m.ID, m.Deliveries)
	}, opts())
	require.NoError(t, err)
	m, err := NewMultiConsumer(&MultiOptions{Workers: cfg.Workers},
		MultiQueue{Consumer: ca, Weight: multiCrashWeights[0]},
		MultiQueue{Consumer: cb, Weight: multiCrashWeights[1]},
		MultiQueue{Consumer: cc, Weight: multiCrashWeights[2]})
	require.NoError(t, err)
	return m
}

// TestMultiCrashHelperProcess is the child process of
// TestCrashMultiQueueLosesNothing: its handlers record their start, then
// block until cancelled (or, Slow, work 20ms). Run by go test it returns at
// once.
func TestMultiCrashHelperProcess(t *testing.T) {
	var cfg multiCrashConfig
	if !crashtest.Config(&cfg) {
		return
	}
	client := redis.NewClient(&redis.Options{Addr: cfg.Addr, PoolSize: 32})
	defer client.Close()
	logger := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelInfo}))
	m := newCrashMulti(t, client, cfg, logger, func(ctx context.Context, _ int, _ string, _ int) error {
		if cfg.Slow {
			time.Sleep(20 * time.Millisecond)
			return nil
		}
		<-ctx.Done()
		return context.Cause(ctx)
	})
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM)
	defer stop()
	_ = m.Run(ctx)
}

// TestCrashMultiQueueLosesNothing (issue 25): a MultiConsumer over three
// queues (three request types) is SIGKILLed while it holds entries of all
// three, its workers' handlers running (blocked, or working and completing
// requests: slow); another MultiConsumer claims them after MinIdle. Every
// request of every queue gets its one result, each queue's stream and PEL
// end empty, and starts are counted exactly: for every id the survivor ran,
// the starts streamq counted (the Deliveries it saw) equal the starts its
// handlers recorded in both processes, 2 for the ids the killed process had
// started and 1 for the rest; an id the survivor did not run was started
// once, and completed, by the killed process.
func TestCrashMultiQueueLosesNothing(t *testing.T) {
	t.Parallel()
	client := realRedis(t)
	for _, slow := range []bool{false, true} {
		t.Run(fmt.Sprintf("slow=%v", slow), func(t *testing.T) {
			t.Parallel()
			crashMultiQueue(t, client, slow)
		})
	}
}

func crashMultiQueue(t *testing.T, client *redis.Client, slow bool) {
	ctx := context.Background()
	const per, workers = 100, 6
	const minIdle = time.Second
	cfg := multiCrashConfig{Addr: sharedAddr(t), Queues: [3]string{queueName(t), queueName(t), queueName(t)},
		Name: "doomed", Workers: workers, MinIdle: minIdle, Slow: slow}
	pa := newProducerOf[multiJob, multiDone](t, client, cfg.Queues[0])
	idsA, prsA := seedBatches(t, pa, "a", per, true, func(i int) multiJob { return multiJob{N: i} })
	pb := newStringProducer(t, client, cfg.Queues[1])
	idsB, prsB := seedBatches(t, pb, "b", per, true, strPayload)
	pc := newProducerOf[[]int, int](t, client, cfg.Queues[2])
	idsC, prsC := seedBatches(t, pc, "c", per, true, func(i int) []int { return make([]int, i%7) })
	ids := [3][]string{idsA, idsB, idsC}

	child := crashtest.Start(t, "TestMultiCrashHelperProcess", cfg)
	started := func() int64 {
		var n int64
		for _, q := range cfg.Queues {
			n += client.HLen(ctx, multiStartsKey(q)).Val()
		}
		return n
	}
	holdsAll := func() bool {
		for _, q := range cfg.Queues {
			if pendingOf(t, client, q, "doomed") == 0 {
				return false
			}
		}
		return true
	}
	if slow {
		// Mid-run: a third of the requests started.
		eventually(t, 30*time.Second, func() bool { return started() >= per && holdsAll() },
			"the child never started %d requests while holding entries of every queue", per)
	} else {
		eventually(t, 30*time.Second, func() bool { return started() == workers && holdsAll() },
			"the child never held entries of every queue while running %d handlers", workers)
	}
	var held [3]int64
	for i, q := range cfg.Queues {
		held[i] = pendingOf(t, client, q, "doomed")
	}
	child.Kill()
	require.True(t, child.KilledBy(syscall.SIGKILL))
	killedAt := time.Now()
	// What the killed process started: its handlers' records.
	var killedStarts [3]map[string]string
	for i, q := range cfg.Queues {
		var err error
		killedStarts[i], err = client.HGetAll(ctx, multiStartsKey(q)).Result()
		require.NoError(t, err)
	}

	var mu sync.Mutex
	seen := [3]map[string][]int{{}, {}, {}} // deliveries seen by the survivor's handlers
	survivor := newCrashMulti(t, client, multiCrashConfig{Queues: cfg.Queues, Name: "survivor", Workers: workers, MinIdle: minIdle},
		testLogger(t), func(_ context.Context, q int, id string, deliveries int) error {
			mu.Lock()
			seen[q][id] = append(seen[q][id], deliveries)
			mu.Unlock()
			return nil
		})
	runMulti(t, survivor)

	deadline := waitCtx(t, minIdle+30*time.Second)
	for i, pr := range prsA {
		got, err := pr.Wait(deadline)
		require.NoError(t, err, "a %d", i)
		require.Equal(t, multiDone{Twice: 2 * i}, got)
	}
	for i, pr := range prsB {
		got, err := pr.Wait(deadline)
		require.NoError(t, err, "b %d", i)
		require.Equal(t, fmt.Sprint("r:x", i), got)
	}
	for i, pr := range prsC {
		got, err := pr.Wait(deadline)
		require.NoError(t, err, "c %d", i)
		require.Equal(t, i%7, got)
	}
	t.Logf("%d requests of 3 queues, the SIGKILLed MultiConsumer holding %v of them (its handlers started %d, %d, %d), completed %v after the kill",
		3*per, held, len(killedStarts[0]), len(killedStarts[1]), len(killedStarts[2]), time.Since(killedAt).Round(time.Millisecond))

	rerun, doneByKilled := 0, 0
	mu.Lock()
	defer mu.Unlock()
	for qi, q := range cfg.Queues {
		recorded, err := client.HGetAll(ctx, multiStartsKey(q)).Result()
		require.NoError(t, err)
		for _, id := range ids[qi] {
			n, err := strconv.Atoi(recorded[id])
			require.NoError(t, err, "queue %d: starts of %s", qi, id)
			_, killedStarted := killedStarts[qi][id]
			switch len(seen[qi][id]) {
			case 0:
				// Completed by the killed process: its one start.
				require.True(t, killedStarted, "queue %d: %s never ran", qi, id)
				require.Equal(t, 1, n, "queue %d: handler starts of %s", qi, id)
				doneByKilled++
			case 1:
				want := 1
				if killedStarted {
					want = 2
					rerun++
				}
				require.Equal(t, want, n, "queue %d: handler starts of %s", qi, id)
				require.Equal(t, n, seen[qi][id][0], "queue %d: %s: streamq's count of starts (Deliveries) is the handlers'", qi, id)
			default:
				t.Fatalf("queue %d: %s ran %d times in the survivor: %v", qi, id, len(seen[qi][id]), seen[qi][id])
			}
		}
		requireDrained(t, client, q)
	}
	t.Logf("slow=%v: %d requests completed by the killed process, %d started by it and run again by the survivor", slow, doneByKilled, rerun)
	if !slow {
		require.Zero(t, doneByKilled)
		require.Equal(t, workers, rerun, "the killed process's starts")
	} else {
		require.Positive(t, doneByKilled)
	}
}
