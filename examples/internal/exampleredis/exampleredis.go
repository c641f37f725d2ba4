// Package exampleredis connects the example programs to Redis: the server
// named by REDIS_URL, or an embedded miniredis when it is not set.
package exampleredis

import (
	"context"
	"fmt"
	"os"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"
)

// Connect returns a client of REDIS_URL's server, or of an embedded miniredis.
func Connect() (client *redis.Client, where string, cleanup func(), err error) {
	if url := os.Getenv("REDIS_URL"); url != "" {
		opts, err := redis.ParseURL(url)
		if err != nil {
			return nil, "", nil, fmt.Errorf("REDIS_URL: %w", err)
		}
		client = redis.NewClient(opts)
		ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
		defer cancel()
		if err := client.Ping(ctx).Err(); err != nil {
			_ = client.Close()
			return nil, "", nil, fmt.Errorf("REDIS_URL %s: %w", url, err)
		}
		return client, opts.Addr, func() { _ = client.Close() }, nil
	}
	srv := miniredis.NewMiniRedis()
	if err := srv.Start(); err != nil {
		return nil, "", nil, fmt.Errorf("start embedded Redis: %w", err)
	}
	client = redis.NewClient(&redis.Options{Addr: srv.Addr()})
	return client, "embedded miniredis at " + srv.Addr(), func() { _ = client.Close(); srv.Close() }, nil
}

// DeleteQueue removes the keys of a run's queue, so a shared server is left
// as it was. The queue name is unique to the run, so every key that contains
// it is the run's own.
func DeleteQueue(ctx context.Context, client *redis.Client, queue string) error {
	iter := client.Scan(ctx, 0, "*"+queue+"*", 500).Iterator()
	for iter.Next(ctx) {
		// One DEL per key: under Redis Cluster a multi-key DEL must stay in one slot.
		if err := client.Del(ctx, iter.Val()).Err(); err != nil {
			return err
		}
	}
	return iter.Err()
}
