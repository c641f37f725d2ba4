package streamq

import (
	"context"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/streamq/streamq/internal/faultproxy"
)

// TestProgressReturnsWithinContextDuringStall: Message.Progress is one round
// trip bounded by its ctx, as documented, also when the connection stalls
// (Redis or the network stops answering): it returns when its ctx ends, so
// the handler goes on. Before, it waited for the client's ReadTimeout (5 s
// here) and go-redis's retries, whatever its ctx said.
func TestProgressReturnsWithinContextDuringStall(t *testing.T) {
	t.Parallel()
	direct := realRedis(t)
	px, err := faultproxy.New(direct.Options().Addr)
	require.NoError(t, err)
	t.Cleanup(func() { _ = px.Close() })
	client := redis.NewClient(&redis.Options{Addr: px.Addr(), ReadTimeout: 5 * time.Second})
	t.Cleanup(func() { _ = client.Close() })
	q := queueName(t)

	started, proceed := make(chan struct{}), make(chan struct{})
	type result struct {
		err  error
		took time.Duration
	}
	reported := make(chan result, 1)
	c, err := NewConsumer(client, q, func(ctx context.Context, m *Message[string]) (string, error) {
		close(started)
		<-proceed
		pctx, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
		defer cancel()
		t0 := time.Now()
		err := m.Progress(pctx, "half")
		reported <- result{err, time.Since(t0)}
		return "ok", nil
	}, fastOpts(t, "stall", 30*time.Second))
	require.NoError(t, err)
	runConsumer(t, c)
	p := newStringProducer(t, direct, q)
	pr := mustProduce(t, p, "job", "x")
	<-started

	px.Stall(time.Minute)
	close(proceed)
	var r result
	select {
	case r = <-reported:
	case <-time.After(4 * time.Second):
		px.Resume()
		r = <-reported
		t.Fatalf("Progress returned after %v (ctx 200ms), only once the stall ended", r.took)
	}
	px.Resume()
	require.ErrorIs(t, r.err, context.DeadlineExceeded)
	require.Less(t, r.took, time.Second, "Progress returned late")
	_, err = pr.Wait(waitCtx(t, 20*time.Second))
	require.NoError(t, err)
}
