package streamq

import (
	"context"
	"fmt"
	"net"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/streamq/streamq/internal/keys"
)

// noticeRig is a producer whose backstop never runs on its own (an hour), so
// that only notices and the check that follows a subscription resolve its
// promises, and a consumer that echoes every request.
func noticeRig(t *testing.T, client *redis.Client) (*Producer[string, string], string, *atomic.Int64) {
	t.Helper()
	q := queueName(t)
	p, err := NewProducer[string, string](client, q, &ProducerOptions{BackstopInterval: time.Hour, Logger: testLogger(t)})
	require.NoError(t, err)
	t.Cleanup(func() { _ = p.Close() })
	var runs atomic.Int64
	c, err := NewConsumer(client, q, func(ctx context.Context, m *Message[string]) (string, error) {
		runs.Add(1)
		return "r-" + m.Payload, nil
	}, fastOpts(t, "w", 10*time.Second))
	require.NoError(t, err)
	runConsumer(t, c)
	return p, q, &runs
}

// subscribers returns how many clients listen to queue q's notice channel.
func subscribers(t *testing.T, client *redis.Client, q string) int64 {
	t.Helper()
	ks, err := keys.Shards(q, 1)
	require.NoError(t, err)
	n, err := client.PubSubNumSub(context.Background(), ks[0].Channel).Result()
	require.NoError(t, err)
	return n[ks[0].Channel]
}

// TestReleasedPromisesAreSentNoNotices: a producer whose batch promises are
// released unheard does not subscribe to completion notices, so Redis sends
// it none (each notice of a queue went to every producer of it, which read
// every one). The first Wait subscribes.
func TestReleasedPromisesAreSentNoNotices(t *testing.T) {
	backends(t, func(t *testing.T, client *redis.Client) {
		p, q, runs := noticeRig(t, client)
		ctx := context.Background()
		jobs := make([]Job[string], 20)
		for i := range jobs {
			jobs[i] = Job[string]{ID: fmt.Sprintf("b%d", i), Request: "x"}
		}
		prs, err := p.ProduceBatch(ctx, jobs)
		require.NoError(t, err)
		for _, pr := range prs {
			pr.Release()
		}
		eventually(t, 20*time.Second, func() bool { return runs.Load() == 20 }, "not every job ran")
		require.Zero(t, subscribers(t, client, q), "a producer nobody listens to subscribed")
		require.Zero(t, p.waiters.len(), "released promises are still held")

		prs, err = p.ProduceBatch(ctx, []Job[string]{{ID: "two", Request: "y"}})
		require.NoError(t, err)
		got, err := waitFor(t, prs[0])
		require.NoError(t, err)
		require.Equal(t, "r-y", got)
		require.EqualValues(t, 1, subscribers(t, client, q), "Wait did not subscribe")
	})
}

// TestWaitFindsOutcomesRecordedBeforeItListened: promises whose requests
// completed before anyone listened (their notices went to nobody) resolve at
// the first Wait or Done, from the records read after the subscription,
// not a BackstopInterval (an hour here) later.
func TestWaitFindsOutcomesRecordedBeforeItListened(t *testing.T) {
	for _, how := range []string{"Wait", "Done"} {
		t.Run(how, func(t *testing.T) {
			backends(t, func(t *testing.T, client *redis.Client) {
				p, q, runs := noticeRig(t, client)
				ctx := context.Background()
				const n = 30
				jobs := make([]Job[string], n)
				for i := range jobs {
					jobs[i] = Job[string]{ID: fmt.Sprintf("j%d", i), Request: fmt.Sprint(i)}
				}
				prs, err := p.ProduceBatch(ctx, jobs)
				require.NoError(t, err)
				eventually(t, 20*time.Second, func() bool { return runs.Load() == n }, "not every job ran")
				ks, err := keys.Shards(q, 1)
				require.NoError(t, err)
				eventually(t, 20*time.Second, func() bool {
					for i := range jobs {
						v, err := client.Get(ctx, ks[0].Record(jobs[i].ID)).Result()
						if err != nil || v[0] == keys.RecordInflight {
							return false
						}
					}
					return true
				}, "not every outcome was recorded")
				for i, pr := range prs {
					if how == "Done" {
						select {
						case <-pr.Done():
						case <-time.After(20 * time.Second):
							t.Fatalf("promise %d: Done did not close in 20s", i)
						}
					}
					got, err := waitFor(t, pr)
					require.NoError(t, err)
					require.Equal(t, fmt.Sprintf("r-%d", i), got)
				}
			})
		})
	}
}

// TestACallAppendedAfterTheSubscriptionsCheckIsChecked: a call registered
// before the producer listened whose append is marked after the check that
// followed the subscription asks for another check (its notice may have gone
// to nobody); one registered after the subscription does not.
func TestACallAppendedAfterTheSubscriptionsCheckIsChecked(t *testing.T) {
	w := newWaiters()
	var checks int
	w.recheck = func() { checks++ }
	early := w.acquire("a")
	w.markAppended(w.acquire("before")) // appended before: the check reads it
	w.hear()
	w.markAppended(early)
	require.Equal(t, 1, checks, "a call appended after the subscription's check was not checked")
	w.markAppended(early)
	require.Equal(t, 1, checks, "marked twice, checked twice")
	w.markAppended(w.acquire("later"))
	require.Equal(t, 1, checks, "a call registered after the subscription asked for a check")

	// The subscription is lost and made again (a reconnect): a call
	// registered before the new confirmation may have had its notice
	// published while nobody listened, and the check that followed the
	// confirmation may have read its record before its append was marked.
	during := w.acquire("during")
	w.hear()
	w.markAppended(during)
	require.Equal(t, 2, checks, "a call appended after a resubscription's check was not checked")
}

// A Wait that started the producer's subscription returns when its promise
// is released (ErrReleased) or its request resolves (the backstop read the
// outcome), without waiting for the subscription attempt to end. (Before,
// it waited for the attempt: up to its 10 s bound while Redis did not
// confirm, then returned the attempt's error even after Release.)
func TestWaitBlockedInSubscribeEndsOnReleaseOrOutcome(t *testing.T) {
	for _, how := range []string{"Release", "Resolved"} {
		t.Run(how, func(t *testing.T) {
			raw := realRedis(t)
			var hang atomic.Bool // new connections hang until their dial ends
			client := redis.NewClient(&redis.Options{Addr: raw.Options().Addr, PoolSize: 8, MinIdleConns: 4,
				Dialer: func(ctx context.Context, network, addr string) (net.Conn, error) {
					if hang.Load() {
						<-ctx.Done()
						return nil, ctx.Err()
					}
					return (&net.Dialer{}).DialContext(ctx, network, addr)
				}})
			t.Cleanup(func() { _ = client.Close() })
			q := queueName(t)
			p, err := NewProducer[string, string](client, q, &ProducerOptions{BackstopInterval: 50 * time.Millisecond, Logger: testLogger(t)})
			require.NoError(t, err)
			defer p.Close()
			ctx := context.Background()
			prs, err := p.ProduceBatch(ctx, []Job[string]{{ID: "a", Request: "x"}})
			require.NoError(t, err)
			for range 4 {
				require.NoError(t, client.Ping(ctx).Err()) // the pool's idle connections serve the backstop
			}
			hang.Store(true) // the subscription's own connection never comes
			defer hang.Store(false)
			if how == "Resolved" {
				c, err := NewConsumer(raw, q, func(ctx context.Context, m *Message[string]) (string, error) {
					return "r-" + m.Payload, nil
				}, fastOpts(t, "w", 10*time.Second))
				require.NoError(t, err)
				runConsumer(t, c)
			} else {
				time.AfterFunc(200*time.Millisecond, prs[0].Release)
			}
			start := time.Now()
			wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
			defer cancel()
			got, err := prs[0].Wait(wctx)
			took := time.Since(start)
			if how == "Release" {
				require.ErrorIs(t, err, ErrReleased)
			} else {
				require.NoError(t, err)
				require.Equal(t, "r-x", got)
			}
			// The attempt's bound is 10 s; the rest absorbs a loaded machine.
			require.Less(t, took, 5*time.Second, "Wait waited for the subscription attempt")
		})
	}
}

// With DiscardResults the notice is the only place a result is: a record
// check that reads the done marker ("N") before the listener handled the
// notice (a listener a little behind) must leave the promise to the notice
// when the producer listened before the request was appended. (Before, the
// check resolved it with ErrNoResult.)
func TestRecordCheckLeavesTheResultToTheNotice(t *testing.T) {
	client := realRedis(t)
	q := queueName(t)
	p, err := NewProducer[string, string](client, q, &ProducerOptions{BackstopInterval: time.Hour, Logger: testLogger(t)})
	require.NoError(t, err)
	defer p.Close()
	ctx := context.Background()
	pr, err := p.Produce(ctx, "a", "x") // listens before the append
	require.NoError(t, err)
	lag := make(chan struct{})
	hold := func() { <-lag }
	p.testHookNotice.Store(&hold) // the listener lags behind
	o := fastOpts(t, "w", 10*time.Second)
	o.DiscardResults = true
	c, err := NewConsumer(client, q, func(ctx context.Context, m *Message[string]) (string, error) {
		return "r-" + m.Payload, nil
	}, o)
	require.NoError(t, err)
	runConsumer(t, c)
	ks, err := keys.Shards(q, 1)
	require.NoError(t, err)
	eventually(t, 10*time.Second, func() bool {
		v, err := client.Get(ctx, ks[0].Record("a")).Result()
		return err == nil && v != "" && v[0] == keys.RecordNoResult
	}, "the request completed")
	// A check while the notice waits in the listener (the periodic one, a
	// resubscription's, a late append's): it reads "N".
	require.NoError(t, p.checkWaiting(ctx))
	select {
	case <-pr.Done():
		t.Fatal("the record check resolved the promise before its notice was handled")
	default:
	}
	close(lag)
	got, err := pr.Wait(ctx)
	require.NoError(t, err)
	require.Equal(t, "r-x", got)
}

// A done marker whose notice never reaches the listener (here one it drops
// as malformed; go-redis also drops messages from a listener that lags a
// minute) leaves its promise to the notice only for a short grace: then a
// check resolves it with ErrNoResult, as without the notice. (Before, every
// check left it to the notice until the record expired.)
func TestDoneMarkerWhoseNoticeIsLostResolves(t *testing.T) {
	for _, interval := range []time.Duration{50 * time.Millisecond, time.Hour} {
		t.Run(interval.String(), func(t *testing.T) {
			client := realRedis(t)
			q := queueName(t)
			p, err := NewProducer[string, string](client, q, &ProducerOptions{BackstopInterval: interval, Logger: testLogger(t)})
			require.NoError(t, err)
			defer p.Close()
			ctx := context.Background()
			pr, err := p.Produce(ctx, "a", "x") // listens before the append: its notice is due
			require.NoError(t, err)
			ks, err := keys.Shards(q, 1)
			require.NoError(t, err)
			// The request completed with DiscardResults; its notice is lost.
			require.NoError(t, client.Set(ctx, ks[0].Record("a"), "N", time.Hour).Err())
			require.NoError(t, client.Publish(ctx, ks[0].Channel, "garbage").Err())
			require.NoError(t, p.checkWaiting(ctx)) // leaves it to the notice, for the grace
			wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
			defer cancel()
			_, err = pr.Wait(wctx)
			require.ErrorIs(t, err, ErrNoResult)
		})
	}
}

// A run that replaced a stored outcome (handOver) gets its call when the
// produce reply is read, which may be after the listener handled the run's
// notice: that call is never left to a notice. (Before, a check skipped its
// done marker for good.)
func TestHandedOverCallIsNotLeftToANotice(t *testing.T) {
	client := realRedis(t)
	q := queueName(t)
	p, err := NewProducer[string, string](client, q, &ProducerOptions{BackstopInterval: time.Hour, Logger: testLogger(t)})
	require.NoError(t, err)
	defer p.Close()
	ctx := context.Background()
	_, err = p.Produce(ctx, "warm", "x") // the producer listens
	require.NoError(t, err)
	ks, err := keys.Shards(q, 1)
	require.NoError(t, err)
	c := p.waiters.acquire("x") // a Produce with a mode that replaces a stored outcome
	items := []*produceItem{{id: "x", call: c}}
	// The new run completed (DiscardResults) and its notice was handled
	// before the producer read the script's reply.
	require.NoError(t, client.Set(ctx, ks[0].Record("x"), "N", time.Hour).Err())
	p.waiters.resolveID("x", "Rnew")
	p.waiters.handOver(items, 0, "Eold") // the reply, read late
	require.NoError(t, p.checkWaiting(ctx))
	select {
	case <-items[0].call.done:
	default:
		t.Fatal("the new run's call was left to a notice that was already handled")
	}
}

// TestNoticeCarriesZeroBytes: a notice is the only place a result is with
// DiscardResults, so its length-prefixed text must carry ids and results
// byte for byte, zero bytes included (Lua's string.format "%s" would stop
// at the first one; complete.lua formats only the lengths).
func TestNoticeCarriesZeroBytes(t *testing.T) {
	backends(t, func(t *testing.T, client *redis.Client) {
		ctx := context.Background()
		q := queueName(t)
		p, err := NewProducer[[]byte, []byte](client, q, &ProducerOptions{BackstopInterval: time.Hour, Logger: testLogger(t)})
		require.NoError(t, err)
		defer p.Close()
		opts := fastOpts(t, "w", 10*time.Second)
		opts.DiscardResults = true
		c, err := NewConsumer(client, q, func(_ context.Context, m *Message[[]byte]) ([]byte, error) {
			return append([]byte("echo\x00:"), m.Payload...), nil
		}, opts)
		require.NoError(t, err)
		runConsumer(t, c)
		ids := []string{"z\x00a", "z\x00b\x00", "plain"}
		var prs []*Promise[[]byte]
		for _, id := range ids {
			pr, err := p.Produce(ctx, id, []byte(id+"\x00\xff"))
			require.NoError(t, err)
			prs = append(prs, pr)
		}
		for i, pr := range prs {
			got, err := waitFor(t, pr)
			require.NoError(t, err, "id %q", ids[i])
			require.Equal(t, []byte("echo\x00:"+ids[i]+"\x00\xff"), got, "id %q", ids[i])
		}
	})
}
