package streamq

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/streamq/streamq/internal/redistest"
	"github.com/streamq/streamq/internal/scripts"
)

// completeArgs builds a complete.lua call for n successful items of queue q.
func completeArgs(q string, n int) ([]string, []any) {
	stream, dead := "streamq:{"+q+"}:stream", "streamq:{"+q+"}:dead"
	keys := []string{stream, dead, "streamq:{" + q + "}:fanout"}
	args := []any{DefaultGroup, "streamq:{" + q + "}:done", 60000, "1", 100, "me", 1, "PUBLISH", "0"}
	for i := range n {
		id := fmt.Sprintf("r%d", i)
		keys = append(keys, "streamq:{"+q+"}:id:"+id)
		args = append(args, fmt.Sprintf("1-%d", i+1), id, "R", "x", "", 1)
	}
	keys = append(keys, "streamq:{"+q+"}:starts:"+DefaultGroup) // last: the start counts
	return keys, args
}

// Lua's unpack() stops at a few thousand values; completion batches of any
// size must still go through.
func TestCompletionOfAHugeBatch(t *testing.T) {
	c := realRedis(t)
	ctx := context.Background()
	q := queueName(t)
	require.NoError(t, c.XGroupCreateMkStream(ctx, "streamq:{"+q+"}:stream", DefaultGroup, "0").Err())
	keys, args := completeArgs(q, 9000)
	require.NoError(t, scripts.Complete.Run(ctx, c, keys, args...).Err())
	require.Equal(t, "Rx", c.Get(ctx, "streamq:{"+q+"}:id:r8999").Val())
}

// A stream that vanished (Redis restarted without persistence) must not make
// completion fail forever after it wrote the records.
func TestCompletionWhenTheStreamIsGone(t *testing.T) {
	c := realRedis(t)
	ctx := context.Background()
	q := queueName(t)
	keys, args := completeArgs(q, 1)
	require.NoError(t, scripts.Complete.Run(ctx, c, keys, args...).Err())
	require.Equal(t, "Rx", c.Get(ctx, "streamq:{"+q+"}:id:r0").Val())
}

// A start charged after the group is gone (a Redis restarted without
// persistence) reads as gone instead of failing the committer's tick.
func TestChargeWhenTheGroupIsGone(t *testing.T) {
	c := realRedis(t)
	ctx := context.Background()
	q := queueName(t)
	res, err := scripts.Charge.Run(ctx, c, []string{"streamq:{" + q + "}:stream", "streamq:{" + q + "}:starts:g"},
		"g", "me", 60000, "1-9", 0).Int64Slice()
	require.NoError(t, err)
	require.Equal(t, []int64{-2}, res)
}

// A request as large as every limit allows must be sendable, or rejected at
// once, never left waiting for a budget it can never get.
func TestItemLargerThanTheBudgetIsRejected(t *testing.T) {
	c, _ := miniRedis(t)
	p, err := NewProducer[[]byte, []byte](c, queueName(t), &ProducerOptions{
		MaxPayloadBytes: 100, MaxBatchBytes: 100, MaxPendingBytes: 100, Logger: testLogger(t)})
	require.NoError(t, err)
	defer p.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	err = p.Enqueue(ctx, "x", make([]byte, 100))
	require.ErrorIs(t, err, ErrPayloadTooLarge)
	require.Contains(t, err.Error(), "with its id")
	require.NoError(t, p.Enqueue(ctx, "x", make([]byte, 99)))
}

// The shard suffix must not make a valid queue name too long.
func TestLongQueueNameWithShards(t *testing.T) {
	c, _ := miniRedis(t)
	_, err := NewProducer[string, string](c, strings.Repeat("q", 128), &ProducerOptions{Shards: 4})
	require.NoError(t, err)
}

// A consumer restarted under its name resumes its pending entries; its first
// claim pass must not take the same entries again and run them twice.
func TestResumedEntriesAreNotClaimedAgainBySelf(t *testing.T) {
	c := realRedis(t)
	ctx := context.Background()
	q := queueName(t)
	stream := "streamq:{" + q + "}:stream"
	p, err := NewProducer[string, string](c, q, &ProducerOptions{Logger: testLogger(t)})
	require.NoError(t, err)
	const n = 60
	for i := range n {
		require.NoError(t, p.Enqueue(ctx, fmt.Sprint("id", i), "v"))
	}
	require.NoError(t, p.Close())
	require.NoError(t, c.XGroupCreateMkStream(ctx, stream, DefaultGroup, "0").Err())
	// An earlier process named "stable" read them and died, longer than MinIdle ago.
	msgs, err := c.XReadGroup(ctx, &redis.XReadGroupArgs{Group: DefaultGroup, Consumer: "stable",
		Streams: []string{stream, ">"}, Count: n}).Result()
	require.NoError(t, err)
	ids := make([]string, 0, n)
	for _, m := range msgs[0].Messages {
		ids = append(ids, m.ID)
	}
	require.NoError(t, c.Do(ctx, append([]any{"XCLAIM", stream, DefaultGroup, "stable", 0},
		append(toAny(ids), "IDLE", 5000, "JUSTID")...)...).Err())

	var mu sync.Mutex
	runs := map[string]int{}
	cons, err := NewConsumer(c, q, func(ctx context.Context, m *Message[string]) (string, error) {
		mu.Lock()
		runs[m.ID]++
		mu.Unlock()
		time.Sleep(time.Duration(len(m.EntryID)%7) * 10 * time.Millisecond) // uneven handlers
		return "ok", nil
	}, &ConsumerOptions{Name: "stable", Workers: 10, MinIdle: time.Second, ClaimInterval: 10 * time.Millisecond,
		ReadBlock: 50 * time.Millisecond, Logger: testLogger(t)})
	require.NoError(t, err)
	runConsumer(t, cons)
	eventually(t, 30*time.Second, func() bool {
		sum, err := c.XPending(ctx, stream, DefaultGroup).Result()
		return err == nil && sum.Count == 0
	}, "pending entries left")
	mu.Lock()
	defer mu.Unlock()
	require.Len(t, runs, n)
	for id, k := range runs {
		require.Equal(t, 1, k, "id %s ran %d times", id, k)
	}
}

func toAny(ss []string) []any {
	out := make([]any, len(ss))
	for i, s := range ss {
		out[i] = s
	}
	return out
}

// With Redis unreachable at shutdown, Run must still return, in about twice
// ShutdownTimeout; the unrecorded outcomes stay pending.
func TestShutdownReturnsWhileRedisIsDown(t *testing.T) {
	srv := redistest.Start(t)
	c := redis.NewClient(&redis.Options{Addr: srv.Addr(), MaxRetries: -1, DialTimeout: 100 * time.Millisecond})
	defer c.Close()
	q := queueName(t)
	gate := make(chan struct{})
	started := make(chan struct{}, 100)
	cons, err := NewConsumer(c, q, func(ctx context.Context, m *Message[string]) (string, error) {
		started <- struct{}{}
		<-gate
		return "ok", nil
	}, &ConsumerOptions{Workers: 1, Prefetch: 16, MaxCompleteBatch: 1, ShutdownTimeout: 200 * time.Millisecond,
		ReadBlock: 50 * time.Millisecond, Logger: testLogger(t)})
	require.NoError(t, err)
	p, err := NewProducer[string, string](c, q, &ProducerOptions{Logger: testLogger(t)})
	require.NoError(t, err)
	for i := range 10 {
		require.NoError(t, p.Enqueue(context.Background(), fmt.Sprint(i), "v"))
	}
	require.NoError(t, p.Close())
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- cons.Run(ctx) }()
	<-started
	srv.Kill()
	close(gate)
	cancel()
	select {
	case err := <-done:
		require.NoError(t, err)
	case <-time.After(10 * time.Second):
		t.Fatal("Run did not return 10s after cancel with ShutdownTimeout=200ms while Redis is down")
	}
}
