package streamq

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/streamq/streamq/internal/keys"
)

func TestShardedQueue(t *testing.T) {
	backends(t, func(t *testing.T, client *redis.Client) {
		ctx := context.Background()
		q := queueName(t)
		const shards, ids = 6, 600
		var mu sync.Mutex
		runs := map[string]int{}
		c, err := NewConsumer(client, q, func(ctx context.Context, m *Message[int]) (int, error) {
			mu.Lock()
			runs[m.ID]++
			mu.Unlock()
			return m.Payload * 2, nil
		}, &ConsumerOptions{Shards: shards, Workers: 4, ReadBlock: 50 * time.Millisecond, Logger: testLogger(t)})
		require.NoError(t, err)
		runConsumer(t, c)

		var wg sync.WaitGroup
		errs := make(chan error, 2*ids)
		for range 2 { // two producers submitting the same ids
			p, err := NewProducer[int, int](client, q, &ProducerOptions{Shards: shards, Logger: testLogger(t)})
			require.NoError(t, err)
			defer p.Close()
			for i := range ids {
				wg.Add(1)
				go func() {
					defer wg.Done()
					pr, err := p.Produce(ctx, fmt.Sprintf("id-%d", i), i)
					if err == nil {
						var got int
						wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
						got, err = pr.Wait(wctx)
						cancel()
						if err == nil && got != 2*i {
							err = fmt.Errorf("id-%d: got %d", i, got)
						}
					}
					if err != nil {
						errs <- err
					}
				}()
			}
		}
		wg.Wait()
		close(errs)
		for err := range errs {
			require.NoError(t, err)
		}
		mu.Lock()
		require.Len(t, runs, ids)
		for id, n := range runs {
			require.Equal(t, 1, n, id)
		}
		mu.Unlock()

		admin, err := NewAdmin(client, q, nil)
		require.NoError(t, err)
		names, err := admin.Keys(ctx)
		require.NoError(t, err)
		require.Len(t, names, shards)
		used := 0
		for _, k := range names {
			if client.Exists(ctx, k.Stream).Val() == 1 {
				used++
			}
		}
		require.Equal(t, shards, used, "ids spread over every shard")
		eventually(t, 10*time.Second, func() bool {
			s, err := admin.Stats(ctx)
			return err == nil && s.Length == 0 && len(s.Groups) == 1 && s.Groups[0].Pending == 0
		}, "every shard drained")

		// Another shard count for the same queue is refused.
		p, err := NewProducer[int, int](client, q, &ProducerOptions{Shards: 3, Logger: testLogger(t)})
		require.NoError(t, err)
		defer p.Close()
		_, err = p.Produce(ctx, "x", 1)
		require.ErrorIs(t, err, ErrShardMismatch)
		require.ErrorIs(t, p.Enqueue(ctx, "x", 1), ErrShardMismatch)
		other, err := NewConsumer(client, q, func(context.Context, *Message[int]) (int, error) { return 0, nil },
			&ConsumerOptions{Logger: testLogger(t)})
		require.NoError(t, err)
		require.ErrorIs(t, other.Run(ctx), ErrShardMismatch)
	})
}

func TestShardedDeadLettersAndRequeue(t *testing.T) {
	client := realRedis(t)
	ctx := context.Background()
	q := queueName(t)
	var mu sync.Mutex
	fail := true
	c, err := NewConsumer(client, q, func(ctx context.Context, m *Message[string]) (string, error) {
		mu.Lock()
		defer mu.Unlock()
		if fail {
			return "", Permanent(fmt.Errorf("refused %s", m.ID))
		}
		return "ok:" + m.ID, nil
	}, &ConsumerOptions{Shards: 4, ReadBlock: 50 * time.Millisecond, Logger: testLogger(t)})
	require.NoError(t, err)
	runConsumer(t, c)
	p, err := NewProducer[string, string](client, q, &ProducerOptions{Shards: 4, Logger: testLogger(t)})
	require.NoError(t, err)
	defer p.Close()
	for i := range 12 {
		pr, err := p.Produce(ctx, fmt.Sprintf("d%d", i), "x")
		require.NoError(t, err)
		_, err = pr.Wait(ctx)
		require.ErrorIs(t, err, ErrDeadLettered)
	}
	admin, err := NewAdmin(client, q, nil)
	require.NoError(t, err)
	var all []DeadLetter
	after := ""
	for {
		page, err := admin.DeadLetters(ctx, after, 5)
		require.NoError(t, err)
		if len(page) == 0 {
			break
		}
		all = append(all, page...)
		after = page[len(page)-1].DeadLetterID
	}
	require.Len(t, all, 12, "paging covers every shard")
	mu.Lock()
	fail = false
	mu.Unlock()
	_, err = admin.Requeue(ctx, all[0].DeadLetterID)
	require.NoError(t, err)
	pr, err := p.Produce(ctx, all[0].ID, "x")
	require.NoError(t, err)
	got, err := pr.Wait(ctx)
	require.NoError(t, err)
	require.Equal(t, "ok:"+all[0].ID, got)
	n, err := admin.PurgeDeadLetters(ctx, all[1].DeadLetterID)
	require.NoError(t, err)
	require.EqualValues(t, 1, n)
	n, err = admin.PurgeDeadLetters(ctx)
	require.NoError(t, err)
	require.EqualValues(t, 10, n)
}

// TestShardedConsumerReadsEveryShard: a consumer of six shards whose
// read-ahead target is smaller than its shards' reads together still reads
// every shard. Before the ring shared its target between shards, the feeder
// of an empty shard took the whole target and held it through its blocking
// read, then took it again, and a job on another shard waited forever (seen
// as a 20 s timeout on a Redis Cluster). Both backends.
func TestShardedConsumerReadsEveryShard(t *testing.T) {
	backends(t, func(t *testing.T, client *redis.Client) {
		ctx := context.Background()
		q := queueName(t)
		const shards = 6
		c, err := NewConsumer(client, q, func(ctx context.Context, m *Message[int]) (int, error) {
			return m.Payload + 1, nil
		}, &ConsumerOptions{Shards: shards, Workers: 4, ReadBlock: 100 * time.Millisecond, Logger: testLogger(t)})
		require.NoError(t, err)
		runConsumer(t, c)
		p, err := NewProducer[int, int](client, q, &ProducerOptions{Shards: shards, Logger: testLogger(t)})
		require.NoError(t, err)
		defer p.Close()
		// Jobs one at a time, so that at each moment five shards are empty
		// and their feeders block in reads; two rounds over every shard.
		for round := range 2 {
			for shard := range shards {
				id := ""
				for i := 0; id == ""; i++ {
					if cand := fmt.Sprintf("r%d-%d", round, i); keys.ShardOf(cand, shards) == shard {
						id = cand
					}
				}
				pr, err := p.Produce(ctx, id, shard)
				require.NoError(t, err)
				wctx, cancel := context.WithTimeout(ctx, 15*time.Second)
				got, err := pr.Wait(wctx)
				cancel()
				require.NoError(t, err, "job %s on shard %d", id, shard)
				require.Equal(t, shard+1, got)
			}
		}
	})
}
