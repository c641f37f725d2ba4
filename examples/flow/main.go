// Flow runs a parent job after its children, and shows progress pushed to
// the caller.
//
// A report is built from three page renders: the renders are the children
// (two on the "render" queue, one on the "render-slow" queue, which reports
// its progress as it goes), the report is the parent on the "report" queue.
// ProduceFlow submits all four in one step; the report's handler runs once
// every render has finished and reads their results with Children. The
// caller waits on the report alone, and watches the slow render's progress
// arrive on its own promise. A second report whose render fails shows the
// default policy: the report does not run and its caller gets the render's
// error.
//
//	go run ./examples/flow
//
// Without REDIS_URL it starts an embedded Redis (miniredis) inside the
// process. With REDIS_URL (redis://host:port[/db]) it uses that server, on
// queues of its own that it deletes at the end.
package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/streamq/streamq"
	"github.com/streamq/streamq/examples/internal/exampleredis"
)

// Page is a render request; Rendered its response.
type Page struct{ Number int }
type Rendered struct{ Text string }

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "flow:", err)
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
	Render := streamq.NewQueue[Page, Rendered]("render-" + suffix)
	SlowRender := streamq.NewQueue[Page, Rendered]("render-slow-" + suffix)
	Report := streamq.NewQueue[string, string]("report-" + suffix)
	fmt.Printf("Redis: %s\n", where)
	defer func() {
		for _, q := range []string{Render.Name(), SlowRender.Name(), Report.Name()} {
			if err := exampleredis.DeleteQueue(context.Background(), client, q); err != nil {
				fmt.Fprintln(os.Stderr, "flow: cleaning up:", err)
			}
		}
	}()
	logger := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelError}))

	render := func(ctx context.Context, m *streamq.Message[Page]) (Rendered, error) {
		if m.Payload.Number < 0 {
			return Rendered{}, streamq.Permanent(errors.New("no such page"))
		}
		return Rendered{Text: fmt.Sprintf("page %d", m.Payload.Number)}, nil
	}
	slowRender := func(ctx context.Context, m *streamq.Message[Page]) (Rendered, error) {
		for pct := 25; pct <= 100; pct += 25 {
			time.Sleep(50 * time.Millisecond) // the work
			if err := m.Progress(ctx, pct); err != nil {
				return Rendered{}, err
			}
		}
		return Rendered{Text: fmt.Sprintf("page %d (slow)", m.Payload.Number)}, nil
	}
	report := func(ctx context.Context, m *streamq.Message[string]) (string, error) {
		children, err := m.Children(ctx)
		if err != nil {
			return "", err
		}
		var pages []string
		for _, c := range children {
			page, err := streamq.ChildResultOf(Render, c) // both render queues share the types and codec
			if err != nil {
				return "", err
			}
			pages = append(pages, page.Text)
		}
		return m.Payload + ": " + strings.Join(pages, ", "), nil
	}

	var wg sync.WaitGroup
	defer wg.Wait()
	runCtx, stop := context.WithCancel(ctx)
	defer stop()
	c1, err := Render.NewConsumer(client, render, &streamq.ConsumerOptions{Logger: logger})
	if err != nil {
		return err
	}
	c2, err := SlowRender.NewConsumer(client, slowRender, &streamq.ConsumerOptions{Logger: logger})
	if err != nil {
		return err
	}
	c3, err := Report.NewConsumer(client, report, &streamq.ConsumerOptions{Logger: logger})
	if err != nil {
		return err
	}
	consume(runCtx, &wg, c1)
	consume(runCtx, &wg, c2)
	consume(runCtx, &wg, c3)

	reports, err := Report.NewProducer(client, &streamq.ProducerOptions{Logger: logger})
	if err != nil {
		return err
	}
	defer reports.Close()
	slow, err := SlowRender.NewProducer(client, &streamq.ProducerOptions{Logger: logger})
	if err != nil {
		return err
	}
	defer slow.Close()

	// One step: the report waits, its three renders are queued.
	pr, err := reports.ProduceFlow(ctx, "report-1", "Quarterly report", []streamq.Child{
		streamq.ChildOf(Render, "r1-page-1", Page{1}),
		streamq.ChildOf(SlowRender, "r1-page-2", Page{2}),
		streamq.ChildOf(Render, "r1-page-3", Page{3}),
	}, nil)
	if err != nil {
		return err
	}
	// Attaching to the slow render (the same id: no second render) gives a
	// promise whose progress is pushed as the handler reports it.
	sp, err := slow.Produce(ctx, "r1-page-2", Page{2})
	if err != nil {
		return err
	}
	for v := range sp.Progress() { // closed when the render completes
		fmt.Printf("page 2: %s%%\n", v)
	}
	got, err := pr.Wait(ctx)
	if err != nil {
		return err
	}
	fmt.Println(got)

	// A failing child: the report does not run, its caller gets the error.
	pr, err = reports.ProduceFlow(ctx, "report-2", "Broken report", []streamq.Child{
		streamq.ChildOf(Render, "r2-page-1", Page{1}),
		streamq.ChildOf(Render, "r2-page-x", Page{-1}),
	}, nil)
	if err != nil {
		return err
	}
	_, err = pr.Wait(ctx)
	fmt.Printf("report-2 failed: %v (ErrChildFailed: %t)\n", err, errors.Is(err, streamq.ErrChildFailed))
	return nil
}

// consume runs a consumer until ctx ends.
func consume[Req, Resp any](ctx context.Context, wg *sync.WaitGroup, c *streamq.Consumer[Req, Resp]) {
	wg.Go(func() {
		if err := c.Run(ctx); err != nil {
			fmt.Fprintln(os.Stderr, "flow: consumer:", err)
		}
	})
}
