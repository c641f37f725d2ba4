package streamq

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/streamq/streamq/internal/keys"
)

// TestShardKeysDisjointFromQueueNames: a queue named like a shard's hash tag
// ("jobs/1.2" beside a 2-shard queue "jobs") must not share any key with that
// shard; both queues run side by side with the same request ids.
func TestShardKeysDisjointFromQueueNames(t *testing.T) {
	t.Parallel()
	client := realRedis(t)
	ctx := context.Background()
	sharded := queueName(t)
	shards, err := keys.Shards(sharded, 2)
	require.NoError(t, err)
	tag := func(k keys.Keys) string {
		return k.Stream[strings.Index(k.Stream, "{")+1 : strings.Index(k.Stream, "}")]
	}
	single := tag(shards[1]) // a valid queue name: today "<sharded>/1.<k>"
	require.NoError(t, keys.ValidateQueue(single))

	shardedAdmin, err := NewAdmin(client, sharded, nil)
	require.NoError(t, err)
	singleAdmin, err := NewAdmin(client, single, nil)
	require.NoError(t, err)

	// Ids that route to shard 1, produced to both queues.
	var ids []string
	for i := 0; len(ids) < 20; i++ {
		if id := fmt.Sprintf("job-%d", i); keys.ShardOf(id, 2) == 1 {
			ids = append(ids, id)
		}
	}
	type queue struct {
		name   string
		shards int
	}
	queues := []queue{{sharded, 2}, {single, 1}}
	for _, q := range queues {
		c, err := NewConsumer(client, q.name, func(ctx context.Context, m *Message[string]) (string, error) {
			return q.name + ":" + m.Payload, nil
		}, &ConsumerOptions{Shards: q.shards, ReadBlock: 50 * time.Millisecond, Logger: testLogger(t)})
		require.NoError(t, err)
		runConsumer(t, c)
	}
	for _, q := range queues {
		p, err := NewProducer[string, string](client, q.name, &ProducerOptions{Shards: q.shards, Logger: testLogger(t)})
		require.NoError(t, err)
		defer p.Close()
		for _, id := range ids {
			pr, err := p.Produce(ctx, id, id)
			require.NoError(t, err)
			wctx, cancel := context.WithTimeout(ctx, 20*time.Second)
			got, err := pr.Wait(wctx)
			cancel()
			require.NoError(t, err)
			require.Equal(t, q.name+":"+id, got, "queue %q, id %s: answered by the other queue", q.name, id)
		}
	}

	// No key or channel name in common.
	names := map[string]string{}
	for _, a := range []*Admin{shardedAdmin, singleAdmin} {
		ks, err := a.Keys(ctx)
		require.NoError(t, err)
		for _, k := range ks {
			for _, name := range []string{k.Stream, k.DeadLetter, k.Channel, k.RecordPattern} {
				if other, ok := names[name]; ok {
					t.Errorf("queue %q and queue %q both use %s", other, a.queue, name)
				}
				names[name] = a.queue
			}
		}
	}
}
