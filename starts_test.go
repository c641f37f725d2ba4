package streamq

// Tests of delivery counting (a delivery is a handler start, however the entry
// arrived), of entries that must never reach a handler (foreign ids, payloads
// a codec panics on), of records kept alive while their request is held, and
// of commands whose reply is lost after the server ran them (go-redis resends
// them).

import (
	"context"
	"errors"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/streamq/streamq/internal/crashtest"
	"github.com/streamq/streamq/internal/faultproxy"
	"github.com/streamq/streamq/internal/redistest"
	"github.com/streamq/streamq/internal/scripts"
)

// startsHandler records the runs and the delivery counts of each id.
type startsHandler struct {
	mu   sync.Mutex
	seen map[string][]int // id -> Deliveries of each run
}

func newStartsHandler() *startsHandler { return &startsHandler{seen: map[string][]int{}} }

func (h *startsHandler) handle(_ context.Context, m *Message[string]) (string, error) {
	h.mu.Lock()
	h.seen[m.ID] = append(h.seen[m.ID], m.Deliveries)
	h.mu.Unlock()
	return "r:" + m.Payload, nil
}

// requireFirstStarts checks that each id ran exactly once, as its first start.
func (h *startsHandler) requireFirstStarts(t *testing.T, ids []string) {
	t.Helper()
	h.mu.Lock()
	defer h.mu.Unlock()
	for _, id := range ids {
		require.Equal(t, []int{1}, h.seen[id], "Deliveries seen by the runs of %s", id)
	}
}

func requireNoDeadLetters(t *testing.T, client *redis.Client, q string) {
	t.Helper()
	admin, err := NewAdmin(client, q, nil)
	require.NoError(t, err)
	dls, err := admin.DeadLetters(context.Background(), "", 100)
	require.NoError(t, err)
	require.Empty(t, dls)
}

// TestStartsGracefulShutdownUnstartedRunOnce: a consumer shuts down with five
// prefetched entries that never started; with MaxDeliveries 1 the next
// consumer runs each of them once, as a first delivery.
func TestStartsGracefulShutdownUnstartedRunOnce(t *testing.T) {
	t.Parallel()
	client := realRedis(t)
	q := queueName(t)
	p := newStringProducer(t, client, q)
	ids := seqIDs("job", 6)
	prs := produceAll(t, p, ids)

	stopA := holdSix(t, client, client, q)
	stopA()
	requireUnstartedRunOnce(t, client, q, ids, prs, 20*time.Second)
	requireDrained(t, client, q)
}

// holdSix runs consumer "A" on clientA (MinIdle 30 s, MaxDeliveries 1) until
// it holds all six entries of q, the first in its handler, the others
// prefetched and never started. stop ends A's Run (its ctx cancelled, the
// handler then let return) and waits for it.
func holdSix(t *testing.T, clientA, client *redis.Client, q string) (stop func()) {
	t.Helper()
	release := make(chan struct{})
	started := make(chan struct{}, 1)
	optsA := fastOpts(t, "A", 30*time.Second)
	optsA.Prefetch, optsA.MaxDeliveries, optsA.holdPrefetch = 6, 1, true
	a, err := NewConsumer(clientA, q, func(ctx context.Context, m *Message[string]) (string, error) {
		started <- struct{}{}
		<-release
		return "r:" + m.Payload, nil
	}, optsA)
	require.NoError(t, err)
	ctxA, stopA := context.WithCancel(context.Background())
	doneA := make(chan error, 1)
	go func() { doneA <- a.Run(ctxA) }()
	<-started
	eventually(t, 10*time.Second, func() bool { return pendingOf(t, client, q, "A") == 6 },
		"A never held all six entries")
	return func() {
		stopA()
		close(release)
		require.NoError(t, <-doneA)
	}
}

// requireUnstartedRunOnce runs consumer "B" (MaxDeliveries 1) on q and
// requires every id's result within the given time, ids[1:] (the entries
// holdSix left unstarted) each started once as a first delivery, and no
// dead letter.
func requireUnstartedRunOnce(t *testing.T, client *redis.Client, q string, ids []string, prs []*Promise[string], within time.Duration) {
	t.Helper()
	h := newStartsHandler()
	optsB := fastOpts(t, "B", 30*time.Second)
	optsB.MaxDeliveries = 1
	b, err := NewConsumer(client, q, h.handle, optsB)
	require.NoError(t, err)
	runConsumer(t, b)
	requireResults(t, client, q, ids, prs, time.Now().Add(within))
	h.requireFirstStarts(t, ids[1:])
	requireNoDeadLetters(t, client, q)
}

// TestStartsSIGKILLFullRingUnstartedRunOnce: a consumer process is killed
// with one handler running and a full ring of entries that never started.
// With MaxDeliveries 1, the next consumer runs every unstarted entry once, as
// a first delivery; the one that started (and crashed) is dead-lettered.
func TestStartsSIGKILLFullRingUnstartedRunOnce(t *testing.T) {
	t.Parallel()
	client := realRedis(t)
	ctx := context.Background()
	q := queueName(t)
	const n = 20
	const minIdle = time.Second
	p := newStringProducer(t, client, q)
	ids := seqIDs("job", n)
	prs := produceAll(t, p, ids)

	child := crashtest.Start(t, "TestCrashHelperProcess", crashConfig{
		Addr: sharedAddr(t), Queue: q, Mode: "block", Name: "doomed",
		Workers: 1, Prefetch: n, MinIdle: minIdle, MaxDeliveries: 1,
	})
	waitChildHolds(t, client, q, "doomed", n, 1)
	child.Kill()
	require.True(t, child.KilledBy(syscall.SIGKILL))
	startedIDs, err := client.SMembers(ctx, startedKey(q)).Result()
	require.NoError(t, err)
	require.Len(t, startedIDs, 1)
	crashed := startedIDs[0]

	h := newStartsHandler()
	opts := fastOpts(t, "survivor", minIdle)
	opts.MaxDeliveries = 1
	c, err := NewConsumer(client, q, h.handle, opts)
	require.NoError(t, err)
	runConsumer(t, c)

	wctx := waitCtx(t, 30*time.Second)
	var unstarted []string
	for i, pr := range prs {
		got, err := pr.Wait(wctx)
		if ids[i] == crashed {
			require.ErrorIs(t, err, ErrDeadLettered, "the entry whose handler started and crashed")
			continue
		}
		require.NoError(t, err, "id %s", ids[i])
		require.Equal(t, "r:p-"+ids[i], got)
		unstarted = append(unstarted, ids[i])
	}
	require.Len(t, unstarted, n-1)
	h.requireFirstStarts(t, unstarted)
	h.mu.Lock()
	require.Empty(t, h.seen[crashed], "the crashed entry ran again with MaxDeliveries 1")
	h.mu.Unlock()
	admin, err := NewAdmin(client, q, nil)
	require.NoError(t, err)
	dls, err := admin.DeadLetters(ctx, "", 100)
	require.NoError(t, err)
	require.Len(t, dls, 1)
	require.Equal(t, crashed, dls[0].ID)
	require.Equal(t, 1, dls[0].Deliveries)
	require.Contains(t, dls[0].Error, "started 1 times")
	requireDrained(t, client, q)
}

// TestStartsRetriedRequestCountsOnEveryBackend: a request that fails twice
// and then succeeds is seen with Deliveries 1, 2, 3 on miniredis exactly as
// on a real Redis.
func TestStartsRetriedRequestCountsOnEveryBackend(t *testing.T) {
	backends(t, func(t *testing.T, client *redis.Client) {
		q := queueName(t)
		p := newStringProducer(t, client, q)
		var mu sync.Mutex
		var seen []int
		c, err := NewConsumer(client, q, func(ctx context.Context, m *Message[string]) (string, error) {
			mu.Lock()
			seen = append(seen, m.Deliveries)
			mu.Unlock()
			if m.Deliveries < 3 {
				return "", RetryAfter(errors.New("transient"), 20*time.Millisecond)
			}
			return "ok:" + m.Payload, nil
		}, fastOpts(t, "retrier", 300*time.Millisecond))
		require.NoError(t, err)
		runConsumer(t, c)

		pr, err := p.Produce(context.Background(), "flaky", "x")
		require.NoError(t, err)
		got, err := pr.Wait(waitCtx(t, 30*time.Second))
		require.NoError(t, err)
		require.Equal(t, "ok:x", got)
		mu.Lock()
		require.Equal(t, []int{1, 2, 3}, seen, "delivery counts seen by the handler")
		mu.Unlock()
	})
}

// TestForeignEntryWithInvalidIDDeadLettered: entries another program appended
// with ids that Produce refuses never reach the handler and get no record.
func TestForeignEntryWithInvalidIDDeadLettered(t *testing.T) {
	t.Parallel()
	client := realRedis(t)
	ctx := context.Background()
	q := queueName(t)
	p := newStringProducer(t, client, q)
	long := strings.Repeat("x", 100_000)
	for _, id := range []string{"", long} {
		require.NoError(t, client.XAdd(ctx, &redis.XAddArgs{Stream: streamKey(q), Values: []any{"id", id, "p", `"foreign"`}}).Err())
	}
	pr, err := p.Produce(ctx, "good", "fine")
	require.NoError(t, err)

	h := newStartsHandler()
	c, err := NewConsumer(client, q, h.handle, fastOpts(t, "strict", 30*time.Second))
	require.NoError(t, err)
	runConsumer(t, c)
	got, err := pr.Wait(waitCtx(t, 20*time.Second))
	require.NoError(t, err)
	require.Equal(t, "r:fine", got)

	admin, err := NewAdmin(client, q, nil)
	require.NoError(t, err)
	var dls []DeadLetter
	eventually(t, 20*time.Second, func() bool {
		dls, err = admin.DeadLetters(ctx, "", 10)
		require.NoError(t, err)
		return len(dls) == 2
	}, "two dead letters expected")
	var reasons []string
	for _, dl := range dls {
		require.Contains(t, dl.Error, "invalid request id")
		require.Empty(t, dl.ID, "a dead letter of an invalid id names no request")
		require.Zero(t, dl.Deliveries, "refused at admission: never started")
		reasons = append(reasons, dl.Error)
	}
	all := strings.Join(reasons, "\n")
	require.Contains(t, all, "the id is empty")
	require.Contains(t, all, "the id is 100000 bytes")
	h.mu.Lock()
	require.Equal(t, map[string][]int{"good": {1}}, h.seen, "only the valid entry reaches the handler")
	h.mu.Unlock()
	require.Zero(t, client.Exists(ctx, recordKey(q, long), recordKey(q, "")).Val(), "records of invalid ids")
	requireDrained(t, client, q)
}

// panickyCodec is JSON, except that it panics on the payload "boom" and on
// the response "explode".
type panickyCodec struct{ JSONCodec }

func (c panickyCodec) Unmarshal(data []byte, v any) error {
	if string(data) == `"boom"` {
		panic("codec cannot take boom")
	}
	return c.JSONCodec.Unmarshal(data, v)
}

func (c panickyCodec) Marshal(v any) ([]byte, error) {
	if s, ok := v.(string); ok && s == "explode" {
		panic("codec cannot take explode")
	}
	return c.JSONCodec.Marshal(v)
}

// TestCodecPanicIsDeadLetter: a codec that panics while decoding a request or
// encoding a response dead-letters that message; the process lives and the
// other messages keep flowing.
func TestCodecPanicIsDeadLetter(t *testing.T) {
	t.Parallel()
	client := realRedis(t)
	ctx := context.Background()
	q := queueName(t)
	p := newStringProducer(t, client, q)
	ids := []string{"ok1", "boom", "ok2", "explode", "ok3"}
	prs := make(map[string]*Promise[string])
	for _, id := range ids {
		pr, err := p.Produce(ctx, id, id)
		require.NoError(t, err)
		prs[id] = pr
	}
	opts := fastOpts(t, "fragile", 30*time.Second)
	opts.Codec = panickyCodec{}
	c, err := NewConsumer(client, q, func(ctx context.Context, m *Message[string]) (string, error) {
		return m.Payload, nil
	}, opts)
	require.NoError(t, err)
	runConsumer(t, c)
	wctx := waitCtx(t, 20*time.Second)
	for _, id := range []string{"ok1", "ok2", "ok3"} {
		got, err := prs[id].Wait(wctx)
		require.NoError(t, err, id)
		require.Equal(t, id, got)
	}
	_, err = prs["boom"].Wait(wctx)
	require.ErrorIs(t, err, ErrDeadLettered)
	require.ErrorContains(t, err, "the codec panicked: codec cannot take boom")
	_, err = prs["explode"].Wait(wctx)
	require.ErrorIs(t, err, ErrDeadLettered)
	require.ErrorContains(t, err, "the codec panicked: codec cannot take explode")
	requireDrained(t, client, q)
}

// TestInflightRecordKeptWhileRunning: a handler runs four times longer than
// InflightTTL. Its record stays in flight while it runs (lease renewals keep
// it at least 3 x MinIdle ahead; the run also outlasts that, so renewals, not
// only the start's charge, must extend it), so its caller gets the result, and
// a second Produce of the id during the run attaches to it.
func TestInflightRecordKeptWhileRunning(t *testing.T) {
	t.Parallel()
	client := realRedis(t)
	ctx := context.Background()
	q := queueName(t)
	const inflightTTL = time.Second
	p, err := NewProducer[string, string](client, q, &ProducerOptions{InflightTTL: inflightTTL, Logger: testLogger(t)})
	require.NoError(t, err)
	t.Cleanup(func() { _ = p.Close() })
	var runs atomic.Int64
	started := make(chan struct{}, 1)
	release := make(chan struct{})
	opts := fastOpts(t, "slow", time.Second)
	opts.ShutdownTimeout = 2 * time.Second // a failed run ends quickly
	c, err := NewConsumer(client, q, func(ctx context.Context, m *Message[string]) (string, error) {
		runs.Add(1)
		started <- struct{}{}
		select {
		case <-release:
		case <-ctx.Done():
			return "", context.Cause(ctx)
		}
		return "done:" + m.Payload, nil
	}, opts)
	require.NoError(t, err)
	runConsumer(t, c)

	pr1, err := p.Produce(ctx, "long", "x")
	require.NoError(t, err)
	producedAt := time.Now()
	<-started
	// The condition is time itself: let the run outlast InflightTTL.
	time.Sleep(time.Until(producedAt.Add(3 * inflightTTL / 2)))
	rec := client.Get(ctx, recordKey(q, "long")).Val()
	require.True(t, strings.HasPrefix(rec, "P"), "record while the handler runs: %q", rec)
	pr2, err := p.Produce(ctx, "long", "y")
	require.NoError(t, err)
	time.Sleep(time.Until(producedAt.Add(4 * inflightTTL)))
	close(release)

	wctx := waitCtx(t, 20*time.Second)
	for i, pr := range []*Promise[string]{pr1, pr2} {
		got, err := pr.Wait(wctx)
		require.NoError(t, err, "caller %d", i+1)
		require.Equal(t, "done:x", got, "caller %d", i+1)
	}
	require.EqualValues(t, 1, runs.Load())
	requireDrained(t, client, q)
}

// resendSetup returns a proxied client for a consumer, and a raw client.
func resendSetup(t *testing.T) (raw, proxied *redis.Client, proxy *faultproxy.Proxy) {
	t.Helper()
	raw = realRedis(t)
	proxy, err := faultproxy.New(raw.Options().Addr)
	require.NoError(t, err)
	t.Cleanup(func() { _ = proxy.Close() })
	proxied = redis.NewClient(&redis.Options{Addr: proxy.Addr(), PoolSize: 16})
	t.Cleanup(func() { _ = proxied.Close() })
	return raw, proxied, proxy
}

// releasedEntries produces ids, has a ghost consumer read them, and releases
// them (idle time far past MinIdle) as a consumer shutting down would, so that
// the next claim pass takes them.
func releasedEntries(t *testing.T, client *redis.Client, q string, ids []string) []*Promise[string] {
	t.Helper()
	ctx := context.Background()
	require.NoError(t, client.XGroupCreateMkStream(ctx, streamKey(q), DefaultGroup, "0").Err())
	prs := produceAll(t, newStringProducer(t, client, q), ids)
	res, err := client.XReadGroup(ctx, &redis.XReadGroupArgs{
		Group: DefaultGroup, Consumer: "ghost", Streams: []string{streamKey(q), ">"}, Count: int64(len(ids)), Block: -1,
	}).Result()
	require.NoError(t, err)
	var eids []string
	for _, m := range res[0].Messages {
		eids = append(eids, m.ID)
	}
	require.Len(t, eids, len(ids))
	require.NoError(t, client.XClaimJustID(ctx, &redis.XClaimArgs{
		Stream: streamKey(q), Group: DefaultGroup, Consumer: "ghost", MinIdle: 0, Messages: eids,
	}).Err())
	// XCLAIM ... IDLE: released.
	require.NoError(t, client.Do(ctx, append([]any{"XCLAIM", streamKey(q), DefaultGroup, "ghost", 0},
		append(toAny(eids), "IDLE", releaseIdle.Milliseconds(), "JUSTID")...)...).Err())
	return prs
}

// requireDropped waits until the proxy dropped one reply.
func requireDropped(t *testing.T, proxy *faultproxy.Proxy) {
	t.Helper()
	select {
	case <-proxy.Dropped():
	case <-time.After(20 * time.Second):
		t.Fatal("the reply was never dropped: the command was not sent")
	}
}

// resendBound is how soon entries whose read or claim reply was lost must be
// handled: far below the MinIdle of these tests (after which any claim pass
// would find them).
const (
	resendMinIdle = 30 * time.Second
	resendBound   = 5 * time.Second
)

// TestResendXReadGroupReplyLost: the reply to an XREADGROUP that read five
// entries is lost, and go-redis sends the read again. The entries sit in the
// consumer's pending list unseen: they must still be handled, once each, as
// first deliveries, well before MinIdle.
func TestResendXReadGroupReplyLost(t *testing.T) {
	t.Parallel()
	raw, proxied, proxy := resendSetup(t)
	q := queueName(t)
	ids := seqIDs("job", 5)
	require.NoError(t, raw.XGroupCreateMkStream(context.Background(), streamKey(q), DefaultGroup, "0").Err())
	prs := produceAll(t, newStringProducer(t, raw, q), ids)
	// The command name as go-redis sends it (RESP), not the word inside a script.
	proxy.DropReplyTo([]byte("$10\r\nxreadgroup\r\n"))

	h := newStartsHandler()
	c, err := NewConsumer(proxied, q, h.handle, fastOpts(t, "reader", resendMinIdle))
	require.NoError(t, err)
	start := time.Now()
	runConsumer(t, c)
	requireDropped(t, proxy)
	requireResults(t, raw, q, ids, prs, start.Add(resendBound))
	t.Logf("entries whose read reply was lost handled %v after start (MinIdle %v)", time.Since(start).Round(time.Millisecond), resendMinIdle)
	h.requireFirstStarts(t, ids)
	requireDrained(t, raw, q)
}

// TestResendClaimReplyLost: the reply to a claim (claim.lua) that took five
// released entries is lost, and go-redis sends it again, which finds nothing
// idle. The entries must still be handled once each, as first deliveries,
// well before MinIdle.
func TestResendClaimReplyLost(t *testing.T) {
	t.Parallel()
	raw, proxied, proxy := resendSetup(t)
	q := queueName(t)
	ids := seqIDs("job", 5)
	prs := releasedEntries(t, raw, q, ids)
	require.NoError(t, scripts.Claim.Load(context.Background(), raw).Err())
	proxy.DropReplyTo([]byte(scripts.Claim.Hash()))

	h := newStartsHandler()
	c, err := NewConsumer(proxied, q, h.handle, fastOpts(t, "claimer", resendMinIdle))
	require.NoError(t, err)
	start := time.Now()
	runConsumer(t, c)
	requireDropped(t, proxy)
	requireResults(t, raw, q, ids, prs, start.Add(resendBound))
	t.Logf("entries whose claim reply was lost handled %v after start (MinIdle %v)", time.Since(start).Round(time.Millisecond), resendMinIdle)
	h.requireFirstStarts(t, ids)
	requireDrained(t, raw, q)
}

// TestResendChargeReplyLost: the reply to the tick that charged handler
// starts is lost and go-redis sends it again: each start is counted once.
// Fresh entries are counted by an HSET in the tick; entries held longer (here
// forced with checkOwner) by charge.lua, which checks the owner.
func TestResendChargeReplyLost(t *testing.T) {
	for _, tc := range []struct {
		name       string
		checkOwner bool
		match      []byte
	}{
		{"hset", false, []byte("$4\r\nhset\r\n")},
		{"charge.lua", true, []byte(scripts.Charge.Hash())},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			raw, proxied, proxy := resendSetup(t)
			q := queueName(t)
			ids := seqIDs("job", 5)
			prs := releasedEntries(t, raw, q, ids)
			require.NoError(t, scripts.Charge.Load(context.Background(), raw).Err())
			proxy.DropReplyTo(tc.match)

			h := newStartsHandler()
			opts := fastOpts(t, "charger", resendMinIdle)
			opts.checkOwner = tc.checkOwner
			c, err := NewConsumer(proxied, q, h.handle, opts)
			require.NoError(t, err)
			start := time.Now()
			runConsumer(t, c)
			requireDropped(t, proxy)
			requireResults(t, raw, q, ids, prs, start.Add(resendBound))
			h.requireFirstStarts(t, ids)
			requireDrained(t, raw, q)
		})
	}
}

// TestChargeWorksOutOfMemory: with maxmemory reached (noeviction), a handler
// start can still be charged: completions free memory only after handlers
// ran, so a refused charge would wedge the queue.
func TestChargeWorksOutOfMemory(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	c := redis.NewClient(&redis.Options{Addr: srv.Addr()})
	t.Cleanup(func() { _ = c.Close() })
	ctx := context.Background()
	stream, starts := "streamq:{oom}:stream", "streamq:{oom}:starts:g"
	require.NoError(t, c.XGroupCreateMkStream(ctx, stream, "g", "0").Err())
	eid := c.XAdd(ctx, &redis.XAddArgs{Stream: stream, Values: []any{"id", "a", "p", "x"}}).Val()
	require.NoError(t, c.XReadGroup(ctx, &redis.XReadGroupArgs{Group: "g", Consumer: "me", Streams: []string{stream, ">"}, Block: -1}).Err())
	require.NoError(t, scripts.Charge.Load(ctx, c).Err())
	require.NoError(t, c.ConfigSet(ctx, "maxmemory", "1").Err())
	require.ErrorContains(t, c.Set(ctx, "streamq:{oom}:x", "y", 0).Err(), "OOM", "the server is not out of memory")
	// The committer's HSET is refused here; charge.lua is what it falls back to.
	require.ErrorContains(t, c.HSet(ctx, starts, eid, 1).Err(), "OOM")
	res, err := scripts.Charge.Run(ctx, c, []string{stream, starts}, "g", "me", 60000, eid, 0).Int64Slice()
	require.NoError(t, err)
	require.Equal(t, []int64{1}, res)
	require.Equal(t, "1", c.HGet(ctx, starts, eid).Val())
	// Resent (its reply lost): the same start, not a second one.
	res, err = scripts.Charge.Run(ctx, c, []string{stream, starts}, "g", "me", 60000, eid, 0).Int64Slice()
	require.NoError(t, err)
	require.Equal(t, []int64{1}, res)
}

// TestStartsMaxDeliveriesThreeOnEveryBackend (issue 17, item 1): with
// MaxDeliveries 3 and plain errors (retried with the consumer's back-off
// through the schedule), a request failing once is seen with Deliveries 1, 2
// and succeeds, and one failing every time is dead-lettered after exactly 3
// starts with its handler's error, never as lost by crashed consumers. On
// miniredis too: streamq counts starts itself, not with Redis's delivery
// counter, which miniredis advances differently.
func TestStartsMaxDeliveriesThreeOnEveryBackend(t *testing.T) {
	backends(t, func(t *testing.T, client *redis.Client) {
		q := queueName(t)
		p := newStringProducer(t, client, q)
		var mu sync.Mutex
		seen := map[string][]int{}
		opts := fastOpts(t, "three", 300*time.Millisecond)
		opts.MaxDeliveries = 3
		opts.RetryBackoff = 10 * time.Millisecond
		c, err := NewConsumer(client, q, func(ctx context.Context, m *Message[string]) (string, error) {
			mu.Lock()
			seen[m.ID] = append(seen[m.ID], m.Deliveries)
			mu.Unlock()
			if m.ID == "always" || m.Deliveries < 2 {
				return "", errors.New("boom")
			}
			return "ok", nil
		}, opts)
		require.NoError(t, err)
		runConsumer(t, c)

		once, err := p.Produce(context.Background(), "once", "x")
		require.NoError(t, err)
		always, err := p.Produce(context.Background(), "always", "y")
		require.NoError(t, err)
		got, err := once.Wait(waitCtx(t, 30*time.Second))
		require.NoError(t, err)
		require.Equal(t, "ok", got)
		_, err = always.Wait(waitCtx(t, 30*time.Second))
		var rerr *RequestError
		require.ErrorAs(t, err, &rerr)
		require.True(t, rerr.DeadLettered, "%v", err)
		require.Contains(t, err.Error(), "boom")
		require.NotContains(t, err.Error(), "crashed")

		mu.Lock()
		require.Equal(t, []int{1, 2}, seen["once"])
		require.Equal(t, []int{1, 2, 3}, seen["always"])
		mu.Unlock()
		a, err := NewAdmin(client, q, nil)
		require.NoError(t, err)
		dls, err := a.DeadLetters(context.Background(), "", 10)
		require.NoError(t, err)
		require.Len(t, dls, 1)
		require.Equal(t, "always", dls[0].ID)
		require.Equal(t, 3, dls[0].Deliveries)
		require.Contains(t, dls[0].Error, "boom")
	})
}

// TestOutcomeAndNextStartShareATick: under a backlog, a worker's outcome and
// the start charge of its next job go to Redis in one committer tick (one
// pipelined round trip), so recording outcomes and charging starts costs
// about one round trip per job with one worker, not two; and each job still
// runs once, as a first start, with its result recorded.
func TestOutcomeAndNextStartShareATick(t *testing.T) {
	backends(t, func(t *testing.T, client *redis.Client) {
		q := queueName(t)
		p := newStringProducer(t, client, q)
		const n = 200
		ids := seqIDs("job", n)
		prs := produceAll(t, p, ids)

		cc := sameServer(client)
		t.Cleanup(func() { _ = cc.Close() })
		calls := newScriptCalls(cc)
		h := newStartsHandler()
		opts := fastOpts(t, "A", 30*time.Second)
		opts.Workers, opts.Prefetch, opts.holdPrefetch = 1, 64, true
		opts.replyWait = true // ticks on cc, where the hook counts them
		c, err := NewConsumer(cc, q, h.handle, opts)
		require.NoError(t, err)
		stop := runConsumer(t, c)
		requireResults(t, client, q, ids, prs, time.Now().Add(30*time.Second))
		stop()

		h.requireFirstStarts(t, ids)
		calls.mu.Lock()
		ticks := calls.pipelines
		calls.mu.Unlock()
		t.Logf("%d jobs: %d ticks, complete.lua %d runs, charge.lua %d runs", n, ticks,
			calls.count(scripts.Complete), calls.count(scripts.Charge))
		require.Zero(t, calls.count(scripts.Charge), "fresh entries are charged without charge.lua")
		// One worker, a ready backlog: n ticks, give or take the first start
		// and the last outcome, and the moments the ring ran empty between
		// reads. Apart, charges and completions would take 2n.
		require.LessOrEqual(t, ticks, n*5/4, "%d ticks for %d jobs", ticks, n)
	})
}

// TestLostChargeReplyThenShutdownCountsNothing: Redis counted a handler start
// whose reply was lost, and the consumer shut down before it could send the
// charge again. Its handler never ran there, so the released entry must count
// nothing: before, the count stayed, and with MaxDeliveries 1 the next
// consumer dead-lettered the request without ever running it.
func TestLostChargeReplyThenShutdownCountsNothing(t *testing.T) {
	t.Parallel()
	raw, _, proxy := resendSetup(t)
	// No resend by go-redis: the reply is lost for good.
	proxied := redis.NewClient(&redis.Options{Addr: proxy.Addr(), PoolSize: 16, MaxRetries: -1})
	t.Cleanup(func() { _ = proxied.Close() })
	ctx := context.Background()
	q := queueName(t)
	ids := []string{"only"}
	require.NoError(t, raw.XGroupCreateMkStream(ctx, streamKey(q), DefaultGroup, "0").Err())
	prs := produceAll(t, newStringProducer(t, raw, q), ids)
	entries, err := raw.XRange(ctx, streamKey(q), "-", "+").Result()
	require.NoError(t, err)
	require.Len(t, entries, 1)
	// A script runs on its first call (not NOSCRIPT) when it is loaded.
	require.NoError(t, scripts.Charge.Load(ctx, raw).Err())
	// The first command the consumer sends that names the entry is its
	// start charge (reads name it in their replies only; leases come every
	// MinIdle/3).
	proxy.DropReplyTo([]byte(entries[0].ID))

	h := newStartsHandler()
	opts := fastOpts(t, "A", 30*time.Second)
	opts.MaxDeliveries, opts.ShutdownTimeout = 1, 2*time.Second
	a, err := NewConsumer(proxied, q, h.handle, opts)
	require.NoError(t, err)
	runCtx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- a.Run(runCtx) }()
	requireDropped(t, proxy)
	cancel()
	select {
	case err := <-done:
		require.NoError(t, err)
	case <-time.After(10 * time.Second):
		t.Fatal("Run did not return after its context ended")
	}

	optsB := fastOpts(t, "B", 30*time.Second)
	optsB.MaxDeliveries = 1
	b, err := NewConsumer(raw, q, h.handle, optsB)
	require.NoError(t, err)
	runConsumer(t, b)
	requireResults(t, raw, q, ids, prs, time.Now().Add(10*time.Second))
	h.requireFirstStarts(t, ids)
	requireNoDeadLetters(t, raw, q)
}
