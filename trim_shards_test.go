package streamq

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/streamq/streamq/internal/keys"
	"github.com/streamq/streamq/internal/scripts"
)

// scriptFault fails every call of one of scripts whose first key is stream,
// before it is sent, as a failing cluster node would.
type scriptFault struct {
	stream  string
	scripts []*redis.Script
}

func (h *scriptFault) DialHook(next redis.DialHook) redis.DialHook { return next }

func (h *scriptFault) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}

func (h *scriptFault) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if isScriptOn(cmd.Args(), h.stream, h.scripts...) {
			err := errors.New("injected: the shard's node fails")
			cmd.SetErr(err)
			return err
		}
		return next(ctx, cmd)
	}
}

// TestFailingShardStopsNoOtherShardsMaintenance: while shard 0's trim and
// prune calls fail, shard 1 is still trimmed and its idle consumers pruned,
// and the error names shard 0's stream. (Both stopped at the first shard
// that failed, so one failing shard let every other shard's stream grow.)
// Real redis-server: a consumer's idle time advances with the clock there.
func TestFailingShardStopsNoOtherShardsMaintenance(t *testing.T) {
	t.Parallel()
	base := realRedis(t)
	ctx := context.Background()
	q := queueName(t)
	ks, err := keys.Shards(q, 2)
	require.NoError(t, err)
	client := sameServer(base)
	t.Cleanup(func() { _ = client.Close() })
	client.AddHook(&scriptFault{stream: ks[0].Stream, scripts: []*redis.Script{scripts.Trim, scripts.Prune}})
	c, err := NewConsumer(client, q, func(ctx context.Context, m *Message[string]) (string, error) {
		return "", nil
	}, &ConsumerOptions{Name: "me", Shards: 2, TrimInterval: -1, ConsumerIdleTimeout: time.Second,
		Logger: testLogger(t)})
	require.NoError(t, err)

	// Each shard: a group that read and acknowledged 50 entries (so the
	// trim may remove them), and an idle consumer with nothing pending.
	const n = 50
	for _, k := range ks {
		require.NoError(t, base.XGroupCreateMkStream(ctx, k.Stream, DefaultGroup, "0").Err())
		for i := range n {
			require.NoError(t, base.XAdd(ctx, &redis.XAddArgs{Stream: k.Stream, Values: []any{"i", i}}).Err())
		}
		got, err := base.XReadGroup(ctx, &redis.XReadGroupArgs{Group: DefaultGroup, Consumer: "gone",
			Streams: []string{k.Stream, ">"}, Count: n, Block: -1}).Result()
		require.NoError(t, err)
		for _, m := range got[0].Messages {
			require.NoError(t, base.XAck(ctx, k.Stream, DefaultGroup, m.ID).Err())
		}
	}
	eventually(t, 5*time.Second, func() bool {
		cs, err := base.XInfoConsumers(ctx, ks[1].Stream, DefaultGroup).Result()
		return err == nil && len(cs) == 1 && cs[0].Idle >= 1100*time.Millisecond
	}, "the consumer idle past ConsumerIdleTimeout")

	removed, err := c.Trim(ctx)
	require.Positive(t, removed, "shard 1 was not trimmed while shard 0 failed")
	require.Less(t, base.XLen(ctx, ks[1].Stream).Val(), int64(n), "shard 1's stream")
	require.EqualValues(t, n, base.XLen(ctx, ks[0].Stream).Val(), "shard 0's stream")
	require.Error(t, err)
	require.Contains(t, err.Error(), ks[0].Stream, "the error names the failing shard")

	deleted, err := c.PruneConsumers(ctx)
	require.Equal(t, []string{"gone"}, deleted, "shard 1's idle consumer was not pruned while shard 0 failed")
	require.Error(t, err)
	require.Contains(t, err.Error(), ks[0].Stream, "the error names the failing shard")
	cs, err := base.XInfoConsumers(ctx, ks[1].Stream, DefaultGroup).Result()
	require.NoError(t, err)
	require.Empty(t, cs, fmt.Sprintf("shard 1's consumers: %+v", cs))
}
