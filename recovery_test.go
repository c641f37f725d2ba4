package streamq

// Recovery tests: lease renewal, retries and their delays, dead letters and
// requeue, entries deleted while pending, graceful shutdown with a full ring,
// undecodable entries and lost leases. Everything that depends on idle times
// runs against a real redis-server; miniredis only where it is faithful.

import (
	"context"
	"crypto/sha1"
	"encoding/hex"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/streamq/streamq/internal/scripts"
)

// scriptCalls counts the successful runs of each Lua script through a client,
// and keeps their arguments.
type scriptCalls struct {
	mu        sync.Mutex
	runs      map[string][][]any // script sha -> args of each successful run
	pipelines int                // pipelined round trips
}

func newScriptCalls(c *redis.Client) *scriptCalls {
	h := &scriptCalls{runs: map[string][][]any{}}
	c.AddHook(h)
	return h
}

func (h *scriptCalls) DialHook(next redis.DialHook) redis.DialHook { return next }

// ProcessPipelineHook counts the pipelines (round trips) and the script
// runs inside them (the committer's ticks).
func (h *scriptCalls) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		err := next(ctx, cmds)
		h.mu.Lock()
		h.pipelines++
		h.mu.Unlock()
		for _, cmd := range cmds {
			h.record(cmd, cmd.Err())
		}
		return err
	}
}

func (h *scriptCalls) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		err := next(ctx, cmd)
		h.record(cmd, err)
		return err
	}
}

// record keeps the arguments of a successful script run.
func (h *scriptCalls) record(cmd redis.Cmder, err error) {
	args := cmd.Args()
	if err != nil || len(args) < 2 {
		return
	}
	name, _ := args[0].(string)
	body, _ := args[1].(string)
	var sha string
	switch strings.ToLower(name) {
	case "evalsha":
		sha = body
	case "eval":
		sum := sha1.Sum([]byte(body))
		sha = hex.EncodeToString(sum[:])
	default:
		return
	}
	h.mu.Lock()
	h.runs[sha] = append(h.runs[sha], args)
	h.mu.Unlock()
}

func (h *scriptCalls) count(s *redis.Script) int {
	h.mu.Lock()
	defer h.mu.Unlock()
	return len(h.runs[s.Hash()])
}

// runsWith counts the runs of s that had arg among their arguments.
func (h *scriptCalls) runsWith(s *redis.Script, arg string) int {
	h.mu.Lock()
	defer h.mu.Unlock()
	n := 0
	for _, args := range h.runs[s.Hash()] {
		for _, a := range args {
			if a == arg {
				n++
				break
			}
		}
	}
	return n
}

// ownClient returns a new client of the same server as c, closed at the end of the test.
func ownClient(t *testing.T, c *redis.Client) *redis.Client {
	oc := sameServer(c)
	t.Cleanup(func() { _ = oc.Close() })
	return oc
}

// fastOpts are consumer options with short recovery timings.
func fastOpts(t *testing.T, name string, minIdle time.Duration) *ConsumerOptions {
	return &ConsumerOptions{
		Name: name, MinIdle: minIdle, ClaimInterval: 100 * time.Millisecond,
		ReadBlock: 100 * time.Millisecond, RetryBackoff: 50 * time.Millisecond,
		TrimInterval: -1, Logger: testLogger(t),
	}
}

// replyWaitOpts makes a consumer send its ticks on its own client (so hooks
// on it see them) and wait for the reply of each start.
func replyWaitOpts(o *ConsumerOptions) *ConsumerOptions {
	o.replyWait = true
	return o
}

func waitCtx(t *testing.T, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

func newStringProducer(t *testing.T, client *redis.Client, q string) *Producer[string, string] {
	p, err := NewProducer[string, string](client, q, &ProducerOptions{Logger: testLogger(t)})
	require.NoError(t, err)
	t.Cleanup(func() { _ = p.Close() })
	return p
}

// TestRecoveryLongHandlersKeepTheirLeases runs four handlers at once, each for
// three times MinIdle, while another consumer runs claim passes: every lease
// is renewed, so each runs once and nothing is stolen.
func TestRecoveryLongHandlersKeepTheirLeases(t *testing.T) {
	t.Parallel()
	client := realRedis(t)
	q := queueName(t)
	const minIdle, workers = 1500 * time.Millisecond, 4
	p := newStringProducer(t, client, q)

	var runsA, runsB atomic.Int64
	started := make(chan struct{}, workers)
	var mu sync.Mutex
	var ctxErrs []error
	optsA := fastOpts(t, "A", minIdle)
	optsA.Workers = workers
	a, err := NewConsumer(client, q, func(ctx context.Context, m *Message[string]) (string, error) {
		runsA.Add(1)
		started <- struct{}{}
		select {
		case <-time.After(3 * minIdle): // the work itself: three times MinIdle
		case <-ctx.Done():
		}
		mu.Lock()
		ctxErrs = append(ctxErrs, context.Cause(ctx))
		mu.Unlock()
		return "A:" + m.Payload, nil
	}, optsA)
	require.NoError(t, err)
	runConsumer(t, a)
	b, err := NewConsumer(client, q, func(ctx context.Context, m *Message[string]) (string, error) {
		runsB.Add(1)
		return "B:" + m.Payload, nil
	}, fastOpts(t, "B", minIdle))
	require.NoError(t, err)

	ids := seqIDs("long", workers)
	prs := produceAll(t, p, ids)
	for range workers {
		<-started
	}
	runConsumer(t, b) // B claims every 100ms while A's handlers run for 3s
	begin := time.Now()
	ctx := waitCtx(t, 30*time.Second)
	for i, pr := range prs {
		got, err := pr.Wait(ctx)
		require.NoError(t, err)
		require.Equal(t, "A:p-"+ids[i], got)
	}
	t.Logf("%d handlers ran %v with MinIdle %v while another consumer ran claim passes",
		workers, time.Since(begin).Round(time.Millisecond), minIdle)
	mu.Lock()
	require.Equal(t, make([]error, workers), ctxErrs, "a long handler's context was cancelled")
	mu.Unlock()
	require.EqualValues(t, workers, runsA.Load())
	require.Zero(t, runsB.Load(), "the second consumer stole entries")
	requireDrained(t, client, q)
}

func TestRecoveryRetriesCountDeliveries(t *testing.T) {
	t.Parallel()
	client := realRedis(t)
	q := queueName(t)
	p := newStringProducer(t, client, q)
	var mu sync.Mutex
	var seen []int
	c, err := NewConsumer(client, q, func(ctx context.Context, m *Message[string]) (string, error) {
		mu.Lock()
		seen = append(seen, m.Deliveries)
		mu.Unlock()
		if m.Deliveries < 3 {
			return "", fmt.Errorf("transient failure %d", m.Deliveries)
		}
		return "ok:" + m.Payload, nil
	}, fastOpts(t, "retrier", 2*time.Second))
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
	admin, err := NewAdmin(client, q, nil)
	require.NoError(t, err)
	dls, err := admin.DeadLetters(context.Background(), "", 10)
	require.NoError(t, err)
	require.Empty(t, dls)
	requireDrained(t, client, q)
}

func TestRecoveryRetryAfterSetsTheDelay(t *testing.T) {
	t.Parallel()
	client := realRedis(t)
	q := queueName(t)
	p := newStringProducer(t, client, q)
	// MinIdle (the back-off's cap) is long so that the back-off, at least
	// RetryBackoff/2 = 10s, cannot be mistaken for RetryAfter's 400ms even on
	// a loaded machine.
	const minIdle, retryAfter = 20 * time.Second, 400 * time.Millisecond
	var mu sync.Mutex
	var failedAt, retriedAt time.Time
	opts := fastOpts(t, "retrier", minIdle)
	// Without RetryAfter the second delivery would wait the back-off: at least
	// RetryBackoff/2 after jitter.
	opts.RetryBackoff = minIdle
	c, err := NewConsumer(client, q, func(ctx context.Context, m *Message[string]) (string, error) {
		mu.Lock()
		defer mu.Unlock()
		if m.Deliveries == 1 {
			failedAt = time.Now()
			return "", RetryAfter(errors.New("rate limited"), retryAfter)
		}
		retriedAt = time.Now()
		return fmt.Sprintf("ok after %d", m.Deliveries), nil
	}, opts)
	require.NoError(t, err)
	runConsumer(t, c)

	pr, err := p.Produce(context.Background(), "limited", "x")
	require.NoError(t, err)
	got, err := pr.Wait(waitCtx(t, 30*time.Second))
	require.NoError(t, err)
	require.Equal(t, "ok after 2", got)
	mu.Lock()
	gap := retriedAt.Sub(failedAt)
	mu.Unlock()
	t.Logf("RetryAfter %v: second delivery %v after the failure (back-off would be >= %v)", retryAfter, gap.Round(time.Millisecond), opts.RetryBackoff/2)
	// Redis keeps idle times in whole milliseconds.
	require.GreaterOrEqual(t, gap, retryAfter-2*time.Millisecond)
	require.Less(t, gap, opts.RetryBackoff/2)
	requireDrained(t, client, q)
}

func TestRecoveryPermanentErrorDeadLettersAtOnce(t *testing.T) {
	backends(t, func(t *testing.T, client *redis.Client) {
		ctx := context.Background()
		q := queueName(t)
		p := newStringProducer(t, client, q)
		var runs atomic.Int64
		c, err := NewConsumer(client, q, func(ctx context.Context, m *Message[string]) (string, error) {
			runs.Add(1)
			return "", Permanent(errors.New("bad input: " + m.Payload))
		}, fastOpts(t, "strict", 2*time.Second))
		require.NoError(t, err)
		runConsumer(t, c)

		pr, err := p.Produce(ctx, "doomed", "x")
		require.NoError(t, err)
		_, err = pr.Wait(waitCtx(t, 30*time.Second))
		require.ErrorIs(t, err, ErrDeadLettered)
		require.ErrorContains(t, err, "bad input: x")
		require.EqualValues(t, 1, runs.Load())
		admin, err := NewAdmin(client, q, nil)
		require.NoError(t, err)
		dls, err := admin.DeadLetters(ctx, "", 10)
		require.NoError(t, err)
		require.Len(t, dls, 1)
		require.Equal(t, "doomed", dls[0].ID)
		require.Equal(t, 1, dls[0].Deliveries)
		require.Equal(t, "bad input: x", dls[0].Error)
		require.Equal(t, "strict", dls[0].Consumer)
		requireDrained(t, client, q)
	})
}

// TestRecoveryEntryDeletedWhilePending deletes some entries (XDEL) while a
// consumer that has died holds them, then lets another consumer (claim pass)
// or the same name (own-PEL resume) recover the rest.
func TestRecoveryEntryDeletedWhilePending(t *testing.T) {
	for _, sameName := range []bool{false, true} {
		mode := "claimed by another consumer"
		if sameName {
			mode = "resumed by the same name"
		}
		t.Run(mode, func(t *testing.T) {
			backendsWithServer(t, func(t *testing.T, client *redis.Client, m *miniredis.Miniredis) {
				testDeletedWhilePending(t, client, m, sameName)
			})
		})
	}
}

// pelOf returns the size of the default group's PEL.
func pelOf(t *testing.T, client *redis.Client, q string) int64 {
	t.Helper()
	sum, err := client.XPending(context.Background(), streamKey(q), DefaultGroup).Result()
	require.NoError(t, err)
	return sum.Count
}

// backendsWithServer is backends that also hands over the miniredis server
// (nil for real Redis), for tests that move its clock.
func backendsWithServer(t *testing.T, fn func(t *testing.T, client *redis.Client, m *miniredis.Miniredis)) {
	t.Run("miniredis", func(t *testing.T) {
		t.Parallel()
		c, m := miniRedis(t)
		fn(t, c, m)
	})
	t.Run("redis", func(t *testing.T) {
		t.Parallel()
		fn(t, realRedis(t), nil)
	})
}

func testDeletedWhilePending(t *testing.T, client *redis.Client, m *miniredis.Miniredis, sameName bool) {
	ctx := context.Background()
	q := queueName(t)
	const n, minIdle = 60, 300 * time.Millisecond
	p := newStringProducer(t, client, q)
	require.NoError(t, client.XGroupCreateMkStream(ctx, streamKey(q), DefaultGroup, "0").Err())
	ids := seqIDs("job", n)
	prs := produceAll(t, p, ids)

	// A consumer reads everything, then dies (it never acknowledges).
	res, err := client.XReadGroup(ctx, &redis.XReadGroupArgs{
		Group: DefaultGroup, Consumer: "dead", Streams: []string{streamKey(q), ">"}, Count: n, Block: -1,
	}).Result()
	require.NoError(t, err)
	require.Len(t, res[0].Messages, n)
	// Every third entry is deleted while pending.
	var live []string
	var livePrs []*Promise[string]
	deleted := map[string]bool{}
	for i, msg := range res[0].Messages {
		if i%3 == 0 {
			require.EqualValues(t, 1, client.XDel(ctx, streamKey(q), msg.ID).Val())
			deleted[ids[i]] = true
		} else {
			live = append(live, ids[i])
			livePrs = append(livePrs, prs[i])
		}
	}
	if m == nil {
		require.EqualValues(t, n, pelOf(t, client, q), "real Redis: XDEL leaves the PEL alone")
	} else {
		// miniredis v2.40.0 differs: its XDEL also removes the ids from every
		// PEL, so the deleted-while-pending state never arises there.
		require.EqualValues(t, n-len(deleted), pelOf(t, client, q), "miniredis: XDEL cleans the PEL")
		m.FastForward(time.Minute)
	}

	cc := ownClient(t, client)
	calls := newScriptCalls(cc)
	h := newCountingHandler()
	name := "rescuer"
	if sameName {
		name = "dead"
	}
	opts := fastOpts(t, name, minIdle)
	opts.Prefetch = 4 // deleted entries count against XAUTOCLAIM's COUNT: several passes
	opts.ClaimInterval = 50 * time.Millisecond
	c, err := NewConsumer(cc, q, h.handle, opts)
	require.NoError(t, err)
	runConsumer(t, c)

	requireResults(t, client, q, live, livePrs, time.Now().Add(30*time.Second))
	h.requireOnceEach(t, live)
	for id := range deleted {
		require.Zero(t, h.runs[id], "handler called for deleted entry %s", id)
	}
	require.Zero(t, client.XLen(ctx, streamKey(q)).Val())

	// Real Redis: XAUTOCLAIM reports deleted ids and claim.lua acknowledges
	// them; the own-PEL read returns them without fields and readHistory
	// acknowledges them. Either way the PEL ends empty.
	eventually(t, 10*time.Second, func() bool { return pelOf(t, client, q) == 0 }, "deleted entries stay in the PEL")

	// No loop: claim passes run about once per ClaimInterval, not back to back.
	before := calls.count(scripts.Claim)
	window := 20 * opts.ClaimInterval
	time.Sleep(window) // measuring a rate: the window is the measurement
	passes := calls.count(scripts.Claim) - before
	t.Logf("claim script runs in %v with ClaimInterval %v: %d", window, opts.ClaimInterval, passes)
	require.Less(t, passes, 60, "claim passes do not end")
}

func TestRecoveryGracefulShutdownReleasesTheRing(t *testing.T) {
	t.Parallel()
	client := realRedis(t)
	ctx := context.Background()
	q := queueName(t)
	const n, prefetch, minIdle = 60, 50, 10 * time.Second
	p := newStringProducer(t, client, q)
	ids := seqIDs("job", n)
	prs := produceAll(t, p, ids)

	started, release := make(chan string, 1), make(chan struct{})
	var runsA atomic.Int64
	var ctxErr error
	optsA := fastOpts(t, "leaving", minIdle)
	optsA.Workers, optsA.Prefetch, optsA.holdPrefetch = 1, prefetch, true
	a, err := NewConsumer(client, q, func(ctx context.Context, m *Message[string]) (string, error) {
		runsA.Add(1)
		started <- m.ID
		<-release // a slow handler
		ctxErr = context.Cause(ctx)
		return "r:" + m.Payload, nil
	}, optsA)
	require.NoError(t, err)
	runCtx, stopA := context.WithCancel(ctx)
	defer stopA()
	returned := make(chan error, 1)
	go func() { returned <- a.Run(runCtx) }()

	first := <-started
	require.Equal(t, ids[0], first)
	eventually(t, 10*time.Second, func() bool { return pendingOf(t, client, q, "leaving") == prefetch },
		"the ring never filled")
	stopA()
	select {
	case err := <-returned:
		t.Fatalf("Run returned (%v) while its handler was still running", err)
	case <-time.After(200 * time.Millisecond): // Run must keep waiting for the handler
	}
	close(release)
	select {
	case err := <-returned:
		require.NoError(t, err)
	case <-time.After(30 * time.Second):
		t.Fatal("Run did not return after its handler finished")
	}
	stoppedAt := time.Now()
	require.NoError(t, ctxErr, "the in-flight handler was cancelled by a graceful shutdown")
	require.EqualValues(t, 1, runsA.Load())
	got, err := prs[0].Wait(waitCtx(t, 5*time.Second))
	require.NoError(t, err)
	require.Equal(t, "r:p-"+ids[0], got)
	require.EqualValues(t, prefetch-1, pendingOf(t, client, q, "leaving"), "released entries stay pending until claimed")

	h := newCountingHandler()
	b, err := NewConsumer(client, q, h.handle, fastOpts(t, "arriving", minIdle))
	require.NoError(t, err)
	runConsumer(t, b)
	requireResults(t, client, q, ids[1:], prs[1:], stoppedAt.Add(minIdle-time.Second))
	elapsed := time.Since(stoppedAt)
	t.Logf("%d released entries completed by another consumer %v after Run returned (MinIdle %v)",
		prefetch-1, elapsed.Round(time.Millisecond), minIdle)
	require.Less(t, elapsed, minIdle)
	h.requireOnceEach(t, ids[1:])
	// Released entries never started, so, like unread ones, they run as a
	// first delivery.
	require.Equal(t, map[int]int{1: n - 1}, h.deliveries)
	requireDrained(t, client, q)
}

func TestRecoveryShutdownTimeoutCancelsAStuckHandler(t *testing.T) {
	t.Parallel()
	client := realRedis(t)
	q := queueName(t)
	const shutdownTimeout = 300 * time.Millisecond
	p := newStringProducer(t, client, q)
	started := make(chan struct{})
	var cause error
	opts := fastOpts(t, "stuck", time.Second)
	opts.ShutdownTimeout = shutdownTimeout
	a, err := NewConsumer(client, q, func(ctx context.Context, m *Message[string]) (string, error) {
		close(started)
		<-ctx.Done() // ignores the shutdown until its own context ends
		cause = context.Cause(ctx)
		return "", ctx.Err()
	}, opts)
	require.NoError(t, err)
	runCtx, stopA := context.WithCancel(context.Background())
	defer stopA()
	returned := make(chan error, 1)
	go func() { returned <- a.Run(runCtx) }()

	pr, err := p.Produce(context.Background(), "stuck", "x")
	require.NoError(t, err)
	<-started
	stopA()
	stoppedAt := time.Now()
	select {
	case err := <-returned:
		require.NoError(t, err)
	case <-time.After(30 * time.Second):
		t.Fatal("Run did not return after ShutdownTimeout")
	}
	took := time.Since(stoppedAt)
	t.Logf("Run returned %v after its context ended (ShutdownTimeout %v)", took.Round(time.Millisecond), shutdownTimeout)
	require.GreaterOrEqual(t, took, shutdownTimeout)
	require.ErrorContains(t, cause, "ShutdownTimeout")
	select {
	case <-pr.Done():
		t.Fatal("the cancelled attempt resolved the caller")
	default:
	}

	// The cancelled attempt is a failed delivery: the entry stays pending and
	// the next consumer completes it.
	h := newCountingHandler()
	b, err := NewConsumer(client, q, h.handle, fastOpts(t, "next", time.Second))
	require.NoError(t, err)
	runConsumer(t, b)
	got, err := pr.Wait(waitCtx(t, 30*time.Second))
	require.NoError(t, err)
	require.Equal(t, "r:x", got)
	require.Equal(t, map[int]int{2: 1}, h.deliveries)
	requireDrained(t, client, q)
}

func TestRecoveryRequeueRunsTheRequestAgain(t *testing.T) {
	backends(t, func(t *testing.T, client *redis.Client) {
		ctx := context.Background()
		q := queueName(t)
		p := newStringProducer(t, client, q)
		var fixed atomic.Bool
		var runs atomic.Int64
		c, err := NewConsumer(client, q, func(ctx context.Context, m *Message[string]) (string, error) {
			runs.Add(1)
			if !fixed.Load() {
				return "", Permanent(errors.New("upstream rejected " + m.Payload))
			}
			return "v2:" + m.Payload, nil
		}, fastOpts(t, "c", 2*time.Second))
		require.NoError(t, err)
		runConsumer(t, c)

		pr, err := p.Produce(ctx, "order-1", "x")
		require.NoError(t, err)
		_, err = pr.Wait(waitCtx(t, 30*time.Second))
		require.ErrorIs(t, err, ErrDeadLettered)
		// Until it is requeued, a new caller gets the dead-letter error.
		again, err := p.Produce(ctx, "order-1", "x")
		require.NoError(t, err)
		require.Empty(t, again.EntryID())
		_, err = again.Wait(ctx)
		require.ErrorIs(t, err, ErrDeadLettered)

		admin, err := NewAdmin(client, q, nil)
		require.NoError(t, err)
		dls, err := admin.DeadLetters(ctx, "", 10)
		require.NoError(t, err)
		require.Len(t, dls, 1)
		fixed.Store(true)
		eid, err := admin.Requeue(ctx, dls[0].DeadLetterID)
		require.NoError(t, err)
		require.NotEmpty(t, eid)
		// A dead letter is requeued once: asking again returns the same entry.
		eid2, err := admin.Requeue(ctx, dls[0].DeadLetterID)
		require.NoError(t, err)
		require.Equal(t, eid, eid2)

		fresh, err := p.Produce(ctx, "order-1", "ignored: the id is in flight or done")
		require.NoError(t, err)
		got, err := fresh.Wait(waitCtx(t, 30*time.Second))
		require.NoError(t, err)
		require.Equal(t, "v2:x", got)
		require.EqualValues(t, 2, runs.Load())
		require.Equal(t, `R"v2:x"`, client.Get(ctx, recordKey(q, "order-1")).Val())
		dls, err = admin.DeadLetters(ctx, "", 10)
		require.NoError(t, err)
		require.Empty(t, dls)
		requireDrained(t, client, q)
	})
}

func TestRecoveryUndecodableEntriesAreDeadLettered(t *testing.T) {
	backends(t, func(t *testing.T, client *redis.Client) {
		ctx := context.Background()
		q := queueName(t)
		p := newStringProducer(t, client, q)
		h := newCountingHandler()
		opts := fastOpts(t, "c", 2*time.Second)
		opts.Workers = 2
		c, err := NewConsumer(client, q, h.handle, opts)
		require.NoError(t, err)
		runConsumer(t, c)

		good := seqIDs("good", 40)
		prs := produceAll(t, p, good[:20])
		bad := []map[string]any{
			{"p": `"no id"`},
			{"id": "no-payload"},
			{"foo": "bar"},
			{"id": "bad-json", "p": "{not json"},
		}
		for _, v := range bad {
			require.NoError(t, client.XAdd(ctx, &redis.XAddArgs{Stream: streamKey(q), Values: v}).Err())
		}
		prs = append(prs, produceAll(t, p, good[20:])...)

		requireResults(t, client, q, good, prs, time.Now().Add(30*time.Second))
		h.requireOnceEach(t, good)
		admin, err := NewAdmin(client, q, nil)
		require.NoError(t, err)
		var dls []DeadLetter
		eventually(t, 10*time.Second, func() bool {
			dls, err = admin.DeadLetters(ctx, "", 10)
			require.NoError(t, err)
			return len(dls) == len(bad)
		}, "undecodable entries not dead-lettered")
		reasons := map[string]string{}
		for _, d := range dls {
			require.Contains(t, d.Error, "undecodable", "dead letter %+v", d)
			// A delivery is a handler start: entries refused at admission
			// never started; a payload that fails to decode did start.
			wantStarts := 0
			if strings.Contains(d.Error, "undecodable request") {
				wantStarts = 1
			}
			require.Equal(t, wantStarts, d.Deliveries, "dead letter %+v", d)
			reasons[d.ID] += d.Error + "\n"
		}
		require.Contains(t, reasons["no-payload"], `"p"`)
		require.Contains(t, reasons["bad-json"], "undecodable request")
		require.Len(t, strings.Split(strings.TrimSpace(reasons[""]), "\n"), 2, "two entries without an id")
		// A caller of the undecodable request's id learns that it was dead-lettered.
		pr, err := p.Produce(ctx, "bad-json", "x")
		require.NoError(t, err)
		_, err = pr.Wait(ctx)
		require.ErrorIs(t, err, ErrDeadLettered)
		requireDrained(t, client, q)
	})
}

func TestRecoveryLostLeaseCancelsTheHandler(t *testing.T) {
	t.Parallel()
	client := realRedis(t)
	ctx := context.Background()
	q := queueName(t)
	const minIdle = 900 * time.Millisecond // leases renewed every 300ms
	p := newStringProducer(t, client, q)
	cc := ownClient(t, client)
	calls := newScriptCalls(cc)
	var runs atomic.Int64
	started := make(chan struct{})
	causes := make(chan error, 1)
	c, err := NewConsumer(cc, q, func(ctx context.Context, m *Message[string]) (string, error) {
		if runs.Add(1) == 1 {
			close(started)
			<-ctx.Done()
			causes <- context.Cause(ctx)
			return "stale", nil // a success after losing the lease must be dropped
		}
		return fmt.Sprintf("fresh after %d deliveries", m.Deliveries), nil
	}, replyWaitOpts(fastOpts(t, "owner", minIdle))) // ticks on cc, where the hook sees complete.lua
	require.NoError(t, err)
	runConsumer(t, c)

	pr, err := p.Produce(ctx, "contested", "x")
	require.NoError(t, err)
	<-started
	claimed, err := client.XClaimJustID(ctx, &redis.XClaimArgs{
		Stream: streamKey(q), Group: DefaultGroup, Consumer: "thief", MinIdle: 0, Messages: []string{pr.EntryID()},
	}).Result()
	require.NoError(t, err)
	require.Equal(t, []string{pr.EntryID()}, claimed)
	select {
	case cause := <-causes:
		require.ErrorIs(t, cause, ErrLeaseLost)
	case <-time.After(30 * time.Second):
		t.Fatal("the handler's context was not cancelled after its entry was claimed")
	}

	// The thief never finishes: the owner claims the entry back after MinIdle
	// and completes it once.
	got, err := pr.Wait(waitCtx(t, 30*time.Second))
	require.NoError(t, err)
	require.Equal(t, "fresh after 2 deliveries", got)
	require.EqualValues(t, 2, runs.Load())
	require.Equal(t, `R"fresh after 2 deliveries"`, client.Get(ctx, recordKey(q, "contested")).Val())
	eventually(t, 5*time.Second, func() bool { return calls.runsWith(scripts.Complete, pr.EntryID()) > 0 }, "no completion")
	require.Equal(t, 1, calls.runsWith(scripts.Complete, pr.EntryID()), "outcomes recorded for the entry")
	requireDrained(t, client, q)
}
