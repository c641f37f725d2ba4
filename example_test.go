package streamq_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync/atomic"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"

	"github.com/streamq/streamq"
)

// The examples run against miniredis, an in-process Redis for tests; in a
// service, pass a client of your Redis server instead.

type resizeRequest struct {
	Image string
	Width int
}

type resizeResult struct {
	Thumbnail string
}

func resize(_ context.Context, m *streamq.Message[resizeRequest]) (resizeResult, error) {
	return resizeResult{Thumbnail: fmt.Sprintf("%s@%dw", m.Payload.Image, m.Payload.Width)}, nil
}

// quiet keeps the examples' output to what they print.
var quiet = slog.New(slog.DiscardHandler)

// startConsumer runs c until the returned function is called, then waits for
// its graceful shutdown.
func startConsumer[Req, Resp any](c *streamq.Consumer[Req, Resp]) (stop func()) {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	return func() {
		cancel()
		if err := <-done; err != nil {
			fmt.Println("consumer:", err)
		}
	}
}

func ExampleProducer_Produce() {
	srv := miniredis.NewMiniRedis()
	if err := srv.Start(); err != nil {
		panic(err)
	}
	defer srv.Close()
	client := redis.NewClient(&redis.Options{Addr: srv.Addr()})
	defer client.Close()
	ctx := context.Background()

	producer, err := streamq.NewProducer[resizeRequest, resizeResult](client, "thumbnails",
		&streamq.ProducerOptions{Logger: quiet})
	if err != nil {
		panic(err)
	}
	defer producer.Close()

	// Two callers submitting the same id while it is queued share one stream
	// entry, one execution and one result.
	first, err := producer.Produce(ctx, "cat.jpg/200", resizeRequest{Image: "cat.jpg", Width: 200})
	if err != nil {
		panic(err)
	}
	second, err := producer.Produce(ctx, "cat.jpg/200", resizeRequest{Image: "cat.jpg", Width: 200})
	if err != nil {
		panic(err)
	}

	consumer, err := streamq.NewConsumer(client, "thumbnails", resize,
		&streamq.ConsumerOptions{ReadBlock: 50 * time.Millisecond, Logger: quiet})
	if err != nil {
		panic(err)
	}
	defer startConsumer(consumer)()

	for _, pr := range []*streamq.Promise[resizeResult]{first, second} {
		res, err := pr.Wait(ctx)
		if err != nil {
			panic(err)
		}
		fmt.Println(pr.ID(), "->", res.Thumbnail)
	}
	fmt.Println("same entry:", first.EntryID() == second.EntryID())
	// Output:
	// cat.jpg/200 -> cat.jpg@200w
	// cat.jpg/200 -> cat.jpg@200w
	// same entry: true
}

func ExampleNewConsumer() {
	srv := miniredis.NewMiniRedis()
	if err := srv.Start(); err != nil {
		panic(err)
	}
	defer srv.Close()
	client := redis.NewClient(&redis.Options{Addr: srv.Addr()})
	defer client.Close()
	ctx := context.Background()

	producer, err := streamq.NewProducer[string, int](client, "words", &streamq.ProducerOptions{Logger: quiet})
	if err != nil {
		panic(err)
	}
	defer producer.Close()
	for _, w := range []string{"alpha", "beta", "gamma"} {
		// Enqueue is fire-and-forget: nothing waits for the result.
		if err := producer.Enqueue(ctx, "word-"+w, w); err != nil {
			panic(err)
		}
	}

	var handled atomic.Int32
	allDone := make(chan struct{})
	// With one worker (the default), requests are handled in the order produced.
	consumer, err := streamq.NewConsumer(client, "words",
		func(ctx context.Context, m *streamq.Message[string]) (int, error) {
			fmt.Printf("%s: %q, delivery %d\n", m.ID, m.Payload, m.Deliveries)
			if handled.Add(1) == 3 {
				close(allDone)
			}
			return len(m.Payload), nil
		},
		&streamq.ConsumerOptions{Workers: 1, ReadBlock: 50 * time.Millisecond, Logger: quiet})
	if err != nil {
		panic(err)
	}
	stop := startConsumer(consumer)
	<-allDone
	stop()
	// Output:
	// word-alpha: "alpha", delivery 1
	// word-beta: "beta", delivery 1
	// word-gamma: "gamma", delivery 1
}

func ExampleProducer_ProduceBatch() {
	srv := miniredis.NewMiniRedis()
	if err := srv.Start(); err != nil {
		panic(err)
	}
	defer srv.Close()
	client := redis.NewClient(&redis.Options{Addr: srv.Addr()})
	defer client.Close()
	ctx := context.Background()

	consumer, err := streamq.NewConsumer(client, "thumbnails", resize,
		&streamq.ConsumerOptions{Workers: 4, ReadBlock: 50 * time.Millisecond, Logger: quiet})
	if err != nil {
		panic(err)
	}
	defer startConsumer(consumer)()

	producer, err := streamq.NewProducer[resizeRequest, resizeResult](client, "thumbnails",
		&streamq.ProducerOptions{Logger: quiet})
	if err != nil {
		panic(err)
	}
	defer producer.Close()

	// One atomic round trip: all three are recorded, or none is.
	promises, err := producer.ProduceBatch(ctx, []streamq.Job[resizeRequest]{
		{ID: "a.png/100", Request: resizeRequest{Image: "a.png", Width: 100}},
		{ID: "b.png/100", Request: resizeRequest{Image: "b.png", Width: 100}},
		{ID: "c.png/300", Request: resizeRequest{Image: "c.png", Width: 300}},
	})
	if err != nil {
		panic(err)
	}
	// Promises come back in input order, whatever order the workers finish in.
	for _, pr := range promises {
		res, err := pr.Wait(ctx)
		if err != nil {
			panic(err)
		}
		fmt.Println(pr.ID(), "->", res.Thumbnail)
	}
	// Output:
	// a.png/100 -> a.png@100w
	// b.png/100 -> b.png@100w
	// c.png/300 -> c.png@300w
}

func ExampleAdmin_DeadLetters() {
	srv := miniredis.NewMiniRedis()
	if err := srv.Start(); err != nil {
		panic(err)
	}
	defer srv.Close()
	client := redis.NewClient(&redis.Options{Addr: srv.Addr()})
	defer client.Close()
	ctx := context.Background()

	var fixed atomic.Bool // the bug that makes the request fail, fixed later
	consumer, err := streamq.NewConsumer(client, "orders",
		func(ctx context.Context, m *streamq.Message[string]) (string, error) {
			if strings.HasPrefix(m.Payload, "poison") && !fixed.Load() {
				// Permanent: retrying cannot help, dead-letter it at once.
				return "", streamq.Permanent(errors.New("unknown product code"))
			}
			return "shipped " + m.Payload, nil
		},
		&streamq.ConsumerOptions{ReadBlock: 50 * time.Millisecond, Logger: quiet})
	if err != nil {
		panic(err)
	}
	defer startConsumer(consumer)()

	producer, err := streamq.NewProducer[string, string](client, "orders", &streamq.ProducerOptions{Logger: quiet})
	if err != nil {
		panic(err)
	}
	defer producer.Close()

	pr, err := producer.Produce(ctx, "order-17", "poison pill")
	if err != nil {
		panic(err)
	}
	_, err = pr.Wait(ctx)
	fmt.Println("dead-lettered:", errors.Is(err, streamq.ErrDeadLettered))

	admin, err := streamq.NewAdmin(client, "orders", nil)
	if err != nil {
		panic(err)
	}
	letters, err := admin.DeadLetters(ctx, "", 100)
	if err != nil {
		panic(err)
	}
	for _, dl := range letters {
		fmt.Printf("%s: %q after %d delivery: %s\n", dl.ID, dl.Payload, dl.Deliveries, dl.Error)
	}

	// Once the handler is fixed, requeue the request: producing its id again
	// attaches to the new entry.
	fixed.Store(true)
	if _, err := admin.Requeue(ctx, letters[0].DeadLetterID); err != nil {
		panic(err)
	}
	pr, err = producer.Produce(ctx, "order-17", "poison pill")
	if err != nil {
		panic(err)
	}
	res, err := pr.Wait(ctx)
	if err != nil {
		panic(err)
	}
	fmt.Println("after requeue:", res)
	stats, err := admin.Stats(ctx)
	if err != nil {
		panic(err)
	}
	fmt.Println("dead letters left:", stats.DeadLetters)
	// Output:
	// dead-lettered: true
	// order-17: "\"poison pill\"" after 1 delivery: unknown product code
	// after requeue: shipped poison pill
	// dead letters left: 0
}

func ExampleCacheFetcher() {
	srv := miniredis.NewMiniRedis()
	if err := srv.Start(); err != nil {
		panic(err)
	}
	defer srv.Close()
	client := redis.NewClient(&redis.Options{Addr: srv.Addr()})
	defer client.Close()
	ctx := context.Background()

	// An upstream service left the request body in a cache key; the stream
	// entry carries only the key. Producers of []byte bypass the codec.
	if err := client.Set(ctx, "body:42", `{"Image":"dog.jpg","Width":64}`, time.Minute).Err(); err != nil {
		panic(err)
	}
	consumer, err := streamq.NewConsumer(client, "thumbnails", resize, &streamq.ConsumerOptions{
		Fetcher:   &streamq.CacheFetcher{Client: client, DeleteOnComplete: true},
		ReadBlock: 50 * time.Millisecond,
		Logger:    quiet,
	})
	if err != nil {
		panic(err)
	}
	defer startConsumer(consumer)()

	producer, err := streamq.NewProducer[[]byte, resizeResult](client, "thumbnails", &streamq.ProducerOptions{Logger: quiet})
	if err != nil {
		panic(err)
	}
	defer producer.Close()
	pr, err := producer.Produce(ctx, "job-42", []byte("body:42"))
	if err != nil {
		panic(err)
	}
	res, err := pr.Wait(ctx)
	if err != nil {
		panic(err)
	}
	fmt.Println(res.Thumbnail)
	// Output:
	// dog.jpg@64w
}
