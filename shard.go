package streamq

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/streamq/streamq/internal/keys"
)

// ErrShardMismatch is returned when a producer, consumer or admin is configured
// with a shard count other than the one the queue was created with. Changing
// the shard count of a live queue would route ids to other shards and break
// deduplication, so it is refused: drain the queue and use a new queue name.
var ErrShardMismatch = errors.New("streamq: shard count differs from the queue's")

// checkShards records the queue's shard count on first use and verifies it on
// later uses; before that it checks the server (checkServer, warnings to log).
// ok caches a successful check. It reads before it writes: under maxmemory,
// Redis refuses SETNX even when the key exists, and a consumer could not start.
func checkShards(ctx context.Context, client redis.UniversalClient, queue string, n int, ok *atomic.Bool, log *slog.Logger) error {
	if ok.Load() {
		return nil
	}
	if err := checkServer(ctx, client, log); err != nil {
		return err
	}
	key := keys.Meta(queue)
	got, err := client.Get(ctx, key).Result()
	if errors.Is(err, redis.Nil) {
		var set bool
		set, err = client.SetNX(ctx, key, n, 0).Result()
		if err != nil {
			return fmt.Errorf("streamq: record the shard count of %s: %w", queue, err)
		}
		got = strconv.Itoa(n)
		if !set {
			got, err = client.Get(ctx, key).Result()
		}
	}
	if err != nil {
		return fmt.Errorf("streamq: read the shard count of %s: %w", queue, err)
	}
	if got != strconv.Itoa(n) {
		return fmt.Errorf("%w: queue %q has %s shards, this one is configured with %d", ErrShardMismatch, queue, got, n)
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

// slotRefresher asks a cluster client to reload its slot map after a
// connection error. go-redis reloads it on MOVED, but a master that died sends
// no MOVED: without a reload its slots keep going to the dead address until
// the periodic refresh (ClusterOptions.ClusterStateReloadInterval, 60s by
// default), long after a replica took over. The zero value does nothing.
type slotRefresher struct {
	cluster *redis.ClusterClient
	last    atomic.Int64 // unix nanoseconds of the last reload asked for
}

func newSlotRefresher(client redis.UniversalClient) *slotRefresher {
	cc, _ := client.(*redis.ClusterClient)
	return &slotRefresher{cluster: cc}
}

// onError reloads the slot map, at most twice a second, when err is not a
// reply from Redis (a refused or broken connection, a timeout).
func (s *slotRefresher) onError(err error) {
	if s == nil || s.cluster == nil || err == nil {
		return
	}
	var reply redis.Error
	if errors.As(err, &reply) || errors.Is(err, context.Canceled) {
		return
	}
	now := time.Now().UnixNano()
	last := s.last.Load()
	if now-last < int64(500*time.Millisecond) || !s.last.CompareAndSwap(last, now) {
		return
	}
	s.cluster.ReloadState(context.Background())
}

// isCluster reports whether client talks to a Redis Cluster, where completion
// notices use sharded pub/sub (SPUBLISH/SSUBSCRIBE) so they stay on one node.
func isCluster(client redis.UniversalClient) bool {
	_, ok := client.(*redis.ClusterClient)
	return ok
}
