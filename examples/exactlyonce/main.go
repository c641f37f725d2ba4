// Exactlyonce credits accounts exactly once, although handlers run more often.
//
// A producer submits 200 deposits. The consumer's handler does not write the
// balances itself: it stages HINCRBY on a balances hash and RPUSH on a
// ledger with m.Tx(), and streamq applies them in the same atomic step that
// records the deposit's result. One deposit in five fails once after staging
// (as if a downstream call timed out): that attempt's staged writes are
// discarded and the retry stages its own. At the end the balances add up to
// the deposits exactly and the ledger holds each deposit once, while the
// handler ran more times than there were deposits. It also shows a command a
// Tx refuses.
//
//	go run ./examples/exactlyonce
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
	"strconv"
	"sync/atomic"
	"time"

	"github.com/streamq/streamq"
	"github.com/streamq/streamq/examples/internal/exampleredis"
)

// Deposit is the request.
type Deposit struct {
	Account string
	Cents   int64
}

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "exactlyonce:", err)
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
	queue := fmt.Sprintf("exactlyonce-%d", time.Now().UnixNano())
	fmt.Printf("Redis: %s, queue %q\n", where, queue)
	defer func() {
		if err := exampleredis.DeleteQueue(context.Background(), client, queue); err != nil {
			fmt.Fprintln(os.Stderr, "exactlyonce: cleaning up:", err)
		}
	}()
	logger := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelError}))

	var runs atomic.Int64
	var keyNames atomic.Pointer[[2]string] // the balances and ledger keys, named in the queue's slot
	refused := make(chan error, 1)
	consumer, err := streamq.NewConsumer(client, queue,
		func(ctx context.Context, m *streamq.Message[Deposit]) (string, error) {
			runs.Add(1)
			tx := m.Tx()
			balances, ledger := tx.Key("balances"), tx.Key("ledger")
			keyNames.Store(&[2]string{balances, ledger})
			if err := tx.HIncrBy(balances, m.Payload.Account, m.Payload.Cents); err != nil {
				return "", streamq.Permanent(err)
			}
			if err := tx.RPush(ledger, m.ID); err != nil {
				return "", streamq.Permanent(err)
			}
			if m.ID == "deposit-0" {
				select {
				case refused <- tx.Do("GET", balances): // reads are not staged
				default:
				}
			}
			n, _ := strconv.Atoi(m.ID[len("deposit-"):])
			if n%5 == 0 && m.Deliveries == 1 {
				return "", errors.New("downstream timed out") // retried; nothing staged is applied
			}
			return "credited", nil
		}, &streamq.ConsumerOptions{Workers: 4, RetryBackoff: 10 * time.Millisecond, Logger: logger})
	if err != nil {
		return err
	}
	runCtx, stop := context.WithCancel(ctx)
	defer stop()
	done := make(chan error, 1)
	go func() { done <- consumer.Run(runCtx) }()

	producer, err := streamq.NewProducer[Deposit, string](client, queue, &streamq.ProducerOptions{Logger: logger})
	if err != nil {
		return err
	}
	defer producer.Close()
	var want int64
	var promises []*streamq.Promise[string]
	for i := range 200 {
		d := Deposit{Account: fmt.Sprint("acct-", i%7), Cents: int64(100 + i)}
		want += d.Cents
		pr, err := producer.Produce(ctx, fmt.Sprint("deposit-", i), d)
		if err != nil {
			return err
		}
		promises = append(promises, pr)
	}
	for _, pr := range promises {
		if _, err := pr.Wait(ctx); err != nil {
			return err
		}
	}
	stop()
	if err := <-done; err != nil {
		return err
	}

	fmt.Println("refused:", <-refused)
	balances, ledger := keyNames.Load()[0], keyNames.Load()[1]
	vals, err := client.HVals(ctx, balances).Result()
	if err != nil {
		return err
	}
	var got int64
	for _, v := range vals {
		n, _ := strconv.ParseInt(v, 10, 64)
		got += n
	}
	entries, err := client.LLen(ctx, ledger).Result()
	if err != nil {
		return err
	}
	fmt.Printf("handler runs: %d for %d deposits\n", runs.Load(), len(promises))
	fmt.Printf("balances: %d cents, deposits: %d cents; ledger entries: %d\n", got, want, entries)
	if got != want || entries != int64(len(promises)) {
		return errors.New("the staged writes were not applied exactly once")
	}
	fmt.Println("every deposit credited exactly once")
	return nil
}
