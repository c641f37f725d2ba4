package streamq

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/redis/go-redis/v9"
	"github.com/streamq/streamq/internal/keys"
	"github.com/stretchr/testify/require"
)

type ctxKey struct{}

// TestHeadersAndTiming: headers set per call and by an interceptor from ctx
// reach the handler and the middleware, with the message's times.
func TestHeadersAndTiming(t *testing.T) {
	backends(t, func(t *testing.T, client *redis.Client) {
		ctx := context.Background()
		q := queueName(t)
		var outs []Outgoing
		var mu sync.Mutex
		fromCtx := func(ctx context.Context, msgs []*Outgoing, next func(context.Context) error) error {
			for _, m := range msgs {
				if v, ok := ctx.Value(ctxKey{}).(string); ok {
					if m.Headers == nil {
						m.Headers = map[string]string{}
					}
					m.Headers["from-ctx"] = v
				}
			}
			err := next(ctx)
			mu.Lock()
			for _, m := range msgs {
				outs = append(outs, *m)
			}
			mu.Unlock()
			return err
		}
		p, err := NewProducer[string, string](client, q, &ProducerOptions{Logger: testLogger(t),
			Interceptors: []ProduceInterceptor{fromCtx}})
		require.NoError(t, err)
		defer p.Close()

		type seen struct {
			msg Message[string]
			d   Delivery
		}
		got := make(chan seen, 10)
		var last sync.Map
		mw := func(ctx context.Context, d *Delivery, next func(context.Context) error) error {
			last.Store(d.ID, *d)
			return next(ctx)
		}
		c, err := NewConsumer(client, q, func(ctx context.Context, m *Message[string]) (string, error) {
			d, _ := last.Load(m.ID)
			got <- seen{*m, d.(Delivery)}
			return m.Headers["k"], nil
		}, &ConsumerOptions{Logger: testLogger(t), Middleware: []Middleware{mw}})
		require.NoError(t, err)

		before := time.Now()
		pctx := context.WithValue(ctx, ctxKey{}, "trace-1")
		pr, err := p.Produce(pctx, "a", "x", Headers(map[string]string{"k": "v1"}), Headers(map[string]string{"k2": "v2"}))
		require.NoError(t, err)
		require.NoError(t, p.Enqueue(ctx, "b", "y"))
		prs, err := p.ProduceBatch(pctx, []Job[string]{{ID: "c", Request: "z", Options: []ProduceOption{Headers(map[string]string{"k": "v3"})}}})
		require.NoError(t, err)
		runConsumer(t, c)

		wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		defer cancel()
		res, err := pr.Wait(wctx)
		require.NoError(t, err)
		require.Equal(t, "v1", res)
		res, err = prs[0].Wait(wctx)
		require.NoError(t, err)
		require.Equal(t, "v3", res)

		byID := map[string]seen{}
		for range 3 {
			select {
			case s := <-got:
				byID[s.msg.ID] = s
			case <-wctx.Done():
				t.Fatal("handler not called 3 times")
			}
		}
		require.Equal(t, map[string]string{"k": "v1", "k2": "v2", "from-ctx": "trace-1"}, byID["a"].msg.Headers)
		require.Nil(t, byID["b"].msg.Headers, "no header set, none stored")
		require.Equal(t, map[string]string{"k": "v3", "from-ctx": "trace-1"}, byID["c"].msg.Headers)
		for id, s := range byID {
			m, d := s.msg, s.d
			require.Equal(t, m.Headers, d.Headers, id)
			require.Equal(t, Delivery{Queue: q, Group: DefaultGroup, Consumer: c.Name(), ID: id, EntryID: m.EntryID,
				Deliveries: 1, MaxDeliveries: DefaultMaxDeliveries, Headers: m.Headers, ProducedAt: m.ProducedAt,
				ReadAt: m.ReadAt, StartedAt: m.StartedAt}, d)
			// ProducedAt is on Redis's clock (the entry id), milliseconds.
			require.WithinDuration(t, before, m.ProducedAt, time.Minute, id)
			require.False(t, m.ReadAt.Before(before), id)
			require.False(t, m.StartedAt.Before(m.ReadAt), id)
			require.True(t, m.Deadline.IsZero())
		}
		mu.Lock()
		defer mu.Unlock()
		require.Len(t, outs, 3) // the Enqueue too, without a header (none in its ctx)
		for _, o := range outs {
			require.Equal(t, q, o.Queue)
			require.NotEmpty(t, o.EntryID, "EntryID is set after next")
		}
	})
}

// TestHeadersLimits: headers count against MaxPayloadBytes; an empty header
// name is refused.
func TestHeadersLimits(t *testing.T) {
	client, _ := miniRedis(t)
	ctx := context.Background()
	p, err := NewProducer[string, string](client, queueName(t), &ProducerOptions{Logger: testLogger(t), MaxPayloadBytes: 100})
	require.NoError(t, err)
	defer p.Close()
	payload := strings.Repeat("x", 80) // 82 bytes encoded
	require.NoError(t, p.Enqueue(ctx, "fits", payload))
	err = p.Enqueue(ctx, "too-big", payload, Headers(map[string]string{"trace": strings.Repeat("t", 20)}))
	require.ErrorIs(t, err, ErrPayloadTooLarge)
	require.ErrorContains(t, err, "with its headers")
	err = p.Enqueue(ctx, "bad", "x", Headers(map[string]string{"": "v"}))
	require.ErrorIs(t, err, ErrInvalidOptions)
}

// TestForeignEntryWithoutHeaders: entries written without the header field,
// or with one that does not parse, still run.
func TestForeignEntryWithoutHeaders(t *testing.T) {
	client, _ := miniRedis(t)
	ctx := context.Background()
	q := queueName(t)
	a, err := NewAdmin(client, q, nil)
	require.NoError(t, err)
	got := make(chan *Message[string], 2)
	c, err := NewConsumer(client, q, func(ctx context.Context, m *Message[string]) (string, error) {
		got <- m
		return "", nil
	}, &ConsumerOptions{Logger: testLogger(t)})
	require.NoError(t, err)
	runConsumer(t, c)
	eventually(t, 5*time.Second, func() bool { _, err := a.Keys(ctx); return err == nil }, "queue not created")
	stream, _, _, _ := firstShardKeys(t, a)
	require.NoError(t, client.XAdd(ctx, &redis.XAddArgs{Stream: stream, Values: []any{"id", "plain", "p", `"a"`}}).Err())
	require.NoError(t, client.XAdd(ctx, &redis.XAddArgs{Stream: stream, Values: []any{"id", "junk", "p", `"b"`, "h", "{not json", "dl", "soon"}}).Err())
	for range 2 {
		select {
		case m := <-got:
			require.Nil(t, m.Headers, m.ID)
			require.True(t, m.Deadline.IsZero(), m.ID)
		case <-time.After(10 * time.Second):
			t.Fatal("foreign entries not handled")
		}
	}
}

// TestMiddlewareOrderErrorsPanics: the first middleware is outermost; it sees
// the handler's error, a handler panic as ErrPanic, and its own returned
// error is the outcome; a panicking middleware fails the attempt. One
// middleware serves consumers of different types.
func TestMiddlewareOrderErrorsPanics(t *testing.T) {
	client, _ := miniRedis(t)
	ctx := context.Background()
	var mu sync.Mutex
	var trail []string
	var seenErrs []error
	record := func(s string) { mu.Lock(); trail = append(trail, s); mu.Unlock() }
	outer := func(ctx context.Context, d *Delivery, next func(context.Context) error) error {
		record("outer>" + d.ID)
		err := next(context.WithValue(ctx, ctxKey{}, "outer"))
		mu.Lock()
		seenErrs = append(seenErrs, err)
		mu.Unlock()
		record("outer<" + d.ID)
		if d.ID == "swallow" {
			return nil // the outcome is the middleware's
		}
		if d.ID == "mw-fails" {
			return Permanent(errors.New("refused by middleware"))
		}
		return err
	}
	inner := func(ctx context.Context, d *Delivery, next func(context.Context) error) error {
		record("inner>" + d.ID)
		if d.ID == "mw-panics" {
			panic("middleware boom")
		}
		return next(ctx)
	}
	opts := &ConsumerOptions{Logger: testLogger(t), MaxDeliveries: 1, Middleware: []Middleware{outer, inner}}

	q := queueName(t)
	p, err := NewProducer[string, string](client, q, &ProducerOptions{Logger: testLogger(t)})
	require.NoError(t, err)
	defer p.Close()
	c, err := NewConsumer(client, q, func(ctx context.Context, m *Message[string]) (string, error) {
		record("handler:" + ctx.Value(ctxKey{}).(string))
		switch m.ID {
		case "fails", "swallow":
			return "", errors.New("handler failed")
		case "panics":
			panic("handler boom")
		}
		return "ok", nil
	}, opts)
	require.NoError(t, err)
	// The same middleware on a consumer of other types.
	q2 := queueName(t)
	p2, err := NewProducer[sumReq, sumResp](client, q2, &ProducerOptions{Logger: testLogger(t)})
	require.NoError(t, err)
	defer p2.Close()
	c2, err := NewConsumer(client, q2, func(ctx context.Context, m *Message[sumReq]) (sumResp, error) {
		return sumResp{m.Payload.A + m.Payload.B}, nil
	}, opts)
	require.NoError(t, err)
	runConsumer(t, c)
	runConsumer(t, c2)

	wait := func(id string) error {
		pr, err := p.Produce(ctx, id, "x")
		require.NoError(t, err)
		wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		defer cancel()
		_, err = pr.Wait(wctx)
		return err
	}
	reset := func() { mu.Lock(); trail, seenErrs = nil, nil; mu.Unlock() }

	require.NoError(t, wait("ok"))
	require.Equal(t, []string{"outer>ok", "inner>ok", "handler:outer", "outer<ok"}, trail)
	require.Equal(t, []error{nil}, seenErrs)

	reset()
	err = wait("fails")
	require.ErrorIs(t, err, ErrDeadLettered)
	require.ErrorContains(t, err, "handler failed")
	require.EqualError(t, seenErrs[0], "handler failed")

	reset()
	err = wait("panics")
	require.ErrorIs(t, err, ErrDeadLettered)
	require.ErrorContains(t, err, "handler boom")
	require.ErrorIs(t, seenErrs[0], ErrPanic)

	reset()
	require.NoError(t, wait("swallow"), "a middleware returning nil makes the attempt a success")

	reset()
	err = wait("mw-fails")
	require.ErrorContains(t, err, "refused by middleware")
	require.Equal(t, []error{nil}, seenErrs, "the handler succeeded; the middleware's error counts")

	reset()
	err = wait("mw-panics")
	require.ErrorIs(t, err, ErrDeadLettered)
	require.ErrorContains(t, err, "middleware boom")
	require.Equal(t, []string{"outer>mw-panics", "inner>mw-panics"}, trail, "a middleware panic unwinds the chain")

	reset()
	pr2, err := p2.Produce(ctx, "sum", sumReq{2, 3})
	require.NoError(t, err)
	resp, err := pr2.Wait(ctx)
	require.NoError(t, err)
	require.Equal(t, 5, resp.Sum)
	require.Equal(t, []string{"outer>sum", "inner>sum", "outer<sum"}, trail)
}

// TestProduceInterceptor: interceptors run outermost first, their errors are
// the call's, and one that does not call next sends nothing.
func TestProduceInterceptor(t *testing.T) {
	client, _ := miniRedis(t)
	ctx := context.Background()
	q := queueName(t)
	var trail []string
	ic := func(name string) ProduceInterceptor {
		return func(ctx context.Context, msgs []*Outgoing, next func(context.Context) error) error {
			trail = append(trail, name+">"+msgs[0].ID)
			if msgs[0].ID == "drop-"+name {
				return nil
			}
			if msgs[0].ID == "fail-"+name {
				return errors.New(name + " refused")
			}
			err := next(ctx)
			trail = append(trail, name+"<")
			return err
		}
	}
	p, err := NewProducer[string, string](client, q, &ProducerOptions{Logger: testLogger(t),
		Interceptors: []ProduceInterceptor{ic("a"), ic("b")}})
	require.NoError(t, err)
	defer p.Close()
	_, err = p.Produce(ctx, "x", "x")
	require.NoError(t, err)
	require.Equal(t, []string{"a>x", "b>x", "b<", "a<"}, trail)
	require.ErrorIs(t, p.Enqueue(ctx, "drop-b", "x"), ErrIntercepted)
	_, err = p.Produce(ctx, "fail-a", "x")
	require.EqualError(t, err, "a refused")
	_, err = p.ProduceBatch(ctx, []Job[string]{{ID: "drop-a", Request: "x"}})
	require.ErrorIs(t, err, ErrIntercepted)
	trail = nil
	require.NoError(t, p.Send(ctx, "sent", "x"))
	require.NoError(t, p.Flush(ctx))
	require.Equal(t, []string{"a>sent", "b>sent", "b<", "a<"}, trail, "Send is intercepted too")
	a, err := NewAdmin(client, q, nil)
	require.NoError(t, err)
	st, err := a.Stats(ctx)
	require.NoError(t, err)
	require.EqualValues(t, 2, st.Length, "only x and sent were sent")
}

// TestDeadlinePassedNeverRuns: a request whose deadline passed before it
// started is dead-lettered without running and without a delivery; its
// callers get ErrDeadlineExceeded.
func TestDeadlinePassedNeverRuns(t *testing.T) {
	backends(t, func(t *testing.T, client *redis.Client) {
		ctx := context.Background()
		q := queueName(t)
		p, err := NewProducer[string, string](client, q, &ProducerOptions{Logger: testLogger(t)})
		require.NoError(t, err)
		defer p.Close()
		var runs atomic.Int64
		c, err := NewConsumer(client, q, func(ctx context.Context, m *Message[string]) (string, error) {
			runs.Add(1)
			return "ran", nil
		}, &ConsumerOptions{Logger: testLogger(t)})
		require.NoError(t, err)
		past, err := p.Produce(ctx, "past", "x", Deadline(time.Now().Add(-time.Second)))
		require.NoError(t, err)
		zero, err := p.Produce(ctx, "zero", "x", Timeout(0))
		require.NoError(t, err)
		future, err := p.Produce(ctx, "future", "x", Timeout(time.Hour))
		require.NoError(t, err)
		runConsumer(t, c)
		wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		defer cancel()
		for _, pr := range []*Promise[string]{past, zero} {
			_, err = pr.Wait(wctx)
			require.ErrorIs(t, err, ErrDeadlineExceeded, pr.ID())
			require.ErrorIs(t, err, ErrDeadLettered, pr.ID())
		}
		res, err := future.Wait(wctx)
		require.NoError(t, err)
		require.Equal(t, "ran", res)
		require.EqualValues(t, 1, runs.Load(), "only the request in time ran")

		a, err := NewAdmin(client, q, nil)
		require.NoError(t, err)
		dls, err := a.DeadLetters(ctx, "", 10)
		require.NoError(t, err)
		require.Len(t, dls, 2)
		for _, dl := range dls {
			require.Equal(t, 0, dl.Deliveries, "a request that never started counts no delivery")
			require.Contains(t, dl.Error, "deadline")
		}
	})
}

// TestHandlerTimeoutAndDeadline: HandlerTimeout and a request's deadline end
// the handler's context with their causes; the failure counts as a delivery.
func TestHandlerTimeoutAndDeadline(t *testing.T) {
	backends(t, func(t *testing.T, client *redis.Client) {
		ctx := context.Background()
		q := queueName(t)
		p, err := NewProducer[string, string](client, q, &ProducerOptions{Logger: testLogger(t)})
		require.NoError(t, err)
		defer p.Close()
		causes := make(chan error, 2)
		c, err := NewConsumer(client, q, func(ctx context.Context, m *Message[string]) (string, error) {
			<-ctx.Done()
			causes <- context.Cause(ctx)
			return "", ctx.Err()
		}, &ConsumerOptions{Logger: testLogger(t), HandlerTimeout: time.Second, MaxDeliveries: 1})
		require.NoError(t, err)
		runConsumer(t, c)
		wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		defer cancel()

		pr, err := p.Produce(ctx, "slow", "x")
		require.NoError(t, err)
		_, err = pr.Wait(wctx)
		require.ErrorIs(t, err, ErrDeadLettered)
		require.ErrorIs(t, <-causes, ErrHandlerTimeout)
		// A deadline earlier than HandlerTimeout ends the context first. (If
		// the machine took longer than it to start the handler, the request
		// would be dead-lettered unstarted, and the wait below fails.)

		pr, err = p.Produce(ctx, "short", "x", Timeout(500*time.Millisecond))
		require.NoError(t, err)
		_, err = pr.Wait(wctx)
		require.ErrorIs(t, err, ErrDeadLettered)
		select {
		case cause := <-causes:
			require.ErrorIs(t, cause, ErrDeadlineExceeded)
		case <-wctx.Done():
			t.Fatal("the handler did not start within the request's 500ms")
		}

		a, err := NewAdmin(client, q, nil)
		require.NoError(t, err)
		dls, err := a.DeadLetters(ctx, "", 10)
		require.NoError(t, err)
		require.Len(t, dls, 2)
		for _, dl := range dls {
			require.Equal(t, 1, dl.Deliveries, "the handler started: one delivery")
		}
	})
	_, err := NewConsumer(&redis.Client{}, "q", func(context.Context, *Message[string]) (string, error) { return "", nil },
		&ConsumerOptions{HandlerTimeout: -time.Second})
	require.ErrorIs(t, err, ErrInvalidOptions)
	require.ErrorContains(t, err, "HandlerTimeout")
}

// TestWrapFetcherKeepsCompletion: a fetcher wrapped with WrapFetcher keeps
// CacheFetcher's DeleteOnComplete; wrapping it in a FetcherFunc, as users
// had to before, silently loses it.
func TestWrapFetcherKeepsCompletion(t *testing.T) {
	backends(t, func(t *testing.T, client *redis.Client) {
		ctx := context.Background()
		cache := &CacheFetcher{Client: client, DeleteOnComplete: true}
		var fetches atomic.Int64
		count := func(ctx context.Context, e Entry, next Fetcher) ([]byte, error) {
			fetches.Add(1)
			return next.Fetch(ctx, e)
		}
		for _, tc := range []struct {
			name    string
			fetcher Fetcher
			deleted bool
		}{
			{"WrapFetcher", WrapFetcher(WrapFetcher(cache, count), count), true},
			{"FetcherFunc", FetcherFunc(cache.Fetch), false},
		} {
			q := queueName(t)
			key := "cache:" + q
			require.NoError(t, client.Set(ctx, key, `"payload"`, time.Minute).Err())
			// []byte requests bypass the codec: the entry holds the cache key.
			p, err := NewProducer[[]byte, string](client, q, &ProducerOptions{Logger: testLogger(t)})
			require.NoError(t, err)
			c, err := NewConsumer(client, q, func(ctx context.Context, m *Message[string]) (string, error) {
				return m.Payload, nil
			}, &ConsumerOptions{Logger: testLogger(t), Fetcher: tc.fetcher})
			require.NoError(t, err)
			stop := runConsumer(t, c)
			pr, err := p.Produce(ctx, "j", []byte(key))
			require.NoError(t, err)
			res, err := pr.Wait(ctx)
			require.NoError(t, err, tc.name)
			require.Equal(t, "payload", res, tc.name)
			stop() // the completion hook has run once Run returned
			n, err := client.Exists(ctx, key).Result()
			require.NoError(t, err)
			require.Equal(t, tc.deleted, n == 0, "%s: cache key deleted", tc.name)
			require.NoError(t, p.Close())
		}
		require.EqualValues(t, 2, fetches.Load(), "each layer counted the one fetch")
	})
}

// ctxLog captures log records with a value of their context.
type ctxLog struct {
	mu   sync.Mutex
	recs []string
}

func (h *ctxLog) Enabled(context.Context, slog.Level) bool { return true }
func (h *ctxLog) Handle(ctx context.Context, r slog.Record) error {
	v, _ := ctx.Value(ctxKey{}).(string)
	attrs := []string{}
	r.Attrs(func(a slog.Attr) bool { attrs = append(attrs, a.Key); return true })
	h.mu.Lock()
	h.recs = append(h.recs, fmt.Sprintf("%s ctx=%s attrs=%s", r.Message, v, strings.Join(attrs, ",")))
	h.mu.Unlock()
	return nil
}
func (h *ctxLog) WithAttrs([]slog.Attr) slog.Handler { return h }
func (h *ctxLog) WithGroup(string) slog.Handler      { return h }

// TestLogsCarryHandlerContext: the log lines about a message's outcome use
// the context its handler ran with (a middleware's span, say).
func TestLogsCarryHandlerContext(t *testing.T) {
	client, _ := miniRedis(t)
	ctx := context.Background()
	q := queueName(t)
	logs := &ctxLog{}
	p, err := NewProducer[string, string](client, q, &ProducerOptions{Logger: testLogger(t)})
	require.NoError(t, err)
	defer p.Close()
	mw := func(ctx context.Context, d *Delivery, next func(context.Context) error) error {
		return next(context.WithValue(ctx, ctxKey{}, "span-"+d.ID))
	}
	c, err := NewConsumer(client, q, func(ctx context.Context, m *Message[string]) (string, error) {
		return "", errors.New("no")
	}, &ConsumerOptions{Logger: slog.New(logs), Middleware: []Middleware{mw}, MaxDeliveries: 2, RetryBackoff: time.Millisecond})
	require.NoError(t, err)
	runConsumer(t, c)
	pr, err := p.Produce(ctx, "j", "x")
	require.NoError(t, err)
	_, err = pr.Wait(ctx)
	require.ErrorIs(t, err, ErrDeadLettered)
	logs.mu.Lock()
	defer logs.mu.Unlock()
	require.Contains(t, logs.recs, "streamq: handler failed; will retry ctx=span-j attrs=id,entry,deliveries,retry_in,err")
	require.Contains(t, logs.recs, "streamq: dead-lettering message ctx=span-j attrs=id,entry,deliveries,reason")
}

// FuzzHeadersRoundTrip: headers encoded at produce parse back unchanged, and
// any bytes in the header and deadline fields (written by another program)
// parse without a panic into headers or none.
func FuzzHeadersRoundTrip(f *testing.F) {
	f.Add("traceparent", "00-0102030405060708090a0b0c0d0e0f10-1112131415161718-01", `{"a":"b"}`, "1700000000000")
	f.Add("k", "", "{not json", "soon")
	f.Add("\x00", "\xff", `{"a":1}`, "-5")
	f.Fuzz(func(t *testing.T, k, v, rawHeaders, rawDeadline string) {
		if k != "" {
			enc, err := encodeHeaders(map[string]string{k: v})
			require.NoError(t, err)
			m := parseMeta(map[string]any{keys.FieldHeaders: enc}, time.Time{})
			// JSON replaces invalid UTF-8; valid text round-trips exactly.
			if utf8.ValidString(k) && utf8.ValidString(v) {
				require.Equal(t, map[string]string{k: v}, m.headers)
			}
		}
		m := parseMeta(map[string]any{keys.FieldHeaders: rawHeaders, keys.FieldDeadline: rawDeadline}, time.Time{})
		if m.headers != nil {
			require.NotEmpty(t, m.headers, "no headers is nil, never an empty map")
		}
		if !m.deadline.IsZero() {
			require.Positive(t, m.deadline.UnixMilli())
		}
	})
}

// TestBackgroundLogsCarryRunContext: the consumer's background loops log
// with the context Run was given, so a host's values (a trace, a tenant)
// reach its slog handler; here the feeder finds its group destroyed.
func TestBackgroundLogsCarryRunContext(t *testing.T) {
	client, _ := miniRedis(t)
	ctx := context.Background()
	q := queueName(t)
	logs := &ctxLog{}
	c, err := NewConsumer(client, q, func(ctx context.Context, m *Message[string]) (string, error) {
		return "", nil
	}, &ConsumerOptions{Logger: slog.New(logs), ClaimInterval: 20 * time.Millisecond})
	require.NoError(t, err)
	rctx, cancel := context.WithCancel(context.WithValue(ctx, ctxKey{}, "run-1"))
	done := make(chan error, 1)
	go func() { done <- c.Run(rctx) }()
	defer func() {
		cancel()
		require.NoError(t, <-done)
	}()
	select {
	case <-c.Ready():
	case <-time.After(10 * time.Second):
		t.Fatal("the consumer did not become ready")
	}
	a, err := NewAdmin(client, q, nil)
	require.NoError(t, err)
	stream, _, _, _ := firstShardKeys(t, a)
	require.NoError(t, client.XGroupDestroy(ctx, stream, DefaultGroup).Err())
	eventually(t, 10*time.Second, func() bool {
		logs.mu.Lock()
		defer logs.mu.Unlock()
		for _, r := range logs.recs {
			if strings.HasPrefix(r, "streamq: consumer group vanished") {
				return strings.Contains(r, " ctx=run-1 ")
			}
		}
		return false
	}, "no log line about the vanished group with Run's context")
}
