package streamqtest_test

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/streamq/streamq"
	"github.com/streamq/streamq/streamqtest"
)

// fakeT records a helper's failure; Fatalf ends the helper's goroutine as
// testing.T's does.
type fakeT struct {
	mu       sync.Mutex
	failed   string
	cleanups []func()
}

func (f *fakeT) Helper()             {}
func (f *fakeT) Logf(string, ...any) {}
func (f *fakeT) Cleanup(fn func())   { f.mu.Lock(); f.cleanups = append(f.cleanups, fn); f.mu.Unlock() }
func (f *fakeT) Fatalf(format string, args ...any) {
	f.mu.Lock()
	f.failed = fmt.Sprintf(format, args...)
	f.mu.Unlock()
	runtime.Goexit()
}

// failure runs fn with a fakeT in its own goroutine and returns the failure
// message ("" when fn passed).
func failure(fn func(t streamqtest.TB)) string {
	f := &fakeT{}
	done := make(chan struct{})
	go func() {
		defer close(done)
		fn(f)
	}()
	<-done
	for i := len(f.cleanups) - 1; i >= 0; i-- {
		f.cleanups[i]()
	}
	return f.failed
}

func TestRequireHelpersFail(t *testing.T) {
	ctx := context.Background()
	client, _ := streamqtest.NewMiniredis(t)
	p, err := streamq.NewProducer[order, receipt](client, "q", nil)
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	if err := p.Enqueue(ctx, "a", order{Item: "tea", Qty: 1}); err != nil {
		t.Fatal(err)
	}
	cases := []struct {
		name string
		fn   func(t streamqtest.TB)
		want string
	}{
		{"produced passes", func(t streamqtest.TB) {
			streamqtest.RequireProduced(ctx, t, client, "q", "a", &streamqtest.RequireOptions{Payload: order{Item: "tea", Qty: 1}, State: streamq.JobQueued})
		}, ""},
		{"missing id", func(t streamqtest.TB) { streamqtest.RequireProduced(ctx, t, client, "q", "b", nil) }, `request "b" was not produced`},
		{"other payload", func(t streamqtest.TB) {
			streamqtest.RequireProduced(ctx, t, client, "q", "a", &streamqtest.RequireOptions{Payload: order{Item: "tea", Qty: 2}})
		}, `carries payload "{\"item\":\"tea\",\"qty\":1}", want "{\"item\":\"tea\",\"qty\":2}"`},
		{"other state", func(t streamqtest.TB) {
			streamqtest.RequireProduced(ctx, t, client, "q", "a", &streamqtest.RequireOptions{State: streamq.JobSucceeded})
		}, `is queued, want succeeded`},
		{"not produced fails", func(t streamqtest.TB) { streamqtest.RequireNotProduced(ctx, t, client, "q", "a") }, `request "a" was produced to queue q: it is queued`},
		{"not produced passes", func(t streamqtest.TB) { streamqtest.RequireNotProduced(ctx, t, client, "q", "b") }, ""},
		{"not dead-lettered", func(t streamqtest.TB) { streamqtest.RequireDeadLettered(ctx, t, client, "q", "a") }, `request "a" of queue q is not among its 0 dead letters`},
	}
	for _, tc := range cases {
		got := failure(tc.fn)
		if tc.want == "" && got != "" || !strings.Contains(got, tc.want) {
			t.Errorf("%s: failure %q, want one containing %q", tc.name, got, tc.want)
		}
	}
}

// idle is a Runner that consumes nothing.
type idle struct{}

func (idle) Run(ctx context.Context) error { <-ctx.Done(); return nil }

func TestDrainFailsWhenNothingConsumes(t *testing.T) {
	ctx := context.Background()
	client, _ := streamqtest.NewMiniredis(t)
	p, err := streamq.NewProducer[order, receipt](client, "q", nil)
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	if err := p.Enqueue(ctx, "a", order{Item: "tea", Qty: 1}); err != nil {
		t.Fatal(err)
	}
	got := failure(func(tb streamqtest.TB) {
		streamqtest.Drain(ctx, tb, client, "q", idle{}, &streamqtest.DrainOptions{Timeout: 200 * time.Millisecond})
	})
	if !strings.Contains(got, "not drained after 200ms: 1 entries in the stream") {
		t.Fatalf("failure %q", got)
	}
}

func TestDrainLeavesLaterJobs(t *testing.T) {
	ctx := context.Background()
	client, _ := streamqtest.NewMiniredis(t)
	var mu sync.Mutex
	var ran []string
	c, err := streamq.NewConsumer(client, "q", func(ctx context.Context, m *streamq.Message[order]) (receipt, error) {
		mu.Lock()
		ran = append(ran, m.ID)
		mu.Unlock()
		return receipt{}, nil
	}, &streamq.ConsumerOptions{ReadBlock: 50 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	p, err := streamq.NewProducer[order, receipt](client, "q", nil)
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	if err := p.Enqueue(ctx, "now", order{Item: "tea"}); err != nil {
		t.Fatal(err)
	}
	if err := p.Enqueue(ctx, "tomorrow", order{Item: "tea"}, streamq.After(24*time.Hour)); err != nil {
		t.Fatal(err)
	}
	streamqtest.Drain(ctx, t, client, "q", c, nil)
	mu.Lock()
	defer mu.Unlock()
	if strings.Join(ran, ",") != "now" {
		t.Fatalf("ran %v, want [now]", ran)
	}
	streamqtest.RequireProduced(ctx, t, client, "q", "tomorrow", &streamqtest.RequireOptions{State: streamq.JobScheduled, Payload: order{Item: "tea"}})
}

func TestNewClientBackend(t *testing.T) {
	t.Setenv(streamqtest.BackendEnv, string(streamqtest.Miniredis))
	c := streamqtest.NewClient(t)
	if got := streamqtest.ClientBackend(c); got != streamqtest.Miniredis {
		t.Fatalf("backend %q, want miniredis", got)
	}
	if err := c.Ping(context.Background()).Err(); err != nil {
		t.Fatal(err)
	}
	t.Setenv(streamqtest.BackendEnv, "nonsense")
	if got := failure(func(tb streamqtest.TB) { streamqtest.NewClient(tb) }); !strings.Contains(got, "STREAMQTEST_BACKEND") {
		t.Fatalf("failure %q", got)
	}
}

// TestPriorityLevels: RequireProduced finds a request queued on a priority
// level's stream, with its payload, and Drain runs every level.
func TestPriorityLevels(t *testing.T) {
	ctx := context.Background()
	client, _ := streamqtest.NewMiniredis(t)
	p, err := streamq.NewProducer[order, receipt](client, "q", nil)
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	for id, lvl := range map[string]streamq.PriorityLevel{"h": streamq.PriorityHigh, "l": streamq.PriorityLow, "n": streamq.PriorityNormal} {
		if err := p.Enqueue(ctx, id, order{Item: id}, streamq.Priority(lvl)); err != nil {
			t.Fatal(err)
		}
	}
	for _, id := range []string{"h", "l", "n"} {
		streamqtest.RequireProduced(ctx, t, client, "q", id, &streamqtest.RequireOptions{State: streamq.JobQueued, Payload: order{Item: id}})
	}
	var mu sync.Mutex
	ran := map[string]streamq.PriorityLevel{}
	c, err := streamq.NewConsumer(client, "q", func(ctx context.Context, m *streamq.Message[order]) (receipt, error) {
		mu.Lock()
		ran[m.ID] = m.Priority
		mu.Unlock()
		return receipt{}, nil
	}, &streamq.ConsumerOptions{ReadBlock: 50 * time.Millisecond, ClaimInterval: 50 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	streamqtest.Drain(ctx, t, client, "q", c, nil)
	mu.Lock()
	defer mu.Unlock()
	want := map[string]streamq.PriorityLevel{"h": streamq.PriorityHigh, "l": streamq.PriorityLow, "n": streamq.PriorityNormal}
	if len(ran) != 3 || ran["h"] != want["h"] || ran["l"] != want["l"] || ran["n"] != want["n"] {
		t.Fatalf("ran %v, want %v", ran, want)
	}
}

// TestRequireProducedRetrying: a retry waiting for its back-off is in state
// JobRetrying, as Admin.Job reports it, and its payload is the one produced.
func TestRequireProducedRetrying(t *testing.T) {
	client := streamqtest.NewClient(t)
	ctx := context.Background()
	c, err := streamq.NewConsumer(client, "q", func(ctx context.Context, m *streamq.Message[order]) (receipt, error) {
		return receipt{}, streamq.RetryAfter(errors.New("supplier down"), 24*time.Hour)
	}, &streamq.ConsumerOptions{ReadBlock: 50 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	p, err := streamq.NewProducer[order, receipt](client, "q", nil)
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	if err := p.Enqueue(ctx, "flaky", order{Item: "tea"}); err != nil {
		t.Fatal(err)
	}
	streamqtest.Drain(ctx, t, client, "q", c, nil)
	streamqtest.RequireProduced(ctx, t, client, "q", "flaky", &streamqtest.RequireOptions{State: streamq.JobRetrying, Payload: order{Item: "tea"}})
}
