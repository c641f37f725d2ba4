package streamq

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/streamq/streamq/internal/keys"
)

// lagRig is a producer p whose listener is held (its notices wait until
// release is called), another producer q of the same queue whose listener
// is not, and a consumer that answers "r-"+payload (o, when set, are its
// options). p's backstop never runs on its own.
func lagRig(t *testing.T, client *redis.Client, o *ConsumerOptions) (p, q *Producer[string, string], ks keys.Keys, release func()) {
	t.Helper()
	name := queueName(t)
	var err error
	p, err = NewProducer[string, string](client, name, &ProducerOptions{BackstopInterval: time.Hour, Logger: testLogger(t)})
	require.NoError(t, err)
	t.Cleanup(func() { _ = p.Close() })
	q = newStringProducer(t, client, name)
	if o == nil {
		o = fastOpts(t, "w", 10*time.Second)
	}
	c, err := NewConsumer(client, name, func(ctx context.Context, m *Message[string]) (string, error) {
		return "r-" + m.Payload, nil
	}, o)
	require.NoError(t, err)
	runConsumer(t, c)
	ctx := context.Background()
	warm, err := p.Produce(ctx, "warm", "w") // p listens
	require.NoError(t, err)
	_, err = warm.Wait(waitCtx(t, 10*time.Second))
	require.NoError(t, err)
	lag := make(chan struct{})
	hold := func() { <-lag }
	p.testHookNotice.Store(&hold) // p's listener lags behind from here
	all, err := keys.Shards(name, 1)
	require.NoError(t, err)
	var once bool
	return p, q, all[0], func() {
		if !once {
			once = true
			close(lag)
		}
	}
}

// completed waits until the record of id holds an outcome.
func completed(t *testing.T, client *redis.Client, ks keys.Keys, id string) {
	t.Helper()
	eventually(t, 10*time.Second, func() bool {
		v, err := client.Get(context.Background(), ks.Record(id)).Result()
		return err == nil && v != "" && v[0] != keys.RecordInflight
	}, "%s completed", id)
}

// TestThrottleCallerIsNotAnsweredByALaterRun: a caller of p attached to a
// Throttle run whose notice p's listener has not handled yet (it lags
// behind) while another producer opens the next window and that run
// completes. Then a call of p reads the later run's outcome: stored (code 2,
// its window open) or replaced by a third run (code 3, its window closed).
// That outcome is not the first caller's: it was produced after the first
// call returned. The first caller gets its own run's result (its notice),
// the later one the outcome it read, or, for the third run, the result of a
// run produced before its call returned. (Before, both were resolved with
// the outcome read, the first caller with a run that did not exist when its
// Produce returned: TestDedupModesThrottleSteadyStream's rare failure.)
func TestThrottleCallerIsNotAnsweredByALaterRun(t *testing.T) {
	for _, tc := range []struct {
		name  string
		dedup Dedup    // of the later call of p
		later []string // what it may get
	}{
		{"stored", DedupStored, []string{"r-b"}},
		{"replaced", DedupNone, []string{"r-b", "r-c"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			client := realRedis(t)
			p, q, ks, release := lagRig(t, client, nil)
			defer release()
			ctx := context.Background()
			const window = time.Hour // its end is the test's: the mode key is deleted
			first, err := p.Produce(ctx, "x", "a", Throttle(window))
			require.NoError(t, err)
			require.Equal(t, DedupNone, first.Deduplicated())
			completed(t, client, ks, "x")
			require.NoError(t, client.Del(ctx, ks.Mode("x")).Err()) // the window closes
			second, err := q.Produce(ctx, "x", "b", Throttle(window))
			require.NoError(t, err)
			require.Equal(t, DedupNone, second.Deduplicated(), "q opens the next window")
			got, err := second.Wait(waitCtx(t, 10*time.Second))
			require.NoError(t, err)
			require.Equal(t, "r-b", got)
			if tc.dedup == DedupNone {
				require.NoError(t, client.Del(ctx, ks.Mode("x")).Err()) // that window closes too
			}
			later, err := p.Produce(ctx, "x", "c", Throttle(window))
			require.NoError(t, err)
			require.Equal(t, tc.dedup, later.Deduplicated())
			release()
			got, err = first.Wait(waitCtx(t, 10*time.Second))
			require.NoError(t, err)
			require.Equal(t, "r-a", got, "the first caller is answered by its own run, not by one produced after its call returned")
			got, err = later.Wait(waitCtx(t, 10*time.Second))
			require.NoError(t, err)
			require.Contains(t, tc.later, got)
		})
	}
}

// TestNewRunDoesNotJoinACallWaitingForAnEarlierRun: a caller of p waits for
// its run's notice (p's listener lags behind) when the run's outcome is gone
// (ResultTTL; here deleted), and a later call of p appends a new run of the
// id (code 0). A record check that reads the new run's outcome answers the
// later caller only: the first one gets its own run's result from the
// notice (or ErrRecordLost after the grace), never the new run's. (Before,
// the later call joined the first one's call, and the check answered both
// with the new run's result.)
func TestNewRunDoesNotJoinACallWaitingForAnEarlierRun(t *testing.T) {
	client := realRedis(t)
	p, _, ks, release := lagRig(t, client, nil)
	defer release()
	ctx := context.Background()
	first, err := p.Produce(ctx, "x", "a")
	require.NoError(t, err)
	completed(t, client, ks, "x")
	require.NoError(t, client.Del(ctx, ks.Record("x")).Err()) // its outcome expired
	later, err := p.Produce(ctx, "x", "c")
	require.NoError(t, err)
	require.Equal(t, DedupNone, later.Deduplicated(), "a new run")
	completed(t, client, ks, "x")
	require.NoError(t, p.checkWaiting(ctx)) // a check while the notices wait
	got, err := later.Wait(waitCtx(t, 10*time.Second))
	require.NoError(t, err)
	require.Equal(t, "r-c", got)
	release()
	got, err = first.Wait(waitCtx(t, 10*time.Second))
	if err != nil {
		require.ErrorIs(t, err, ErrRecordLost)
	} else {
		require.Equal(t, "r-a", got, "the first caller is not answered by a run produced after its call returned")
	}
	require.Eventually(t, func() bool { return p.waiters.len() == 0 }, 5*time.Second, 10*time.Millisecond, "calls left")
}

// discardOpts are a consumer's options that keep no result (DiscardResults).
func discardOpts(t *testing.T) *ConsumerOptions {
	o := fastOpts(t, "w", 10*time.Second)
	o.DiscardResults = true
	return o
}

// TestStoredDoneMarkerLeavesTheResultToTheNotice: with DiscardResults, a
// caller of p waits for its request's notice (p's listener lags behind)
// when a later call of p reads the done marker (code 2, "N"). The result is
// in the notice, on its way: both callers get it. (Before, the later call
// resolved the shared call with the marker: ErrNoResult for the first
// caller too, as a record check did before noticeDue.)
func TestStoredDoneMarkerLeavesTheResultToTheNotice(t *testing.T) {
	client := realRedis(t)
	p, _, ks, release := lagRig(t, client, discardOpts(t))
	defer release()
	ctx := context.Background()
	first, err := p.Produce(ctx, "a", "x")
	require.NoError(t, err)
	completed(t, client, ks, "a")
	later, err := p.Produce(ctx, "a", "y")
	require.NoError(t, err)
	require.Equal(t, DedupStored, later.Deduplicated())
	release()
	got, err := first.Wait(waitCtx(t, 10*time.Second))
	require.NoError(t, err, "the first caller gets the result its notice carries")
	require.Equal(t, "r-x", got)
	got, err = later.Wait(waitCtx(t, 10*time.Second))
	require.NoError(t, err, "the later caller gets the result its notice carries")
	require.Equal(t, "r-x", got)
}

// TestStoredDoneMarkerWhoseNoticeIsLostResolves: as above, but the notice
// never reaches the listener. The later caller is answered within the grace
// (BackstopInterval, at most 1 s) with ErrNoResult, and so is the first.
func TestStoredDoneMarkerWhoseNoticeIsLostResolves(t *testing.T) {
	client := realRedis(t)
	p, _, ks, release := lagRig(t, client, discardOpts(t))
	defer release()
	ctx := context.Background()
	first, err := p.Produce(ctx, "a", "x")
	require.NoError(t, err)
	completed(t, client, ks, "a")
	start := time.Now()
	later, err := p.Produce(ctx, "a", "y")
	require.NoError(t, err)
	_, err = later.Wait(waitCtx(t, 10*time.Second))
	require.ErrorIs(t, err, ErrNoResult)
	// The grace is 1 s; the rest absorbs a loaded machine.
	require.Less(t, time.Since(start), 5*time.Second, "the later caller waited past the grace")
	_, err = first.Wait(waitCtx(t, 10*time.Second))
	require.ErrorIs(t, err, ErrNoResult)
}

// TestNewRunsNoticeHandledBeforeTheReply: a call whose reply says it opened
// a new run (code 3, handOver; code 0 after an earlier caller's, newRun)
// gets a new call when the reply is read. The new run's notice may have
// been handled before that (a fast consumer, a reply read late): it
// resolved the call the caller registered before the append. The new call
// then takes that outcome, instead of waiting for the id's next notice,
// which is a later run's: a run produced after the call returned. (Before,
// the caller got the later run's outcome, another way to
// TestDedupModesThrottleSteadyStream's rare failure.)
func TestNewRunsNoticeHandledBeforeTheReply(t *testing.T) {
	t.Run("replaced", func(t *testing.T) {
		w := newWaiters()
		w.hear()
		c := w.acquire("x") // registered before the append
		items := []*produceItem{{id: "x", call: c}}
		w.resolveID("x", "Rnew")     // the new run's notice, handled first
		w.handOver(items, 0, "Rold") // the reply, read late
		w.resolveID("x", "Rlater")   // the next run's notice, produced later
		requireResolved(t, items[0].call, "Rnew")
	})
	t.Run("new after a gone record", func(t *testing.T) {
		w := newWaiters()
		w.hear()
		first := w.acquire("x")
		w.markAppended(first) // an earlier caller returned, waiting
		c, joined := w.join("x")
		require.True(t, joined)
		w.resolveID("x", "Rnew")           // the new run's notice (the earlier run's was lost)
		got := w.newRun("x", c, time.Hour) // the reply, read late: code 0
		w.markAppended(got)
		w.resolveID("x", "Rlater")
		requireResolved(t, got, "Rnew")
	})
}

// requireResolved checks that c is resolved with record.
func requireResolved(t *testing.T, c *call, record string) {
	t.Helper()
	select {
	case <-c.done:
	default:
		t.Fatal("the call is not resolved")
	}
	require.NoError(t, c.err)
	require.Equal(t, record, c.record, "resolved with a later run's outcome")
}

// TestRetiredCallWaitsForItsNoticeUntilAReconnect: a call retired by a new
// run (handOver, its caller joined while it waited) is answered by the id's
// next notice however late, not from the replaced outcome (which may be a
// later window's); a confirmation of the subscription after a reconnect,
// whose notice may have gone to nobody, resolves it with that outcome.
func TestRetiredCallWaitsForItsNoticeUntilAReconnect(t *testing.T) {
	for _, reconnect := range []bool{false, true} {
		t.Run(fmt.Sprintf("reconnect=%v", reconnect), func(t *testing.T) {
			w := newWaiters()
			w.hear()
			first := w.acquire("x")
			w.markAppended(first) // its caller returned, waiting
			c, joined := w.join("x")
			require.True(t, joined)
			items := []*produceItem{{id: "x", call: c, joined: joined}}
			w.handOver(items, 0, "Rreplaced") // code 3: a new run
			require.NotSame(t, first, items[0].call)
			select {
			case <-first.done:
				t.Fatal("the retired call was answered without its notice")
			default:
			}
			if reconnect {
				w.hear()
				requireResolved(t, first, "Rreplaced")
				return
			}
			w.resolveID("x", "Rfirst") // its notice, late
			w.resolveID("x", "Rnew")   // the new run's
			requireResolved(t, first, "Rfirst")
			requireResolved(t, items[0].call, "Rnew")
			require.Zero(t, w.len())
		})
	}
}
