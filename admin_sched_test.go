package streamq

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/streamq/streamq/internal/keys"
)

// TestAdminJobScheduled: a delayed request and a retry waiting for its
// back-off are reported scheduled, with their due time (and, for the retry,
// the starts so far); Forget of a scheduled request removes it from the
// schedule, so it never runs. Before, Job failed on a "P@<due>" record
// (job.lua read it as an entry id) and so did Forget.
func TestAdminJobScheduled(t *testing.T) {
	backends(t, func(t *testing.T, client *redis.Client) {
		ctx := context.Background()
		q := queueName(t)
		p := newStringProducer(t, client, q)
		before := time.Now()
		_, err := p.Produce(ctx, "later", "x", After(time.Hour))
		require.NoError(t, err)
		_, err = p.Produce(ctx, "forgotten", "x", After(time.Hour))
		require.NoError(t, err)
		admin, err := NewAdmin(client, q, nil)
		require.NoError(t, err)

		j, err := admin.Job(ctx, "later")
		require.NoError(t, err)
		require.Equal(t, JobScheduled, j.State)
		require.WithinDuration(t, before.Add(time.Hour), j.Due, 5*time.Second)
		require.Empty(t, j.EntryID)
		require.Zero(t, j.Deliveries)
		require.Greater(t, j.TTL, time.Hour)

		require.NoError(t, admin.Forget(ctx, "forgotten", false))
		_, err = admin.Job(ctx, "forgotten")
		require.ErrorIs(t, err, ErrNotFound)
		s, err := admin.Stats(ctx)
		require.NoError(t, err)
		require.EqualValues(t, 1, s.Scheduled, "the forgotten request left the schedule")
		require.NoError(t, admin.Cancel(ctx, "later"))
	})
}

// TestAdminJobRetryScheduled: a request whose handler asked for a retry later
// is retrying (in the retry set) with its start count and last error; Forget removes it; a consumer running
// meanwhile never starts it again.
func TestAdminJobRetryScheduled(t *testing.T) {
	t.Parallel()
	client := realRedis(t)
	ctx := context.Background()
	q := queueName(t)
	p := newStringProducer(t, client, q)
	starts := make(chan int, 10)
	c, err := NewConsumer(client, q, func(ctx context.Context, m *Message[string]) (string, error) {
		starts <- m.Deliveries
		return "", RetryAfter(errors.New("not yet"), time.Hour)
	}, &ConsumerOptions{Name: "w", ReadBlock: 50 * time.Millisecond, Logger: testLogger(t)})
	require.NoError(t, err)
	stop := runConsumer(t, c)
	require.NoError(t, p.Enqueue(ctx, "retry", "x"))
	require.Equal(t, 1, <-starts)
	admin, err := NewAdmin(client, q, nil)
	require.NoError(t, err)
	var j JobInfo
	eventually(t, 10*time.Second, func() bool {
		j, err = admin.Job(ctx, "retry")
		return err == nil && j.State == JobRetrying
	}, "the retry is scheduled: %+v %v", j, err)
	require.WithinDuration(t, time.Now().Add(time.Hour), j.Due, 10*time.Second)
	require.Equal(t, 1, j.Deliveries, "starts so far")
	require.Contains(t, j.Error, "not yet", "the attempt's error")
	require.NoError(t, admin.Forget(ctx, "retry", false))
	_, err = admin.Job(ctx, "retry")
	require.ErrorIs(t, err, ErrNotFound)
	s, err := admin.Stats(ctx)
	require.NoError(t, err)
	require.Zero(t, s.Scheduled)
	stop()
	require.Empty(t, starts)
}

// TestAdminJobCanceled: after Admin.Cancel, Job reports the request
// canceled (with the stored message), and Cancel asked again (a caller's
// retry, or go-redis resending after a lost reply) succeeds without
// announcing anything twice. Before, Job failed with ErrWrongType ("starts
// with "C", which streamq never writes") and a second Cancel said the request
// "is completed".
func TestAdminJobCanceled(t *testing.T) {
	backends(t, func(t *testing.T, client *redis.Client) {
		ctx := context.Background()
		q := queueName(t)
		p := newStringProducer(t, client, q)
		pr, err := p.Produce(ctx, "later", "x", After(time.Hour))
		require.NoError(t, err)
		admin, err := NewAdmin(client, q, nil)
		require.NoError(t, err)
		require.NoError(t, admin.Cancel(ctx, "later"))
		_, err = pr.Wait(waitCtx(t, 10*time.Second))
		require.ErrorIs(t, err, ErrCanceled)

		j, err := admin.Job(ctx, "later")
		require.NoError(t, err)
		require.Equal(t, JobCanceled, j.State)
		require.Contains(t, j.Error, "canceled by Admin.Cancel")
		require.Empty(t, j.EntryID)
		require.True(t, j.Due.IsZero())
		require.Greater(t, j.TTL, time.Duration(0))
		require.LessOrEqual(t, j.TTL, DefaultResultTTL)

		require.NoError(t, admin.Cancel(ctx, "later"), "the request is canceled: asking again is no error")
		again, err := admin.Job(ctx, "later")
		require.NoError(t, err)
		require.Equal(t, j.Error, again.Error, "the second Cancel stored nothing new")
	})
}

// TestAdminStatsCanceled: Stats.Canceled counts the requests Admin.Cancel
// cancelled, summed over the shards. Cancelling a cancelled request again
// (a caller's retry, or go-redis resending after a lost reply) counts nothing,
// nor does a Cancel that is refused. Before, Stats had no such count.
func TestAdminStatsCanceled(t *testing.T) {
	backends(t, func(t *testing.T, client *redis.Client) {
		ctx := context.Background()
		q := queueName(t)
		p, err := NewProducer[string, string](client, q, &ProducerOptions{Shards: 2, Logger: testLogger(t)})
		require.NoError(t, err)
		t.Cleanup(func() { _ = p.Close() })
		admin, err := NewAdmin(client, q, nil)
		require.NoError(t, err)
		// One id per shard, so that the count is a sum over both.
		var ids []string
		for shard := range 2 {
			for i := 0; ; i++ {
				if id := fmt.Sprintf("later-%d", i); keys.ShardOf(id, 2) == shard {
					ids = append(ids, id)
					break
				}
			}
		}
		for _, id := range append([]string{"kept"}, ids...) {
			_, err := p.Produce(ctx, id, "x", After(time.Hour))
			require.NoError(t, err)
		}
		require.NoError(t, p.Enqueue(ctx, "queued", "x"))
		s, err := admin.Stats(ctx)
		require.NoError(t, err)
		require.Zero(t, s.Canceled)

		for _, id := range ids {
			require.NoError(t, admin.Cancel(ctx, id))
		}
		require.NoError(t, admin.Cancel(ctx, ids[0]), "cancelled already: no error")
		require.NoError(t, admin.Cancel(ctx, "queued"), "queued: cancelled in the stream")
		require.ErrorIs(t, admin.Cancel(ctx, "never"), ErrNotFound)
		s, err = admin.Stats(ctx)
		require.NoError(t, err)
		require.EqualValues(t, 3, s.Canceled, "three requests cancelled, one of them twice")
		require.EqualValues(t, 1, s.Scheduled, "kept waits")
	})
}
