package streamq

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/streamq/streamq/internal/faultproxy"
)

// proxiedProducer returns a producer whose client (with readTimeout) reaches
// the shared real redis-server through a fault proxy, a direct client, and the proxy.
func proxiedProducer(t *testing.T, q string, readTimeout time.Duration, opts *ProducerOptions, hooks ...redis.Hook) (*Producer[string, string], *redis.Client, *faultproxy.Proxy) {
	t.Helper()
	direct := realRedis(t)
	px, err := faultproxy.New(direct.Options().Addr)
	require.NoError(t, err)
	t.Cleanup(func() { _ = px.Close() })
	client := redis.NewClient(&redis.Options{Addr: px.Addr(), ReadTimeout: readTimeout})
	for _, h := range hooks {
		client.AddHook(h)
	}
	t.Cleanup(func() { _ = client.Close() })
	if opts == nil {
		opts = &ProducerOptions{}
	}
	opts.Logger = testLogger(t)
	p, err := NewProducer[string, string](client, q, opts)
	require.NoError(t, err)
	return p, direct, px
}

// returnsWithin runs fn in a goroutine and fails the test unless it returns
// within d. It returns fn's error.
func returnsWithin(t *testing.T, d time.Duration, what string, fn func() error) error {
	t.Helper()
	done := make(chan error, 1)
	go func() { done <- fn() }()
	select {
	case err := <-done:
		return err
	case <-time.After(d):
		t.Fatalf("%s did not return within %v", what, d)
		return nil
	}
}

// A connection that stalls while the first Produce subscribes must not hold
// that caller past its context, nor other callers past theirs, nor Close.
func TestFirstProduceDuringStallReturnsWithinContext(t *testing.T) {
	q := queueName(t)
	const closeTimeout = 500 * time.Millisecond
	p, _, px := proxiedProducer(t, q, 5*time.Second, &ProducerOptions{CloseTimeout: closeTimeout})
	ctx := context.Background()
	// The shard count is recorded and the connection pool is warm; then the
	// connection stalls just as the first Produce subscribes.
	require.NoError(t, p.Enqueue(ctx, "warm", "x"))
	px.Stall(time.Minute)
	defer px.Resume()

	// A call stuck on the stall would take the 5 s ReadTimeout or more; the
	// grace only absorbs scheduling on a loaded machine.
	const grace = 500 * time.Millisecond
	type result struct {
		err error
		at  time.Time
	}
	start := time.Now()
	cctx, cancel := context.WithCancel(ctx)
	first := make(chan result, 1)
	go func() {
		_, err := p.Produce(cctx, "a", "x")
		first <- result{err, time.Now()}
	}()
	second := make(chan result, 1)
	dctx, dcancel := context.WithTimeout(ctx, time.Second)
	defer dcancel()
	go func() {
		_, err := p.Produce(dctx, "b", "x")
		second <- result{err, time.Now()}
	}()
	batch := make(chan result, 1)
	go func() {
		_, err := p.ProduceBatch(dctx, []Job[string]{{ID: "c", Request: "x"}})
		batch <- result{err, time.Now()}
	}()
	enq := make(chan result, 1)
	go func() {
		err := p.Enqueue(dctx, "d", "x")
		enq <- result{err, time.Now()}
	}()

	time.Sleep(200 * time.Millisecond) // let the first call reach the subscription
	cancel()
	cancelledAt := time.Now()
	select {
	case r := <-first:
		require.ErrorIs(t, r.err, context.Canceled)
		require.LessOrEqual(t, r.at.Sub(cancelledAt), grace, "the cancelled Produce returned late")
	case <-time.After(5 * time.Second):
		t.Fatalf("the cancelled Produce did not return within 5s of its cancellation")
	}
	deadline := start.Add(time.Second)
	for name, ch := range map[string]chan result{"Produce": second, "ProduceBatch": batch, "Enqueue": enq} {
		select {
		case r := <-ch:
			require.ErrorIs(t, r.err, context.DeadlineExceeded, name)
			require.LessOrEqual(t, r.at.Sub(deadline), grace, "%s with a 1s deadline returned late", name)
		case <-time.After(5 * time.Second):
			t.Fatalf("%s with a 1s deadline did not return within 5s", name)
		}
	}
	closeStart := time.Now()
	require.NoError(t, returnsWithin(t, 10*time.Second, "Close", p.Close))
	require.LessOrEqual(t, time.Since(closeStart), closeTimeout+grace, "Close took longer than CloseTimeout")
	px.Resume()
	waitStopped(t, p)
}

// waitStopped waits until every goroutine of the closed producer p ended.
func waitStopped(t *testing.T, p *Producer[string, string]) {
	t.Helper()
	select {
	case <-p.stopped:
	case <-time.After(30 * time.Second):
		t.Fatal("the producer's goroutines did not end after the stall")
	}
}

// Once subscribed, a stalled connection holds no caller past its context:
// not a batch round trip, not a coalesced send, not the budget, and Close
// returns within CloseTimeout, answering callers without a deadline.
func TestCallsDuringStallReturnWithinContextAndClose(t *testing.T) {
	q := queueName(t)
	const closeTimeout = 500 * time.Millisecond
	p, _, px := proxiedProducer(t, q, 5*time.Second, &ProducerOptions{CloseTimeout: closeTimeout, BackstopInterval: 20 * time.Millisecond})
	ctx := context.Background()
	_, err := p.Produce(ctx, "warm", "x")
	require.NoError(t, err)
	px.Stall(time.Minute)
	defer px.Resume()

	// A call stuck on the stall would take the 5 s ReadTimeout or more; the
	// grace only absorbs scheduling on a loaded machine (109 ms was seen).
	const grace = 500 * time.Millisecond
	// Calls without a deadline, blocked in Redis I/O (the backstop's MGET too).
	noDeadline := make(chan error, 3)
	go func() { _, err := p.ProduceBatch(ctx, []Job[string]{{ID: "b1", Request: "x"}}); noDeadline <- err }()
	go func() { noDeadline <- p.Enqueue(ctx, "e1", "x") }()
	go func() { _, err := p.Produce(ctx, "p1", "x"); noDeadline <- err }()
	// Calls with one return by their deadline.
	for _, name := range []string{"Produce", "ProduceBatch", "Enqueue"} {
		dctx, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
		deadline, _ := dctx.Deadline()
		err := returnsWithin(t, 5*time.Second, name, func() error {
			switch name {
			case "Produce":
				_, err := p.Produce(dctx, name, "x")
				return err
			case "ProduceBatch":
				_, err := p.ProduceBatch(dctx, []Job[string]{{ID: name, Request: "x"}})
				return err
			default:
				return p.Enqueue(dctx, name, "x")
			}
		})
		cancel()
		require.ErrorIs(t, err, context.DeadlineExceeded, name)
		require.LessOrEqual(t, time.Since(deadline), grace, "%s returned late", name)
	}
	start := time.Now()
	require.NoError(t, returnsWithin(t, 10*time.Second, "Close", p.Close))
	require.LessOrEqual(t, time.Since(start), closeTimeout+grace, "Close took longer than CloseTimeout")
	for range 3 {
		select {
		case err := <-noDeadline:
			require.ErrorIs(t, err, ErrClosed)
		case <-time.After(grace):
			t.Fatal("a call without a deadline was still blocked after Close returned")
		}
	}
	px.Resume()
	waitStopped(t, p)
}

// Produce and the other ctx-taking calls with a nil context say so, and a
// producer that saw such a call stays usable and closable.
func TestNilContextLeavesProducerUsable(t *testing.T) {
	client := realRedis(t)
	q := queueName(t)
	p, err := NewProducer[string, string](client, q, &ProducerOptions{Logger: testLogger(t)})
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	// Subscribed first, so the nil context reaches the send path.
	pr, err := p.Produce(ctx, "first", "x")
	require.NoError(t, err)

	got := map[string]any{}
	panics := func(name string, fn func()) {
		defer func() { got[name] = recover() }()
		fn()
	}
	// Nil contexts on purpose (staticcheck SA1012 flags them, rightly).
	panics("Produce", func() { _, _ = p.Produce(nil, "n1", "x") })
	panics("Enqueue", func() { _ = p.Enqueue(nil, "n2", "x") })
	panics("ProduceBatch", func() { _, _ = p.ProduceBatch(nil, []Job[string]{{ID: "n3", Request: "x"}}) })
	panics("Wait", func() { _, _ = pr.Wait(nil) })

	// Still usable: every call works, and Close returns.
	_, err = p.Produce(ctx, "after", "x")
	require.NoError(t, err)
	require.NoError(t, p.Enqueue(ctx, "after2", "x"))
	_, err = p.ProduceBatch(ctx, []Job[string]{{ID: "after3", Request: "x"}})
	require.NoError(t, err)
	require.NoError(t, returnsWithin(t, 10*time.Second, "Close", p.Close))
	_, err = pr.Wait(ctx)
	require.ErrorIs(t, err, ErrClosed)
	for _, name := range []string{"Produce", "Enqueue", "ProduceBatch", "Wait"} {
		require.NotNil(t, got[name], "%s(nil, ...) did not panic", name)
		require.Contains(t, fmt.Sprint(got[name]), "nil Context", "%s(nil, ...) panic message", name)
	}
}

// panicCodec panics in Marshal for the request "boom" and in Unmarshal of any
// response; otherwise it is JSON.
type panicCodec struct{ JSONCodec }

var errCodecBug = errors.New("codec bug")

func (c panicCodec) Marshal(v any) ([]byte, error) {
	if s, ok := v.(string); ok && s == "boom" {
		panic(errCodecBug)
	}
	return c.JSONCodec.Marshal(v)
}

func (panicCodec) Unmarshal(data []byte, v any) error {
	panic("cannot take " + string(data))
}

// A panic in a user codec on the producer side is an error returned to the
// caller, not a crash of its goroutine.
func TestCodecPanicInProducerIsAnError(t *testing.T) {
	client := realRedis(t)
	q := queueName(t)
	p, err := NewProducer[string, string](client, q, &ProducerOptions{Codec: panicCodec{}, Logger: testLogger(t)})
	require.NoError(t, err)
	defer p.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()

	_, err = p.Produce(ctx, "m1", "boom")
	require.ErrorIs(t, err, errCodecBug, "the panic value is wrapped")
	require.Contains(t, err.Error(), "panicked")
	require.ErrorIs(t, p.Enqueue(ctx, "m2", "boom"), errCodecBug)
	_, err = p.ProduceBatch(ctx, []Job[string]{{ID: "m3", Request: "fine"}, {ID: "m4", Request: "boom"}})
	require.ErrorIs(t, err, errCodecBug)

	// The response decoder panics: Wait returns an error, every time.
	c, err := NewConsumer(client, q, func(ctx context.Context, m *Message[string]) (string, error) {
		return "answer", nil
	}, &ConsumerOptions{ReadBlock: 50 * time.Millisecond, Logger: testLogger(t)})
	require.NoError(t, err)
	runConsumer(t, c)
	pr, err := p.Produce(ctx, "u1", "fine")
	require.NoError(t, err)
	for range 2 {
		_, err = pr.Wait(ctx)
		require.Error(t, err)
		require.Contains(t, err.Error(), "panicked")
		require.Contains(t, err.Error(), "cannot take")
	}
	// The producer still works.
	require.NoError(t, p.Enqueue(ctx, "m5", "fine"))
}

// missNotice produces one request through a proxied producer and makes its
// completion notice miss the producer: the producer's connections drop and
// stay down while the request completes (with resultTTL) and, when expire is
// set, while its result expires. Before the connections come back, armMGet
// (when not nil) is told to fail that many MGETs of the producer's client.
// It returns the promise.
func missNotice(t *testing.T, resultTTL time.Duration, expire bool, armMGet *failMGet, fails int64) *Promise[string] {
	q := queueName(t)
	var hooks []redis.Hook
	if armMGet != nil {
		hooks = append(hooks, armMGet)
	}
	p, direct, px := proxiedProducer(t, q, 500*time.Millisecond, &ProducerOptions{BackstopInterval: time.Hour}, hooks...)
	t.Cleanup(func() { _ = p.Close() })
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	gate := make(chan struct{})
	c, err := NewConsumer(direct, q, func(ctx context.Context, m *Message[string]) (string, error) {
		<-gate
		return "done", nil
	}, &ConsumerOptions{ResultTTL: resultTTL, ReadBlock: 50 * time.Millisecond, Logger: testLogger(t)})
	require.NoError(t, err)
	runConsumer(t, c)
	pr, err := p.Produce(ctx, "lost", "x")
	require.NoError(t, err)

	channel := "streamq:{" + q + "}:done"
	px.Stall(time.Minute)
	px.Cut()
	eventually(t, 10*time.Second, func() bool {
		n, err := direct.PubSubNumSub(ctx, channel).Result()
		return err == nil && n[channel] == 0
	}, "the producer's subscription did not end")
	close(gate)
	record := "streamq:{" + q + "}:id:lost"
	eventually(t, 10*time.Second, func() bool { return direct.Get(ctx, record).Val() == `R"done"` }, "no result recorded")
	if expire {
		eventually(t, 10*time.Second, func() bool { return direct.Exists(ctx, record).Val() == 0 }, "the result did not expire")
	}
	if armMGet != nil {
		armMGet.n.Store(fails)
	}
	px.Resume()
	return pr
}

// A notice missed during an outage longer than ResultTTL ends in
// ErrRecordLost; its advice must be true: the request may have run, and
// producing it again may run it again.
func TestMissedNoticeAndExpiredResultSaysItMayHaveRun(t *testing.T) {
	pr := missNotice(t, 200*time.Millisecond, true, nil, 0)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	// The resubscription checks at once (BackstopInterval is an hour).
	_, err := pr.Wait(ctx)
	require.ErrorIs(t, err, ErrRecordLost)
	msg := err.Error()
	require.Contains(t, msg, "may have run", "the advice says the request may have completed: %s", msg)
	require.Contains(t, msg, "ResultTTL", "the advice names the option to raise: %s", msg)
	require.False(t, strings.Contains(msg, "; produce the id again"), "the advice must not promise a harmless retry: %s", msg)
}

// failMGet fails the next n MGET commands, as a connection not yet usable
// right after an outage would.
type failMGet struct{ n atomic.Int64 }

func (h *failMGet) DialHook(next redis.DialHook) redis.DialHook { return next }
func (h *failMGet) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if cmd.Name() == "mget" && h.n.Load() > 0 && h.n.Add(-1) >= 0 {
			cmd.SetErr(errors.New("injected: connection not ready"))
			return cmd.Err()
		}
		return next(ctx, cmd)
	}
}
func (h *failMGet) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}

// When the record check that follows a resubscription fails, it is tried
// again soon, not a BackstopInterval later: the missed result is found while
// its record lives.
func TestFailedCheckAfterMissedNoticeIsRetriedSoon(t *testing.T) {
	h := &failMGet{}
	pr := missNotice(t, time.Hour, false, h, 2)
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	got, err := pr.Wait(ctx)
	require.NoError(t, err, "BackstopInterval is an hour: only a prompt retry finds the result")
	require.Equal(t, "done", got)
	require.Zero(t, h.n.Load(), "the injected failures happened")
}

// mgetCounter counts MGET commands.
type mgetCounter struct{ n atomic.Int64 }

func (h *mgetCounter) DialHook(next redis.DialHook) redis.DialHook { return next }
func (h *mgetCounter) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if cmd.Name() == "mget" {
			h.n.Add(1)
		}
		return next(ctx, cmd)
	}
}
func (h *mgetCounter) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}

// Released promises cost nothing: they leave the waiter registry and the
// backstop reads nothing for them.
func TestReleasedPromisesCostNothing(t *testing.T) {
	client := sameServer(realRedis(t))
	defer client.Close()
	hook := &mgetCounter{}
	client.AddHook(hook)
	q := queueName(t)
	p, err := NewProducer[string, string](client, q, &ProducerOptions{BackstopInterval: time.Hour, Logger: testLogger(t)})
	require.NoError(t, err)
	defer p.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()

	const n = 100_000
	promises := make([]*Promise[string], 0, n)
	jobs := make([]Job[string], 0, DefaultMaxBatchItems)
	for i := 0; i < n; i += DefaultMaxBatchItems {
		jobs = jobs[:0]
		for j := i; j < min(n, i+DefaultMaxBatchItems); j++ {
			jobs = append(jobs, Job[string]{ID: fmt.Sprint("r", j), Request: "x"})
		}
		prs, err := p.ProduceBatch(ctx, jobs)
		require.NoError(t, err)
		promises = append(promises, prs...)
	}
	require.Equal(t, n, p.waiters.len())
	require.NoError(t, p.checkWaiting(ctx))
	require.Positive(t, hook.n.Load(), "the backstop reads waiting records")

	// One id is also held by a second promise, which keeps waiting.
	kept, err := p.Produce(ctx, "r0", "x")
	require.NoError(t, err)
	for _, pr := range promises {
		pr.Release()
		pr.Release() // idempotent
	}
	require.Equal(t, 1, p.waiters.len(), "only the id still held by a promise is waiting")
	kept.Release()
	require.Equal(t, 0, p.waiters.len())
	hook.n.Store(0)
	require.NoError(t, p.checkWaiting(ctx))
	require.Zero(t, hook.n.Load(), "the backstop read records of released promises")

	_, err = promises[1].Wait(ctx)
	require.ErrorIs(t, err, ErrReleased)
	_, err = kept.Wait(ctx)
	require.ErrorIs(t, err, ErrReleased)
}
