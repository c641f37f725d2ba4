package streamq

import (
	"context"
	"slices"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/streamq/streamq/internal/crashtest"
)

// TestCrashCancelledWhilePendingOnDeadConsumer: a consumer process holds
// eight requests (two in handlers, six in its ring). It is frozen
// (SIGSTOP, so it cannot act on the cancel notices) while one running and
// one prefetched request are cancelled, then SIGKILLed, and a third request
// is cancelled while it is pending on the dead consumer. Another consumer
// then claims what the dead one held: the five others run once each, and
// none of the three cancelled ones runs; their callers get ErrCanceled, and
// the stream and the PEL end empty.
func TestCrashCancelledWhilePendingOnDeadConsumer(t *testing.T) {
	t.Parallel()
	client := realRedis(t)
	ctx := context.Background()
	q := queueName(t)
	const n, workers = 8, 2
	const minIdle = time.Second
	p := newStringProducer(t, client, q)
	a, err := NewAdmin(client, q, nil)
	require.NoError(t, err)
	ids := seqIDs("job", n)
	prs := produceAll(t, p, ids)

	child := crashtest.Start(t, "TestCrashHelperProcess", crashConfig{
		Addr: sharedAddr(t), Queue: q, Mode: "block", Name: "doomed",
		Workers: workers, Prefetch: n, MinIdle: minIdle, MaxDeliveries: 5,
	})
	waitChildHolds(t, client, q, "doomed", n, workers)
	running := client.SMembers(ctx, startedKey(q)).Val()
	require.Len(t, running, workers)
	var queued []string
	for _, id := range ids {
		if !slices.Contains(running, id) {
			queued = append(queued, id)
		}
	}
	require.NoError(t, syscall.Kill(child.PID(), syscall.SIGSTOP))
	cancelled := []string{running[0], queued[0]}
	for _, id := range cancelled {
		require.NoError(t, a.Cancel(ctx, id))
		info, err := a.Job(ctx, id)
		require.NoError(t, err)
		require.Equal(t, JobCanceled, info.State)
	}
	child.Kill()
	require.True(t, child.KilledBy(syscall.SIGKILL))
	require.NoError(t, a.Cancel(ctx, queued[1]), "pending on a dead consumer")
	cancelled = append(cancelled, queued[1])
	killedAt := time.Now()

	h := newCountingHandler()
	c, err := NewConsumer(client, q, h.handle, &ConsumerOptions{
		Name: "survivor", Workers: workers, MinIdle: minIdle, ClaimInterval: 100 * time.Millisecond,
		ReadBlock: 100 * time.Millisecond, Logger: testLogger(t),
	})
	require.NoError(t, err)
	stop := runConsumer(t, c)

	var rest []string
	var restPrs []*Promise[string]
	wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	for i, id := range ids {
		if slices.Contains(cancelled, id) {
			_, err := prs[i].Wait(wctx)
			require.ErrorIs(t, err, ErrCanceled, id)
			continue
		}
		rest, restPrs = append(rest, id), append(restPrs, prs[i])
	}
	requireResults(t, client, q, rest, restPrs, killedAt.Add(minIdle+30*time.Second))
	stop()
	h.requireOnceEach(t, rest) // none of the cancelled ones
	for _, id := range cancelled {
		require.Equal(t, byte('C'), client.Get(ctx, recordKey(q, id)).Val()[0], id)
	}
	requireDrained(t, client, q)
	require.Zero(t, client.HLen(ctx, startsKey(q)).Val(), "no start count left")
	s, err := a.Stats(ctx)
	require.NoError(t, err)
	require.EqualValues(t, len(cancelled), s.Canceled)
}
