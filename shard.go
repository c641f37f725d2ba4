package streamq

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"sync/atomic"

	"github.com/redis/go-redis/v9"

	"github.com/streamq/streamq/internal/keys"
)

// ErrShardMismatch is returned when a producer, consumer or admin is configured
// with a shard count other than the one the queue was created with. Changing
// the shard count of a live queue would route ids to other shards and break
// deduplication, so it is refused: drain the queue and use a new queue name.
var ErrShardMismatch = errors.New("streamq: shard count differs from the queue's")

// checkShards records the queue's shard count on first use and verifies it on
// later uses. ok caches a successful check.
func checkShards(ctx context.Context, client redis.UniversalClient, queue string, n int, ok *atomic.Bool) error {
	if ok.Load() {
		return nil
	}
	key := keys.Meta(queue)
	set, err := client.SetNX(ctx, key, n, 0).Result()
	if err != nil {
		return fmt.Errorf("streamq: record the shard count of %s: %w", queue, err)
	}
	if !set {
		got, err := client.Get(ctx, key).Result()
		if err != nil {
			return fmt.Errorf("streamq: read the shard count of %s: %w", queue, err)
		}
		if got != strconv.Itoa(n) {
			return fmt.Errorf("%w: queue %q has %s shards, this one is configured with %d", ErrShardMismatch, queue, got, n)
		}
	}
	ok.Store(true)
	return nil
}

// queueShards reads the shard count recorded for queue; 1 when none is.
func queueShards(ctx context.Context, client redis.UniversalClient, queue string) (int, error) {
	got, err := client.Get(ctx, keys.Meta(queue)).Result()
	if errors.Is(err, redis.Nil) {
		return 1, nil
	}
	if err != nil {
		return 0, fmt.Errorf("streamq: read the shard count of %s: %w", queue, err)
	}
	n, err := strconv.Atoi(got)
	if err != nil || n < 1 {
		return 0, fmt.Errorf("%w: %s holds %q, not a shard count", ErrWrongType, keys.Meta(queue), got)
	}
	return n, nil
}

// isCluster reports whether client talks to a Redis Cluster, where completion
// notices use sharded pub/sub (SPUBLISH/SSUBSCRIBE) so they stay on one node.
func isCluster(client redis.UniversalClient) bool {
	_, ok := client.(*redis.ClusterClient)
	return ok
}
