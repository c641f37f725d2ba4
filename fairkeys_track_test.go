package streamq

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"
)

// TestFairKeysLimitSetWhileRunning: without a limit a shard keeps no count
// of slots per key (keys:running), yet KeyStats counts a key's running jobs
// exactly; a limit set while jobs of the key run counts them at once, so
// the key's next jobs wait until fewer than the limit run; and once the
// limit is removed the count goes and nothing of the key is left.
func TestFairKeysLimitSetWhileRunning(t *testing.T) {
	backends(t, func(t *testing.T, client *redis.Client) {
		ctx := context.Background()
		q := queueName(t)
		running := "streamq:{" + q + "}:keys:running"
		p := newStringProducer(t, client, q)
		a, err := NewAdmin(client, q, nil)
		require.NoError(t, err)
		release := make(chan struct{})
		var cur, worst, lateDone atomic.Int64
		opts := fastOpts(t, "track", 5*time.Second)
		opts.Workers = 8
		c, err := NewConsumer(client, q, func(ctx context.Context, m *Message[string]) (string, error) {
			n := cur.Add(1)
			defer cur.Add(-1)
			if strings.HasPrefix(m.ID, "early") {
				<-release
				return "", nil
			}
			for {
				old := worst.Load()
				if n <= old || worst.CompareAndSwap(old, n) {
					break
				}
			}
			time.Sleep(20 * time.Millisecond)
			lateDone.Add(1)
			return "", nil
		}, opts)
		require.NoError(t, err)
		runConsumer(t, c)
		unblock := sync.OnceFunc(func() { close(release) })
		t.Cleanup(unblock) // before the consumer stops, should an assertion fail
		for i := range 4 {
			mustProduce(t, p, fmt.Sprint("early", i), "x", Key("k")).Release()
		}
		eventually(t, 10*time.Second, func() bool { return cur.Load() == 4 }, "the key's first jobs did not start")
		require.Zero(t, client.Exists(ctx, running).Val(), "no limit: no count of slots per key")
		st, err := a.KeyStats(ctx, "k")
		require.NoError(t, err)
		require.Equal(t, KeyStat{Key: "k", Running: 4, Weight: 1}, st, "a key's slots are counted without keys:running")

		require.NoError(t, a.SetKeyLimit(ctx, "k", 2))
		require.Equal(t, "4", client.HGet(ctx, running, "k").Val(), "a limit counts the slots already held")
		for i := range 4 {
			mustProduce(t, p, fmt.Sprint("late", i), "x", Key("k")).Release()
		}
		st, err = a.KeyStats(ctx, "k")
		require.NoError(t, err)
		require.Equal(t, KeyStat{Key: "k", Waiting: 4, Running: 4, Limit: 2, Weight: 1}, st, "over its limit, the key's new jobs wait")
		unblock()
		eventually(t, 10*time.Second, func() bool { return lateDone.Load() == 4 }, "the key's later jobs did not run")
		require.LessOrEqual(t, worst.Load(), int64(2), "a later job started while 2 or more of the key ran")

		require.NoError(t, a.SetKeyLimit(ctx, "k", 0))
		eventually(t, 10*time.Second, func() bool { return len(fairKeysLeft(t, client, q)) == 0 }, "keyed state left after the limit went")
	})
}
