package streamq

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
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

func later(a, b time.Time) time.Time {
	if a.After(b) {
		return a
	}
	return b
}

// percentile returns the p-th percentile (0..100) of sorted ds.
func percentile(ds []time.Duration, p float64) time.Duration {
	if len(ds) == 0 {
		return 0
	}
	i := int(float64(len(ds)-1) * p / 100)
	return ds[i]
}

// TestDelayedTenThousand: 10,000 jobs due at random times within 5 s, three
// consumers: each starts exactly once and never before its due time (the
// host's clock, which the local redis-server shares). Lateness is logged;
// only a generous bound is asserted.
func TestDelayedTenThousand(t *testing.T) {
	if testing.Short() {
		t.Skip("schedules 10,000 jobs")
	}
	client := realRedis(t)
	ctx := context.Background()
	q := queueName(t)
	const jobs = 10000
	due := make(map[string]time.Time, jobs)
	var mu sync.Mutex
	started := make(map[string][]time.Time, jobs)
	all := make(chan struct{})
	handler := func(ctx context.Context, m *Message[string]) (string, error) {
		now := time.Now()
		mu.Lock()
		started[m.ID] = append(started[m.ID], now)
		if len(started) == jobs {
			select {
			case <-all:
			default:
				close(all)
			}
		}
		mu.Unlock()
		return "", nil
	}
	for i := range 3 {
		c, err := NewConsumer[string, string](sameServer(client), q, handler, &ConsumerOptions{
			Name: fmt.Sprintf("c%d", i), Workers: 16, DiscardResults: true, Logger: testLogger(t)})
		require.NoError(t, err)
		runConsumer(t, c)
	}
	p, err := NewProducer[string, string](client, q, nil)
	require.NoError(t, err)
	defer p.Close()
	// Let the consumers subscribe first: no job is due in the first second.
	// (Under -race scheduling can take longer: lateness is measured from the
	// due time or from when the job's batch was recorded, whichever is later.)
	start := time.Now().Add(time.Second)
	recorded := make(map[string]time.Time, jobs)
	batch := make([]Job[string], 0, 500)
	rng := rand.New(rand.NewPCG(1, 2))
	for i := range jobs {
		id := fmt.Sprintf("d-%d", i)
		at := start.Add(time.Duration(rng.Int64N(int64(5 * time.Second))))
		due[id] = at
		batch = append(batch, Job[string]{ID: id, Request: "x", Options: []ProduceOption{At(at)}})
		if len(batch) == cap(batch) {
			prs, err := p.ProduceBatch(ctx, batch)
			require.NoError(t, err)
			now := time.Now()
			for _, pr := range prs {
				recorded[pr.ID()] = now
				pr.Release()
			}
			batch = batch[:0]
		}
	}
	t.Logf("scheduled %d jobs in %v", jobs, time.Since(start.Add(-time.Second)))
	select {
	case <-all:
	case <-time.After(60 * time.Second):
		mu.Lock()
		n := len(started)
		mu.Unlock()
		t.Fatalf("only %d of %d jobs started within 60s", n, jobs)
	}
	// Give a duplicate promotion time to show up.
	time.Sleep(200 * time.Millisecond)
	mu.Lock()
	defer mu.Unlock()
	late := make([]time.Duration, 0, jobs)
	for id, ts := range started {
		require.Len(t, ts, 1, "job %s started %d times", id, len(ts))
		d := ts[0].Sub(due[id])
		require.GreaterOrEqual(t, d, time.Duration(0), "job %s started %v before its due time", id, -d)
		late = append(late, ts[0].Sub(later(due[id], recorded[id])))
	}
	require.Len(t, started, jobs)
	slices.Sort(late)
	t.Logf("lateness (handler start - due) of %d delayed jobs, 3 consumers: p50 %v, p99 %v, max %v",
		jobs, percentile(late, 50), percentile(late, 99), late[len(late)-1])
	require.Less(t, percentile(late, 99), 2*time.Second, "p99 lateness")
	n, err := client.ZCard(ctx, "streamq:{"+q+"}:schedule").Result()
	require.NoError(t, err)
	require.Zero(t, n)
}
