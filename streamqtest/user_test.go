package streamqtest_test

// A unit test as a streamq user writes it: only the public API of streamq and
// streamqtest. It runs on miniredis and on a real redis-server and checks
// that both give the same results.

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/streamq/streamq"
	"github.com/streamq/streamq/streamqtest"
)

type order struct {
	Item string `json:"item"`
	Qty  int    `json:"qty"`
}

type receipt struct {
	Item  string `json:"item"`
	Total int    `json:"total"`
}

// scenario produces five orders (a flaky one retried, one failing for good,
// one refused permanently, one produced twice, one delayed) and returns what
// happened, as text, so that two backends' runs can be compared.
func scenario(t *testing.T, client *redis.Client) []string {
	ctx := context.Background()
	const queue = "orders"
	var mu sync.Mutex
	starts := map[string][]int{}
	handle := func(ctx context.Context, m *streamq.Message[order]) (receipt, error) {
		mu.Lock()
		starts[m.ID] = append(starts[m.ID], m.Deliveries)
		mu.Unlock()
		switch {
		case m.Payload.Qty <= 0:
			return receipt{}, streamq.Permanent(fmt.Errorf("quantity %d", m.Payload.Qty))
		case m.Payload.Item == "unobtainium":
			return receipt{}, errors.New("out of stock")
		case m.Payload.Item == "flaky" && m.Deliveries == 1:
			return receipt{}, errors.New("warehouse timeout")
		}
		return receipt{Item: m.Payload.Item, Total: 3 * m.Payload.Qty}, nil
	}
	c, err := streamq.NewConsumer(client, queue, handle, &streamq.ConsumerOptions{
		Name: "worker", MaxDeliveries: 3, RetryBackoff: 10 * time.Millisecond, ReadBlock: 50 * time.Millisecond,
	})
	if err != nil {
		t.Fatal(err)
	}
	p, err := streamq.NewProducer[order, receipt](client, queue, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()

	produce := func(id string, o order, opts ...streamq.ProduceOption) *streamq.Promise[receipt] {
		pr, err := p.Produce(ctx, id, o, opts...)
		if err != nil {
			t.Fatalf("produce %s: %v", id, err)
		}
		return pr
	}
	promises := map[string]*streamq.Promise[receipt]{
		"ok":      produce("ok", order{Item: "tea", Qty: 2}),
		"ok-dup":  produce("ok", order{Item: "tea", Qty: 2}),
		"flaky":   produce("flaky", order{Item: "flaky", Qty: 1}),
		"doomed":  produce("doomed", order{Item: "unobtainium", Qty: 1}),
		"refused": produce("refused", order{Item: "tea", Qty: 0}),
		"later":   produce("later", order{Item: "cake", Qty: 1}, streamq.After(200*time.Millisecond)),
	}
	streamqtest.RequireProduced(ctx, t, client, queue, "ok", &streamqtest.RequireOptions{Payload: order{Item: "tea", Qty: 2}})
	streamqtest.RequireProduced(ctx, t, client, queue, "later", &streamqtest.RequireOptions{Payload: order{Item: "cake", Qty: 1}})
	streamqtest.RequireNotProduced(ctx, t, client, queue, "never")

	streamqtest.Drain(ctx, t, client, queue, c, nil)

	var out []string
	for _, name := range []string{"ok", "ok-dup", "flaky", "doomed", "refused", "later"} {
		waitCtx, cancel := context.WithTimeout(ctx, 5*time.Second)
		r, err := promises[name].Wait(waitCtx)
		cancel()
		switch {
		case errors.Is(err, streamq.ErrDeadLettered):
			out = append(out, fmt.Sprintf("%s: dead-lettered: %v", name, err))
		case err != nil:
			out = append(out, fmt.Sprintf("%s: failed: %v", name, err))
		default:
			out = append(out, fmt.Sprintf("%s: %+v", name, r))
		}
	}
	for _, id := range []string{"doomed", "refused"} {
		dl := streamqtest.RequireDeadLettered(ctx, t, client, queue, id)
		out = append(out, fmt.Sprintf("dead letter %s: deliveries %d: %s", id, dl.Deliveries, dl.Error))
	}
	info := streamqtest.RequireProduced(ctx, t, client, queue, "flaky", &streamqtest.RequireOptions{State: streamq.JobSucceeded})
	out = append(out, fmt.Sprintf("job flaky: %s %s", info.State, info.Result))
	ids := make([]string, 0, len(starts))
	for id := range starts {
		ids = append(ids, id)
	}
	sort.Strings(ids)
	for _, id := range ids {
		out = append(out, fmt.Sprintf("starts %s: %v", id, starts[id]))
	}
	return out
}

func TestUserScenarioSameOnBothBackends(t *testing.T) {
	want := []string{
		`ok: {Item:tea Total:6}`,
		`ok-dup: {Item:tea Total:6}`,
		`flaky: {Item:flaky Total:3}`,
		`doomed: dead-lettered: streamq: request dead-lettered: out of stock`,
		`refused: dead-lettered: streamq: request dead-lettered: quantity 0`,
		`later: {Item:cake Total:3}`,
		`dead letter doomed: deliveries 3: out of stock`,
		`dead letter refused: deliveries 1: quantity 0`,
		`job flaky: succeeded {"item":"flaky","total":3}`,
		`starts doomed: [1 2 3]`,
		`starts flaky: [1 2]`,
		`starts later: [1]`,
		`starts ok: [1]`,
		`starts refused: [1]`,
	}
	results := map[streamqtest.Backend][]string{}
	var mu sync.Mutex
	t.Run("miniredis", func(t *testing.T) {
		client, _ := streamqtest.NewMiniredis(t)
		got := scenario(t, client)
		mu.Lock()
		results[streamqtest.Miniredis] = got
		mu.Unlock()
		requireLines(t, want, got)
	})
	t.Run("redis-server", func(t *testing.T) {
		_, err := exec.LookPath("redis-server")
		if err != nil && os.Getenv("STREAMQ_REDIS_SERVER") == "" && os.Getenv("CI") == "" {
			t.Skip("redis-server not installed")
		}
		client := streamqtest.NewRedisServer(t)
		got := scenario(t, client)
		mu.Lock()
		results[streamqtest.RedisServer] = got
		mu.Unlock()
		requireLines(t, want, got)
	})
	if a, b := results[streamqtest.Miniredis], results[streamqtest.RedisServer]; a != nil && b != nil {
		requireLines(t, a, b)
	}
}

func requireLines(t *testing.T, want, got []string) {
	t.Helper()
	if strings.Join(want, "\n") != strings.Join(got, "\n") {
		t.Fatalf("results differ:\nwant:\n%s\n\ngot:\n%s", strings.Join(want, "\n"), strings.Join(got, "\n"))
	}
}
