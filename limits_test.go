package streamq

import (
	"context"
	"fmt"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"
)

// commandDone is a go-redis hook that closes done once a command called name
// has returned.
type commandDone struct {
	name string
	once sync.Once
	done chan struct{}
}

func (h *commandDone) DialHook(next redis.DialHook) redis.DialHook { return next }

func (h *commandDone) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		err := next(ctx, cmd)
		if strings.EqualFold(cmd.Name(), h.name) {
			h.once.Do(func() { close(h.done) })
		}
		return err
	}
}

func (h *commandDone) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}

// A deep ring costs memory only as it fills: Run with the largest Prefetch on
// an empty queue allocates little. (The ring used to be a channel of Prefetch
// places, allocated at Run: 76 MiB for Prefetch 10,000,000.)
//
// Not parallel: it measures the process's allocations, so it runs while no
// other test of the package does.
func TestRunWithHugePrefetchOnEmptyQueueAllocatesLittle(t *testing.T) {
	client := sameServer(realRedis(t))
	defer client.Close()
	read := &commandDone{name: "xreadgroup", done: make(chan struct{})}
	client.AddHook(read)
	q := queueName(t)
	const prefetch = 1_000_000 // MaxPrefetch
	c, err := NewConsumer(client, q, func(ctx context.Context, m *Message[string]) (string, error) {
		return "ok", nil
	}, &ConsumerOptions{Prefetch: prefetch, Workers: 4, ReadBlock: 20 * time.Millisecond, Logger: testLogger(t)})
	require.NoError(t, err)

	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	stop := runConsumer(t, c)
	// By the end of its first read of new entries, Run has set up everything
	// it sets up before any work.
	select {
	case <-read.done:
	case <-time.After(10 * time.Second):
		t.Fatal("the consumer did not read within 10s")
	}
	runtime.ReadMemStats(&after)
	stop()
	allocated := after.TotalAlloc - before.TotalAlloc
	t.Logf("Run with Prefetch %d on an empty queue allocated %d KiB", prefetch, allocated>>10)
	// A ring allocated up front costs 8 bytes a place (7.6 MiB here); the
	// threshold leaves room for the client, the goroutines and the test.
	const limit = 2 << 20
	require.Less(t, allocated, uint64(limit), "Run allocated %d KiB before any work", allocated>>10)
}

// Options whose cost is paid before any work have upper bounds, refused at
// construction with an error that names the option, its bound and why.
func TestConsumerOptionUpperBounds(t *testing.T) {
	client, _ := miniRedis(t)
	h := func(ctx context.Context, m *Message[string]) (string, error) { return "", nil }
	for _, tc := range []struct {
		opts ConsumerOptions
		msg  string
	}{
		{ConsumerOptions{Prefetch: 1_000_001}, "Prefetch is 1000001; it must be at most 1000000"},
		{ConsumerOptions{Prefetch: 10_000_000}, "Prefetch is 10000000; it must be at most 1000000"},
		{ConsumerOptions{Workers: 10_001, Prefetch: 20_000}, "Workers is 10001; it must be at most 10000"},
		{ConsumerOptions{Workers: 100_000}, "Workers is 100000; it must be at most 10000"},
		{ConsumerOptions{MaxCompleteBatch: 10_001}, "MaxCompleteBatch is 10001; it must be at most 10000"},
	} {
		_, err := NewConsumer(client, queueName(t), h, &tc.opts)
		require.ErrorIs(t, err, ErrInvalidOptions, "%+v", tc.opts)
		require.ErrorContains(t, err, tc.msg)
		t.Log(err)
	}
	// The bounds themselves are accepted.
	for _, o := range []ConsumerOptions{
		{Prefetch: 1_000_000},
		{Workers: 10_000},
		{MaxCompleteBatch: 10_000},
	} {
		_, err := NewConsumer(client, queueName(t), h, &o)
		require.NoError(t, err, fmt.Sprintf("%+v", o))
	}
}
