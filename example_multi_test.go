package streamq_test

import (
	"context"
	"fmt"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"

	"github.com/streamq/streamq"
)

// One process serves two queues, each with its own types and options, over
// one pool of workers: while both have work waiting, "emails" gets three
// handler starts for each of "thumbnails".
func ExampleNewMultiConsumer() {
	srv := miniredis.NewMiniRedis()
	if err := srv.Start(); err != nil {
		panic(err)
	}
	defer srv.Close()
	client := redis.NewClient(&redis.Options{Addr: srv.Addr()})
	defer client.Close()
	ctx := context.Background()

	emails, err := streamq.NewConsumer(client, "emails",
		func(ctx context.Context, m *streamq.Message[string]) (string, error) {
			return "sent to " + m.Payload, nil
		},
		&streamq.ConsumerOptions{ReadBlock: 50 * time.Millisecond, MaxDeliveries: 5, Logger: quiet})
	if err != nil {
		panic(err)
	}
	thumbnails, err := streamq.NewConsumer(client, "thumbnails", resize,
		&streamq.ConsumerOptions{ReadBlock: 50 * time.Millisecond, Logger: quiet})
	if err != nil {
		panic(err)
	}
	multi, err := streamq.NewMultiConsumer(&streamq.MultiOptions{Workers: 4},
		streamq.MultiQueue{Consumer: emails, Weight: 3},
		streamq.MultiQueue{Consumer: thumbnails, Weight: 1})
	if err != nil {
		panic(err)
	}
	runCtx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- multi.Run(runCtx) }()

	mail, err := streamq.NewProducer[string, string](client, "emails", &streamq.ProducerOptions{Logger: quiet})
	if err != nil {
		panic(err)
	}
	defer mail.Close()
	images, err := streamq.NewProducer[resizeRequest, resizeResult](client, "thumbnails", &streamq.ProducerOptions{Logger: quiet})
	if err != nil {
		panic(err)
	}
	defer images.Close()
	sent, err := mail.Produce(ctx, "welcome/ada", "ada@example.com")
	if err != nil {
		panic(err)
	}
	thumb, err := images.Produce(ctx, "dog.png/64", resizeRequest{Image: "dog.png", Width: 64})
	if err != nil {
		panic(err)
	}

	// Each caller gets its own queue's result type.
	text, err := sent.Wait(ctx)
	if err != nil {
		panic(err)
	}
	img, err := thumb.Wait(ctx)
	if err != nil {
		panic(err)
	}
	fmt.Println(sent.ID(), "->", text)
	fmt.Println(thumb.ID(), "->", img.Thumbnail)
	// The queues' consumers belong to the MultiConsumer while it runs.
	fmt.Println("own Run refused:", emails.Run(ctx) != nil)

	cancel()
	if err := <-done; err != nil {
		fmt.Println("run:", err)
	}
	// Output:
	// welcome/ada -> sent to ada@example.com
	// dog.png/64 -> dog.png@64w
	// own Run refused: true
}
