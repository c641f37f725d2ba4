// Multiqueue runs one pool of workers over three queues with weights 6:3:1,
// then pauses one of them while the others go on.
//
// Each queue has its own request and result types and options: "payments"
// (Charge -> Receipt, weight 6), "emails" (Email -> string, weight 3) and
// "reports" (string -> string, weight 1, retried at most twice). A backlog
// is produced on all three first; two workers then take the starts in the
// weights' proportions, which the program prints per ten starts. Then
// "emails" is paused: its new requests wait, without holding a worker,
// while the others' complete; after Resume they run.
//
//	go run ./examples/multiqueue
//
// Without REDIS_URL it starts an embedded Redis (miniredis) inside the
// process. With REDIS_URL (redis://host:port[/db]) it uses that server, on
// queues of its own that it deletes at the end.
package main

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/streamq/streamq"
	"github.com/streamq/streamq/examples/internal/exampleredis"
)

// Charge is a payment request; Receipt its result.
type Charge struct{ Cents int }
type Receipt struct{ Ref string }

// Email is an email to send.
type Email struct{ To string }

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "multiqueue:", err)
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
	suffix := fmt.Sprint(time.Now().UnixNano())
	Payments := streamq.NewQueue[Charge, Receipt]("payments-" + suffix)
	Emails := streamq.NewQueue[Email, string]("emails-" + suffix)
	Reports := streamq.NewQueue[string, string]("reports-" + suffix)
	fmt.Printf("Redis: %s\n", where)
	defer func() {
		for _, q := range []string{Payments.Name(), Emails.Name(), Reports.Name()} {
			if err := exampleredis.DeleteQueue(context.Background(), client, q); err != nil {
				fmt.Fprintln(os.Stderr, "multiqueue: cleaning up:", err)
			}
		}
	}()
	logger := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelError}))

	// The order of the starts, one letter per queue.
	var mu sync.Mutex
	var order strings.Builder
	started := func(letter byte) {
		mu.Lock()
		order.WriteByte(letter)
		mu.Unlock()
		time.Sleep(2 * time.Millisecond) // the work
	}
	payments, err := Payments.NewConsumer(client, func(ctx context.Context, m *streamq.Message[Charge]) (Receipt, error) {
		started('P')
		return Receipt{Ref: "rcpt-" + m.ID}, nil
	}, &streamq.ConsumerOptions{Logger: logger})
	if err != nil {
		return err
	}
	emails, err := Emails.NewConsumer(client, func(ctx context.Context, m *streamq.Message[Email]) (string, error) {
		started('E')
		return "sent to " + m.Payload.To, nil
	}, &streamq.ConsumerOptions{Logger: logger})
	if err != nil {
		return err
	}
	reports, err := Reports.NewConsumer(client, func(ctx context.Context, m *streamq.Message[string]) (string, error) {
		started('R')
		return "report " + m.Payload, nil
	}, &streamq.ConsumerOptions{Logger: logger, MaxDeliveries: 2})
	if err != nil {
		return err
	}
	mc, err := streamq.NewMultiConsumer(&streamq.MultiOptions{Workers: 2},
		streamq.MultiQueue{Consumer: payments, Weight: 6},
		streamq.MultiQueue{Consumer: emails, Weight: 3},
		streamq.MultiQueue{Consumer: reports, Weight: 1})
	if err != nil {
		return err
	}

	pp, err := Payments.NewProducer(client, &streamq.ProducerOptions{Logger: logger})
	if err != nil {
		return err
	}
	defer pp.Close()
	ep, err := Emails.NewProducer(client, &streamq.ProducerOptions{Logger: logger})
	if err != nil {
		return err
	}
	defer ep.Close()
	rp, err := Reports.NewProducer(client, &streamq.ProducerOptions{Logger: logger})
	if err != nil {
		return err
	}
	defer rp.Close()

	// A backlog on every queue before the workers start.
	var waits []func() error
	for i := range 60 {
		id := fmt.Sprint("p", i)
		pr, err := pp.Produce(ctx, id, Charge{Cents: 100 * i})
		if err != nil {
			return err
		}
		waits = append(waits, func() error { _, err := pr.Wait(ctx); return err })
		if i < 30 {
			pr, err := ep.Produce(ctx, fmt.Sprint("e", i), Email{To: fmt.Sprintf("user%d@example.com", i)})
			if err != nil {
				return err
			}
			waits = append(waits, func() error { _, err := pr.Wait(ctx); return err })
		}
		if i < 10 {
			pr, err := rp.Produce(ctx, fmt.Sprint("r", i), fmt.Sprint(i))
			if err != nil {
				return err
			}
			waits = append(waits, func() error { _, err := pr.Wait(ctx); return err })
		}
	}

	runCtx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- mc.Run(runCtx) }()
	defer func() {
		stop()
		if err := <-done; err != nil {
			fmt.Fprintln(os.Stderr, "multiqueue: run:", err)
		}
	}()
	for _, wait := range waits {
		if err := wait(); err != nil {
			return err
		}
	}
	mu.Lock()
	starts := order.String()
	mu.Unlock()
	fmt.Println("starts of 100 backlogged requests, per ten (P payments 6, E emails 3, R reports 1):")
	for i := 0; i+10 <= len(starts); i += 10 {
		s := starts[i : i+10]
		fmt.Printf("  %s  P%d E%d R%d\n", s, strings.Count(s, "P"), strings.Count(s, "E"), strings.Count(s, "R"))
	}

	// Pause emails: its requests wait in the ring without a worker, the
	// others' run.
	admin, err := Emails.NewAdmin(client, nil)
	if err != nil {
		return err
	}
	if err := admin.Pause(ctx); err != nil {
		return err
	}
	time.Sleep(2 * streamq.PauseCheckInterval) // every consumer has seen the pause
	email, err := ep.Produce(ctx, "e-late", Email{To: "late@example.com"})
	if err != nil {
		return err
	}
	charge, err := pp.Produce(ctx, "p-late", Charge{Cents: 4200})
	if err != nil {
		return err
	}
	receipt, err := charge.Wait(ctx)
	if err != nil {
		return err
	}
	select {
	case <-email.Done():
		return fmt.Errorf("an email ran while its queue was paused")
	default:
	}
	fmt.Printf("emails paused: the payment ran (%s), the email waits\n", receipt.Ref)
	if err := admin.Resume(ctx); err != nil {
		return err
	}
	sent, err := email.Wait(ctx)
	if err != nil {
		return err
	}
	fmt.Printf("emails resumed: %s\n", sent)
	return nil
}
