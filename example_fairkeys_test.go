package streamq_test

import (
	"context"

	"github.com/redis/go-redis/v9"

	"github.com/streamq/streamq"
)

// Fair queuing by key: each tenant's jobs take turns, and at most two jobs
// of one tenant run at once across every consumer.
func ExampleKey() {
	ctx := context.Background()
	rdb := redis.NewClient(&redis.Options{Addr: "localhost:6379"})
	handle := func(ctx context.Context, m *streamq.Message[string]) (string, error) { return "done:" + m.Key, nil }

	producer, err := streamq.NewProducer[string, string](rdb, "exports", nil)
	if err != nil {
		panic(err)
	}
	_, err = producer.Produce(ctx, "export-981", "report.csv", streamq.Key("tenant-42"))
	if err != nil {
		panic(err)
	}
	c, err := streamq.NewConsumer(rdb, "exports", handle, &streamq.ConsumerOptions{
		Workers:  16,
		KeyLimit: 2, // per tenant, across every consumer and process
	})
	if err != nil {
		panic(err)
	}
	_ = c.Run(ctx)
}
