package streamq

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/streamq/streamq/internal/faultproxy"
)

// stallClient returns a client of the shared real redis-server through a
// fault proxy, with a ReadTimeout far beyond the short contexts the stall
// tests give their calls (so a call that waits for the client's timeouts
// shows), and a pool large enough that no call waits for a connection.
func stallClient(t *testing.T) (*redis.Client, *redis.Client, *faultproxy.Proxy) {
	t.Helper()
	direct := realRedis(t)
	px, err := faultproxy.New(direct.Options().Addr)
	require.NoError(t, err)
	t.Cleanup(func() { _ = px.Close() })
	client := redis.NewClient(&redis.Options{Addr: px.Addr(), ReadTimeout: 5 * time.Second, PoolSize: 128})
	t.Cleanup(func() { _ = client.Close() })
	return direct, client, px
}

// stallCall is one public call made while the connection stalls.
type stallCall struct {
	name string
	call func(ctx context.Context) error
}

// callsDuringStall stalls px and makes every call at once, each with a ctx
// of 200ms: each must return ctx's error within a second of its ctx's end.
// The stall ends with the test (the abandoned calls then finish).
func callsDuringStall(t *testing.T, px *faultproxy.Proxy, calls []stallCall) {
	t.Helper()
	const timeout = 200 * time.Millisecond
	type result struct {
		err  error
		took time.Duration
	}
	results := make([]result, len(calls))
	px.Stall(time.Minute)
	var wg sync.WaitGroup
	for i, c := range calls {
		wg.Go(func() {
			ctx, cancel := context.WithTimeout(context.Background(), timeout)
			defer cancel()
			t0 := time.Now()
			err := c.call(ctx)
			results[i] = result{err, time.Since(t0)}
		})
	}
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(20 * time.Second):
		px.Resume()
		<-done
		t.Error("calls still stalled after 20s; the stall was ended")
	}
	px.Resume()
	for i, c := range calls {
		r := results[i]
		assert.ErrorIs(t, r.err, context.DeadlineExceeded, "%s: took %v", c.name, r.took)
		assert.Less(t, r.took, timeout+time.Second, "%s returned late (ctx %v): %v", c.name, timeout, r.err)
	}
}

// TestAdminCallsReturnWithinContextDuringStall: every Admin method (and
// Queues) returns ctx's error when its ctx ends, also while the connection
// stalls (Redis or the network stops answering). Before, each waited for the
// client's ReadTimeout (5s here) whatever its ctx said: go-redis does not
// interrupt a socket read when the ctx ends.
func TestAdminCallsReturnWithinContextDuringStall(t *testing.T) {
	t.Parallel()
	direct, client, px := stallClient(t)
	q := queueName(t)
	p := newStringProducer(t, direct, q)
	require.NoError(t, p.Enqueue(context.Background(), "job", "x"))
	a, err := NewAdmin(client, q, nil)
	require.NoError(t, err)
	_, err = a.Stats(waitCtx(t, 10*time.Second)) // checks the server once
	require.NoError(t, err)

	calls := []stallCall{
		{"Stats", func(ctx context.Context) error { _, err := a.Stats(ctx); return err }},
		{"Keys", func(ctx context.Context) error { _, err := a.Keys(ctx); return err }},
		{"History", func(ctx context.Context) error { _, err := a.History(ctx, time.Hour); return err }},
		{"Completed", func(ctx context.Context) error { _, err := a.Completed(ctx, "", 10); return err }},
		{"DeadLetters", func(ctx context.Context) error { _, err := a.DeadLetters(ctx, "", 10); return err }},
		{"DeadLetter", func(ctx context.Context) error { _, err := a.DeadLetter(ctx, "1-1"); return err }},
		{"Requeue", func(ctx context.Context) error { _, err := a.Requeue(ctx, "1-1"); return err }},
		{"PurgeDeadLetters", func(ctx context.Context) error { _, err := a.PurgeDeadLetters(ctx, "1-1"); return err }},
		{"RequeueAll", func(ctx context.Context) error { _, err := a.RequeueAll(ctx, DeadLetterFilter{}); return err }},
		{"PurgeMatching", func(ctx context.Context) error { _, err := a.PurgeMatching(ctx, DeadLetterFilter{}); return err }},
		{"Job", func(ctx context.Context) error { _, err := a.Job(ctx, "job"); return err }},
		{"Forget", func(ctx context.Context) error { return a.Forget(ctx, "job", false) }},
		{"Cancel", func(ctx context.Context) error { return a.Cancel(ctx, "job") }},
		{"RunNow", func(ctx context.Context) error { return a.RunNow(ctx, "job") }},
		{"Jobs", func(ctx context.Context) error { _, err := a.Jobs(ctx, JobsQuery{State: JobQueued}); return err }},
		{"TopKeys", func(ctx context.Context) error { _, err := a.TopKeys(ctx, 5); return err }},
		{"KeyStats", func(ctx context.Context) error { _, err := a.KeyStats(ctx, "k"); return err }},
		{"PauseKey", func(ctx context.Context) error { return a.PauseKey(ctx, "k") }},
		{"ResumeKey", func(ctx context.Context) error { return a.ResumeKey(ctx, "k") }},
		{"SetKeyLimit", func(ctx context.Context) error { return a.SetKeyLimit(ctx, "k", 2) }},
		{"SetKeyWeight", func(ctx context.Context) error { return a.SetKeyWeight(ctx, "k", 2) }},
		{"SetKeyDefaults", func(ctx context.Context) error { return a.SetKeyDefaults(ctx, 2, 0) }},
		{"SetKeyRate", func(ctx context.Context) error {
			return a.SetKeyRate(ctx, "k", &RateLimit{N: 1, Per: time.Second})
		}},
		{"SetKeyRateDefault", func(ctx context.Context) error {
			return a.SetKeyRateDefault(ctx, &RateLimit{N: 1, Per: time.Second})
		}},
		{"Consumers", func(ctx context.Context) error { _, err := a.Consumers(ctx); return err }},
		{"Trim", func(ctx context.Context) error { _, err := a.Trim(ctx); return err }},
		{"Pause", func(ctx context.Context) error { return a.Pause(ctx) }},
		{"Resume", func(ctx context.Context) error { return a.Resume(ctx) }},
		{"TxKeys", func(ctx context.Context) error { _, err := a.TxKeys(ctx, "n"); return err }},
		{"TxSum", func(ctx context.Context) error { _, err := a.TxSum(ctx, "n"); return err }},
		{"Queues", func(ctx context.Context) error { _, err := Queues(ctx, client); return err }},
	}
	callsDuringStall(t, px, calls)
}

// TestAdminStallFirstCall: an Admin's first call also checks the server
// (one round trip more, before the call's own): it too ends with its ctx.
func TestAdminStallFirstCall(t *testing.T) {
	t.Parallel()
	_, client, px := stallClient(t)
	q := queueName(t)
	var calls []stallCall
	for i := range 3 {
		a, err := NewAdmin(client, q, nil)
		require.NoError(t, err)
		calls = append(calls, stallCall{fmt.Sprintf("Stats#%d", i), func(ctx context.Context) error { _, err := a.Stats(ctx); return err }})
	}
	callsDuringStall(t, px, calls)
}

// TestClientCallsReturnWithinContextDuringStall: the consumer's and the
// producer's public calls made outside a handler return within their ctx
// while the connection stalls, as the Admin's do.
func TestClientCallsReturnWithinContextDuringStall(t *testing.T) {
	t.Parallel()
	_, client, px := stallClient(t)
	q := queueName(t)
	p := newStringProducer(t, client, q)
	require.NoError(t, p.Enqueue(waitCtx(t, 10*time.Second), "warm", "x")) // the producer's setup
	c, err := NewConsumer(client, q, func(ctx context.Context, m *Message[string]) (string, error) {
		return "ok", nil
	}, fastOpts(t, "stall", 30*time.Second))
	require.NoError(t, err)

	calls := []stallCall{
		{"Consumer.Trim", func(ctx context.Context) error { _, err := c.Trim(ctx); return err }},
		{"Consumer.PruneConsumers", func(ctx context.Context) error { _, err := c.PruneConsumers(ctx); return err }},
		{"Producer.Enqueue", func(ctx context.Context) error { return p.Enqueue(ctx, "e", "x") }},
		{"Producer.Produce", func(ctx context.Context) error { _, err := p.Produce(ctx, "p", "x"); return err }},
		{"Producer.EnqueueBatch", func(ctx context.Context) error {
			return p.EnqueueBatch(ctx, []Job[string]{{ID: "b1", Request: "x"}})
		}},
		{"Producer.ProduceBatch", func(ctx context.Context) error {
			_, err := p.ProduceBatch(ctx, []Job[string]{{ID: "b2", Request: "x"}})
			return err
		}},
		{"Producer.ProduceFlow", func(ctx context.Context) error {
			_, err := p.ProduceFlow(ctx, "f", "x", []Child{ChildOf(NewQueue[string, string](q), "f1", "x")}, nil)
			return err
		}},
		{"Producer.Send+Flush", func(ctx context.Context) error {
			if err := p.Send(ctx, "s", "x"); err != nil {
				return err
			}
			return p.Flush(ctx)
		}},
	}
	callsDuringStall(t, px, calls)
}

// TestChildrenReturnsWithinContextDuringStall: Message.Children, one read
// bounded by its ctx as documented, returns when its ctx ends also while
// the connection stalls, so the parent's handler goes on.
func TestChildrenReturnsWithinContextDuringStall(t *testing.T) {
	t.Parallel()
	handlerCallDuringStall(t, "Children", "parent",
		func(ctx context.Context, p *Producer[string, string], q string) (*Promise[string], error) {
			return p.ProduceFlow(ctx, "parent", "x", []Child{ChildOf(NewQueue[string, string](q), "child", "x")}, nil)
		},
		func(ctx context.Context, m *Message[string]) error {
			_, err := m.Children(ctx)
			return err
		})
}

// handlerCallDuringStall runs call in the handler of request id (produced
// by produce; other requests of the queue just complete) while the
// consumer's connection stalls, with a ctx of 200 ms: call must return the
// ctx's error within a second, not when the stall ends, and the request
// then completes.
func handlerCallDuringStall(t *testing.T, name, id string,
	produce func(ctx context.Context, p *Producer[string, string], q string) (*Promise[string], error),
	call func(ctx context.Context, m *Message[string]) error) {
	t.Helper()
	direct, client, px := stallClient(t)
	q := queueName(t)
	started, proceed := make(chan struct{}), make(chan struct{})
	type result struct {
		err  error
		took time.Duration
	}
	done := make(chan result, 1)
	c, err := NewConsumer(client, q, func(ctx context.Context, m *Message[string]) (string, error) {
		if m.ID != id {
			return "other", nil
		}
		close(started)
		<-proceed
		cctx, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
		defer cancel()
		t0 := time.Now()
		err := call(cctx, m)
		done <- result{err, time.Since(t0)}
		return "ok", nil
	}, fastOpts(t, "stall", 30*time.Second))
	require.NoError(t, err)
	runConsumer(t, c)
	pr, err := produce(waitCtx(t, 10*time.Second), newStringProducer(t, direct, q), q)
	require.NoError(t, err)
	<-started

	px.Stall(time.Minute)
	close(proceed)
	var r result
	select {
	case r = <-done:
	case <-time.After(4 * time.Second):
		px.Resume()
		r = <-done
		t.Fatalf("%s returned after %v (ctx 200ms), only once the stall ended", name, r.took)
	}
	px.Resume()
	require.ErrorIs(t, r.err, context.DeadlineExceeded)
	require.Less(t, r.took, time.Second, "%s returned late", name)
	_, err = pr.Wait(waitCtx(t, 20*time.Second))
	require.NoError(t, err)
}

// stallOnHook stalls the proxy right before the first command named one of
// names whose arguments include arg is sent.
type stallOnHook struct {
	px    *faultproxy.Proxy
	names []string
	arg   string
	once  sync.Once
}

func (h *stallOnHook) DialHook(next redis.DialHook) redis.DialHook { return next }

func (h *stallOnHook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}

func (h *stallOnHook) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if slices.Contains(h.names, cmd.Name()) && slices.ContainsFunc(cmd.Args(), func(a any) bool { return a == h.arg }) {
			h.once.Do(func() { h.px.Stall(time.Minute) })
		}
		return next(ctx, cmd)
	}
}

// TestAdminRequeueAllStalledReturnsWhatItDid: when RequeueAll's ctx ends
// while a requeue waits for a stalled connection, it returns at once what
// it did by then (Done false, no error, as when ctx ends between two
// requeues). The requeue it gave up on still lands once the stall ends (as
// a write whose reply was lost), and nothing after it is sent: the third
// dead letter stays.
func TestAdminRequeueAllStalledReturnsWhatItDid(t *testing.T) {
	t.Parallel()
	direct, client, px := stallClient(t)
	q := queueName(t)
	dls := deadLetters(t, direct, q, "d1", "d2", "d3")
	client.AddHook(&stallOnHook{px: px, names: []string{"evalsha", "eval"}, arg: dls[1].DeadLetterID})
	a, err := NewAdmin(client, q, nil)
	require.NoError(t, err)

	ctx, cancel := context.WithTimeout(context.Background(), 500*time.Millisecond)
	defer cancel()
	t0 := time.Now()
	res, err := a.RequeueAll(ctx, DeadLetterFilter{})
	took := time.Since(t0)
	px.Resume()
	require.NoError(t, err)
	require.Less(t, took, 1500*time.Millisecond, "RequeueAll returned late")
	require.False(t, res.Done)
	require.EqualValues(t, 1, res.Requeued, "d1 requeued; d2's requeue was given up on")

	da, err := NewAdmin(direct, q, nil)
	require.NoError(t, err)
	eventually(t, 10*time.Second, func() bool {
		left, err := da.DeadLetters(context.Background(), "", 10)
		return err == nil && len(left) == 1
	}, "d2's requeue lands once the stall ends")
	left, err := da.DeadLetters(context.Background(), "", 10)
	require.NoError(t, err)
	require.Len(t, left, 1)
	require.Equal(t, "d3", left[0].ID, "nothing after the abandoned requeue is sent")
}
