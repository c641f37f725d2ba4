package streamq

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/streamq/streamq/internal/keys"
)

// TestSendRunsEveryRequestOnce: requests handed over by Send from several
// goroutines, some ids sent twice, each run exactly once after Flush; the
// caller's ctx ending right after Send does not drop its request. Both
// backends.
func TestSendRunsEveryRequestOnce(t *testing.T) {
	backends(t, func(t *testing.T, client *redis.Client) {
		ctx := context.Background()
		q := queueName(t)
		const n, senders = 400, 4
		var mu sync.Mutex
		runs := map[string]int{}
		var total atomic.Int64
		c, err := NewConsumer(client, q, func(ctx context.Context, m *Message[int]) (struct{}, error) {
			mu.Lock()
			runs[m.ID]++
			mu.Unlock()
			total.Add(1)
			return struct{}{}, nil
		}, &ConsumerOptions{Workers: 4, DiscardResults: true, Logger: testLogger(t)})
		require.NoError(t, err)
		runConsumer(t, c)
		p, err := NewProducer[int, struct{}](client, q, &ProducerOptions{Logger: testLogger(t)})
		require.NoError(t, err)
		defer p.Close()

		var wg sync.WaitGroup
		for s := range senders {
			wg.Go(func() {
				for i := s; i < n; i += senders {
					sctx, cancel := context.WithCancel(ctx)
					err := p.Send(sctx, fmt.Sprintf("s%d", i), i)
					cancel() // the write outlives the call
					if err != nil {
						t.Error(err)
						return
					}
					if i%10 == 0 { // a second send of the id attaches to it
						if err := p.Send(ctx, fmt.Sprintf("s%d", i), i); err != nil {
							t.Error(err)
							return
						}
					}
				}
			})
		}
		wg.Wait()
		fctx, cancel := context.WithTimeout(ctx, 20*time.Second)
		defer cancel()
		require.NoError(t, p.Flush(fctx))
		eventually(t, 20*time.Second, func() bool { return total.Load() >= n }, "ran %d of %d", total.Load(), n)
		mu.Lock()
		defer mu.Unlock()
		require.Len(t, runs, n)
		for id, k := range runs {
			require.Equal(t, 1, k, "%s ran %d times", id, k)
		}
	})
}

// TestSendFailuresReachCallbackAndFlush: a request that cannot be written
// (its record key holds a hash) is reported to OnSendError and by Flush,
// which wraps ErrWrongType; the next Flush starts clean.
func TestSendFailuresReachCallbackAndFlush(t *testing.T) {
	backends(t, func(t *testing.T, client *redis.Client) {
		ctx := context.Background()
		q := queueName(t)
		k, err := keys.New(q)
		require.NoError(t, err)
		require.NoError(t, client.HSet(ctx, k.Record("bad"), "f", "v").Err())
		var mu sync.Mutex
		var reported []string
		var reportedErrs []error
		p, err := NewProducer[string, string](client, q, &ProducerOptions{Logger: testLogger(t),
			OnSendError: func(id string, err error) {
				mu.Lock()
				reported = append(reported, id)
				reportedErrs = append(reportedErrs, err)
				mu.Unlock()
			}})
		require.NoError(t, err)
		defer p.Close()
		require.NoError(t, p.Send(ctx, "good", "x"))
		require.NoError(t, p.Send(ctx, "bad", "x"), "Send returns before Redis answers")
		err = p.Flush(ctx)
		require.ErrorIs(t, err, ErrWrongType)
		require.ErrorContains(t, err, "1 sends failed")
		mu.Lock()
		require.Equal(t, []string{"bad"}, reported)
		require.ErrorIs(t, reportedErrs[0], ErrWrongType)
		mu.Unlock()
		require.NoError(t, p.Flush(ctx), "failures are reported once")
		require.EqualValues(t, 1, client.Exists(ctx, k.Record("good")).Val())
	})
}

// TestSendBoundedAndCloseWritesWhatItAccepted: with MaxPendingBytes full
// Send blocks within its ctx; Close writes every request Send accepted.
func TestSendBoundedAndCloseWritesWhatItAccepted(t *testing.T) {
	backends(t, func(t *testing.T, client *redis.Client) {
		ctx := context.Background()
		q := queueName(t)
		p, err := NewProducer[string, string](client, q, &ProducerOptions{Logger: testLogger(t)})
		require.NoError(t, err)
		const n = 200
		for i := range n {
			require.NoError(t, p.Send(ctx, fmt.Sprintf("c%d", i), "x"))
		}
		require.NoError(t, p.Close())
		k, err := keys.New(q)
		require.NoError(t, err)
		require.EqualValues(t, n, client.XLen(ctx, k.Stream).Val(), "Close wrote every accepted Send")
		require.ErrorIs(t, p.Send(ctx, "late", "x"), ErrClosed)

		// A full budget: Send waits, and gives up with its ctx.
		p2, err := NewProducer[string, string](client, q, &ProducerOptions{Logger: testLogger(t),
			MaxPayloadBytes: 64, MaxBatchBytes: 64, MaxPendingBytes: 64})
		require.NoError(t, err)
		defer p2.Close()
		require.NoError(t, p2.budget.acquire(ctx, nil, 64)) // as if 64 bytes were waiting to be written
		defer p2.budget.release(64)
		sctx, cancel := context.WithTimeout(ctx, 50*time.Millisecond)
		defer cancel()
		require.ErrorIs(t, p2.Send(sctx, "blocked", "x"), context.DeadlineExceeded)
	})
}

// TestSendRunsInterceptors: a produce interceptor's headers travel with a
// request handed over by Send, like with Enqueue (miniredis).
func TestSendRunsInterceptors(t *testing.T) {
	client, _ := miniRedis(t)
	ctx := context.Background()
	q := queueName(t)
	got := make(chan map[string]string, 1)
	c, err := NewConsumer(client, q, func(ctx context.Context, m *Message[string]) (string, error) {
		got <- m.Headers
		return "", nil
	}, &ConsumerOptions{Logger: testLogger(t)})
	require.NoError(t, err)
	runConsumer(t, c)
	p, err := NewProducer[string, string](client, q, &ProducerOptions{Logger: testLogger(t),
		Interceptors: []ProduceInterceptor{func(ctx context.Context, msgs []*Outgoing, next func(context.Context) error) error {
			for _, m := range msgs {
				m.Headers = map[string]string{"trace": "t-1"}
			}
			return next(ctx)
		}}})
	require.NoError(t, err)
	defer p.Close()
	require.NoError(t, p.Send(ctx, "h", "x"))
	require.NoError(t, p.Flush(ctx))
	select {
	case h := <-got:
		require.Equal(t, map[string]string{"trace": "t-1"}, h)
	case <-time.After(10 * time.Second):
		t.Fatal("the request did not run")
	}
}
