package streamq

// Tests of Admin.Cancel on requests in the stream: queued (never runs) and
// running (its handler's context is cancelled by a pushed notice), and the
// races with completion and retries, all against a real redis-server. The
// crash case is in cancel_crash_test.go.

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"
)

// startsKey is the default group's start-count hash of an unsharded queue.
func startsKey(q string) string { return "streamq:{" + q + "}:starts:" + DefaultGroup }

// retryKey is the retry set of an unsharded queue.
func retryKey(q string) string { return "streamq:{" + q + "}:retry" }

// TestCancelQueuedNeverRuns: a queued request that Admin.Cancel cancels is
// deleted from the stream: every caller (a second producer's attached
// promise too) gets ErrCanceled, no handler starts it (no start counted), a
// later Produce or Send of the id finds the stored outcome, and the other
// requests run as usual.
func TestCancelQueuedNeverRuns(t *testing.T) {
	t.Parallel()
	client := realRedis(t)
	ctx := context.Background()
	q := queueName(t)
	p1, p2 := newStringProducer(t, client, q), newStringProducer(t, client, q)
	a, err := NewAdmin(client, q, nil)
	require.NoError(t, err)

	ids := seqIDs("keep", 5)
	prs := produceAll(t, p1, ids)
	victim := mustProduce(t, p1, "victim", "p-victim")
	attached := mustProduce(t, p2, "victim", "p-victim")
	require.Equal(t, DedupInflight, attached.Deduplicated())
	entry := victim.EntryID()

	require.NoError(t, a.Cancel(ctx, "victim"))
	wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	for _, pr := range []*Promise[string]{victim, attached} {
		_, err := pr.Wait(wctx)
		require.ErrorIs(t, err, ErrCanceled)
	}
	info, err := a.Job(ctx, "victim")
	require.NoError(t, err)
	require.Equal(t, JobCanceled, info.State)
	require.Empty(t, client.XRange(ctx, streamKey(q), entry, entry).Val(), "the entry is deleted")
	require.NoError(t, a.Cancel(ctx, "victim"), "cancelled already: nil")

	// Producing the id again answers from the stored outcome; Send writes
	// nothing either.
	again := mustProduce(t, p1, "victim", "p-victim")
	require.Equal(t, DedupStored, again.Deduplicated())
	_, err = again.Wait(wctx)
	require.ErrorIs(t, err, ErrCanceled)
	require.NoError(t, p2.Send(ctx, "victim", "p-victim"))
	require.NoError(t, p2.Flush(wctx))

	h := newCountingHandler()
	c, err := NewConsumer(client, q, h.handle, &ConsumerOptions{Workers: 2, ReadBlock: 50 * time.Millisecond, Logger: testLogger(t)})
	require.NoError(t, err)
	stop := runConsumer(t, c)
	requireResults(t, client, q, ids, prs, time.Now().Add(20*time.Second))
	stop()
	h.requireOnceEach(t, ids) // and not the victim
	require.False(t, client.HExists(ctx, startsKey(q), entry).Val(), "no start counted")
	requireDrained(t, client, q)
	s, err := a.Stats(ctx)
	require.NoError(t, err)
	require.EqualValues(t, 1, s.Canceled)
}

// TestCancelRunningHandlerSeesCancel: Admin.Cancel of a request whose
// handler runs pushes a notice to its consumer, which cancels the handler's
// context with cause ErrCanceled. Whatever the handler returns then (a
// result, or an error that would be retried) is not recorded: callers get
// ErrCanceled, and nothing is retried. It measures the time from the Cancel
// call to the handler seeing ctx.Done() over 50 runs.
func TestCancelRunningHandlerSeesCancel(t *testing.T) {
	t.Parallel()
	client := realRedis(t)
	ctx := context.Background()
	q := queueName(t)
	p := newStringProducer(t, client, q)
	a, err := NewAdmin(client, q, nil)
	require.NoError(t, err)

	type seen struct {
		at    time.Time
		cause error
	}
	started := make(chan string, 1)
	done := make(chan seen, 1)
	var mu sync.Mutex
	starts := map[string]int{}
	c, err := NewConsumer(client, q, func(ctx context.Context, m *Message[string]) (string, error) {
		mu.Lock()
		starts[m.ID]++
		mu.Unlock()
		started <- m.ID
		<-ctx.Done()
		done <- seen{time.Now(), context.Cause(ctx)}
		if m.Payload == "fail" {
			return "", errors.New("would be retried")
		}
		return "late result", nil
	}, &ConsumerOptions{Workers: 2, MaxDeliveries: 5, RetryBackoff: time.Millisecond, ReadBlock: 50 * time.Millisecond,
		MinIdle: 30 * time.Second, Logger: testLogger(t)})
	require.NoError(t, err)
	stop := runConsumer(t, c)

	const runs = 50
	lat := make([]time.Duration, 0, runs)
	ids := seqIDs("run", runs)
	for i, id := range ids {
		payload := "ok"
		if i%2 == 1 {
			payload = "fail"
		}
		pr := mustProduce(t, p, id, payload)
		select {
		case got := <-started:
			require.Equal(t, id, got)
		case <-time.After(10 * time.Second):
			t.Fatalf("%s never started", id)
		}
		t0 := time.Now()
		require.NoError(t, a.Cancel(ctx, id))
		var s seen
		select {
		case s = <-done:
		case <-time.After(10 * time.Second):
			t.Fatalf("the handler of %s never saw its context cancelled", id)
		}
		require.ErrorIs(t, s.cause, ErrCanceled)
		lat = append(lat, s.at.Sub(t0))
		wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		_, err := pr.Wait(wctx)
		cancel()
		require.ErrorIs(t, err, ErrCanceled)
	}
	stop() // every outcome the consumer queued is written by now
	for _, id := range ids {
		info, err := a.Job(ctx, id)
		require.NoError(t, err)
		require.Equal(t, JobCanceled, info.State, id)
		require.Equal(t, 1, starts[id], "%s ran once, and was not retried", id)
	}
	require.Zero(t, client.ZCard(ctx, retryKey(q)).Val(), "no retry scheduled")
	require.Zero(t, client.HLen(ctx, startsKey(q)).Val(), "no start count left")
	requireDrained(t, client, q)

	slices.Sort(lat)
	msg := fmt.Sprintf("Cancel call -> handler's ctx.Done(), %d runs: p50 %v, p90 %v, max %v", runs,
		lat[len(lat)/2].Round(time.Microsecond), lat[len(lat)*9/10].Round(time.Microsecond), lat[len(lat)-1].Round(time.Microsecond))
	t.Log(msg)
	fmt.Println(msg)
}

// TestCancelRaceWithCompletion cancels requests at random moments of their
// life (queued, in the ring, in the handler, with the outcome on its way to
// Redis): either Cancel returns nil and every caller (two producers) gets
// ErrCanceled, or it returns ErrFinished and every caller gets the result;
// never both, and the record agrees.
func TestCancelRaceWithCompletion(t *testing.T) {
	t.Parallel()
	client := realRedis(t)
	ctx := context.Background()
	q := queueName(t)
	p1, p2 := newStringProducer(t, client, q), newStringProducer(t, client, q)
	a, err := NewAdmin(client, q, nil)
	require.NoError(t, err)
	var runs sync.Map
	c, err := NewConsumer(client, q, func(ctx context.Context, m *Message[string]) (string, error) {
		n, _ := runs.LoadOrStore(m.ID, new(atomic.Int32))
		n.(*atomic.Int32).Add(1)
		if d := rand.N(300 * time.Microsecond); d > 150*time.Microsecond {
			time.Sleep(d)
		}
		return "r:" + m.Payload, nil
	}, &ConsumerOptions{Workers: 4, ReadBlock: 50 * time.Millisecond, Logger: testLogger(t)})
	require.NoError(t, err)
	runConsumer(t, c)

	const n = 200
	var canceled, finished int
	for i := range n {
		id := fmt.Sprintf("race-%03d", i)
		pr1 := mustProduce(t, p1, id, id)
		pr2 := mustProduce(t, p2, id, id)
		if i%4 != 0 { // a quarter cancelled at once, mostly while queued
			time.Sleep(rand.N(600 * time.Microsecond))
		}
		cerr := a.Cancel(ctx, id)
		wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		r1, err1 := pr1.Wait(wctx)
		r2, err2 := pr2.Wait(wctx)
		cancel()
		rec := client.Get(ctx, recordKey(q, id)).Val()
		if cerr == nil {
			canceled++
			require.ErrorIs(t, err1, ErrCanceled, id)
			require.ErrorIs(t, err2, ErrCanceled, id)
			require.Equal(t, byte('C'), rec[0], "%s: record %q", id, rec)
		} else {
			finished++
			require.ErrorIs(t, cerr, ErrFinished, id)
			require.NoError(t, err1, id)
			require.NoError(t, err2, id)
			require.Equal(t, "r:"+id, r1)
			require.Equal(t, "r:"+id, r2)
			require.Equal(t, `R"r:`+id+`"`, rec)
		}
		if v, ok := runs.Load(id); ok {
			require.LessOrEqual(t, v.(*atomic.Int32).Load(), int32(1), "%s ran more than once", id)
		}
	}
	t.Logf("%d requests: %d cancelled, %d finished first", n, canceled, finished)
	eventually(t, 10*time.Second, func() bool { return client.XLen(ctx, streamKey(q)).Val() == 0 }, "stream not drained")
}

// TestCancelRetryingDoesNotRunAgain: a request that fails and is retried
// (back-off 1 ms: it moves between the stream, the handler and the retry set
// all the time) is cancelled at a random moment: once Cancel returns, at
// most the attempt a consumer already held starts, and after the consumer
// stopped nothing of the request is left to run: no retry waiting, no
// entry, the record cancelled.
func TestCancelRetryingDoesNotRunAgain(t *testing.T) {
	t.Parallel()
	client := realRedis(t)
	ctx := context.Background()
	q := queueName(t)
	p := newStringProducer(t, client, q)
	a, err := NewAdmin(client, q, nil)
	require.NoError(t, err)
	var mu sync.Mutex
	starts := map[string]int{}
	c, err := NewConsumer(client, q, func(ctx context.Context, m *Message[string]) (string, error) {
		mu.Lock()
		starts[m.ID]++
		mu.Unlock()
		return "", errors.New("fails every time")
	}, &ConsumerOptions{Workers: 2, MaxDeliveries: 1 << 20, RetryBackoff: time.Millisecond, RetryBackoffMax: time.Millisecond,
		ReadBlock: 50 * time.Millisecond, Logger: testLogger(t)})
	require.NoError(t, err)
	stop := runConsumer(t, c)

	const n = 20
	ids := seqIDs("retry", n)
	prs := produceAll(t, p, ids)
	atCancel := map[string]int{}
	for i, id := range ids {
		want := 1 + i%5
		eventually(t, 10*time.Second, func() bool {
			mu.Lock()
			defer mu.Unlock()
			return starts[id] >= want
		}, "%s never started %d times", id, want)
		time.Sleep(rand.N(time.Millisecond))
		require.NoError(t, a.Cancel(ctx, id))
		mu.Lock()
		atCancel[id] = starts[id]
		mu.Unlock()
		wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		_, err := prs[i].Wait(wctx)
		cancel()
		require.ErrorIs(t, err, ErrCanceled)
	}
	stop()
	for _, id := range ids {
		require.LessOrEqual(t, starts[id], atCancel[id]+1, "%s: only the attempt held at the cancel may start", id)
		require.Equal(t, byte('C'), client.Get(ctx, recordKey(q, id)).Val()[0], id)
	}
	require.Zero(t, client.ZCard(ctx, retryKey(q)).Val(), "no retry waiting")
	require.Zero(t, client.HLen(ctx, "streamq:{"+q+"}:schedule:data").Val()+client.HLen(ctx, startsKey(q)).Val(),
		"no retry data or start count left")
	requireDrained(t, client, q)
}

// TestCancelRunningOnEveryShardAndLevel: the cancel notice names the
// stream (shard and priority level) of the entry, so a consumer of a
// sharded queue finds the slot of a running request of any level, and one
// consumer of another group (a fan-out group) running the same entry under
// the same name keeps its copy.
func TestCancelRunningOnEveryShardAndLevel(t *testing.T) {
	t.Parallel()
	client := realRedis(t)
	ctx := context.Background()
	q := queueName(t)
	p, err := NewProducer[string, string](client, q, &ProducerOptions{Shards: 2, Logger: testLogger(t)})
	require.NoError(t, err)
	defer p.Close()
	a, err := NewAdmin(client, q, nil)
	require.NoError(t, err)
	started := make(chan string, 16)
	causes := make(chan error, 16)
	handler := func(ctx context.Context, m *Message[string]) (string, error) {
		started <- m.ID
		<-ctx.Done()
		causes <- context.Cause(ctx)
		return "", ctx.Err()
	}
	c, err := NewConsumer(client, q, handler, &ConsumerOptions{Name: "w", Shards: 2, Workers: 4, ClaimInterval: 100 * time.Millisecond,
		ReadBlock: 50 * time.Millisecond, Logger: testLogger(t)})
	require.NoError(t, err)
	runConsumer(t, c)
	var auditCanceled atomic.Int32
	audit, err := NewConsumer(client, q, func(ctx context.Context, m *Message[string]) (string, error) {
		select {
		case <-ctx.Done():
			if errors.Is(context.Cause(ctx), ErrCanceled) {
				auditCanceled.Add(1)
			}
			return "", context.Cause(ctx)
		case <-time.After(300 * time.Millisecond):
			return "audited", nil
		}
	}, &ConsumerOptions{Name: "w", Group: "audit", Fanout: true, Shards: 2, Workers: 8, ClaimInterval: 100 * time.Millisecond,
		ReadBlock: 50 * time.Millisecond, Logger: testLogger(t)})
	require.NoError(t, err)
	runConsumer(t, audit)
	<-audit.Ready()

	levels := []PriorityLevel{PriorityNormal, PriorityHigh, PriorityLow}
	for i := range 6 {
		id := fmt.Sprintf("lvl-%d", i)
		pr, err := p.Produce(ctx, id, "x", Priority(levels[i%3]))
		require.NoError(t, err)
		select {
		case got := <-started:
			require.Equal(t, id, got)
		case <-time.After(10 * time.Second):
			t.Fatalf("%s never started", id)
		}
		require.NoError(t, a.Cancel(ctx, id))
		select {
		case cause := <-causes:
			require.ErrorIs(t, cause, ErrCanceled, id)
		case <-time.After(10 * time.Second):
			t.Fatalf("the handler of %s (level %v) never saw its cancellation", id, levels[i%3])
		}
		wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		_, err = pr.Wait(wctx)
		cancel()
		require.ErrorIs(t, err, ErrCanceled)
	}
	require.Zero(t, auditCanceled.Load(), "a notice for group %s stopped a handler of group audit", DefaultGroup)
}

// TestCancelNoticeParse: a cancel notice is "c" and four length-prefixed
// strings; anything else (a wake-up's due time, a cut or padded notice) is
// not taken for one.
func TestCancelNoticeParse(t *testing.T) {
	group, consumer, level, entry, ok := parseCancelNotice("c7:streamq5:w:a:b1:212:1700000000-0")
	require.True(t, ok)
	require.Equal(t, []any{"streamq", "w:a:b", 2, "1700000000-0"}, []any{group, consumer, level, entry})
	require.True(t, isCancelNotice("c1:g1:c1:01:e"))
	require.False(t, isCancelNotice("1700000000000"))
	for _, bad := range []string{"c", "c7:streamq", "c1:g1:c1:31:e", "c1:g1:c1:x1:e", "c1:g1:c1:01:ee", "c1:g1:c-1:01:e", "c1:g1:c1:01:e9:"} {
		_, _, _, _, ok := parseCancelNotice(bad)
		require.False(t, ok, bad)
	}
}

// TestCancelNoticeLostInAReconnection: every pub/sub connection is killed
// right before cancel.lua runs, so its notice may reach no consumer. The
// consumer's promoter resubscribes and asks for a lease renewal at once,
// which finds the entry gone and ends the handler's context: within
// seconds, not MinIdle/3 (10 s here). The caller gets ErrCanceled either
// way (its producer checks its records after resubscribing). It runs on a
// server of its own: killing every pub/sub connection of the shared one made
// the other tests' consumers renew their leases at once, and a fan-out
// group's renewal that found a cancelled entry gone stopped its handler in
// TestCancelRunningOnEveryShardAndLevel (4 of 81 runs under load).
func TestCancelNoticeLostInAReconnection(t *testing.T) {
	t.Parallel()
	client := privateRedis(t)
	ctx := context.Background()
	q := queueName(t)
	p := newStringProducer(t, client, q)
	a, err := NewAdmin(client, q, nil)
	require.NoError(t, err)
	started := make(chan struct{}, 1)
	causes := make(chan error, 1)
	c, err := NewConsumer(client, q, func(ctx context.Context, m *Message[string]) (string, error) {
		started <- struct{}{}
		<-ctx.Done()
		causes <- context.Cause(ctx)
		return "late", nil
	}, &ConsumerOptions{MinIdle: 30 * time.Second, ReadBlock: 50 * time.Millisecond, Logger: testLogger(t)})
	require.NoError(t, err)
	runConsumer(t, c)
	pr := mustProduce(t, p, "lost-notice", "x")
	select {
	case <-started:
	case <-time.After(10 * time.Second):
		t.Fatal("never started")
	}
	a.beforeCancel = func() {
		require.NoError(t, client.ClientKillByFilter(ctx, "TYPE", "pubsub").Err())
	}
	t0 := time.Now()
	require.NoError(t, a.Cancel(ctx, "lost-notice"))
	select {
	case cause := <-causes:
		require.True(t, errors.Is(cause, ErrCanceled) || errors.Is(cause, ErrLeaseLost), "cause %v", cause)
		t.Logf("the handler's context ended %v after Cancel, cause: %v", time.Since(t0).Round(time.Millisecond), cause)
	case <-time.After(5 * time.Second):
		t.Fatal("the handler's context did not end within 5s of a cancel whose notice was lost")
	}
	wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	_, err = pr.Wait(wctx)
	require.ErrorIs(t, err, ErrCanceled)
}

// entryGoneWithTwin sets up a request ("victim", high level) whose record
// names an entry that no stream holds any more (deleted by hand), while the
// default level's stream holds another request's entry ("other", payload
// "other's payload") with the same entry id: entry ids are per stream. The
// queue's group exists (a consumer ran once), so scripts check holders. It
// returns the admin, the victim's promise and the shared entry id.
func entryGoneWithTwin(t *testing.T, client *redis.Client, q string) (*Admin, *Promise[string], string) {
	t.Helper()
	ctx := context.Background()
	p := newStringProducer(t, client, q)
	a, err := NewAdmin(client, q, nil)
	require.NoError(t, err)
	c, err := NewConsumer(client, q, func(context.Context, *Message[string]) (string, error) { return "", nil },
		&ConsumerOptions{ReadBlock: 50 * time.Millisecond, Logger: testLogger(t)})
	require.NoError(t, err)
	stop := runConsumer(t, c)
	stop()
	victim := mustProduce(t, p, "victim", "x", Priority(PriorityHigh))
	eid := victim.EntryID()
	require.EqualValues(t, 1, client.XDel(ctx, streamKey(q)+":high", eid).Val(), "the victim's entry, deleted by hand")
	require.NoError(t, client.XAdd(ctx, &redis.XAddArgs{Stream: streamKey(q), ID: eid, Values: []any{"id", "other", "p", `"other's payload"`}}).Err())
	return a, victim, eid
}

// TestCancelOfAnEntryGoneLeavesOtherLevelsAlone: a request whose record
// names an entry that no stream holds any more (deleted by hand) is
// cancelled without touching any stream. Entry ids are per stream: the
// request's entry was on the high level's stream, and the default level's
// stream holds another request's entry with the same id. Before,
// cancel.lua, finding the entry on no level, fell back to the default
// level's stream and deleted that other request's entry (and would have
// stopped its handler, had one held it): the other request was lost.
func TestCancelOfAnEntryGoneLeavesOtherLevelsAlone(t *testing.T) {
	t.Parallel()
	client := realRedis(t)
	ctx := context.Background()
	q := queueName(t)
	a, victim, eid := entryGoneWithTwin(t, client, q)

	require.NoError(t, a.Cancel(ctx, "victim"))
	_, err := victim.Wait(waitCtx(t, 10*time.Second))
	require.ErrorIs(t, err, ErrCanceled)
	require.Len(t, client.XRange(ctx, streamKey(q), eid, eid).Val(), 1, "the other request's entry is still in the default stream")
}

// TestForgetAndJobOfAnEntryGoneLeaveOtherLevelsAlone: as
// TestCancelOfAnEntryGoneLeavesOtherLevelsAlone, for Admin.Job and
// Admin.Forget, which found the request's stream the same way (entrystream.lua)
// and fell back to the default level's: Job showed the other request's
// payload as the victim's, and Forget deleted the other request's entry.
func TestForgetAndJobOfAnEntryGoneLeaveOtherLevelsAlone(t *testing.T) {
	t.Parallel()
	client := realRedis(t)
	ctx := context.Background()
	q := queueName(t)
	a, _, eid := entryGoneWithTwin(t, client, q)

	info, err := a.Job(ctx, "victim")
	require.NoError(t, err)
	require.Empty(t, info.Payload, "no payload of another request")

	require.NoError(t, a.Forget(ctx, "victim", true))
	require.Len(t, client.XRange(ctx, streamKey(q), eid, eid).Val(), 1, "the other request's entry is still in the default stream")
}
