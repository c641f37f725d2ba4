package streamq_test

import (
	"context"
	"fmt"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/streamq/streamq"
)

// The answering group's consumers keep a list of the recently completed
// requests (the newest 10,000 per shard, none older than a day), which
// Admin.Completed pages through, newest first.
func ExampleRetention() {
	ctx := context.Background()
	client := redis.NewClient(&redis.Options{Addr: "localhost:6379"})
	opts := &streamq.ConsumerOptions{Retention: &streamq.Retention{MaxCount: 10_000, MaxAge: 24 * time.Hour}}
	c, err := streamq.NewConsumer(client, "mail", func(ctx context.Context, m *streamq.Message[string]) (string, error) {
		return "sent", nil
	}, opts)
	if err != nil {
		panic(err)
	}
	go func() { _ = c.Run(ctx) }()

	admin, err := streamq.NewAdmin(client, "mail", nil)
	if err != nil {
		panic(err)
	}
	page, err := admin.Completed(ctx, "", 50)
	if err != nil {
		panic(err)
	}
	for _, j := range page.Jobs {
		fmt.Println(j.ID, j.State, j.At.Format(time.RFC3339))
	}
}
