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

// exampleClient starts a miniredis and returns a client of it and a function
// that closes both.
func exampleClient() (*redis.Client, func()) {
	srv := miniredis.NewMiniRedis()
	if err := srv.Start(); err != nil {
		panic(err)
	}
	client := redis.NewClient(&redis.Options{Addr: srv.Addr()})
	return client, func() { _ = client.Close(); srv.Close() }
}

type invoice struct {
	Customer string
	Cents    int
}

// A queue defined once with its types: its producer and consumer cannot
// disagree on them.
var invoices = streamq.NewQueue[invoice, string]("invoices")

func ExampleNewQueue() {
	client, closeAll := exampleClient()
	defer closeAll()
	ctx := context.Background()

	consumer, err := invoices.NewConsumer(client, func(ctx context.Context, m *streamq.Message[invoice]) (string, error) {
		return fmt.Sprintf("%s owes %d.%02d", m.Payload.Customer, m.Payload.Cents/100, m.Payload.Cents%100), nil
	}, &streamq.ConsumerOptions{ReadBlock: 50 * time.Millisecond, Logger: quiet})
	if err != nil {
		panic(err)
	}
	stop := startConsumer(consumer)
	defer stop()

	producer, err := invoices.NewProducer(client, &streamq.ProducerOptions{Logger: quiet})
	if err != nil {
		panic(err)
	}
	defer producer.Close()
	promise, err := producer.Produce(ctx, "inv-1", invoice{Customer: "ada", Cents: 1250})
	if err != nil {
		panic(err)
	}
	fmt.Println(promise.Wait(ctx))
	// Output:
	// ada owes 12.50 <nil>
}

// A handler that fails is retried; Deliveries counts its starts.
func ExampleRetryAfter() {
	client, closeAll := exampleClient()
	defer closeAll()
	ctx := context.Background()

	consumer, err := streamq.NewConsumer(client, "flaky", func(ctx context.Context, m *streamq.Message[string]) (string, error) {
		fmt.Println("start", m.Deliveries)
		if m.Deliveries < 3 {
			// Retry in 10ms rather than after the exponential back-off.
			return "", streamq.RetryAfter(errors.New("upstream busy"), 10*time.Millisecond)
		}
		return "done", nil
	}, &streamq.ConsumerOptions{MaxDeliveries: 5, ReadBlock: 50 * time.Millisecond, Logger: quiet})
	if err != nil {
		panic(err)
	}
	stop := startConsumer(consumer)
	defer stop()

	producer, err := streamq.NewProducer[string, string](client, "flaky", &streamq.ProducerOptions{Logger: quiet})
	if err != nil {
		panic(err)
	}
	defer producer.Close()
	promise, err := producer.Produce(ctx, "job-1", "x")
	if err != nil {
		panic(err)
	}
	fmt.Println(promise.Wait(ctx))
	// Output:
	// start 1
	// start 2
	// start 3
	// done <nil>
}

// Producing an id again is deduplicated; RetryFailed runs a failed id again.
func ExampleRetryFailed() {
	client, closeAll := exampleClient()
	defer closeAll()
	ctx := context.Background()

	consumer, err := streamq.NewConsumer(client, "parse", func(ctx context.Context, m *streamq.Message[string]) (string, error) {
		if m.Payload == "" {
			return "", streamq.Permanent(errors.New("empty document"))
		}
		return "parsed " + m.Payload, nil
	}, &streamq.ConsumerOptions{ReadBlock: 50 * time.Millisecond, Logger: quiet})
	if err != nil {
		panic(err)
	}
	stop := startConsumer(consumer)
	defer stop()
	producer, err := streamq.NewProducer[string, string](client, "parse", &streamq.ProducerOptions{Logger: quiet})
	if err != nil {
		panic(err)
	}
	defer producer.Close()

	produce := func(doc string, opts ...streamq.ProduceOption) {
		promise, err := producer.Produce(ctx, "doc-7", doc, opts...)
		if err != nil {
			panic(err)
		}
		res, err := promise.Wait(ctx)
		fmt.Printf("%s: %q %v\n", promise.Deduplicated(), res, err)
	}
	produce("")                             // fails for good
	produce("fixed")                        // the stored failure answers
	produce("fixed", streamq.RetryFailed()) // runs again
	produce("other", streamq.RetryFailed()) // a stored success answers
	// Output:
	// new: "" streamq: request dead-lettered: empty document
	// answered from the stored outcome: "" streamq: request dead-lettered: empty document
	// new: "parsed fixed" <nil>
	// answered from the stored outcome: "parsed fixed" <nil>
}

// Admin.Job looks at an id without producing it.
func ExampleAdmin_Job() {
	client, closeAll := exampleClient()
	defer closeAll()
	ctx := context.Background()

	producer, err := streamq.NewProducer[string, string](client, "reports", &streamq.ProducerOptions{Logger: quiet})
	if err != nil {
		panic(err)
	}
	defer producer.Close()
	if err := producer.Enqueue(ctx, "report-2026", "annual"); err != nil {
		panic(err)
	}
	admin, err := streamq.NewAdmin(client, "reports", nil)
	if err != nil {
		panic(err)
	}
	info, err := admin.Job(ctx, "report-2026")
	fmt.Println(info.State, err)
	_, err = admin.Job(ctx, "report-1999")
	fmt.Println(errors.Is(err, streamq.ErrNotFound))
	// Output:
	// queued <nil>
	// true
}

// Ready is closed once the consumer reads: a readiness probe.
func ExampleConsumer_Ready() {
	client, closeAll := exampleClient()
	defer closeAll()

	consumer, err := streamq.NewConsumer(client, "probe", func(ctx context.Context, m *streamq.Message[string]) (string, error) {
		return m.Payload, nil
	}, &streamq.ConsumerOptions{ReadBlock: 50 * time.Millisecond, Logger: quiet})
	if err != nil {
		panic(err)
	}
	stop := startConsumer(consumer)
	defer stop()
	select {
	case <-consumer.Ready():
		fmt.Println("ready")
	case <-time.After(10 * time.Second):
		fmt.Println("not ready after 10s")
	}
	// Output:
	// ready
}

// Admin.Jobs lists the jobs of one state a page at a time; RunNow runs a
// scheduled one at once.
func ExampleAdmin_Jobs() {
	client, closeAll := exampleClient()
	defer closeAll()
	ctx := context.Background()

	producer, err := streamq.NewProducer[string, string](client, "reports", &streamq.ProducerOptions{Logger: quiet})
	if err != nil {
		panic(err)
	}
	defer producer.Close()
	for i, after := range []time.Duration{3 * time.Hour, time.Hour, 2 * time.Hour} {
		if err := producer.Enqueue(ctx, fmt.Sprintf("report-%d", i), "weekly", streamq.After(after)); err != nil {
			panic(err)
		}
	}
	admin, err := streamq.NewAdmin(client, "reports", nil)
	if err != nil {
		panic(err)
	}
	cursor := ""
	for {
		page, err := admin.Jobs(ctx, streamq.JobsQuery{State: streamq.JobScheduled, Limit: 2, Cursor: cursor})
		if err != nil {
			panic(err)
		}
		for _, j := range page.Jobs {
			fmt.Println(j.ID, "due in", time.Until(j.Due).Round(time.Hour))
		}
		if page.Next == "" {
			break
		}
		cursor = page.Next
	}
	fmt.Println(admin.RunNow(ctx, "report-0"))
	info, _ := admin.Job(ctx, "report-0")
	fmt.Println(info.State)
	// Output:
	// report-1 due in 1h0m0s
	// report-2 due in 2h0m0s
	// report-0 due in 3h0m0s
	// <nil>
	// queued
}
