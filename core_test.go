package streamq

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"
)

type sumReq struct{ A, B int }
type sumResp struct{ Sum int }

func TestProduceConsumeRoundTrip(t *testing.T) {
	backends(t, func(t *testing.T, client *redis.Client) {
		ctx := context.Background()
		q := queueName(t)
		p, err := NewProducer[sumReq, sumResp](client, q, &ProducerOptions{Logger: testLogger(t)})
		require.NoError(t, err)
		defer p.Close()
		var calls atomic.Int64
		c, err := NewConsumer(client, q, func(ctx context.Context, m *Message[sumReq]) (sumResp, error) {
			calls.Add(1)
			return sumResp{m.Payload.A + m.Payload.B}, nil
		}, &ConsumerOptions{Workers: 4, Logger: testLogger(t)})
		require.NoError(t, err)
		runConsumer(t, c)

		for i := range 50 {
			pr, err := p.Produce(ctx, fmt.Sprintf("sum-%d", i), sumReq{i, 1})
			require.NoError(t, err)
			wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
			resp, err := pr.Wait(wctx)
			cancel()
			require.NoError(t, err)
			require.Equal(t, i+1, resp.Sum)
		}
		require.EqualValues(t, 50, calls.Load())

		// Producing a completed id again returns the stored result without a new run.
		pr, err := p.Produce(ctx, "sum-7", sumReq{100, 100})
		require.NoError(t, err)
		require.Empty(t, pr.EntryID())
		resp, err := pr.Wait(ctx)
		require.NoError(t, err)
		require.Equal(t, 8, resp.Sum)
		require.EqualValues(t, 50, calls.Load())
		eventually(t, 5*time.Second, func() bool { return client.XLen(ctx, "streamq:{"+q+"}:stream").Val() == 0 },
			"stream not empty")
	})
}

func TestConcurrentProducersSameIDsRunOnce(t *testing.T) {
	backends(t, func(t *testing.T, client *redis.Client) {
		ctx := context.Background()
		q := queueName(t)
		const shared, unique, producers = 500, 500, 4
		var mu sync.Mutex
		runs := map[string]int{}
		c, err := NewConsumer(client, q, func(ctx context.Context, m *Message[string]) (string, error) {
			mu.Lock()
			runs[m.ID]++
			mu.Unlock()
			return "r:" + m.Payload, nil
		}, &ConsumerOptions{Workers: 8, Logger: testLogger(t)})
		require.NoError(t, err)
		runConsumer(t, c)

		var wg sync.WaitGroup
		errs := make(chan error, producers*(shared+unique))
		for pi := range producers {
			wg.Add(1)
			go func() {
				defer wg.Done()
				// Each producer has its own client, as separate processes would.
				pc := redis.NewClient(client.Options())
				defer pc.Close()
				p, err := NewProducer[string, string](pc, q, &ProducerOptions{Logger: testLogger(t)})
				if err != nil {
					errs <- err
					return
				}
				defer p.Close()
				var inner sync.WaitGroup
				ids := make([]string, 0, shared+unique)
				for i := range shared {
					ids = append(ids, fmt.Sprintf("shared-%d", i))
				}
				for i := range unique {
					ids = append(ids, fmt.Sprintf("p%d-%d", pi, i))
				}
				for _, id := range ids {
					inner.Add(1)
					go func() {
						defer inner.Done()
						pr, err := p.Produce(ctx, id, id)
						if err != nil {
							errs <- err
							return
						}
						wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
						defer cancel()
						got, err := pr.Wait(wctx)
						if err != nil {
							errs <- fmt.Errorf("%s: %w", id, err)
							return
						}
						if got != "r:"+id {
							errs <- fmt.Errorf("%s: got %q", id, got)
						}
					}()
				}
				inner.Wait()
			}()
		}
		wg.Wait()
		close(errs)
		for err := range errs {
			require.NoError(t, err)
		}
		mu.Lock()
		defer mu.Unlock()
		require.Len(t, runs, shared+producers*unique)
		for id, n := range runs {
			require.Equal(t, 1, n, "id %s ran %d times", id, n)
		}
		eventually(t, 5*time.Second, func() bool { return client.XLen(ctx, "streamq:{"+q+"}:stream").Val() == 0 },
			"stream not empty")
	})
}

func TestHandlerErrorAndPanicReachWaiters(t *testing.T) {
	backends(t, func(t *testing.T, client *redis.Client) {
		ctx := context.Background()
		q := queueName(t)
		p, err := NewProducer[string, string](client, q, &ProducerOptions{Logger: testLogger(t)})
		require.NoError(t, err)
		defer p.Close()
		c, err := NewConsumer(client, q, func(ctx context.Context, m *Message[string]) (string, error) {
			switch m.Payload {
			case "panic":
				panic("boom")
			case "fail":
				return "", errors.New("no luck")
			}
			return m.Payload, nil
		}, &ConsumerOptions{MaxDeliveries: 1, Logger: testLogger(t)})
		require.NoError(t, err)
		runConsumer(t, c)

		for _, in := range []string{"fail", "panic"} {
			pr, err := p.Produce(ctx, in, in)
			require.NoError(t, err)
			_, err = pr.Wait(ctx)
			require.ErrorIs(t, err, ErrFailed)
			require.ErrorIs(t, err, ErrDeadLettered)
		}
		pr, err := p.Produce(ctx, "ok", "ok")
		require.NoError(t, err)
		got, err := pr.Wait(ctx)
		require.NoError(t, err)
		require.Equal(t, "ok", got)
	})
}
