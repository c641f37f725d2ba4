package streamq

import (
	"context"
	"errors"
	"fmt"
	"strings"
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
		// The full figures on real Redis; fewer on miniredis, which is slower.
		shared, unique, producers := 2000, 2000, 4
		if strings.Contains(t.Name(), "miniredis") {
			shared, unique = 300, 300
		}
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
				pc := sameServer(client)
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
						// A loaded machine can time out a round trip (miniredis
						// serves every client on one goroutine): producing the id
						// again is safe and is what a caller does. What must hold
						// is that each id runs once.
						var pr *Promise[string]
						var err error
						for attempt := 0; attempt < 5; attempt++ {
							if pr, err = p.Produce(ctx, id, id); err == nil {
								break
							}
						}
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

func TestRestartedProducerGetsResultsOfInflightIDs(t *testing.T) {
	backends(t, func(t *testing.T, client *redis.Client) {
		ctx := context.Background()
		q := queueName(t)
		ids := make([]string, 200)
		for i := range ids {
			ids[i] = fmt.Sprintf("inflight-%d", i)
		}
		first, err := NewProducer[string, string](client, q, &ProducerOptions{Logger: testLogger(t)})
		require.NoError(t, err)
		var old []*Promise[string]
		for _, id := range ids {
			pr, err := first.Produce(ctx, id, id)
			require.NoError(t, err)
			old = append(old, pr)
		}
		require.NoError(t, first.Close()) // no consumer yet: everything is in flight
		for _, pr := range old {
			_, err := pr.Wait(ctx)
			require.ErrorIs(t, err, ErrClosed)
		}

		second, err := NewProducer[string, string](client, q, &ProducerOptions{Logger: testLogger(t)})
		require.NoError(t, err)
		defer second.Close()
		var again []*Promise[string]
		for _, id := range ids {
			pr, err := second.Produce(ctx, id, "ignored: the id is in flight")
			require.NoError(t, err)
			again = append(again, pr)
		}
		var runs atomic.Int64
		c, err := NewConsumer(client, q, func(ctx context.Context, m *Message[string]) (string, error) {
			runs.Add(1)
			return "done:" + m.Payload, nil
		}, &ConsumerOptions{Workers: 4, ReadBlock: 100 * time.Millisecond, Logger: testLogger(t)})
		require.NoError(t, err)
		runConsumer(t, c)
		for i, pr := range again {
			wctx, cancel := context.WithTimeout(ctx, 20*time.Second)
			got, err := pr.Wait(wctx)
			cancel()
			require.NoError(t, err)
			require.Equal(t, "done:"+ids[i], got)
		}
		require.EqualValues(t, len(ids), runs.Load())
	})
}

func TestBackstopRecoversLostNotice(t *testing.T) {
	backends(t, func(t *testing.T, client *redis.Client) {
		ctx := context.Background()
		q := queueName(t)
		p, err := NewProducer[string, string](client, q, &ProducerOptions{
			BackstopInterval: 20 * time.Millisecond, Logger: testLogger(t)})
		require.NoError(t, err)
		defer p.Close()
		pr, err := p.Produce(ctx, "quiet", "x")
		require.NoError(t, err)
		// A result recorded without a notice, as when the notice was lost.
		require.NoError(t, client.Set(ctx, "streamq:{"+q+"}:id:quiet", `R"from the record"`, time.Minute).Err())
		wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		defer cancel()
		got, err := pr.Wait(wctx)
		require.NoError(t, err)
		require.Equal(t, "from the record", got)

		// A record that vanished resolves the promise with ErrRecordLost.
		pr, err = p.Produce(ctx, "vanishing", "x")
		require.NoError(t, err)
		require.NoError(t, client.Del(ctx, "streamq:{"+q+"}:id:vanishing").Err())
		_, err = pr.Wait(wctx)
		require.ErrorIs(t, err, ErrRecordLost)
	})
}

func TestResultsArriveAfterSubscriptionIsCut(t *testing.T) {
	client := realRedis(t)
	ctx := context.Background()
	q := queueName(t)
	pc := sameServer(client)
	defer pc.Close()
	require.NoError(t, pc.Do(ctx, "CLIENT", "SETNAME", "victim").Err())
	p, err := NewProducer[string, string](pc, q, &ProducerOptions{
		BackstopInterval: time.Hour, Logger: testLogger(t)}) // only a resubscription can trigger the check
	require.NoError(t, err)
	defer p.Close()
	pr, err := p.Produce(ctx, "cut", "x")
	require.NoError(t, err)
	// Cut every pub/sub connection, then complete the request at once.
	require.NoError(t, client.Do(ctx, "CLIENT", "KILL", "TYPE", "pubsub").Err())
	c, err := NewConsumer(client, q, func(ctx context.Context, m *Message[string]) (string, error) {
		return "ok", nil
	}, &ConsumerOptions{ReadBlock: 100 * time.Millisecond, Logger: testLogger(t)})
	require.NoError(t, err)
	runConsumer(t, c)
	wctx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	got, err := pr.Wait(wctx)
	require.NoError(t, err)
	require.Equal(t, "ok", got)
}

func TestBadInputIsRejectedBeforeWriting(t *testing.T) {
	client, m := miniRedis(t)
	ctx := context.Background()
	q := queueName(t)
	p, err := NewProducer[string, string](client, q, &ProducerOptions{MaxPayloadBytes: 10, MaxBatchBytes: 10, Logger: testLogger(t)})
	require.NoError(t, err)
	defer p.Close()
	_, err = p.Produce(ctx, "", "x")
	require.ErrorIs(t, err, ErrInvalidID)
	_, err = p.Produce(ctx, strings.Repeat("i", MaxIDLen+1), "x")
	require.ErrorIs(t, err, ErrInvalidID)
	_, err = p.Produce(ctx, "big", strings.Repeat("x", 20))
	require.ErrorIs(t, err, ErrPayloadTooLarge)
	require.Empty(t, m.Keys(), "nothing was written")

	// A record key of the wrong type is reported, not overwritten.
	require.NoError(t, client.HSet(ctx, "streamq:{"+q+"}:id:h", "f", "v").Err())
	_, err = p.Produce(ctx, "h", "x")
	require.ErrorIs(t, err, ErrWrongType)
	require.ErrorIs(t, p.Enqueue(ctx, "h", "x"), ErrWrongType)

	// A cancelled context returns at once.
	cctx, cancel := context.WithCancel(ctx)
	cancel()
	_, err = p.Produce(cctx, "c", "x")
	require.ErrorIs(t, err, context.Canceled)
}

func TestOptionsAreValidated(t *testing.T) {
	client, _ := miniRedis(t)
	h := func(context.Context, *Message[string]) (string, error) { return "", nil }
	for name, o := range map[string]*ConsumerOptions{
		"Workers":         {Workers: -1},
		"Prefetch":        {Workers: 8, Prefetch: 4},
		"MinIdle":         {MinIdle: time.Microsecond},
		"MaxDeliveries":   {MaxDeliveries: -2},
		"PriorityWeights": {PriorityWeights: [3]int{6, 0, 1}},
		"FetchTimeout":    {FetchTimeout: time.Microsecond},
	} {
		_, err := NewConsumer(client, "q", h, o)
		require.ErrorIs(t, err, ErrInvalidOptions, name)
		require.Contains(t, err.Error(), name)
	}
	// -1 is no bound, as FetchRetries' -1 is no retries.
	_, err := NewConsumer(client, "q", h, &ConsumerOptions{FetchTimeout: -1})
	require.NoError(t, err)
	_, err = NewConsumer(client, "bad{name}", h, nil)
	require.ErrorIs(t, err, ErrInvalidOptions)
	_, err = NewConsumer[string, string](client, "q", nil, nil)
	require.ErrorIs(t, err, ErrInvalidOptions)
	_, err = NewProducer[string, string](client, "", nil)
	require.ErrorIs(t, err, ErrInvalidOptions)
	_, err = NewProducer[string, string](client, "q", &ProducerOptions{MaxPayloadBytes: 100, MaxBatchBytes: 10})
	require.ErrorIs(t, err, ErrInvalidOptions)
	require.Contains(t, err.Error(), "MaxBatchBytes")
	_, err = NewProducer[string, string](nil, "q", nil)
	require.ErrorIs(t, err, ErrInvalidOptions)
}

func TestRawBytesSkipTheCodec(t *testing.T) {
	client, _ := miniRedis(t)
	ctx := context.Background()
	q := queueName(t)
	p, err := NewProducer[[]byte, []byte](client, q, &ProducerOptions{Logger: testLogger(t)})
	require.NoError(t, err)
	defer p.Close()
	c, err := NewConsumer(client, q, func(ctx context.Context, m *Message[[]byte]) ([]byte, error) {
		return append([]byte("echo:"), m.Payload...), nil
	}, &ConsumerOptions{ReadBlock: 50 * time.Millisecond, Logger: testLogger(t)})
	require.NoError(t, err)
	runConsumer(t, c)
	pr, err := p.Produce(ctx, "raw", []byte{0, 1, 2, 0xff})
	require.NoError(t, err)
	got, err := pr.Wait(ctx)
	require.NoError(t, err)
	require.Equal(t, []byte("echo:\x00\x01\x02\xff"), got)
	require.Equal(t, "R"+"echo:\x00\x01\x02\xff", client.Get(ctx, "streamq:{"+q+"}:id:raw").Val(),
		"the record holds the bytes as they are")
}

func TestDiscardResultsKeepsDedupOnly(t *testing.T) {
	backends(t, func(t *testing.T, client *redis.Client) {
		ctx := context.Background()
		q := queueName(t)
		p, err := NewProducer[string, string](client, q, &ProducerOptions{Logger: testLogger(t)})
		require.NoError(t, err)
		defer p.Close()
		var runs atomic.Int64
		c, err := NewConsumer(client, q, func(ctx context.Context, m *Message[string]) (string, error) {
			runs.Add(1)
			return "fresh", nil
		}, &ConsumerOptions{DiscardResults: true, ReadBlock: 50 * time.Millisecond, Logger: testLogger(t)})
		require.NoError(t, err)
		runConsumer(t, c)
		pr, err := p.Produce(ctx, "ff", "x")
		require.NoError(t, err)
		got, err := pr.Wait(ctx)
		require.NoError(t, err, "a caller waiting at completion still gets the result")
		require.Equal(t, "fresh", got)
		require.Equal(t, "N", client.Get(ctx, "streamq:{"+q+"}:id:ff").Val())
		pr, err = p.Produce(ctx, "ff", "x")
		require.NoError(t, err)
		_, err = pr.Wait(ctx)
		require.ErrorIs(t, err, ErrNoResult)
		require.EqualValues(t, 1, runs.Load())
	})
}
