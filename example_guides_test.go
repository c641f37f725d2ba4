package streamq_test

// The examples in this file are compiled, not run: they need a Redis server
// and run until stopped. The guides under docs/ quote them (the doccheck test
// keeps each quotation equal to its source).

import (
	"context"
	"fmt"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/streamq/streamq"
)

type Report struct {
	Day time.Time
}

type Percent struct {
	Done int
}

// Delayed requests: After counts on the Redis server's clock, At compares
// with it; both are recorded and deduplicated at once.
func ExampleAfter() {
	ctx := context.Background()
	rdb := redis.NewClient(&redis.Options{Addr: "localhost:6379"})
	p, err := streamq.NewProducer[Report, string](rdb, "reports", nil)
	if err != nil {
		panic(err)
	}
	defer p.Close()
	tomorrowNine := time.Now().Truncate(24 * time.Hour).Add(33 * time.Hour)
	req := Report{Day: time.Now()}

	promise, err := p.Produce(ctx, "report-42", req, streamq.After(10*time.Minute))
	if err != nil {
		panic(err)
	}
	err = p.Enqueue(ctx, "reminder-7", req, streamq.At(tomorrowNine))
	if err != nil {
		panic(err)
	}
	_, err = p.ProduceBatch(ctx, []streamq.Job[Report]{
		{ID: "a", Request: req, Options: []streamq.ProduceOption{streamq.After(time.Hour)}},
	})
	if err != nil {
		panic(err)
	}
	fmt.Println(promise.Wait(ctx)) // once it ran, ten minutes from now
}

// Priority levels: high requests start before normal and low ones, by
// weights unless the consumer sets StrictPriority.
func ExamplePriority() {
	ctx := context.Background()
	rdb := redis.NewClient(&redis.Options{Addr: "localhost:6379"})
	p, err := streamq.NewProducer[string, string](rdb, "billing", nil)
	if err != nil {
		panic(err)
	}
	defer p.Close()

	_, err = p.Produce(ctx, "invoice-9", "ada", streamq.Priority(streamq.PriorityHigh))
	if err != nil {
		panic(err)
	}
	err = p.Enqueue(ctx, "reindex-3", "all", streamq.Priority(streamq.PriorityLow), streamq.After(time.Hour))
	if err != nil {
		panic(err)
	}

	c, err := streamq.NewConsumer(rdb, "billing", func(ctx context.Context, m *streamq.Message[string]) (string, error) {
		return fmt.Sprintf("%s at level %v", m.ID, m.Priority), nil
	}, &streamq.ConsumerOptions{Workers: 4, PriorityWeights: [3]int{6, 3, 1}})
	if err != nil {
		panic(err)
	}
	_ = c.Run(ctx)
}

// Flows take Priority, At and After for the parent and each child.
func ExampleProducer_ProduceFlow_priorityAndDelay() {
	ctx := context.Background()
	rdb := redis.NewClient(&redis.Options{Addr: "localhost:6379"})
	Render := streamq.NewQueue[int, string]("render")
	reports := streamq.NewQueue[string, string]("report")
	p, err := reports.NewProducer(rdb, nil)
	if err != nil {
		panic(err)
	}
	defer p.Close()
	tonight := time.Now().Truncate(24 * time.Hour).Add(22 * time.Hour)

	pr, err := p.ProduceFlow(ctx, "report-2", "Nightly report", []streamq.Child{
		streamq.ChildOf(Render, "r2-cover", 0, streamq.Priority(streamq.PriorityHigh)),
		streamq.ChildOf(Render, "r2-appendix", 9, streamq.Priority(streamq.PriorityLow), streamq.After(time.Minute)),
	}, &streamq.FlowOptions{Parent: []streamq.ProduceOption{streamq.At(tonight)}})
	if err != nil {
		panic(err)
	}
	fmt.Println(pr.Wait(ctx)) // tonight at the earliest, once both pages are rendered
}

// A rate limit shared by every consumer of the group.
func ExampleRateLimit() {
	rdb := redis.NewClient(&redis.Options{Addr: "localhost:6379"})
	send := func(ctx context.Context, m *streamq.Message[string]) (string, error) { return "sent", nil }

	c, err := streamq.NewConsumer(rdb, "mail", send, &streamq.ConsumerOptions{
		Workers:   16,
		RateLimit: &streamq.RateLimit{N: 100, Per: time.Second}, // all consumers together
	})
	if err != nil {
		panic(err)
	}
	_ = c.Run(context.Background())
}

// Periodic jobs: every replica runs the same registrations, and each slot is
// produced once.
func ExampleNewPeriodic() {
	ctx := context.Background()
	rdb := redis.NewClient(&redis.Options{Addr: "localhost:6379"})
	producer, err := streamq.NewProducer[Report, string](rdb, "reports", nil)
	if err != nil {
		panic(err)
	}
	defer producer.Close()

	pd, err := streamq.NewPeriodic(producer, nil)
	if err != nil {
		panic(err)
	}
	nightly, err := streamq.Cron("0 2 * * *") // UTC unless "CRON_TZ=Europe/Berlin 0 2 * * *"
	if err != nil {
		panic(err)
	}
	err = pd.Register(streamq.PeriodicJob[Report]{
		Name: "nightly-report", Schedule: nightly,
		Request: func(slot time.Time) (Report, error) { return Report{Day: slot}, nil },
	})
	if err != nil {
		panic(err)
	}
	err = pd.Register(streamq.PeriodicJob[Report]{Name: "heartbeat", Schedule: streamq.Every(time.Minute),
		Request: func(time.Time) (Report, error) { return Report{}, nil }, Missed: streamq.RunLatestMissed})
	if err != nil {
		panic(err)
	}
	_ = pd.Run(ctx) // in every replica; returns when ctx ends
}

// Progress: the handler reports, every caller of the id receives.
func ExampleMessage_Progress() {
	ctx := context.Background()
	rdb := redis.NewClient(&redis.Options{Addr: "localhost:6379"})

	c, err := streamq.NewConsumer(rdb, "exports", func(ctx context.Context, m *streamq.Message[string]) (string, error) {
		for done := 10; done <= 100; done += 10 {
			// ... a tenth of the work ...
			if err := m.Progress(ctx, Percent{done}); err != nil { // encoded with the consumer's codec
				return "", err
			}
		}
		return "exported " + m.Payload, nil
	}, nil)
	if err != nil {
		panic(err)
	}
	go func() { _ = c.Run(ctx) }()

	p, err := streamq.NewProducer[string, string](rdb, "exports", nil)
	if err != nil {
		panic(err)
	}
	defer p.Close()
	promise, err := p.Produce(ctx, "export-3", "invoices-2026")
	if err != nil {
		panic(err)
	}
	for v := range promise.Progress() { // closed when the request completes
		fmt.Printf("%s\n", v) // the encoded value: {"Done":40}
	}
	fmt.Println(promise.Wait(ctx))
}

// Pause stops every consumer of the queue from starting handlers; Resume
// lets the backlog drain. The state lives in Redis.
func ExampleAdmin_Pause() {
	ctx := context.Background()
	rdb := redis.NewClient(&redis.Options{Addr: "localhost:6379"})
	admin, err := streamq.NewAdmin(rdb, "orders", nil)
	if err != nil {
		panic(err)
	}

	if err := admin.Pause(ctx); err != nil { // running handlers finish; producers keep accepting
		panic(err)
	}
	stats, err := admin.Stats(ctx)
	if err != nil {
		panic(err)
	}
	fmt.Println(stats.Paused, stats.PausedAt)
	if err := admin.Resume(ctx); err != nil {
		panic(err)
	}
}
