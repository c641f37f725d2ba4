package streamq

import (
	"context"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
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
	for _, name := range []string{"Enqueue", "Produce"} {
		dctx, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
		deadline, _ := dctx.Deadline()
		err := returnsWithin(t, 5*time.Second, name, func() error {
			if name == "Enqueue" {
				return p.Enqueue(dctx, "stalled-"+name, "x")
			}
			_, err := p.Produce(dctx, "stalled-"+name, "x")
			return err
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
	for _, id := range []string{"after", "stalled-Enqueue", "stalled-Produce"} {
		require.NoError(t, p.Enqueue(ctx, id, "x"), id)
	}
	n, err := direct.XLen(ctx, streamKey(q)).Result()
	require.NoError(t, err)
	require.EqualValues(t, 4, n, "warm, after and the two stalled ids: one entry each")
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

// countEvals is a hook that counts the script calls of a client.
func countEvals(n *int) redis.Hook { return evalCounter{n} }

type evalCounter struct{ n *int }

func (evalCounter) DialHook(next redis.DialHook) redis.DialHook { return next }
func (h evalCounter) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if name := cmd.Name(); name == "evalsha" || name == "eval" {
			*h.n++
		}
		return next(ctx, cmd)
	}
}
func (evalCounter) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
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
