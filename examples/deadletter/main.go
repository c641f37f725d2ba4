// Deadletter shows what happens to requests that cannot be handled, and how
// an operator inspects, requeues and purges them.
//
// A payments consumer handles transfers. One transfer names a currency the
// handler does not know yet: the handler fails it with streamq.Permanent, so
// it is dead-lettered at once and its caller gets the error (a plain error
// would be retried, with back-off, up to MaxDeliveries times first). Another
// program writes an entry the queue cannot decode: it is dead-lettered too,
// with the reason, instead of being skipped or crashing the consumer. The
// other transfers flow on. The operator lists the dead letters, adds the
// currency, requeues the transfer (its caller, producing the id again, gets
// the new result) and purges the garbage.
//
//	go run ./examples/deadletter
//
// Without REDIS_URL it starts an embedded Redis (miniredis) inside the
// process. With REDIS_URL (redis://host:port[/db]) it uses that server and
// deletes the keys it wrote.
package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/streamq/streamq"
	"github.com/streamq/streamq/examples/internal/exampleredis"
)

// Transfer is the request.
type Transfer struct {
	From, To string
	Amount   int // minor units
	Currency string
}

// Receipt is the response.
type Receipt struct {
	Text string
}

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "deadletter:", err)
		os.Exit(1)
	}
}

func run() error {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	client, where, cleanup, err := exampleredis.Connect()
	if err != nil {
		return err
	}
	defer cleanup()
	queue := fmt.Sprintf("deadletter-example-%d", time.Now().UnixNano())
	defer func() {
		if err := exampleredis.DeleteQueue(context.Background(), client, queue); err != nil {
			fmt.Fprintln(os.Stderr, "deadletter: cleaning up:", err)
		}
	}()
	fmt.Printf("Redis: %s, queue %q\n\n", where, queue)
	logger := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelError}))

	var mu sync.Mutex
	currencies := map[string]bool{"EUR": true, "USD": true}
	consumer, err := streamq.NewConsumer(client, queue,
		func(ctx context.Context, m *streamq.Message[Transfer]) (Receipt, error) {
			t := m.Payload
			mu.Lock()
			known := currencies[t.Currency]
			mu.Unlock()
			if !known {
				return Receipt{}, streamq.Permanent(fmt.Errorf("unknown currency %q", t.Currency))
			}
			return Receipt{Text: fmt.Sprintf("%s paid %s %d.%02d %s", t.From, t.To, t.Amount/100, t.Amount%100, t.Currency)}, nil
		},
		&streamq.ConsumerOptions{ReadBlock: 100 * time.Millisecond, Logger: logger})
	if err != nil {
		return err
	}
	runCtx, stop := context.WithCancel(ctx)
	runDone := make(chan error, 1)
	go func() { runDone <- consumer.Run(runCtx) }()
	defer func() {
		stop()
		<-runDone
	}()

	producer, err := streamq.NewProducer[Transfer, Receipt](client, queue, &streamq.ProducerOptions{Logger: logger})
	if err != nil {
		return err
	}
	defer producer.Close()

	transfers := map[string]Transfer{
		"tx-1": {From: "ann", To: "bob", Amount: 1250, Currency: "EUR"},
		"tx-2": {From: "bob", To: "cy", Amount: 999, Currency: "CHF"}, // not known yet
		"tx-3": {From: "cy", To: "ann", Amount: 4000, Currency: "USD"},
	}
	// Another program writes an entry without streamq's fields.
	names, err := mustAdmin(client, queue).Keys(ctx)
	if err != nil {
		return err
	}
	if err := client.XAdd(ctx, &redis.XAddArgs{Stream: names[0].Stream, Values: []any{"event", "legacy-ping"}}).Err(); err != nil {
		return err
	}
	for _, id := range []string{"tx-1", "tx-2", "tx-3"} {
		receipt, err := produceAndWait(ctx, producer, id, transfers[id])
		switch {
		case errors.Is(err, streamq.ErrDeadLettered):
			fmt.Printf("%s: dead-lettered: %v\n", id, err)
		case err != nil:
			return err
		default:
			fmt.Printf("%s: %s\n", id, receipt.Text)
		}
	}

	// The operator's view.
	admin := mustAdmin(client, queue)
	var letters []streamq.DeadLetter
	waitUntil(ctx, func() bool { // the garbage entry may still be on its way
		letters, err = admin.DeadLetters(ctx, "", 100)
		return err != nil || len(letters) == 2
	})
	if err != nil {
		return err
	}
	fmt.Printf("\n%d dead letters:\n", len(letters))
	for _, dl := range letters {
		id := dl.ID
		if id == "" {
			id = "(no id)"
		}
		fmt.Printf("  %s  entry %s, %d delivery, by %s\n    error: %s\n", id, dl.EntryID, dl.Deliveries, dl.Consumer, dl.Error)
	}

	// Fix the cause, then requeue the transfer and purge the garbage.
	mu.Lock()
	currencies["CHF"] = true
	mu.Unlock()
	fmt.Println("\nCHF added; requeueing tx-2 and purging the undecodable entry")
	for _, dl := range letters {
		if dl.ID == "" {
			if _, err := admin.PurgeDeadLetters(ctx, dl.DeadLetterID); err != nil {
				return err
			}
			continue
		}
		if _, err := admin.Requeue(ctx, dl.DeadLetterID); err != nil {
			return err
		}
	}
	// The caller produces the id again and attaches to the requeued request.
	receipt, err := produceAndWait(ctx, producer, "tx-2", transfers["tx-2"])
	if err != nil {
		return fmt.Errorf("tx-2 after requeue: %w", err)
	}
	fmt.Printf("tx-2: %s\n", receipt.Text)

	stats, err := admin.Stats(ctx)
	if err != nil {
		return err
	}
	fmt.Printf("\nsummary: %d dead letters left, %d entries in the stream\n", stats.DeadLetters, stats.Length)
	if stats.DeadLetters != 0 {
		return errors.New("dead letters left")
	}
	return nil
}

func produceAndWait(ctx context.Context, p *streamq.Producer[Transfer, Receipt], id string, t Transfer) (Receipt, error) {
	pr, err := p.Produce(ctx, id, t)
	if err != nil {
		return Receipt{}, err
	}
	return pr.Wait(ctx)
}

func mustAdmin(client *redis.Client, queue string) *streamq.Admin {
	a, err := streamq.NewAdmin(client, queue, nil)
	if err != nil {
		panic(err)
	}
	return a
}

// waitUntil polls cond until it holds or ctx ends.
func waitUntil(ctx context.Context, cond func() bool) {
	for !cond() && ctx.Err() == nil {
		time.Sleep(10 * time.Millisecond)
	}
}
