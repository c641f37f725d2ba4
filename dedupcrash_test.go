package streamq

import (
	"context"
	"os"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/streamq/streamq/internal/crashtest"
)

// throttleCrashWindow is the Throttle window of TestDedupModesThrottleSurvivesSIGKILL:
// long enough for both crashes and the rescue to happen inside it.
const throttleCrashWindow = 8 * time.Second

// helperProducer connects a crash test's producer process to addr.
func helperProducer(t *testing.T, addr, q string) (*redis.Client, *Producer[string, string]) {
	client := redis.NewClient(&redis.Options{Addr: addr})
	p, err := NewProducer[string, string](client, q, nil)
	if err != nil {
		t.Fatal(err)
	}
	return client, p
}

// producedKey is set by a crash test's producer process once its calls
// returned; the parent waits for it before the SIGKILL.
func producedKey(q string) string { return "crashtest:{" + q + "}:produced" }

// producedThenHold marks a producer process's calls done and stops the
// process until the parent's SIGKILL.
func producedThenHold(ctx context.Context, client *redis.Client, q string) {
	client.Set(ctx, producedKey(q), "1", 0)
	_ = syscall.Kill(os.Getpid(), syscall.SIGSTOP) // held until the parent's SIGKILL
	time.Sleep(time.Hour)
}

// TestDedupModesThrottleProducerHelperProcess is the producer process of
// TestDedupModesThrottleSurvivesSIGKILL: it produces "v1" for each id with
// Throttle, marks that it did, and waits to be killed.
func TestDedupModesThrottleProducerHelperProcess(t *testing.T) {
	var cfg modeProducerConfig
	if !crashtest.Config(&cfg) {
		return
	}
	client, p := helperProducer(t, cfg.Addr, cfg.Queue)
	ctx := context.Background()
	for _, id := range cfg.IDs {
		if _, err := p.Produce(ctx, id, "v1", Throttle(throttleCrashWindow)); err != nil {
			t.Fatal(err)
		}
	}
	producedThenHold(ctx, client, cfg.Queue)
}

// TestDedupModesThrottleSurvivesSIGKILL: a producer process opens a
// Throttle window for 20 ids and is SIGKILLed; a consumer process starts
// every run and is SIGKILLed with the handlers running, inside the window.
// Counted per id, nothing is lost and no run is added beyond the rule: the
// calls inside the window attach to the crashed run ("v2" not used), a new
// consumer runs it once more with "v1" (the at-least-once rerun after a
// consumer crash), every caller gets that outcome, and a call after that,
// still inside the window, gets the stored outcome without a run ("v3").
func TestDedupModesThrottleSurvivesSIGKILL(t *testing.T) {
	t.Parallel()
	client := realRedis(t)
	ctx := context.Background()
	q := queueName(t)
	ids := seqIDs("thr", 20)
	prod := crashtest.Start(t, "TestDedupModesThrottleProducerHelperProcess", modeProducerConfig{Addr: sharedAddr(t), Queue: q, IDs: ids})
	cons := crashtest.Start(t, "TestCrashHelperProcess", crashConfig{
		Addr: sharedAddr(t), Queue: q, Mode: "block", Name: "doomed", Workers: len(ids), Prefetch: len(ids), MinIdle: 500 * time.Millisecond,
	})
	opened := time.Now()
	eventually(t, 20*time.Second, func() bool { return client.Exists(ctx, producedKey(q)).Val() == 1 }, "the producer's calls")
	prod.Kill()
	require.True(t, prod.KilledBy(syscall.SIGKILL))
	eventually(t, 20*time.Second, func() bool { return client.SCard(ctx, startedKey(q)).Val() == int64(len(ids)) }, "every id started")
	cons.Kill()
	require.True(t, cons.KilledBy(syscall.SIGKILL))

	p := newStringProducer(t, client, q)
	var prs []*Promise[string]
	for _, id := range ids {
		pr := mustProduce(t, p, id, "v2", Throttle(throttleCrashWindow))
		require.Equal(t, DedupInflight, pr.Deduplicated(), "%s: inside the window, attached to the crashed run", id)
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
		require.Equal(t, "ran:v1", got, ids[i])
	}
	require.Less(t, time.Since(opened), throttleCrashWindow-time.Second, "the test ran inside the window")
	for _, id := range ids {
		pr := mustProduce(t, p, id, "v3", Throttle(throttleCrashWindow))
		require.Equal(t, DedupStored, pr.Deduplicated(), "%s: inside the window, the stored outcome", id)
		got, err := pr.Wait(waitCtx(t, 5*time.Second))
		require.NoError(t, err)
		require.Equal(t, "ran:v1", got)
	}
	mu.Lock()
	defer mu.Unlock()
	for _, id := range ids {
		require.Equal(t, []string{"v1"}, runs[id], "%s: one rerun after the consumer crash, nothing more", id)
	}
}
