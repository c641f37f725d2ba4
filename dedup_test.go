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
