// Fairkeys shows fair queuing by key: one tenant's burst does not delay the
// others, and at most two jobs of one tenant run at once.
//
// Tenant "big" produces 300 jobs, then tenants "t1".."t5" produce 3 jobs
// each. Four workers run them (each job takes 2 ms). The program prints the
// order of the first 40 starts, the worst start position of the small
// tenants' jobs, and the most jobs of one tenant that ran at once (the
// handlers count them), which the limit of two bounds. An operator's view
// of the keys (Admin.TopKeys) is printed while the burst drains.
//
//	go run ./examples/fairkeys
//
// Without REDIS_URL it starts an embedded Redis (miniredis) inside the
// process. With REDIS_URL (redis://host:port[/db]) it uses that server, on
// a queue of its own that it deletes at the end.
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

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "fairkeys:", err)
		os.Exit(1)
	}
}

func run() error {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	client, where, cleanup, err := exampleredis.Connect()
	if err != nil {
		return err
	}
	defer cleanup()
	fmt.Println("Redis:", where)
	queue := streamq.NewQueue[string, string](fmt.Sprintf("fairkeys-%d", time.Now().UnixNano()))
	defer func() { _ = exampleredis.DeleteQueue(context.Background(), client, queue.Name()) }()
	quiet := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))

	var mu sync.Mutex
	var order []string
	running := map[string]int{}
	most := 0
	newConsumer := func() (*streamq.Consumer[string, string], error) {
		return queue.NewConsumer(client, consumerHandler(&mu, &order, running, &most),
			&streamq.ConsumerOptions{Workers: 4, KeyLimit: 2, KeyWindow: 8, Logger: quiet})
	}
	// The limit and window are stored before the burst is produced (a
	// consumer stores its KeyLimit and KeyWindow too when it starts).
	admin, err := queue.NewAdmin(client, nil)
	if err != nil {
		return err
	}
	if err := admin.SetKeyDefaults(ctx, 2, 8); err != nil {
		return err
	}
	producer, err := queue.NewProducer(client, &streamq.ProducerOptions{Logger: quiet})
	if err != nil {
		return err
	}
	defer producer.Close()
	for i := range 300 {
		if err := producer.Send(ctx, fmt.Sprint("big-", i), "job", streamq.Key("big")); err != nil {
			return err
		}
	}
	var small []*streamq.Promise[string]
	for i := range 3 {
		for t := 1; t <= 5; t++ {
			p, err := producer.Produce(ctx, fmt.Sprintf("t%d-%d", t, i), "job", streamq.Key(fmt.Sprint("t", t)))
			if err != nil {
				return err
			}
			small = append(small, p)
		}
	}
	if err := producer.Flush(ctx); err != nil {
		return err
	}
	top, err := admin.TopKeys(ctx, 3)
	if err != nil {
		return err
	}
	for _, k := range top {
		fmt.Printf("key %-4s waiting %3d  running %d  limit %d\n", k.Key, k.Waiting, k.Running, k.Limit)
	}

	consumer, err := newConsumer()
	if err != nil {
		return err
	}
	runCtx2, stop2 := context.WithCancel(ctx)
	defer stop2()
	go func() { _ = consumer.Run(runCtx2) }()
	for _, p := range small {
		if _, err := p.Wait(ctx); err != nil {
			return err
		}
	}
	mu.Lock()
	defer mu.Unlock()
	worst := 0
	for i, k := range order {
		if k != "big" {
			worst = i + 1
		}
	}
	fmt.Println("first starts:", strings.Join(order[:min(40, len(order))], " "))
	fmt.Printf("the last small tenants' job started as start %d of %d, with %d jobs of \"big\" still waiting\n", worst, len(order), 300+15-len(order))
	fmt.Printf("most jobs of one tenant at once: %d (KeyLimit 2)\n", most)
	return nil
}

// consumerHandler records the order of starts and the most jobs of one key
// running at once.
func consumerHandler(mu *sync.Mutex, order *[]string, running map[string]int, most *int) streamq.Handler[string, string] {
	return func(ctx context.Context, m *streamq.Message[string]) (string, error) {
		mu.Lock()
		*order = append(*order, m.Key)
		running[m.Key]++
		*most = max(*most, running[m.Key])
		mu.Unlock()
		time.Sleep(2 * time.Millisecond)
		mu.Lock()
		running[m.Key]--
		mu.Unlock()
		return "done", nil
	}
}
