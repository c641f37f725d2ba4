package streamq_test

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"

	"github.com/streamq/streamq"
)

// A handler stages its writes with Tx; they are applied with its result,
// once, although the first attempt failed after staging.
func ExampleMessage_Tx() {
	srv := miniredis.NewMiniRedis()
	if err := srv.Start(); err != nil {
		panic(err)
	}
	defer srv.Close()
	client := redis.NewClient(&redis.Options{Addr: srv.Addr()})
	defer client.Close()
	ctx := context.Background()

	consumer, err := streamq.NewConsumer(client, "visits", func(_ context.Context, m *streamq.Message[string]) (string, error) {
		tx := m.Tx()
		visits := tx.Key("visits") // "streamq:{visits}:tx:visits", in the queue's slot
		if err := tx.HIncrBy(visits, m.Payload, 1); err != nil {
			return "", streamq.Permanent(err)
		}
		if m.Deliveries == 1 {
			return "", errors.New("flaky downstream") // retried: nothing staged is applied
		}
		fmt.Println("refused:", errors.Is(tx.Do("GET", visits), streamq.ErrTxCommand))
		return visits, nil
	}, &streamq.ConsumerOptions{Workers: 1, ReadBlock: 50 * time.Millisecond, RetryBackoff: 10 * time.Millisecond, Logger: quiet})
	if err != nil {
		panic(err)
	}
	defer startConsumer(consumer)()
	producer, err := streamq.NewProducer[string, string](client, "visits", &streamq.ProducerOptions{Logger: quiet})
	if err != nil {
		panic(err)
	}
	defer producer.Close()

	pr, err := producer.Produce(ctx, "visit-1", "home")
	if err != nil {
		panic(err)
	}
	visits, err := pr.Wait(ctx) // the handler returns the key's name
	if err != nil {
		panic(err)
	}
	fmt.Println(visits, client.HGet(ctx, visits, "home").Val())
	// Output:
	// refused: true
	// streamq:{visits}:tx:visits 1
}
