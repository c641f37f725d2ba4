// Quickstart produces and consumes requests with streamq.
//
// Three producers, as three services would, submit orders to one queue; some
// order ids are submitted by more than one producer. A consumer with three
// workers prices each order once, and every caller prints the result it got,
// duplicates included. One order is invalid: its handler fails permanently, so
// it is dead-lettered and its callers receive the error. A summary line ends
// the run.
//
//	go run ./examples/quickstart
//
// Without REDIS_URL it starts an embedded Redis (miniredis) inside the
// process. With REDIS_URL (redis://host:port[/db]) it uses that server, on a
// queue of its own that it deletes at the end.
package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"sort"
	"sync"
	"sync/atomic"
	"time"

	"github.com/streamq/streamq"
	"github.com/streamq/streamq/examples/internal/exampleredis"
)

// Order is the request.
type Order struct {
	Item     string
	Quantity int
}

// Invoice is the response.
type Invoice struct {
	Total int // cents
}

var prices = map[string]int{"apple": 40, "pear": 55, "plum": 25, "fig": 90}

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "quickstart:", err)
		os.Exit(1)
	}
}

func run() error {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	start := time.Now()

	client, where, cleanup, err := exampleredis.Connect()
	if err != nil {
		return err
	}
	defer cleanup()
	queue := fmt.Sprintf("quickstart-%d", time.Now().UnixNano())
	fmt.Printf("Redis: %s, queue %q\n", where, queue)
	defer func() {
		if err := exampleredis.DeleteQueue(context.Background(), client, queue); err != nil {
			fmt.Fprintln(os.Stderr, "quickstart: cleaning up:", err)
		}
	}()

	// Library logs at warning level and above go to stderr; the dead-lettered
	// order would log one, which is expected here, so keep errors only.
	logger := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelError}))

	// The consumer: three handlers at once. It counts how often each order ran.
	var runsMu sync.Mutex
	runs := map[string]int{}
	consumer, err := streamq.NewConsumer(client, queue,
		func(ctx context.Context, m *streamq.Message[Order]) (Invoice, error) {
			runsMu.Lock()
			runs[m.ID]++
			runsMu.Unlock()
			price, ok := prices[m.Payload.Item]
			if !ok || m.Payload.Quantity <= 0 {
				// Retrying cannot fix this order: fail it for good.
				return Invoice{}, streamq.Permanent(fmt.Errorf("cannot price %d x %q", m.Payload.Quantity, m.Payload.Item))
			}
			time.Sleep(20 * time.Millisecond) // the work
			return Invoice{Total: price * m.Payload.Quantity}, nil
		},
		&streamq.ConsumerOptions{Workers: 3, ReadBlock: 100 * time.Millisecond, ResultTTL: 10 * time.Minute, Logger: logger})
	if err != nil {
		return err
	}
	consumerCtx, stopConsumer := context.WithCancel(ctx)
	consumerDone := make(chan error, 1)
	go func() { consumerDone <- consumer.Run(consumerCtx) }()

	// The orders: 16 ids; each producer submits a window of 8, overlapping the
	// next producer's window, so 8 ids are submitted twice.
	orders := make([]Order, 16)
	items := []string{"apple", "pear", "plum", "fig"}
	for i := range orders {
		orders[i] = Order{Item: items[i%len(items)], Quantity: i + 1}
	}
	orders[11] = Order{Item: "durian", Quantity: 3} // not on the price list
	const producers, window, stride = 3, 8, 4

	var ok, failed, submitted atomic.Int64
	var wg sync.WaitGroup
	errs := make(chan error, producers*window)
	for p := range producers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			// One Producer per service; each would have its own client too.
			producer, err := streamq.NewProducer[Order, Invoice](client, queue, &streamq.ProducerOptions{Logger: logger})
			if err != nil {
				errs <- err
				return
			}
			defer producer.Close()
			var calls sync.WaitGroup
			for i := p * stride; i < p*stride+window && i < len(orders); i++ {
				calls.Add(1)
				go func() {
					defer calls.Done()
					id := fmt.Sprintf("order-%02d", i)
					submitted.Add(1)
					promise, err := producer.Produce(ctx, id, orders[i])
					if err != nil {
						errs <- fmt.Errorf("producer %d: %s: %w", p, id, err)
						return
					}
					inv, err := promise.Wait(ctx)
					switch {
					case errors.Is(err, streamq.ErrFailed):
						failed.Add(1)
						fmt.Printf("producer %d: %s failed: %v\n", p, id, err)
					case err != nil:
						errs <- fmt.Errorf("producer %d: %s: %w", p, id, err)
					default:
						ok.Add(1)
						fmt.Printf("producer %d: %s %d x %s = $%d.%02d\n", p, id,
							orders[i].Quantity, orders[i].Item, inv.Total/100, inv.Total%100)
					}
				}()
			}
			calls.Wait()
		}()
	}
	wg.Wait()
	close(errs)
	stopConsumer()
	if err := <-consumerDone; err != nil {
		return err
	}
	for err := range errs {
		return err
	}

	runsMu.Lock()
	defer runsMu.Unlock()
	handlerRuns, distinct := 0, len(runs)
	var repeated []string
	for id, n := range runs {
		handlerRuns += n
		if n > 1 {
			repeated = append(repeated, id)
		}
	}
	sort.Strings(repeated)
	admin, err := streamq.NewAdmin(client, queue, nil)
	if err != nil {
		return err
	}
	stats, err := admin.Stats(ctx)
	if err != nil {
		return err
	}
	fmt.Printf("summary: %d producers submitted %d requests for %d distinct ids; %d handler runs; "+
		"%d results delivered, %d failures delivered; %d dead-lettered; %d left in the stream; %v\n",
		producers, submitted.Load(), distinct, handlerRuns, ok.Load(), failed.Load(),
		stats.DeadLetters, stats.Length, time.Since(start).Round(time.Millisecond))
	if len(repeated) > 0 {
		return fmt.Errorf("ids handled more than once: %v", repeated)
	}
	if distinct != len(orders) || ok.Load()+failed.Load() != submitted.Load() {
		return fmt.Errorf("expected %d ids handled and every caller answered", len(orders))
	}
	return nil
}
