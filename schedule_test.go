package streamq

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"
)

// TestDelayedJobBasics: a job produced with After runs once, not before its
// time, and its callers (two producers of the id) get its result; both
// backends.
func TestDelayedJobBasics(t *testing.T) {
	backends(t, func(t *testing.T, client *redis.Client) {
		ctx := context.Background()
		q := queueName(t)
		var mu sync.Mutex
		starts := map[string][]time.Time{}
		c, err := NewConsumer[string, string](client, q, func(ctx context.Context, m *Message[string]) (string, error) {
			mu.Lock()
			starts[m.ID] = append(starts[m.ID], time.Now())
			mu.Unlock()
			return "done:" + m.Payload, nil
		}, &ConsumerOptions{Logger: testLogger(t)})
		require.NoError(t, err)
		runConsumer(t, c)
		p1, err := NewProducer[string, string](client, q, nil)
		require.NoError(t, err)
		defer p1.Close()
		p2, err := NewProducer[string, string](sameServer(client), q, nil)
		require.NoError(t, err)
		defer p2.Close()

		produced := time.Now()
		pr1, err := p1.Produce(ctx, "a", "x", After(300*time.Millisecond))
		require.NoError(t, err)
		require.Equal(t, "", pr1.EntryID(), "a scheduled job has no entry yet")
		pr2, err := p2.Produce(ctx, "a", "y", After(time.Hour)) // attaches: options of a known id change nothing
		require.NoError(t, err)
		for _, pr := range []*Promise[string]{pr1, pr2} {
			wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
			got, err := pr.Wait(wctx)
			cancel()
			require.NoError(t, err)
			require.Equal(t, "done:x", got)
		}
		mu.Lock()
		defer mu.Unlock()
		require.Len(t, starts["a"], 1)
		require.GreaterOrEqual(t, starts["a"][0].Sub(produced), 300*time.Millisecond)

		// At in the past runs now; At in the future waits.
		pr3, err := p1.Produce(ctx, "b", "z", At(time.Now().Add(-time.Hour)))
		require.NoError(t, err)
		require.NotEmpty(t, pr3.EntryID())
	})
}

// TestCancelScheduled: Admin.Cancel removes a scheduled job; its callers get
// ErrCanceled; a job already appended cannot be cancelled.
func TestCancelScheduled(t *testing.T) {
	backends(t, func(t *testing.T, client *redis.Client) {
		ctx := context.Background()
		q := queueName(t)
		p, err := NewProducer[string, string](client, q, nil)
		require.NoError(t, err)
		defer p.Close()
		a, err := NewAdmin(client, q, nil)
		require.NoError(t, err)
		pr, err := p.Produce(ctx, "late", "x", After(time.Hour))
		require.NoError(t, err)
		require.NoError(t, a.Cancel(ctx, "late"))
		wctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		defer cancel()
		_, err = pr.Wait(wctx)
		require.ErrorIs(t, err, ErrCanceled)
		// Producing it again returns the stored outcome.
		pr, err = p.Produce(ctx, "late", "x", After(time.Hour))
		require.NoError(t, err)
		_, err = pr.Wait(wctx)
		require.ErrorIs(t, err, ErrCanceled)
		require.ErrorIs(t, a.Cancel(ctx, "late"), ErrNotScheduled)
		require.ErrorIs(t, a.Cancel(ctx, "never"), ErrNotFound)
		_, err = p.Produce(ctx, "now", "x")
		require.NoError(t, err)
		err = a.Cancel(ctx, "now")
		require.ErrorIs(t, err, ErrNotScheduled)
		require.Contains(t, err.Error(), "already in the stream")
		n, err := client.ZCard(ctx, "streamq:{"+q+"}:schedule").Result()
		require.NoError(t, err)
		require.Zero(t, n)
	})
}

// TestRetryAfterExact: RetryAfter(err, 300ms) runs the next attempt 300 ms
// later, far below MinIdle's claim path.
func TestRetryAfterExact(t *testing.T) {
	t.Parallel()
	client := realRedis(t)
	ctx := context.Background()
	q := queueName(t)
	var mu sync.Mutex
	var at []time.Time
	var deliveries []int
	c, err := NewConsumer[string, string](client, q, func(ctx context.Context, m *Message[string]) (string, error) {
		mu.Lock()
		defer mu.Unlock()
		at = append(at, time.Now())
		deliveries = append(deliveries, m.Deliveries)
		if len(at) < 3 {
			return "", RetryAfter(errors.New("not yet"), 300*time.Millisecond)
		}
		return "ok", nil
	}, &ConsumerOptions{Logger: testLogger(t)})
	require.NoError(t, err)
	runConsumer(t, c)
	p, err := NewProducer[string, string](client, q, nil)
	require.NoError(t, err)
	defer p.Close()
	pr, err := p.Produce(ctx, "r", "x")
	require.NoError(t, err)
	wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	got, err := pr.Wait(wctx)
	require.NoError(t, err)
	require.Equal(t, "ok", got)
	mu.Lock()
	defer mu.Unlock()
	require.Equal(t, []int{1, 2, 3}, deliveries)
	for i := 1; i < len(at); i++ {
		gap := at[i].Sub(at[i-1])
		t.Logf("RetryAfter(300ms): attempt %d started %v after attempt %d", i+1, gap, i)
		require.GreaterOrEqual(t, gap, 250*time.Millisecond, fmt.Sprint(gap))
		require.Less(t, gap, 600*time.Millisecond, fmt.Sprint(gap))
	}
}
