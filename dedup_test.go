package streamq

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"
)

// TestDedupRetryFailed (issue 17): producing a failed id again returns the
// stored failure (DedupStored); with RetryFailed it runs again with the new
// payload, for an error and for a dead letter, now and delayed. A stored
// success is never rerun, and an id in flight is attached to (DedupInflight).
func TestDedupRetryFailed(t *testing.T) {
	backends(t, func(t *testing.T, client *redis.Client) {
		ctx := context.Background()
		q := queueName(t)
		p := newStringProducer(t, client, q)
		var runs atomic.Int64
		opts := fastOpts(t, "dedup", time.Second)
		opts.ShutdownTimeout = 200 * time.Millisecond // ends the "slow" handler
		c, err := NewConsumer(client, q, func(ctx context.Context, m *Message[string]) (string, error) {
			runs.Add(1)
			switch m.Payload {
			case "bad":
				return "", Permanent(errors.New("bad request"))
			case "slow":
				<-ctx.Done()
				return "", ctx.Err()
			}
			return "ok:" + m.Payload, nil
		}, opts)
		require.NoError(t, err)
		runConsumer(t, c)
		wait := func(pr *Promise[string]) (string, error) { return pr.Wait(waitCtx(t, 20*time.Second)) }

		first, err := p.Produce(ctx, "doc", "bad")
		require.NoError(t, err)
		require.Equal(t, DedupNone, first.Deduplicated())
		_, err = wait(first)
		require.ErrorIs(t, err, ErrDeadLettered)

		again, err := p.Produce(ctx, "doc", "good")
		require.NoError(t, err)
		require.Equal(t, DedupStored, again.Deduplicated())
		_, err = wait(again)
		require.ErrorIs(t, err, ErrDeadLettered, "without RetryFailed, the stored failure")

		fixed, err := p.Produce(ctx, "doc", "good", RetryFailed())
		require.NoError(t, err)
		require.Equal(t, DedupNone, fixed.Deduplicated())
		got, err := wait(fixed)
		require.NoError(t, err)
		require.Equal(t, "ok:good", got)

		ranBefore := runs.Load()
		done, err := p.Produce(ctx, "doc", "other", RetryFailed())
		require.NoError(t, err)
		require.Equal(t, DedupStored, done.Deduplicated(), "a stored success is not rerun")
		got, err = wait(done)
		require.NoError(t, err)
		require.Equal(t, "ok:good", got)
		require.Equal(t, ranBefore, runs.Load())

		// Delayed: a failed id scheduled again with RetryFailed and After.
		_, err = wait(mustProduce(t, p, "late", "bad"))
		require.ErrorIs(t, err, ErrFailed)
		later, err := p.Produce(ctx, "late", "good", RetryFailed(), After(50*time.Millisecond))
		require.NoError(t, err)
		require.Equal(t, DedupNone, later.Deduplicated())
		got, err = wait(later)
		require.NoError(t, err)
		require.Equal(t, "ok:good", got)

		// In flight: attached, whatever the payload.
		slow := mustProduce(t, p, "busy", "slow")
		attached, err := p.Produce(ctx, "busy", "different", RetryFailed())
		require.NoError(t, err)
		require.Equal(t, DedupInflight, attached.Deduplicated())
		require.Equal(t, "attached to the request in flight", attached.Deduplicated().String())
		slow.Release()
		attached.Release()
	})
}

func mustProduce(t *testing.T, p *Producer[string, string], id, req string, opts ...ProduceOption) *Promise[string] {
	t.Helper()
	pr, err := p.Produce(context.Background(), id, req, opts...)
	require.NoError(t, err)
	return pr
}

// TestDuplicateProduceAppendsNothing: producing an id that is in flight or
// completed appends no entry, whether it comes alone, in a coalesced call, in
// an atomic batch or delayed: the stream's entries-added counter (which counts
// every XADD, also of entries deleted since) does not move.
func TestDuplicateProduceAppendsNothing(t *testing.T) {
	t.Parallel()
	client := realRedis(t)
	ctx := context.Background()
	q := queueName(t)
	stream := "streamq:{" + q + "}:stream"
	p := newStringProducer(t, client, q)
	added := func() int64 {
		t.Helper()
		info, err := client.XInfoStream(ctx, stream).Result()
		require.NoError(t, err)
		return info.EntriesAdded
	}
	ids := []string{"d0", "d1", "d2", "d3", "d4"}
	jobs := make([]Job[string], len(ids))
	var first []*Promise[string]
	for i, id := range ids {
		pr := mustProduce(t, p, id, "x")
		require.Equal(t, DedupNone, pr.Deduplicated())
		first = append(first, pr)
		jobs[i] = Job[string]{ID: id, Request: "y"}
	}
	require.EqualValues(t, 5, added())

	// In flight: attached to the queued entries.
	for i, id := range ids {
		pr := mustProduce(t, p, id, "y")
		require.Equal(t, DedupInflight, pr.Deduplicated())
		require.Equal(t, first[i].EntryID(), pr.EntryID())
		pr.Release()
	}
	prs, err := p.ProduceBatch(ctx, jobs)
	require.NoError(t, err)
	for i, pr := range prs {
		require.Equal(t, DedupInflight, pr.Deduplicated())
		require.Equal(t, first[i].EntryID(), pr.EntryID())
		pr.Release()
	}
	require.EqualValues(t, 5, added(), "in-flight duplicates appended entries")
	require.EqualValues(t, 5, client.XLen(ctx, stream).Val())

	// Completed: answered from the record.
	c, err := NewConsumer(client, q, func(ctx context.Context, m *Message[string]) (string, error) {
		return "ok:" + m.Payload, nil
	}, fastOpts(t, "dedup", time.Second))
	require.NoError(t, err)
	runConsumer(t, c)
	for _, pr := range first {
		got, err := pr.Wait(waitCtx(t, 20*time.Second))
		require.NoError(t, err)
		require.Equal(t, "ok:x", got)
	}
	for _, id := range ids {
		pr := mustProduce(t, p, id, "y")
		require.Equal(t, DedupStored, pr.Deduplicated())
		got, err := pr.Wait(ctx)
		require.NoError(t, err)
		require.Equal(t, "ok:x", got)
	}
	prs, err = p.ProduceBatch(ctx, jobs)
	require.NoError(t, err)
	for _, pr := range prs {
		require.Equal(t, DedupStored, pr.Deduplicated())
		pr.Release()
	}
	later := mustProduce(t, p, "d0", "y", After(time.Hour))
	require.Equal(t, DedupStored, later.Deduplicated())
	later.Release()
	require.EqualValues(t, 5, added(), "completed duplicates appended entries")
	require.Zero(t, client.ZCard(ctx, "streamq:{"+q+"}:schedule").Val())

	// A record key of another type is refused and leaves no entry.
	rec := "streamq:{" + q + "}:id:h"
	require.NoError(t, client.HSet(ctx, rec, "f", "v").Err())
	_, err = p.Produce(ctx, "h", "x")
	require.ErrorIs(t, err, ErrWrongType)
	_, err = p.ProduceBatch(ctx, []Job[string]{{ID: "d5", Request: "x"}, {ID: "h", Request: "x"}})
	require.ErrorIs(t, err, ErrWrongType)
	require.Zero(t, client.XLen(ctx, stream).Val())
	require.Zero(t, client.Exists(ctx, "streamq:{"+q+"}:id:d5").Val())
	require.Equal(t, "hash", client.Type(ctx, rec).Val())
}
