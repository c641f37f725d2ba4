package streamq

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// TestMultiPausedQueueKeepsNoReadAhead: end to end, a queue paused while
// its entries wait in the shared ring (its workers busy) does not stop the
// other queue's requests.
func TestMultiPausedQueueKeepsNoReadAhead(t *testing.T) {
	t.Parallel()
	client := realRedis(t)
	ctx := context.Background()
	qx, qy := queueName(t)+"-x", queueName(t)+"-y"
	px, py := newStringProducer(t, client, qx), newStringProducer(t, client, qy)
	for i := range 50 {
		mustProduce(t, px, fmt.Sprint("x", i), "x")
	}
	gate := make(chan struct{})
	var xStarts atomic.Int32
	cx, err := NewConsumer(client, qx, func(ctx context.Context, m *Message[string]) (string, error) {
		xStarts.Add(1)
		<-gate
		return "ok", nil
	}, fastOpts(t, "x", 10*time.Second))
	require.NoError(t, err)
	cy, err := NewConsumer(client, qy, func(ctx context.Context, m *Message[string]) (string, error) {
		return "ok", nil
	}, fastOpts(t, "y", 10*time.Second))
	require.NoError(t, err)
	mc, err := NewMultiConsumer(&MultiOptions{Workers: 2, Prefetch: 64}, MultiQueue{Consumer: cx}, MultiQueue{Consumer: cy})
	require.NoError(t, err)
	var once atomic.Bool
	open := func() {
		if once.CompareAndSwap(false, true) {
			close(gate)
		}
	}
	defer open() // before runMulti's cleanup stops the handlers' consumer
	runMulti(t, mc)
	// Both workers in X's handlers, X's entries read ahead up to the target.
	var p *pool
	eventually(t, 10*time.Second, func() bool {
		if p = mc.lastPool.Load(); p == nil || xStarts.Load() < 2 {
			return false
		}
		p.ring.qmu.Lock()
		defer p.ring.qmu.Unlock()
		return p.ring.qs[0].n > 0
	}, "X read nothing ahead")
	admin, err := NewAdmin(client, qx, nil)
	require.NoError(t, err)
	require.NoError(t, admin.Pause(ctx))
	eventually(t, 5*time.Second, func() bool {
		p.ring.qmu.Lock()
		defer p.ring.qmu.Unlock()
		return p.ring.qs[0].paused
	}, "the pause was not seen")
	open()
	for i := range 5 {
		pr := mustProduce(t, py, fmt.Sprint("y", i), "y")
		wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		_, err := pr.Wait(wctx)
		cancel()
		require.NoError(t, err, "queue Y's request did not run while X was paused")
	}
	require.NoError(t, admin.Resume(ctx))
}

// TestPriorityStrictDefaultIntervals: a StrictPriority consumer with the
// default ClaimInterval and ReadBlock drains a high and a low backlog. It
// stalled after a few dozen starts when a feeder stepped aside after an
// empty claim pass (the low feeder waits, never getting room while high is
// backlogged, so the high feeder sat out ReadBlock each time and found its
// next claim pass due): caught before release, kept as a regression test.
func TestPriorityStrictDefaultIntervals(t *testing.T) {
	t.Parallel()
	client := realRedis(t)
	q := queueName(t)
	p := newStringProducer(t, client, q)
	produceLevel(t, p, "h", 8000, PriorityHigh)
	produceLevel(t, p, "l", 1000, PriorityLow)
	var starts atomic.Int64
	c, err := NewConsumer(client, q, func(ctx context.Context, m *Message[string]) (string, error) {
		starts.Add(1)
		return "", nil
	}, &ConsumerOptions{Workers: 2, StrictPriority: true, TrimInterval: -1, Logger: testLogger(t)})
	require.NoError(t, err)
	defer runConsumer(t, c)()
	eventually(t, 20*time.Second, func() bool { return starts.Load() == 9000 }, "stalled")
}
