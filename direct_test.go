package streamq

import (
	"context"
	"fmt"
	"net"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/streamq/streamq/internal/faultproxy"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// An idle producer sends a call's request from the caller's goroutine (a
// direct send). When the connection stalls, the call still returns when its
// ctx ends (the connection is cut under it), and the producer's next calls
// work once Redis answers again, on a new connection.
func TestDirectSendReturnsWithinContext(t *testing.T) {
	q := queueName(t)
	p, direct, px := proxiedProducer(t, q, 5*time.Second, nil)
	defer p.Close()
	ctx := context.Background()
	require.NoError(t, p.Enqueue(ctx, "warm", "x"))
	require.NotNil(t, p.direct, "a *redis.Client producer sends directly when idle")

	px.Stall(time.Minute)
	names := []string{"Enqueue", "Produce", "ProduceBatch", "EnqueueBatch"}
	for _, name := range names {
		dctx, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
		deadline, _ := dctx.Deadline()
		err := returnsWithin(t, 5*time.Second, name, func() error {
			id := "stalled-" + name
			switch name {
			case "Enqueue":
				return p.Enqueue(dctx, id, "x")
			case "Produce":
				_, err := p.Produce(dctx, id, "x")
				return err
			case "ProduceBatch":
				_, err := p.ProduceBatch(dctx, []Job[string]{{ID: id, Request: "x"}})
				return err
			}
			return p.EnqueueBatch(dctx, []Job[string]{{ID: id, Request: "x"}})
		})
		cancel()
		require.ErrorIs(t, err, context.DeadlineExceeded, name)
		// Stuck on the stall, it would take the 5 s ReadTimeout: the bound
		// only absorbs scheduling on a loaded machine.
		require.LessOrEqual(t, time.Since(deadline), 500*time.Millisecond, "%s returned late", name)
	}
	px.Resume()

	// The producer is idle again and its direct connection was cut: the
	// next call dials a new one. Whether the stalled requests were recorded
	// is unknown to their callers; producing them again is safe either way.
	require.NoError(t, p.Enqueue(ctx, "after", "x"))
	for _, name := range names {
		require.NoError(t, p.Enqueue(ctx, "stalled-"+name, "x"), name)
	}
	n, err := direct.XLen(ctx, streamKey(q)).Result()
	require.NoError(t, err)
	require.EqualValues(t, 2+len(names), n, "warm, after and the stalled ids: one entry each")
}

// A direct send that fails for a reason that is not the caller's (its
// connection is cut as the reply comes back) is sent again the usual way,
// on the user's client: the caller gets its answer, and the id's one entry.
func TestDirectSendFailureGoesTheUsualWay(t *testing.T) {
	q := queueName(t)
	var evals int
	p, direct, px := proxiedProducer(t, q, 5*time.Second, nil, countEvals(&evals))
	defer p.Close()
	ctx := context.Background()
	require.NoError(t, p.Enqueue(ctx, "warm", "x"))
	require.Zero(t, evals, "the idle producer's call went on its own connection, not the user's client")

	fired := px.CutReplyTo([]byte("cut-me"))
	pr, err := p.Produce(ctx, "cut-me", "x")
	require.NoError(t, err)
	<-fired
	require.Equal(t, 1, evals, "the cut call was sent again on the user's client")
	n, err := direct.XLen(ctx, streamKey(q)).Result()
	require.NoError(t, err)
	require.EqualValues(t, 2, n, "warm and cut-me, once each")
	pr.Release()
}

// A batch of one shard goes on the idle producer's own connection like a
// one-job call, from the caller's goroutine; cut as its reply comes back, it
// is sent again on the user's client, and each id has one entry.
func TestDirectBatchFailureGoesTheUsualWay(t *testing.T) {
	q := queueName(t)
	var evals int
	p, direct, px := proxiedProducer(t, q, 5*time.Second, nil, countEvals(&evals))
	defer p.Close()
	ctx := context.Background()
	require.NoError(t, p.EnqueueBatch(ctx, []Job[string]{{ID: "w1", Request: "x"}, {ID: "w2", Request: "x"}}))
	prs, err := p.ProduceBatch(ctx, []Job[string]{{ID: "w3", Request: "x"}})
	require.NoError(t, err)
	releaseAll(prs)
	require.Zero(t, evals, "the idle producer's batches went on its own connection, not the user's client")

	fired := px.CutReplyTo([]byte("cut-batch"))
	prs, err = p.ProduceBatch(ctx, []Job[string]{{ID: "cut-batch", Request: "x"}, {ID: "b2", Request: "x"}})
	require.NoError(t, err)
	<-fired
	require.Equal(t, 1, evals, "the cut batch was sent again on the user's client")
	require.Len(t, prs, 2)
	releaseAll(prs)
	n, err := direct.XLen(ctx, streamKey(q)).Result()
	require.NoError(t, err)
	require.EqualValues(t, 5, n, "w1, w2, w3, cut-batch and b2, once each")

	// An invalid batch's answer is the answer: it is not sent again.
	require.NoError(t, direct.LPush(ctx, "streamq:{"+q+"}:id:bad", "x").Err())
	err = p.EnqueueBatch(ctx, []Job[string]{{ID: "ok", Request: "x"}, {ID: "bad", Request: "x"}})
	require.ErrorIs(t, err, ErrWrongType)
	require.Equal(t, 1, evals, "the invalid batch was sent again on the user's client")
}

// One-job calls and batches of many goroutines share the producer's direct
// connection one call at a time (the others go the usual way), and every id
// is appended once.
func TestDirectConnectionIsUsedByOneCallAtATime(t *testing.T) {
	client := realRedis(t)
	q := queueName(t)
	p, err := NewProducer[string, string](client, q, &ProducerOptions{Logger: testLogger(t)})
	require.NoError(t, err)
	defer p.Close()
	require.NotNil(t, p.direct)
	var most atomic.Int32
	p.direct.client.AddHook(scriptsInFlight(&most))

	ctx := context.Background()
	const goroutines, rounds = 8, 40
	var wg sync.WaitGroup
	for g := range goroutines {
		wg.Go(func() {
			for r := range rounds {
				id := fmt.Sprintf("g%d-r%d", g, r)
				var err error
				if (g+r)%2 == 0 {
					err = p.Enqueue(ctx, id, "x")
				} else {
					err = p.EnqueueBatch(ctx, []Job[string]{{ID: id + "a", Request: "x"}, {ID: id + "b", Request: "x"}})
				}
				assert.NoError(t, err, id)
			}
		})
	}
	wg.Wait()
	require.LessOrEqual(t, most.Load(), int32(1), "two calls used the direct connection at once")
	n, err := client.XLen(ctx, streamKey(q)).Result()
	require.NoError(t, err)
	require.EqualValues(t, goroutines*rounds/2*3, n, "each id once: one per Enqueue, two per batch")
}

// releaseAll releases every promise of a batch.
func releaseAll(prs []*Promise[string]) {
	for _, pr := range prs {
		pr.Release()
	}
}

// TestEnqueueAfterScriptFlush: a server that lost its scripts (a restart,
// SCRIPT FLUSH) answers produce.lua's EVALSHA with NOSCRIPT; the producer
// sends the call again as an EVAL with the source, on the direct path and in
// a batch, and each request is appended once.
func TestEnqueueAfterScriptFlush(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	client := realRedis(t)
	q := queueName(t)
	p, err := NewProducer[string, string](client, q, &ProducerOptions{Logger: testLogger(t)})
	require.NoError(t, err)
	defer p.Close()
	require.NoError(t, p.Enqueue(ctx, "a", "x"))
	require.NoError(t, client.ScriptFlush(ctx).Err())
	require.NoError(t, p.Enqueue(ctx, "b", "x"))
	require.NoError(t, client.ScriptFlush(ctx).Err())
	_, err = p.ProduceBatch(ctx, []Job[string]{{ID: "c", Request: "x"}, {ID: "d", Request: "x"}})
	require.NoError(t, err)
	require.EqualValues(t, 4, client.XLen(ctx, benchStream(q)).Val())
}

// writeSeam is a connection whose writes call after (when set) once they
// returned: the moment between go-redis writing a command and setting the
// deadline of the read that follows.
type writeSeam struct {
	net.Conn
	after *atomic.Pointer[func()]
}

func (c writeSeam) Write(b []byte) (int, error) {
	n, err := c.Conn.Write(b)
	if f := c.after.Swap(nil); f != nil {
		(*f)()
	}
	return n, err
}

// A ctx that ends just after a direct call's request was written, before
// go-redis sets the reply's read deadline, still ends the call at once:
// the deadline that go-redis sets next must not undo the cut. (Before, the
// call waited for the reply: for the stall here, 2 s, or up to ReadTimeout.)
func TestDirectCallCutBetweenWriteAndReadReturns(t *testing.T) {
	for _, name := range []string{"Enqueue", "EnqueueBatch"} {
		t.Run(name, func(t *testing.T) {
			q := queueName(t)
			direct := realRedis(t)
			px, err := faultproxy.New(direct.Options().Addr)
			require.NoError(t, err)
			t.Cleanup(func() { _ = px.Close() })
			var after atomic.Pointer[func()]
			client := redis.NewClient(&redis.Options{Addr: px.Addr(), ReadTimeout: 5 * time.Second,
				Dialer: func(ctx context.Context, network, addr string) (net.Conn, error) {
					c, err := (&net.Dialer{}).DialContext(ctx, network, addr)
					if err != nil {
						return nil, err
					}
					return writeSeam{c, &after}, nil
				}})
			t.Cleanup(func() { _ = client.Close() })
			p, err := NewProducer[string, string](client, q, &ProducerOptions{Logger: testLogger(t)})
			require.NoError(t, err)
			defer p.Close()
			ctx := context.Background()
			require.NoError(t, p.Enqueue(ctx, "warm", "x"))

			cctx, cancel := context.WithCancel(ctx)
			defer cancel()
			px.Stall(2 * time.Second)
			defer px.Resume()
			cut := func() {
				cancel()
				// The interrupt (context.AfterFunc) runs in a goroutine of
				// its own: wait until it has cut the connection, before
				// go-redis sets the reply's read deadline.
				eventually(t, time.Second, p.direct.cut.Load, "the interrupt ran")
			}
			after.Store(&cut)
			start := time.Now()
			if name == "Enqueue" {
				err = p.Enqueue(cctx, "cut", "x")
			} else {
				err = p.EnqueueBatch(cctx, []Job[string]{{ID: "cut", Request: "x"}})
			}
			took := time.Since(start)
			require.ErrorIs(t, err, context.Canceled)
			require.Less(t, took, time.Second, "the call returned %v after its ctx ended", took)
		})
	}
}

// A call's ctx that ends as the call returns cuts no later call: its
// interrupt, run late in a goroutine of its own, finds another call on the
// connection and leaves it alone. (Before, the later call was cut and sent
// again on the user's client.)
func TestLateInterruptCutsNoLaterCall(t *testing.T) {
	q := queueName(t)
	var evals int
	p, _, px := proxiedProducer(t, q, 5*time.Second, nil, countEvals(&evals))
	defer p.Close()
	ctx := context.Background()
	require.NoError(t, p.Enqueue(ctx, "warm", "x"))
	require.Zero(t, evals)

	// The first call's interrupt starts when its ctx ends, inside the call,
	// and waits until the second call is in flight.
	late, release := make(chan struct{}), make(chan struct{})
	var once sync.Once
	p.direct.testHook = func() {
		once.Do(func() {
			close(late)
			<-release
		})
	}
	actx, cancelA := context.WithCancel(ctx)
	var calls atomic.Int32
	p.direct.client.AddHook(beforeScripts(func() {
		switch calls.Add(1) {
		case 1: // the first call: its ctx ends before its command is sent
			cancelA()
			<-late
		case 2: // the second call: its reply is held back while the late interrupt runs
			px.Stall(300 * time.Millisecond)
			time.AfterFunc(50*time.Millisecond, func() { close(release) })
		}
	}))
	_ = p.EnqueueBatch(actx, []Job[string]{{ID: "a", Request: "x"}}) // its ctx ended: any outcome
	require.NoError(t, p.EnqueueBatch(ctx, []Job[string]{{ID: "b", Request: "x"}}))
	require.Zero(t, evals, "the second call was cut by the first one's ctx and sent again on the user's client")
}

// scriptHook is a hook that runs around each script call (EVALSHA or EVAL)
// of a client: f gets the call and whatever runs it. Other commands pass
// (a new connection's HELLO runs inside the call that dialed).
type scriptHook func(ctx context.Context, cmd redis.Cmder, next redis.ProcessHook) error

func (scriptHook) DialHook(next redis.DialHook) redis.DialHook { return next }
func (f scriptHook) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if name := cmd.Name(); name != "evalsha" && name != "eval" {
			return next(ctx, cmd)
		}
		return f(ctx, cmd, next)
	}
}
func (scriptHook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}

// countEvals is a hook that counts the script calls of a client.
func countEvals(n *int) redis.Hook {
	return scriptHook(func(ctx context.Context, cmd redis.Cmder, next redis.ProcessHook) error {
		*n++
		return next(ctx, cmd)
	})
}

// beforeScripts is a hook that calls f before each script call.
func beforeScripts(f func()) redis.Hook {
	return scriptHook(func(ctx context.Context, cmd redis.Cmder, next redis.ProcessHook) error {
		f()
		return next(ctx, cmd)
	})
}

// scriptsInFlight is a hook that keeps in most the most script calls in
// flight at once.
func scriptsInFlight(most *atomic.Int32) redis.Hook {
	var now atomic.Int32
	return scriptHook(func(ctx context.Context, cmd redis.Cmder, next redis.ProcessHook) error {
		n := now.Add(1)
		defer now.Add(-1)
		for {
			m := most.Load()
			if n <= m || most.CompareAndSwap(m, n) {
				break
			}
		}
		return next(ctx, cmd)
	})
}
