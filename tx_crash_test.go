package streamq

// The exactly-once crash test of staged writes: consumers SIGKILLed while
// handlers run, and Redis killed and restarted (appendfsync always) once.

import (
	"context"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"os"
	"os/signal"
	"strconv"
	"syscall"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/streamq/streamq/internal/crashtest"
	"github.com/streamq/streamq/internal/keys"
	"github.com/streamq/streamq/internal/redistest"
)

// txCrashConfig is what a child consumer of TestTxExactlyOnceUnderCrashes does.
type txCrashConfig struct {
	Addr, Queue, Name string
}

// txRunsKey counts handler starts (written directly, not staged: every
// start counts, including those a crash cut short).
func txRunsKey(q string) string { return "crashtest:{" + q + "}:txruns" }

// TestTxCrashHelperProcess is the consumer process of
// TestTxExactlyOnceUnderCrashes; run by go test it returns at once.
func TestTxCrashHelperProcess(t *testing.T) {
	var cfg txCrashConfig
	if !crashtest.Config(&cfg) {
		return
	}
	client := redis.NewClient(&redis.Options{Addr: cfg.Addr, PoolSize: 32})
	defer client.Close()
	handler := func(ctx context.Context, m *Message[int]) (string, error) {
		if err := client.Incr(ctx, txRunsKey(cfg.Queue)).Err(); err != nil {
			return "", err
		}
		tx := m.Tx()
		if err := tx.IncrBy(tx.Key("total"), int64(m.Payload)); err != nil {
			return "", Permanent(err)
		}
		if err := tx.SAdd(tx.Key("done"), m.ID); err != nil {
			return "", Permanent(err)
		}
		// Long enough that kills land inside handlers, between staging and
		// the outcome.
		time.Sleep(time.Duration(5+rand.IntN(20)) * time.Millisecond)
		return "ok", nil
	}
	c, err := NewConsumer(client, cfg.Queue, handler, &ConsumerOptions{
		Name: cfg.Name, Workers: 8, Prefetch: 32, MinIdle: 600 * time.Millisecond,
		ClaimInterval: 100 * time.Millisecond, ReadBlock: 100 * time.Millisecond,
		MaxDeliveries: 1000, RetryBackoff: 20 * time.Millisecond, TrimInterval: -1,
		Logger: slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn})),
	})
	if err != nil {
		t.Fatal(err)
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM)
	defer stop()
	_ = c.Run(ctx)
}

// TestTxExactlyOnceUnderCrashes: 10,000 jobs, each staging INCRBY total
// <amount> and SADD done <id>, run by three consumer processes that are
// SIGKILLed at random (a new one started for each), while Redis is killed
// and restarted once (appendonly, appendfsync always). At the end total is
// the sum of the amounts exactly and done holds every id, though handlers
// ran more than 10,000 times.
func TestTxExactlyOnceUnderCrashes(t *testing.T) {
	if testing.Short() {
		t.Skip("takes about 20 s")
	}
	t.Parallel()
	srv := redistest.Start(t, redistest.WithAppendOnly("always"))
	client := redis.NewClient(&redis.Options{Addr: srv.Addr(), PoolSize: 16})
	t.Cleanup(func() { _ = client.Close() })
	ctx := context.Background()
	q := queueName(t)
	k, err := keys.New(q)
	require.NoError(t, err)
	const jobs = 10_000

	p, err := NewProducer[int, string](client, q, &ProducerOptions{Logger: testLogger(t)})
	require.NoError(t, err)
	t.Cleanup(func() { _ = p.Close() })
	sum := 0
	batch := make([]Job[int], 0, 500)
	for i := range jobs {
		amount := 1 + (i*7919)%1000
		sum += amount
		batch = append(batch, Job[int]{ID: "job-" + strconv.Itoa(i), Request: amount})
		if len(batch) == cap(batch) {
			_, err := p.ProduceBatch(ctx, batch)
			require.NoError(t, err)
			batch = batch[:0]
		}
	}

	seq := 0
	start := func() *crashtest.Proc {
		seq++
		return crashtest.Start(t, "TestTxCrashHelperProcess", txCrashConfig{Addr: srv.Addr(), Queue: q, Name: fmt.Sprint("c", seq)})
	}
	procs := []*crashtest.Proc{start(), start(), start()}
	doneCount := func() int64 {
		n, _ := client.SCard(ctx, k.TxKey("done")).Result() // errors while Redis restarts
		return n
	}
	restarted, kills := false, 0
	deadline := time.Now().Add(40 * time.Second)
	for doneCount() < jobs*9/10 {
		require.True(t, time.Now().Before(deadline), "only %d of %d done", doneCount(), jobs)
		time.Sleep(time.Duration(300+rand.IntN(400)) * time.Millisecond)
		i := rand.IntN(len(procs))
		procs[i].Kill()
		kills++
		procs[i] = start()
		if !restarted && doneCount() > jobs/3 {
			srv.Kill()
			srv.Restart(t)
			restarted = true
		}
	}
	require.True(t, restarted, "Redis was not restarted")
	eventually(t, time.Until(deadline)+5*time.Second, func() bool {
		return doneCount() == jobs && client.XLen(ctx, k.Stream).Val() == 0
	}, "done: %d of %d", doneCount(), jobs)

	require.Equal(t, strconv.Itoa(sum), client.Get(ctx, k.TxKey("total")).Val(), "total")
	require.EqualValues(t, jobs, client.SCard(ctx, k.TxKey("done")).Val())
	runs, err := client.Get(ctx, txRunsKey(q)).Int()
	require.NoError(t, err)
	t.Logf("%d kills, %d handler runs for %d jobs", kills, runs, jobs)
	require.Greater(t, runs, jobs, "no handler ran twice: the kills hit no handler")
	requireDrained(t, client, q)
	for _, pr := range procs {
		pr.Kill()
	}
}
