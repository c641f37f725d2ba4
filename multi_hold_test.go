package streamq

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// TestMultiPausedQueueGivesBackItsWorker: in a pool of one worker, a queue
// paused while the worker waits for one of its slots (for the queue's
// rate-limit token, or for the slot's payload fetch) gives the worker back:
// the other queue's requests complete during the pause, the paused queue
// starts nothing, and its requests run after Resume. Before, the worker
// took the token (or waited for the fetch) and then waited at the pause
// gate until Resume, and every other queue stopped.
func TestMultiPausedQueueGivesBackItsWorker(t *testing.T) {
	t.Parallel()
	client := realRedis(t)
	for _, wait := range []string{"token", "fetch"} {
		t.Run(wait, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			qa, qb := queueName(t), queueName(t)
			pa, pb := newStringProducer(t, client, qa), newStringProducer(t, client, qb)
			var startsA atomic.Int64
			optsA := fastOpts(t, "hold", 10*time.Second)
			fetching := make(chan struct{}, 1)
			release := make(chan struct{})
			var once sync.Once
			free := func() { once.Do(func() { close(release) }) }
			defer free()
			switch wait {
			case "token":
				// The first start takes the burst; the second waits 5 s.
				optsA.RateLimit = &RateLimit{N: 1, Per: 5 * time.Second}
			case "fetch":
				optsA.Fetcher = FetcherFunc(func(ctx context.Context, e Entry) ([]byte, error) {
					if string(e.Data) == `"slow"` {
						select {
						case fetching <- struct{}{}:
						default:
						}
						select {
						case <-release:
						case <-ctx.Done():
							return nil, ctx.Err()
						}
					}
					return e.Data, nil
				})
			}
			ca, err := NewConsumer(client, qa, func(ctx context.Context, m *Message[string]) (string, error) {
				startsA.Add(1)
				return "a:" + m.Payload, nil
			}, optsA)
			require.NoError(t, err)
			cb, err := NewConsumer(client, qb, func(ctx context.Context, m *Message[string]) (string, error) {
				return "b:" + m.Payload, nil
			}, fastOpts(t, "hold", 10*time.Second))
			require.NoError(t, err)
			m, err := NewMultiConsumer(&MultiOptions{Workers: 1},
				MultiQueue{Consumer: ca, Weight: 10}, MultiQueue{Consumer: cb, Weight: 1})
			require.NoError(t, err)
			runMulti(t, m)

			first := mustProduce(t, pa, "a0", "fast")
			_, err = first.Wait(waitCtx(t, 10*time.Second))
			require.NoError(t, err)
			second := mustProduce(t, pa, "a1", "slow")
			// The only worker holds A's second slot: waiting for its token,
			// or for its payload.
			var p *pool
			switch wait {
			case "token":
				eventually(t, 10*time.Second, func() bool {
					p = m.lastPool.Load()
					p.ring.qmu.Lock()
					defer p.ring.qmu.Unlock()
					return p.ring.qs[0].waiting == 1
				}, "the worker never waited for A's token")
			case "fetch":
				select {
				case <-fetching:
				case <-time.After(10 * time.Second):
					t.Fatal("A's second payload was never fetched")
				}
				p = m.lastPool.Load()
				eventually(t, 10*time.Second, func() bool {
					p.ring.qmu.Lock()
					defer p.ring.qmu.Unlock()
					return p.ring.qs[0].n == 0
				}, "the worker never took A's second slot")
			}
			admin, err := NewAdmin(client, qa, nil)
			require.NoError(t, err)
			require.NoError(t, admin.Pause(ctx))
			eventually(t, 5*time.Second, func() bool {
				p.ring.qmu.Lock()
				defer p.ring.qmu.Unlock()
				return p.ring.qs[0].paused
			}, "the pause was not seen")
			for i := range 5 {
				pr := mustProduce(t, pb, fmt.Sprint("b", i), "b")
				got, err := pr.Wait(waitCtx(t, 10*time.Second))
				require.NoError(t, err, "b %d: the paused queue kept the pool's only worker (%s)", i,
					lazyString(func() string { return ringState(m) }))
				require.Equal(t, "b:b", got)
			}
			require.EqualValues(t, 1, startsA.Load(), "a paused queue's request started")
			free() // the payload arrives during the pause
			require.NoError(t, admin.Resume(ctx))
			got, err := second.Wait(waitCtx(t, 20*time.Second))
			require.NoError(t, err, "A's request after Resume")
			require.Equal(t, "a:slow", got)
		})
	}
}

// TestMultiRateLimitLateTokensDoNotBurst: tokens a pool's limiter took for
// slots waiting in the ring, which no worker was free to use at their time,
// are not used later all at once. All four workers are held by handlers
// while the limiter has tokens for the rate-limited queue's next slots;
// when the handlers return, its starts must keep the documented bound: in
// any window W at most W*N/Per + Burst. Start times are taken in the
// handler, so each window is widened by the scheduling delay between a
// token and its handler's start (startJitter, 80% of the interval);
// before, the late tokens started two or three handlers within a
// millisecond.
func TestMultiRateLimitLateTokensDoNotBurst(t *testing.T) {
	t.Parallel()
	client := realRedis(t)
	qa, qb := queueName(t), queueName(t)
	pa, pb := newStringProducer(t, client, qa), newStringProducer(t, client, qb)
	const (
		// Per second: one start every 100ms. The interval must be shorter
		// than the limiter's look-ahead (100ms of tokens per call) for
		// tokens to be granted ahead at all.
		rate  = 10
		burst = 1
		// The delay allowed between a token and its handler's start: 80% of
		// the interval, so a loaded machine (a full -race suite on two
		// cores) does not fail the test, while two starts within 20ms, the
		// bug's signature (they came within a few milliseconds), still do.
		startJitter = 80 * time.Millisecond
	)
	interval := time.Second / rate
	release := make(chan struct{}) // phase one's handlers wait for it
	var releaseOnce sync.Once
	free := func() { releaseOnce.Do(func() { close(release) }) }
	defer free()
	var mu sync.Mutex
	var startsA []time.Time
	countA := func() int {
		mu.Lock()
		defer mu.Unlock()
		return len(startsA)
	}
	optsA := fastOpts(t, "late", 10*time.Second)
	optsA.RateLimit = &RateLimit{N: rate, Per: time.Second, Burst: burst}
	ca, err := NewConsumer(client, qa, func(ctx context.Context, m *Message[string]) (string, error) {
		mu.Lock()
		startsA = append(startsA, time.Now())
		mu.Unlock()
		<-release
		return "", nil
	}, optsA)
	require.NoError(t, err)
	type grant struct {
		at    time.Time
		first time.Duration
		n     int
	}
	var gmu sync.Mutex
	var grants []grant
	ca.onGrant = func(now time.Time, first time.Duration, n int) {
		gmu.Lock()
		grants = append(grants, grant{time.Now(), first, n})
		gmu.Unlock()
	}
	var startsB atomic.Int64
	ownB := make(chan struct{}) // B's first handler waits for it
	var ownOnce sync.Once
	freeOwn := func() { ownOnce.Do(func() { close(ownB) }) }
	defer freeOwn()
	cb, err := NewConsumer(client, qb, func(ctx context.Context, m *Message[string]) (string, error) {
		startsB.Add(1)
		if m.Payload == "own" {
			<-ownB
		} else {
			<-release
		}
		return "", nil
	}, fastOpts(t, "late", 10*time.Second))
	require.NoError(t, err)
	m, err := NewMultiConsumer(&MultiOptions{Workers: 4, Prefetch: 64}, MultiQueue{Consumer: ca}, MultiQueue{Consumer: cb})
	require.NoError(t, err)
	runMulti(t, m)

	// Every worker in one of B's handlers, then A's requests wait in the
	// ring.
	mustProduce(t, pb, "b0", "own").Release()
	for i := 1; i < 4; i++ {
		mustProduce(t, pb, fmt.Sprint("b", i), "b").Release()
	}
	eventually(t, 10*time.Second, func() bool { return startsB.Load() == 4 }, "B's starts")
	const nA = 12
	for i := range nA {
		mustProduce(t, pa, fmt.Sprint("a", i), "a").Release()
	}
	p := m.lastPool.Load()
	eventually(t, 10*time.Second, func() bool { return p.ring.queuedOf(0) >= 2 }, "A's slots never waited in the ring")
	// One worker comes free: it waits for A's token, and the limiter takes
	// tokens for A's waiting slots too (two fit in its horizon). A's
	// handler then holds that worker as well, and no worker is free when
	// the second token is due.
	freeOwn()
	eventually(t, 10*time.Second, func() bool { return countA() == 1 }, "A's first start")
	// Every token granted so far is due (and then some) before the workers
	// come free.
	gmu.Lock()
	var due time.Time
	for _, g := range grants {
		if d := g.at.Add(max(g.first, 0) + time.Duration(g.n)*interval); d.After(due) {
			due = d
		}
	}
	t.Logf("grants before the release: %+v", grants)
	gmu.Unlock()
	time.Sleep(time.Until(due.Add(2 * interval)))
	free()
	eventually(t, 20*time.Second, func() bool { return countA() == nA }, "A's starts after the release")

	mu.Lock()
	ts := append([]time.Time(nil), startsA...)
	mu.Unlock()
	maxInWindow(ts, 0) // sorts
	for i := range ts {
		for j := i + 1; j < len(ts); j++ {
			w := ts[j].Sub(ts[i])
			bound := float64(w+startJitter)/float64(interval) + burst
			require.LessOrEqualf(t, float64(j-i+1), bound,
				"%d starts within %v (bound %.2f: %d/s, burst %d, %v of scheduling delay allowed); starts %v",
				j-i+1, w, bound, rate, burst, startJitter, offsets(ts))
		}
	}
}

// offsets returns ts relative to the first, for messages.
func offsets(ts []time.Time) []time.Duration {
	out := make([]time.Duration, len(ts))
	for i := range ts {
		out[i] = ts[i].Sub(ts[0]).Round(time.Millisecond)
	}
	return out
}
