// Dedupmodes shows two produce options that decide, in Redis, what a call
// does with a request id that is already known: Debounce and Replace.
//
// Debounce: a document is saved five times in quick succession; each save
// asks for the document to be reindexed with Debounce(200ms, 2s). The index
// is rebuilt once, 200 ms after the last save, with the last version, and
// all five callers get that one outcome.
//
// Replace: a slow render of a picture's thumbnail is running when the
// picture changes three more times; each change asks for a render with
// Replace. The running render finishes, then exactly one more render runs,
// with the latest picture; every caller, the first one included, gets that
// render's outcome. Admin.Job shows the render waiting behind the running
// one.
//
//	go run ./examples/dedupmodes
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
	"sync"
	"time"

	"github.com/streamq/streamq"
	"github.com/streamq/streamq/examples/internal/exampleredis"
)

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "dedupmodes:", err)
		os.Exit(1)
	}
}

// runLog records what the handlers ran, per id.
type runLog struct {
	mu   sync.Mutex
	runs map[string][]string
}

func (l *runLog) add(id, payload string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.runs[id] = append(l.runs[id], payload)
}

func (l *runLog) of(id string) []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]string(nil), l.runs[id]...)
}

func run() error {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	client, where, cleanup, err := exampleredis.Connect()
	if err != nil {
		return err
	}
	defer cleanup()
	suffix := time.Now().UnixNano()
	index, thumbs := fmt.Sprintf("index-%d", suffix), fmt.Sprintf("thumbs-%d", suffix)
	fmt.Printf("Redis: %s, queues %q and %q\n", where, index, thumbs)
	defer func() {
		for _, q := range []string{index, thumbs} {
			if err := exampleredis.DeleteQueue(context.Background(), client, q); err != nil {
				fmt.Fprintln(os.Stderr, "dedupmodes: cleaning up:", err)
			}
		}
	}()
	logger := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelError}))
	log := &runLog{runs: map[string][]string{}}

	// The consumers: the indexer is quick; the renderer takes 300 ms and
	// says when it starts.
	indexer, err := streamq.NewConsumer(client, index, func(ctx context.Context, m *streamq.Message[string]) (string, error) {
		log.add(m.ID, m.Payload)
		return "indexed " + m.Payload, nil
	}, &streamq.ConsumerOptions{Logger: logger})
	if err != nil {
		return err
	}
	renderStarted := make(chan string, 10)
	renderer, err := streamq.NewConsumer(client, thumbs, func(ctx context.Context, m *streamq.Message[string]) (string, error) {
		log.add(m.ID, m.Payload)
		renderStarted <- m.Payload
		select {
		case <-time.After(300 * time.Millisecond):
		case <-ctx.Done():
			return "", ctx.Err()
		}
		return "thumbnail of " + m.Payload, nil
	}, &streamq.ConsumerOptions{Logger: logger})
	if err != nil {
		return err
	}
	runCtx, stop := context.WithCancel(ctx)
	var wg sync.WaitGroup
	for _, c := range []interface{ Run(context.Context) error }{indexer, renderer} {
		wg.Go(func() { _ = c.Run(runCtx) })
	}
	defer func() { stop(); wg.Wait() }()

	// Debounce: five saves, 20 ms apart.
	ip, err := streamq.NewProducer[string, string](client, index, &streamq.ProducerOptions{Logger: logger})
	if err != nil {
		return err
	}
	defer ip.Close()
	fmt.Println("\nDebounce(200ms, 2s): five saves of doc-1, 20 ms apart")
	var saves []*streamq.Promise[string]
	for v := 1; v <= 5; v++ {
		pr, err := ip.Produce(ctx, "doc-1", fmt.Sprintf("doc-1 v%d", v), streamq.Debounce(200*time.Millisecond, 2*time.Second))
		if err != nil {
			return err
		}
		saves = append(saves, pr)
		time.Sleep(20 * time.Millisecond)
	}
	for i, pr := range saves {
		got, err := pr.Wait(ctx)
		if err != nil {
			return err
		}
		fmt.Printf("  save %d (%s) got %q\n", i+1, pr.Deduplicated(), got)
	}
	fmt.Printf("  the indexer ran %d time(s): %q\n", len(log.of("doc-1")), log.of("doc-1"))

	// Replace: a render is running when the picture changes three times.
	tp, err := streamq.NewProducer[string, string](client, thumbs, &streamq.ProducerOptions{Logger: logger})
	if err != nil {
		return err
	}
	defer tp.Close()
	fmt.Println("\nReplace: pic-7 changes three times while its first render runs")
	first, err := tp.Produce(ctx, "pic-7", "pic-7 v1", streamq.Replace())
	if err != nil {
		return err
	}
	fmt.Printf("  render of %s started\n", <-renderStarted)
	changes := []*streamq.Promise[string]{first}
	for v := 2; v <= 4; v++ {
		pr, err := tp.Produce(ctx, "pic-7", fmt.Sprintf("pic-7 v%d", v), streamq.Replace())
		if err != nil {
			return err
		}
		changes = append(changes, pr)
	}
	admin, err := streamq.NewAdmin(client, thumbs, nil)
	if err != nil {
		return err
	}
	info, err := admin.Job(ctx, "pic-7")
	if err != nil {
		return err
	}
	fmt.Printf("  Admin.Job: state %s, mode %s, waiting behind it: %s\n", info.State, info.Mode, info.Replacement)
	for i, pr := range changes {
		got, err := pr.Wait(ctx)
		if err != nil {
			return err
		}
		fmt.Printf("  change %d (%s) got %q\n", i+1, pr.Deduplicated(), got)
	}
	fmt.Printf("  the renderer ran %d time(s): %q\n", len(log.of("pic-7")), log.of("pic-7"))

	if d, r := log.of("doc-1"), log.of("pic-7"); len(d) != 1 || d[0] != "doc-1 v5" || len(r) != 2 || r[1] != "pic-7 v4" {
		return fmt.Errorf("unexpected runs: doc-1 %q, pic-7 %q", d, r)
	}
	fmt.Println("\nok: one index run with the last save; one more render, with the latest picture")
	return nil
}
