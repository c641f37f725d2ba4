package streamq

import (
	"context"
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/streamq/streamq/internal/keys"
)

// TestFanoutGroupDeadLettersItsOwnFailure: group A answers callers and
// succeeds; fan-out group B fails the same request for good. Callers get A's
// result; B's failure is a dead letter of B (not of A); requeueing it reruns
// the request in B only.
func TestFanoutGroupDeadLettersItsOwnFailure(t *testing.T) {
	ctx := context.Background()
	client := realRedis(t)
	q := queueName(t)
	var runsA, runsB atomic.Int64
	a, err := NewConsumer(client, q, func(ctx context.Context, m *Message[int]) (int, error) {
		runsA.Add(1)
		return m.Payload * 2, nil
	}, &ConsumerOptions{Group: "answer", ReadBlock: 50 * time.Millisecond, Logger: testLogger(t)})
	require.NoError(t, err)
	bFails := atomic.Bool{}
	bFails.Store(true)
	b, err := NewConsumer(client, q, func(ctx context.Context, m *Message[int]) (int, error) {
		runsB.Add(1)
		if bFails.Load() {
			return 0, Permanent(errors.New("audit refused it"))
		}
		return 0, nil
	}, &ConsumerOptions{Group: "audit", Fanout: true, ReadBlock: 50 * time.Millisecond, Logger: testLogger(t)})
	require.NoError(t, err)
	// The fan-out group exists before the first request, so it sees every one.
	runConsumer(t, b)
	eventually(t, 10*time.Second, func() bool {
		n, err := client.Exists(ctx, "streamq:{"+q+"}:stream").Result()
		return err == nil && n == 1
	}, "fan-out group created")
	runConsumer(t, a)

	p, err := NewProducer[int, int](client, q, &ProducerOptions{Logger: testLogger(t)})
	require.NoError(t, err)
	defer p.Close()
	pr, err := p.Produce(ctx, "x", 21)
	require.NoError(t, err)
	wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	got, err := pr.Wait(wctx)
	require.NoError(t, err, "callers get the answering group's result")
	require.Equal(t, 42, got)

	adminB, err := NewAdmin(client, q, &AdminOptions{Group: "audit"})
	require.NoError(t, err)
	adminA, err := NewAdmin(client, q, nil)
	require.NoError(t, err)
	var dl []DeadLetter
	eventually(t, 10*time.Second, func() bool {
		dl, err = adminB.DeadLetters(ctx, "", 10)
		return err == nil && len(dl) == 1
	}, "B's failure is a dead letter of B")
	require.Equal(t, "x", dl[0].ID)
	require.Contains(t, dl[0].Error, "audit refused it")
	dlA, err := adminA.DeadLetters(ctx, "", 10)
	require.NoError(t, err)
	require.Empty(t, dlA, "the answering group has no dead letter")
	rec, err := client.Get(ctx, "streamq:{"+q+"}:id:x").Result()
	require.NoError(t, err)
	require.True(t, strings.HasPrefix(rec, "R"), "the record is A's result, got %q", rec)

	// Requeue B's dead letter: B runs it again, A does not, the record stays.
	bFails.Store(false)
	beforeA, beforeB := runsA.Load(), runsB.Load()
	newEntry, err := adminB.Requeue(ctx, dl[0].DeadLetterID)
	require.NoError(t, err)
	eventually(t, 10*time.Second, func() bool { return runsB.Load() == beforeB+1 }, "B reruns the requeued request")
	// A acknowledges the requeued entry without running it: wait until both
	// groups have read it and nothing is pending, then check.
	eventually(t, 10*time.Second, func() bool {
		groups, err := client.XInfoGroups(ctx, "streamq:{"+q+"}:stream").Result()
		if err != nil || len(groups) != 2 {
			return false
		}
		for _, g := range groups {
			if g.Pending != 0 || g.LastDeliveredID != newEntry {
				return false
			}
		}
		return true
	}, "both groups are done with the requeued entry")
	require.Equal(t, beforeA, runsA.Load(), "the answering group does not rerun B's requeue")
	rec2, err := client.Get(ctx, "streamq:{"+q+"}:id:x").Result()
	require.NoError(t, err)
	require.Equal(t, rec, rec2, "the requeue of B's dead letter leaves the caller's record alone")
	dl, err = adminB.DeadLetters(ctx, "", 10)
	require.NoError(t, err)
	require.Empty(t, dl)
}

// TestSecondAnsweringGroupRefused: a queue has one answering group; a second
// non-fan-out group is refused with ErrAnsweringGroup.
func TestSecondAnsweringGroupRefused(t *testing.T) {
	client := realRedis(t)
	q := queueName(t)
	h := func(ctx context.Context, m *Message[int]) (int, error) { return 0, nil }
	a, err := NewConsumer(client, q, h, &ConsumerOptions{Group: "one", ReadBlock: 50 * time.Millisecond, Logger: testLogger(t)})
	require.NoError(t, err)
	runConsumer(t, a)
	eventually(t, 10*time.Second, func() bool {
		return client.Exists(context.Background(), keys.AnsweringGroup(q)).Val() == 1
	}, "answering group registered")
	b, err := NewConsumer(client, q, h, &ConsumerOptions{Group: "two", Logger: testLogger(t)})
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	err = b.Run(ctx)
	require.ErrorIs(t, err, ErrAnsweringGroup)
	require.Contains(t, err.Error(), "Fanout")
}

// TestRetryLeavesTheEntryWhileTheFanoutMarkerIsSet: a retry acknowledges
// its entry but does not delete it once the shard's fan-out marker is set,
// even while the stream has one group. A fan-out consumer sets the marker
// before it creates its group (at "0"), so that group reads the entry;
// complete.lua already left entries alone then, and retry.lua, which looked
// only at the number of groups, deleted it.
func TestRetryLeavesTheEntryWhileTheFanoutMarkerIsSet(t *testing.T) {
	backends(t, func(t *testing.T, client *redis.Client) {
		ctx := context.Background()
		q := queueName(t)
		ks, err := keys.Shards(q, 1)
		require.NoError(t, err)
		k := ks[0]
		failed := make(chan struct{}, 1)
		o := fastOpts(t, "main", 30*time.Second)
		o.RetryBackoff, o.MaxDeliveries = time.Hour, 5
		c, err := NewConsumer(client, q, func(ctx context.Context, m *Message[string]) (string, error) {
			failed <- struct{}{}
			return "", errors.New("fails, with retries left")
		}, o)
		require.NoError(t, err)
		runConsumer(t, c)
		select {
		case <-c.Ready():
		case <-time.After(10 * time.Second):
			t.Fatal("the consumer was not ready in 10s")
		}
		// A fan-out consumer starting: its marker is set, its group not yet.
		require.NoError(t, client.Set(ctx, k.Fanout, "1", 0).Err())
		p := newStringProducer(t, client, q)
		require.NoError(t, p.Enqueue(ctx, "j", "x"))
		<-failed
		eventually(t, 10*time.Second, func() bool { return strings.HasPrefix(client.Get(ctx, k.Record("j")).Val(), "P@") }, "no retry scheduled")
		require.EqualValues(t, 1, client.XLen(ctx, k.Stream).Val(), "the retried attempt's entry was deleted while the fan-out marker was set")
		pending, err := client.XPending(ctx, k.Stream, DefaultGroup).Result()
		require.NoError(t, err)
		require.Zero(t, pending.Count, "the retried attempt's entry is still pending")
	})
}
