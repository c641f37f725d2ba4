package streamq

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"
)

// produceRefs appends one request per id, in order, in atomic batches, with the
// request bytes given by ref. It returns the stream entry ids in the same order.
func produceRefs(t *testing.T, p *Producer[[]byte, string], ids []string, ref func(id string) []byte) []string {
	t.Helper()
	ctx := context.Background()
	entryIDs := make([]string, 0, len(ids))
	for start := 0; start < len(ids); start += 500 {
		end := min(start+500, len(ids))
		jobs := make([]Job[[]byte], 0, end-start)
		for _, id := range ids[start:end] {
			jobs = append(jobs, Job[[]byte]{ID: id, Request: ref(id)})
		}
		prs, err := p.ProduceBatch(ctx, jobs)
		require.NoError(t, err)
		for _, pr := range prs {
			require.NotEmpty(t, pr.EntryID())
			entryIDs = append(entryIDs, pr.EntryID())
		}
	}
	return entryIDs
}

// streamLen returns the length of queue q's stream.
func streamLen(client redis.UniversalClient, q string) int64 {
	return client.XLen(context.Background(), "streamq:{"+q+"}:stream").Val()
}

// The seed system's check: every message read is handled exactly once, and with
// one worker in stream order, although fetches finish in random order.
func TestPrefetchOrderAndExactlyOnce(t *testing.T) {
	backends(t, func(t *testing.T, client *redis.Client) {
		const n = 5000
		q := queueName(t)
		p, err := NewProducer[[]byte, string](client, q, &ProducerOptions{Logger: testLogger(t)})
		require.NoError(t, err)
		defer p.Close()

		var (
			mu      sync.Mutex
			fetched = map[string]int{} // request id -> fetch calls
			handled []string           // request ids in handling order
			entries []string           // entry ids in handling order
		)
		done := make(chan struct{})
		fetcher := FetcherFunc(func(ctx context.Context, e Entry) ([]byte, error) {
			time.Sleep(rand.N(500 * time.Microsecond)) // a source with uneven latency
			mu.Lock()
			fetched[e.ID]++
			mu.Unlock()
			return append([]byte("payload:"), e.Data...), nil
		})
		c, err := NewConsumer(client, q, func(ctx context.Context, m *Message[[]byte]) (string, error) {
			if want := "payload:ref:" + m.ID; string(m.Payload) != want {
				return "", Permanent(fmt.Errorf("payload %q, want %q", m.Payload, want))
			}
			mu.Lock()
			handled = append(handled, m.ID)
			entries = append(entries, m.EntryID)
			if len(handled) == n {
				close(done)
			}
			mu.Unlock()
			return "ok", nil
		}, &ConsumerOptions{Workers: 1, Prefetch: 16, Fetcher: fetcher, Logger: testLogger(t)})
		require.NoError(t, err)
		runConsumer(t, c)

		ids := make([]string, n)
		for i := range ids {
			ids[i] = fmt.Sprintf("m%05d", i)
		}
		produced := produceRefs(t, p, ids, func(id string) []byte { return []byte("ref:" + id) })

		select {
		case <-done:
		case <-time.After(2 * time.Minute):
			mu.Lock()
			got := len(handled)
			mu.Unlock()
			t.Fatalf("handled %d of %d messages", got, n)
		}
		eventually(t, 10*time.Second, func() bool { return streamLen(client, q) == 0 }, "stream not emptied")

		mu.Lock()
		defer mu.Unlock()
		require.Equal(t, ids, handled, "handled order differs from stream order")
		require.Equal(t, produced, entries, "entry ids handled differ from those produced")
		require.Len(t, fetched, n, "every message read is fetched")
		for id, calls := range fetched {
			require.Equal(t, 1, calls, "message %s fetched %d times", id, calls)
		}
	})
}

// countingFetcher counts payloads fetched but not yet handled (the handler
// calls done; the consumer drops a payload when its handler returns), and
// records the maximum.
type countingFetcher struct {
	held, peak, fetches atomic.Int64
}

func (f *countingFetcher) Fetch(_ context.Context, e Entry) ([]byte, error) {
	f.fetches.Add(1)
	n := f.held.Add(1)
	for {
		p := f.peak.Load()
		if n <= p || f.peak.CompareAndSwap(p, n) {
			break
		}
	}
	return e.Data, nil
}

func (f *countingFetcher) done() { f.held.Add(-1) }

func TestPrefetchBoundsPayloadsInMemory(t *testing.T) {
	backends(t, func(t *testing.T, client *redis.Client) {
		const n, depth, workers = 200, 8, 2
		q := queueName(t)
		p, err := NewProducer[[]byte, string](client, q, &ProducerOptions{Logger: testLogger(t)})
		require.NoError(t, err)
		defer p.Close()
		ids := make([]string, n)
		for i := range ids {
			ids[i] = fmt.Sprintf("b%d", i)
		}
		// A backlog first, so the fast source could run far ahead of the handlers.
		produceRefs(t, p, ids, func(id string) []byte { return []byte(`"` + id + `"`) })

		f := &countingFetcher{}
		var handled atomic.Int64
		c, err := NewConsumer(client, q, func(ctx context.Context, m *Message[string]) (string, error) {
			time.Sleep(2 * time.Millisecond) // a slow handler
			handled.Add(1)
			f.done()
			return m.Payload, nil
		}, &ConsumerOptions{Workers: workers, Prefetch: depth, Fetcher: f, Logger: testLogger(t)})
		require.NoError(t, err)
		runConsumer(t, c)

		eventually(t, time.Minute, func() bool { return handled.Load() == n }, "not every message was handled")
		eventually(t, 10*time.Second, func() bool { return f.held.Load() == 0 }, "payloads still held after handling")
		require.EqualValues(t, n, f.fetches.Load())
		t.Logf("peak payloads held: %d (Prefetch %d, Workers %d)", f.peak.Load(), depth, workers)
		require.LessOrEqual(t, f.peak.Load(), int64(depth), "more payloads held than Prefetch")
		require.Greater(t, f.peak.Load(), int64(workers), "the ring never prefetched beyond the running handlers")
	})
}

// A source that fails the first two fetches of a message recovers within the
// fetch retries: the message is handled once, in its first delivery, and the
// other messages keep flowing while it is retried.
func TestPrefetchFetchRetriesRecover(t *testing.T) {
	backends(t, func(t *testing.T, client *redis.Client) {
		const others = 30
		ctx := context.Background()
		q := queueName(t)
		p, err := NewProducer[[]byte, string](client, q, &ProducerOptions{Logger: testLogger(t)})
		require.NoError(t, err)
		defer p.Close()

		var (
			flakyAttempts atomic.Int64
			othersHandled atomic.Int64
			flakyHandled  atomic.Int64
			flakyDeliv    atomic.Int64
			enoughOthers  = make(chan struct{})
			closeOnce     sync.Once
		)
		errSource := errors.New("source unavailable")
		fetcher := FetcherFunc(func(ctx context.Context, e Entry) ([]byte, error) {
			if e.ID != "flaky" {
				return e.Data, nil
			}
			switch flakyAttempts.Add(1) {
			case 1:
				return nil, errSource
			case 2:
				// Hold the second failure until other messages went past:
				// a message being retried must not stall the ring.
				select {
				case <-enoughOthers:
				case <-time.After(30 * time.Second):
				case <-ctx.Done():
				}
				return nil, errSource
			}
			return e.Data, nil
		})
		c, err := NewConsumer(client, q, func(ctx context.Context, m *Message[string]) (string, error) {
			if m.ID == "flaky" {
				flakyHandled.Add(1)
				flakyDeliv.Store(int64(m.Deliveries))
			} else if othersHandled.Add(1) == 10 {
				closeOnce.Do(func() { close(enoughOthers) })
			}
			return "done:" + m.Payload, nil
		}, &ConsumerOptions{Workers: 2, Prefetch: 16, Fetcher: fetcher, FetchBackoff: time.Millisecond, Logger: testLogger(t)})
		require.NoError(t, err)
		runConsumer(t, c)

		ids := []string{"flaky"}
		for i := range others {
			ids = append(ids, fmt.Sprintf("o%d", i))
		}
		produceRefs(t, p, ids, func(id string) []byte { return []byte(`"` + id + `"`) })

		pr, err := p.Produce(ctx, "flaky", []byte(`"flaky"`))
		require.NoError(t, err)
		wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		defer cancel()
		got, err := pr.Wait(wctx)
		require.NoError(t, err)
		require.Equal(t, "done:flaky", got)
		require.GreaterOrEqual(t, othersHandled.Load(), int64(10), "the ring stalled behind a retried fetch")
		eventually(t, 10*time.Second, func() bool { return othersHandled.Load() == others }, "other messages not all handled")
		require.EqualValues(t, 1, flakyHandled.Load())
		require.EqualValues(t, 1, flakyDeliv.Load(), "fetch retries must not count as deliveries")
		require.EqualValues(t, 3, flakyAttempts.Load())
	})
}

// A source that always fails exhausts FetchRetries on each attempt; the
// message is retried through the schedule, then dead-lettered with the fetch
// error after MaxDeliveries failed fetches. The handler never started, so the
// dead letter counts 0 deliveries (issue 17: it counted the failed fetches).
func TestPrefetchFetchFailureDeadLetters(t *testing.T) {
	t.Parallel()
	client := realRedis(t)
	ctx := context.Background()
	q := queueName(t)
	p, err := NewProducer[[]byte, string](client, q, &ProducerOptions{Logger: testLogger(t)})
	require.NoError(t, err)
	defer p.Close()

	var badAttempts atomic.Int64
	var badHandled, goodHandled atomic.Int64
	fetcher := FetcherFunc(func(ctx context.Context, e Entry) ([]byte, error) {
		if e.ID == "bad" {
			badAttempts.Add(1)
			return nil, errors.New("object store says 503")
		}
		return e.Data, nil
	})
	c, err := NewConsumer(client, q, func(ctx context.Context, m *Message[string]) (string, error) {
		if m.ID == "bad" {
			badHandled.Add(1)
		} else {
			goodHandled.Add(1)
		}
		return m.Payload, nil
	}, &ConsumerOptions{
		Workers: 2, Fetcher: fetcher, FetchRetries: 1, FetchBackoff: time.Millisecond,
		MaxDeliveries: 2, RetryBackoff: time.Millisecond, MinIdle: 300 * time.Millisecond,
		ClaimInterval: 20 * time.Millisecond, Logger: testLogger(t),
	})
	require.NoError(t, err)
	runConsumer(t, c)

	bad, err := p.Produce(ctx, "bad", []byte(`"bad"`))
	require.NoError(t, err)
	var good []*Promise[string]
	for i := range 20 {
		pr, err := p.Produce(ctx, fmt.Sprintf("g%d", i), []byte(fmt.Sprintf(`"g%d"`, i)))
		require.NoError(t, err)
		good = append(good, pr)
	}
	wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	for i, pr := range good {
		got, err := pr.Wait(wctx)
		require.NoError(t, err)
		require.Equal(t, fmt.Sprintf("g%d", i), got)
	}
	_, badErr := bad.Wait(wctx)
	err = badErr
	require.ErrorIs(t, err, ErrDeadLettered)
	require.ErrorContains(t, err, "object store says 503")
	require.ErrorContains(t, err, "fetch failed after 2 attempts")
	require.EqualValues(t, 0, badHandled.Load(), "a message whose fetch failed reached the handler")
	require.EqualValues(t, 20, goodHandled.Load())
	require.EqualValues(t, 4, badAttempts.Load(), "2 deliveries x (1 + FetchRetries) attempts")

	admin, err := NewAdmin(client, q, nil)
	require.NoError(t, err)
	dls, err := admin.DeadLetters(ctx, "", 10)
	require.NoError(t, err)
	require.Len(t, dls, 1)
	require.Equal(t, "bad", dls[0].ID)
	require.Equal(t, 0, dls[0].Deliveries, "a failed fetch is not a handler start")
	require.Contains(t, dls[0].Error, "object store says 503")
	require.Contains(t, dls[0].Error, "the handler did not run")
	require.Equal(t, 1, strings.Count(badErr.Error(), "streamq:"), "the prefix once: %v", badErr)
	require.Equal(t, `"bad"`, string(dls[0].Payload), "the dead letter keeps the reference, not a fetched payload")
	eventually(t, 10*time.Second, func() bool { return streamLen(client, q) == 0 }, "stream not emptied")
}

// mapSource is a Source backed by a map, counting reads.
type mapSource struct {
	mu    sync.Mutex
	blobs map[string][]byte
	gets  map[string]int
}

var errNoObject = errors.New("no such object")

func (s *mapSource) Get(_ context.Context, key string) ([]byte, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.gets[key]++
	b, ok := s.blobs[key]
	if !ok {
		return nil, fmt.Errorf("%w: %s", errNoObject, key)
	}
	return b, nil
}

func (s *mapSource) count(key string) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.gets[key]
}

func TestCacheFetcherFetch(t *testing.T) {
	backends(t, func(t *testing.T, client *redis.Client) {
		ctx := context.Background()
		q := queueName(t)
		hitKey, missKey := q+":hit", q+":miss"
		require.NoError(t, client.Set(ctx, hitKey, "from-cache", time.Minute).Err())
		src := &mapSource{blobs: map[string][]byte{missKey: []byte("from-source"), hitKey: []byte("stale")}, gets: map[string]int{}}

		f := &CacheFetcher{Client: client, Source: src}
		b, err := f.Fetch(ctx, Entry{ID: "a", Data: []byte(hitKey)})
		require.NoError(t, err)
		require.Equal(t, "from-cache", string(b))
		require.Zero(t, src.count(hitKey), "a cache hit must not read the source")

		b, err = f.Fetch(ctx, Entry{ID: "b", Data: []byte(missKey)})
		require.NoError(t, err)
		require.Equal(t, "from-source", string(b))
		require.Equal(t, 1, src.count(missKey))

		_, err = f.Fetch(ctx, Entry{ID: "c", Data: []byte(q + ":nowhere")})
		require.ErrorIs(t, err, errNoObject)
		require.ErrorContains(t, err, q+":nowhere")

		// Without a Source, a miss is ErrCacheMiss.
		_, err = (&CacheFetcher{Client: client}).Fetch(ctx, Entry{ID: "b", Data: []byte(missKey)})
		require.ErrorIs(t, err, ErrCacheMiss)

		// Key mappings.
		require.NoError(t, client.Set(ctx, "cache:"+q+":k", "mapped-cache", time.Minute).Err())
		src.blobs["obj/"+q+":j"] = []byte("mapped-source")
		mapped := &CacheFetcher{
			Client:    client,
			Source:    src,
			CacheKey:  func(e Entry) string { return "cache:" + string(e.Data) },
			SourceKey: func(e Entry) string { return "obj/" + string(e.Data) },
		}
		b, err = mapped.Fetch(ctx, Entry{Data: []byte(q + ":k")})
		require.NoError(t, err)
		require.Equal(t, "mapped-cache", string(b))
		b, err = mapped.Fetch(ctx, Entry{Data: []byte(q + ":j")})
		require.NoError(t, err)
		require.Equal(t, "mapped-source", string(b))

		// A cache key of the wrong type is an error, not a miss.
		require.NoError(t, client.RPush(ctx, q+":list", "x").Err())
		_, err = f.Fetch(ctx, Entry{Data: []byte(q + ":list")})
		require.Error(t, err)
		require.NotErrorIs(t, err, ErrCacheMiss)
		require.Zero(t, src.count(q+":list"))

		// Completed deletes only with DeleteOnComplete.
		require.NoError(t, f.Completed(ctx, []Entry{{Data: []byte(hitKey)}}))
		require.EqualValues(t, 1, client.Exists(ctx, hitKey).Val())
		f.DeleteOnComplete = true
		require.NoError(t, f.Completed(ctx, []Entry{{Data: []byte(hitKey)}, {Data: []byte(missKey)}}))
		require.EqualValues(t, 0, client.Exists(ctx, hitKey).Val())
	})
}

// End to end: some payloads are in the cache, the rest come from the source,
// and the cache keys of completed messages are deleted.
func TestCacheFetcherConsumer(t *testing.T) {
	backends(t, func(t *testing.T, client *redis.Client) {
		const n = 40
		ctx := context.Background()
		q := queueName(t)
		src := &mapSource{blobs: map[string][]byte{}, gets: map[string]int{}}
		ids := make([]string, n)
		keyOf := func(id string) string { return q + ":obj:" + id }
		for i := range ids {
			ids[i] = fmt.Sprintf("c%d", i)
			src.blobs[keyOf(ids[i])] = []byte(`"source:` + ids[i] + `"`)
			if i%2 == 0 {
				require.NoError(t, client.Set(ctx, keyOf(ids[i]), `"cache:`+ids[i]+`"`, time.Minute).Err())
			}
		}
		p, err := NewProducer[[]byte, string](client, q, &ProducerOptions{Logger: testLogger(t)})
		require.NoError(t, err)
		defer p.Close()
		c, err := NewConsumer(client, q, func(ctx context.Context, m *Message[string]) (string, error) {
			return m.Payload, nil
		}, &ConsumerOptions{
			Workers: 2, Fetcher: &CacheFetcher{Client: client, Source: src, DeleteOnComplete: true},
			Logger: testLogger(t),
		})
		require.NoError(t, err)
		runConsumer(t, c)

		var prs []*Promise[string]
		for _, id := range ids {
			pr, err := p.Produce(ctx, id, []byte(keyOf(id)))
			require.NoError(t, err)
			prs = append(prs, pr)
		}
		wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		defer cancel()
		for i, pr := range prs {
			got, err := pr.Wait(wctx)
			require.NoError(t, err)
			if i%2 == 0 {
				require.Equal(t, "cache:"+ids[i], got)
				require.Zero(t, src.count(keyOf(ids[i])), "cached payload %s read from the source", ids[i])
			} else {
				require.Equal(t, "source:"+ids[i], got)
				require.Equal(t, 1, src.count(keyOf(ids[i])))
			}
		}
		// The delete follows the recorded result, so wait for it.
		eventually(t, 10*time.Second, func() bool {
			for i := 0; i < n; i += 2 {
				if client.Exists(ctx, keyOf(ids[i])).Val() != 0 {
					return false
				}
			}
			return true
		}, "cache keys not deleted after completion")
	})
}

// Prefetching overlaps fetch latency with handling. The speed-up is the
// benchmark's business (it depends on the machine's load); here the overlap
// itself is counted: with a ring of 16, fetches start while a handler runs;
// with a ring of one, never.
func TestPrefetchOverlapsFetchAndHandler(t *testing.T) {
	if testing.Short() {
		t.Skip("timing test")
	}
	client := realRedis(t)
	const n = 60
	elapsed := func(depth int) (time.Duration, int64) {
		var running, overlaps atomic.Int64
		q := queueName(t)
		p, err := NewProducer[[]byte, string](client, q, &ProducerOptions{Logger: testLogger(t)})
		require.NoError(t, err)
		defer p.Close()
		ids := make([]string, n)
		for i := range ids {
			ids[i] = fmt.Sprintf("v%d", i)
		}
		produceRefs(t, p, ids, func(id string) []byte { return []byte(`"` + id + `"`) })

		var handled atomic.Int64
		done := make(chan struct{})
		fetcher := FetcherFunc(func(ctx context.Context, e Entry) ([]byte, error) {
			if running.Load() > 0 {
				overlaps.Add(1)
			}
			time.Sleep(5 * time.Millisecond) // simulated source latency
			return e.Data, nil
		})
		c, err := NewConsumer(client, q, func(ctx context.Context, m *Message[string]) (string, error) {
			running.Add(1)
			defer running.Add(-1)
			time.Sleep(5 * time.Millisecond) // simulated work
			if handled.Add(1) == n {
				close(done)
			}
			return m.Payload, nil
		}, &ConsumerOptions{Workers: 1, Prefetch: depth, Fetcher: fetcher, Logger: testLogger(t)})
		require.NoError(t, err)
		start := time.Now()
		stop := runConsumer(t, c)
		select {
		case <-done:
		case <-time.After(time.Minute):
			t.Fatalf("depth %d: handled %d of %d", depth, handled.Load(), n)
		}
		d := time.Since(start)
		stop()
		return d, overlaps.Load()
	}
	d1, o1 := elapsed(1)
	d16, o16 := elapsed(16)
	t.Logf("%d messages, fetch 5ms + handler 5ms, one worker: depth 1 %v, depth 16 %v (%.2fx); fetches started while a handler ran: %d and %d",
		n, d1, d16, float64(d1)/float64(d16), o1, o16)
	// A ring of one reads the next entry only once the handler is done.
	require.Zero(t, o1, "a fetch overlapped a handler with Prefetch 1")
	require.Positive(t, o16, "no fetch overlapped a handler with Prefetch 16")
}

// A fetch error wrapped with Permanent (an object that will never exist, say)
// is neither retried nor redelivered: the message is dead-lettered at once.
func TestPrefetchPermanentFetchErrorNotRetried(t *testing.T) {
	backends(t, func(t *testing.T, client *redis.Client) {
		ctx := context.Background()
		q := queueName(t)
		p, err := NewProducer[[]byte, string](client, q, &ProducerOptions{Logger: testLogger(t)})
		require.NoError(t, err)
		defer p.Close()
		var attempts atomic.Int64
		fetcher := FetcherFunc(func(ctx context.Context, e Entry) ([]byte, error) {
			attempts.Add(1)
			return nil, Permanent(errors.New("no such object"))
		})
		c, err := NewConsumer(client, q, func(ctx context.Context, m *Message[string]) (string, error) {
			return m.Payload, nil
		}, &ConsumerOptions{Fetcher: fetcher, FetchRetries: 3, FetchBackoff: time.Millisecond, Logger: testLogger(t)})
		require.NoError(t, err)
		runConsumer(t, c)

		pr, err := p.Produce(ctx, "gone", []byte(`"gone"`))
		require.NoError(t, err)
		wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		defer cancel()
		_, err = pr.Wait(wctx)
		require.ErrorIs(t, err, ErrDeadLettered)
		require.ErrorContains(t, err, "no such object")
		require.EqualValues(t, 1, attempts.Load(), "a permanent fetch error was retried")
	})
}

// syncBuffer is a bytes.Buffer safe for a logger and a test reading it.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (w *syncBuffer) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.b.Write(p)
}

func (w *syncBuffer) String() string {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.b.String()
}

// TestPrefetchFetchFailureIsNotAHandlerFailure (issue 17): a fetch that fails
// (FetchRetries exhausted) twice and then succeeds reaches the handler with
// Deliveries 1 and is logged as a failed fetch, never as a failed handler:
// only handler starts count. On the old code each failed fetch was charged as
// a start: the handler saw Deliveries 4, and the log said "handler failed".
func TestPrefetchFetchFailureIsNotAHandlerFailure(t *testing.T) {
	backends(t, func(t *testing.T, client *redis.Client) {
		ctx := context.Background()
		q := queueName(t)
		p, err := NewProducer[[]byte, string](client, q, &ProducerOptions{Logger: testLogger(t)})
		require.NoError(t, err)
		defer p.Close()
		var attempts atomic.Int64
		fetcher := FetcherFunc(func(ctx context.Context, e Entry) ([]byte, error) {
			if attempts.Add(1) <= 3 {
				return nil, errors.New("object store says 503")
			}
			return e.Data, nil
		})
		var logs syncBuffer
		var deliveries atomic.Int64
		c, err := NewConsumer(client, q, func(ctx context.Context, m *Message[string]) (string, error) {
			deliveries.Store(int64(m.Deliveries))
			return "ok:" + m.Payload, nil
		}, &ConsumerOptions{
			Fetcher: fetcher, FetchRetries: -1, MaxDeliveries: 4, RetryBackoff: time.Millisecond,
			ReadBlock: 50 * time.Millisecond, Logger: slog.New(slog.NewTextHandler(&logs, nil)),
		})
		require.NoError(t, err)
		runConsumer(t, c)
		pr, err := p.Produce(ctx, "ref", []byte(`"x"`))
		require.NoError(t, err)
		got, err := pr.Wait(waitCtx(t, 30*time.Second))
		require.NoError(t, err, "logs:\n%s", logs.String())
		require.Equal(t, "ok:x", got)
		require.EqualValues(t, 1, deliveries.Load(), "failed fetches counted as deliveries")
		require.EqualValues(t, 4, attempts.Load())
		require.Contains(t, logs.String(), "fetch failed; will retry")
		require.NotContains(t, logs.String(), "handler failed")
	})
}

// A fetch that does not return holds the worker that took its slot (with
// Workers 1, every other job): FetchTimeout ends each attempt, which then
// fails like any failed fetch, so the other jobs run and the hung one is
// retried and dead-lettered as MaxDeliveries says.
func TestPrefetchHangingFetchTimesOut(t *testing.T) {
	t.Parallel()
	client := realRedis(t)
	ctx := context.Background()
	q := queueName(t)
	p, err := NewProducer[[]byte, string](client, q, &ProducerOptions{Logger: testLogger(t)})
	require.NoError(t, err)
	defer p.Close()

	var hangAttempts atomic.Int64
	fetcher := FetcherFunc(func(ctx context.Context, e Entry) ([]byte, error) {
		if e.ID == "hang" {
			hangAttempts.Add(1)
			<-ctx.Done() // a source that never answers: only the ctx ends it
			return nil, ctx.Err()
		}
		return e.Data, nil
	})
	c, err := NewConsumer(client, q, func(ctx context.Context, m *Message[string]) (string, error) {
		return m.Payload, nil
	}, &ConsumerOptions{
		Workers: 1, Fetcher: fetcher, FetchTimeout: 50 * time.Millisecond, FetchRetries: 1, FetchBackoff: time.Millisecond,
		MaxDeliveries: 2, RetryBackoff: time.Millisecond, Logger: testLogger(t),
	})
	require.NoError(t, err)
	runConsumer(t, c)

	hang, err := p.Produce(ctx, "hang", []byte(`"hang"`))
	require.NoError(t, err)
	next, err := p.Produce(ctx, "next", []byte(`"next"`))
	require.NoError(t, err)
	got, err := waitFor(t, next)
	require.NoError(t, err, "a job behind a fetch that never returns did not run")
	require.Equal(t, "next", got)
	_, err = waitFor(t, hang)
	require.ErrorIs(t, err, ErrDeadLettered)
	require.ErrorContains(t, err, "did not return within FetchTimeout (50ms)")
	require.EqualValues(t, 4, hangAttempts.Load(), "2 deliveries x (1 + FetchRetries) attempts")
}
