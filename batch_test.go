package streamq

import (
	"context"
	"fmt"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"
)

// countingHook counts the commands sent, and EVALSHA/EVAL calls separately.
type countingHook struct{ cmds, scripts atomic.Int64 }

func (h *countingHook) DialHook(next redis.DialHook) redis.DialHook { return next }

func (h *countingHook) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		h.count(cmd)
		return next(ctx, cmd)
	}
}

func (h *countingHook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		for _, c := range cmds {
			h.count(c)
		}
		return next(ctx, cmds)
	}
}

func (h *countingHook) count(cmd redis.Cmder) {
	h.cmds.Add(1)
	if name := strings.ToLower(cmd.Name()); name == "evalsha" || name == "eval" {
		h.scripts.Add(1)
	}
}

func TestConcurrentProduceCallsShareRoundTrips(t *testing.T) {
	client := realRedis(t)
	ctx := context.Background()
	q := queueName(t)
	pc := sameServer(client)
	defer pc.Close()
	hook := &countingHook{}
	pc.AddHook(hook)
	p, err := NewProducer[int, int](pc, q, &ProducerOptions{Logger: testLogger(t)})
	require.NoError(t, err)
	defer p.Close()

	const callers = 1000
	start := make(chan struct{})
	var wg sync.WaitGroup
	errs := make(chan error, callers)
	for i := range callers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			if err := p.Enqueue(ctx, fmt.Sprintf("job-%d", i), i); err != nil {
				errs <- err
			}
		}()
	}
	close(start)
	wg.Wait()
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}
	require.EqualValues(t, callers, client.XLen(ctx, "streamq:{"+q+"}:stream").Val())
	trips := hook.scripts.Load()
	t.Logf("%d concurrent Enqueue calls took %d script round trips (%.1f calls per trip)",
		callers, trips, float64(callers)/float64(trips))
	require.Less(t, trips, int64(callers/4), "coalescing should share round trips")
}

func TestProduceBatch(t *testing.T) {
	backends(t, func(t *testing.T, client *redis.Client) {
		ctx := context.Background()
		q := queueName(t)
		stream := "streamq:{" + q + "}:stream"
		p, err := NewProducer[string, string](client, q, &ProducerOptions{
			MaxBatchItems: 10, MaxPayloadBytes: 64, MaxBatchBytes: 256, Logger: testLogger(t)})
		require.NoError(t, err)
		defer p.Close()

		t.Run("one oversized item writes nothing", func(t *testing.T) {
			_, err := p.ProduceBatch(ctx, []Job[string]{{ID: "a", Request: "x"}, {ID: "b", Request: strings.Repeat("y", 100)}})
			require.ErrorIs(t, err, ErrPayloadTooLarge)
			require.Contains(t, err.Error(), "job 1")
			require.Zero(t, client.XLen(ctx, stream).Val())
		})
		t.Run("too many items or bytes", func(t *testing.T) {
			jobs := make([]Job[string], 11)
			for i := range jobs {
				jobs[i] = Job[string]{ID: fmt.Sprint(i), Request: "x"}
			}
			_, err := p.ProduceBatch(ctx, jobs)
			require.ErrorIs(t, err, ErrBatchTooLarge)
			jobs = jobs[:8]
			for i := range jobs {
				jobs[i].Request = strings.Repeat("z", 60)
			}
			_, err = p.ProduceBatch(ctx, jobs)
			require.ErrorIs(t, err, ErrBatchTooLarge)
			require.Zero(t, client.XLen(ctx, stream).Val())
		})
		t.Run("invalid id writes nothing", func(t *testing.T) {
			_, err := p.ProduceBatch(ctx, []Job[string]{{ID: "a", Request: "x"}, {ID: "", Request: "y"}})
			require.ErrorIs(t, err, ErrInvalidID)
			require.Zero(t, client.XLen(ctx, stream).Val())
		})
		t.Run("a wrong key type fails the whole batch and leaves nothing", func(t *testing.T) {
			rec := func(id string) string { return "streamq:{" + q + "}:id:" + id }
			require.NoError(t, client.LPush(ctx, rec("bad"), "x").Err())
			// A stored failure that the batch would replace (RetryFailed).
			require.NoError(t, client.Set(ctx, rec("failed"), "Eboom", time.Hour).Err())
			_, err := p.ProduceBatch(ctx, []Job[string]{
				{ID: "w1", Request: "x"},
				{ID: "later", Request: "z", Options: []ProduceOption{After(time.Hour)}},
				{ID: "failed", Request: "f", Options: []ProduceOption{RetryFailed()}},
				{ID: "bad", Request: "y"},
			})
			require.ErrorIs(t, err, ErrWrongType)
			require.Contains(t, err.Error(), "item 4")
			require.Zero(t, client.Exists(ctx, stream).Val(), "the stream the batch created")
			require.Zero(t, client.Exists(ctx, rec("w1"), rec("later")).Val(), "records the batch created")
			require.Zero(t, client.Exists(ctx, "streamq:{"+q+"}:schedule", "streamq:{"+q+"}:schedule:data").Val())
			require.Equal(t, "Eboom", client.Get(ctx, rec("failed")).Val(), "the replaced failure is put back")
			ttl := client.PTTL(ctx, rec("failed")).Val()
			require.Greater(t, ttl, 59*time.Minute, "with its TTL")
			require.NoError(t, client.Del(ctx, rec("failed")).Err())
		})
		t.Run("a plain batch with a wrong key type undoes its appends", func(t *testing.T) {
			// Every job due now, with no options: produce.lua's plain form.
			rec := func(id string) string { return "streamq:{" + q + "}:id:" + id }
			require.NoError(t, client.LPush(ctx, rec("bad"), "x").Err()) // kept for the subtests after
			plain := []Job[string]{{ID: "p1", Request: "x"}, {ID: "p2", Request: "y"}, {ID: "p1", Request: "z"}, {ID: "bad", Request: "w"}}
			_, err := p.ProduceBatch(ctx, plain)
			require.ErrorIs(t, err, ErrWrongType)
			require.Contains(t, err.Error(), "item 4")
			require.Zero(t, client.Exists(ctx, stream).Val(), "the stream the batch created")
			require.Zero(t, client.Exists(ctx, rec("p1"), rec("p2")).Val(), "records the batch created")

			// A stream that existed stays, without the batch's entries.
			first, err := p.ProduceBatch(ctx, []Job[string]{{ID: "kept", Request: "k"}, {ID: "kept2", Request: "k"}})
			require.NoError(t, err)
			_, err = p.ProduceBatch(ctx, plain)
			require.ErrorIs(t, err, ErrWrongType)
			entries := client.XRange(ctx, stream, "-", "+").Val()
			require.Len(t, entries, 2)
			require.Equal(t, first[0].EntryID(), entries[0].ID)
			require.Equal(t, first[1].EntryID(), entries[1].ID)
			require.Zero(t, client.Exists(ctx, rec("p1"), rec("p2")).Val())
			require.NoError(t, client.Del(ctx, stream, rec("kept"), rec("kept2")).Err())
		})
		t.Run("independent plain items: a wrong key type rejects only its own", func(t *testing.T) {
			// As coalesced Enqueues are sent: one produce.lua call, items
			// independent.
			rec := func(id string) string { return "streamq:{" + q + "}:id:" + id }
			require.NoError(t, client.LPush(ctx, rec("bad"), "x").Err()) // kept for the subtests after
			require.NoError(t, client.Set(ctx, rec("gone"), "Eboom", time.Hour).Err())
			items, err := p.batchItems(ctx, []Job[string]{
				{ID: "i1", Request: "x"},
				{ID: "bad", Request: "y"},
				{ID: "gone", Request: "again", Options: []ProduceOption{RetryFailed()}},
				{ID: "i1", Request: "z"},
			}, nil)
			require.NoError(t, err)
			outs, errs := p.runShards(ctx, items, false)
			for _, err := range errs {
				require.NoError(t, err)
			}
			require.EqualValues(t, outcomeAppended, outs[0].code)
			require.EqualValues(t, outcomeRejected, outs[1].code)
			require.Contains(t, outs[1].data, "not a streamq record")
			require.EqualValues(t, outcomeAppended, outs[2].code, "a stored failure replaced (RetryFailed)")
			require.EqualValues(t, outcomeInflight, outs[3].code)
			require.Equal(t, outs[0].data, outs[3].data, "the same id twice: one entry")
			require.Equal(t, "P"+outs[2].data, client.Get(ctx, rec("gone")).Val())
			entries := client.XRange(ctx, stream, "-", "+").Val()
			require.Len(t, entries, 2, "no entry of the rejected item")
			require.Equal(t, outs[0].data, entries[0].ID)
			require.Equal(t, outs[2].data, entries[1].ID)
			require.NoError(t, client.Del(ctx, stream, rec("i1"), rec("gone")).Err())
		})
		t.Run("an undone batch puts back a schedule member it overwrote", func(t *testing.T) {
			// A job whose record expired before it was promoted left its
			// member; a batch that schedules the id again, then fails, must
			// not delete that job.
			sched, data := "streamq:{"+q+"}:schedule", "streamq:{"+q+"}:schedule:data"
			require.NoError(t, client.ZAdd(ctx, sched, redis.Z{Score: 12345, Member: "rold"}).Err())
			require.NoError(t, client.HSet(ctx, data, "rold", "the old job").Err())
			_, err := p.ProduceBatch(ctx, []Job[string]{
				{ID: "old", Request: "new", Options: []ProduceOption{After(time.Hour)}},
				{ID: "bad", Request: "y"},
			})
			require.ErrorIs(t, err, ErrWrongType)
			require.Equal(t, float64(12345), client.ZScore(ctx, sched, "rold").Val())
			require.Equal(t, "the old job", client.HGet(ctx, data, "rold").Val())
			require.Zero(t, client.Exists(ctx, "streamq:{"+q+"}:id:old").Val())
			require.NoError(t, client.Del(ctx, sched, data).Err())
		})
		t.Run("duplicates share one entry, retries give the same entries", func(t *testing.T) {
			jobs := []Job[string]{{ID: "d1", Request: "a"}, {ID: "d2", Request: "b"}, {ID: "d1", Request: "c"}, {ID: "d3", Request: "d"}}
			prs, err := p.ProduceBatch(ctx, jobs)
			require.NoError(t, err)
			require.Len(t, prs, 4)
			require.Equal(t, prs[0].EntryID(), prs[2].EntryID())
			require.EqualValues(t, 3, client.XLen(ctx, stream).Val())
			for i, pr := range prs {
				require.Equal(t, jobs[i].ID, pr.ID())
			}
			// Entries are in input order.
			require.Less(t, prs[0].EntryID(), prs[1].EntryID())
			require.Less(t, prs[1].EntryID(), prs[3].EntryID())

			again, err := p.ProduceBatch(ctx, jobs)
			require.NoError(t, err)
			for i := range jobs {
				require.Equal(t, prs[i].EntryID(), again[i].EntryID())
			}
			require.EqualValues(t, 3, client.XLen(ctx, stream).Val())
		})
	})
}

func TestProduceBatchResultsInOrder(t *testing.T) {
	backends(t, func(t *testing.T, client *redis.Client) {
		ctx := context.Background()
		q := queueName(t)
		p, err := NewProducer[int, int](client, q, &ProducerOptions{Logger: testLogger(t)})
		require.NoError(t, err)
		defer p.Close()
		c, err := NewConsumer(client, q, func(ctx context.Context, m *Message[int]) (int, error) {
			return m.Payload * m.Payload, nil
		}, &ConsumerOptions{Workers: 4, ReadBlock: 100 * time.Millisecond, Logger: testLogger(t)})
		require.NoError(t, err)
		runConsumer(t, c)
		jobs := make([]Job[int], 100)
		for i := range jobs {
			jobs[i] = Job[int]{ID: fmt.Sprintf("sq-%d", i), Request: i}
		}
		prs, err := p.ProduceBatch(ctx, jobs)
		require.NoError(t, err)
		for i, pr := range prs {
			got, err := pr.Wait(ctx)
			require.NoError(t, err)
			require.Equal(t, i*i, got)
		}
	})
}

// TestBatchRetriedAfterLostReply cuts the connection after the request was
// sent, so the reply is lost; the retry must yield the same entries.
func TestBatchRetriedAfterLostReply(t *testing.T) {
	client := realRedis(t)
	ctx := context.Background()
	q := queueName(t)
	stream := "streamq:{" + q + "}:stream"
	var cut atomic.Bool
	lossy := redis.NewClient(&redis.Options{
		Addr:       client.Options().Addr,
		MaxRetries: -1,
		Dialer: func(ctx context.Context, network, addr string) (net.Conn, error) {
			c, err := net.Dial(network, addr)
			if err != nil {
				return nil, err
			}
			return &replyDropConn{Conn: c, drop: &cut}, nil
		},
	})
	defer lossy.Close()
	p, err := NewProducer[string, string](lossy, q, &ProducerOptions{Logger: testLogger(t)})
	require.NoError(t, err)
	defer p.Close()
	jobs := []Job[string]{{ID: "r1", Request: "a"}, {ID: "r2", Request: "b"}, {ID: "r3", Request: "c"}}
	// Subscribe and load the script first, so the cut hits the batch itself.
	_, err = p.ProduceBatch(ctx, []Job[string]{{ID: "warm-up", Request: "w"}})
	require.NoError(t, err)
	require.NoError(t, client.Del(ctx, stream).Err())

	cut.Store(true)
	_, err = p.ProduceBatch(ctx, jobs)
	require.Error(t, err, "the reply was dropped, so the outcome is unknown")
	cut.Store(false)
	require.EqualValues(t, 3, client.XLen(ctx, stream).Val(), "the batch reached Redis")
	before, err := client.XRange(ctx, stream, "-", "+").Result()
	require.NoError(t, err)

	prs, err := p.ProduceBatch(ctx, jobs)
	require.NoError(t, err)
	require.EqualValues(t, 3, client.XLen(ctx, stream).Val(), "the retry appended nothing")
	for i, pr := range prs {
		require.Equal(t, before[i].ID, pr.EntryID())
	}
}

// replyDropConn closes the connection instead of reading a reply while drop is set.
type replyDropConn struct {
	net.Conn
	drop *atomic.Bool
}

func (c *replyDropConn) Read(b []byte) (int, error) {
	if c.drop.Load() {
		// Give the server time to execute the request already written, then cut.
		time.Sleep(50 * time.Millisecond)
		_ = c.Conn.Close()
		return 0, net.ErrClosed
	}
	return c.Conn.Read(b)
}

func TestProducerClose(t *testing.T) {
	client, _ := miniRedis(t)
	ctx := context.Background()
	q := queueName(t)
	p, err := NewProducer[string, string](client, q, &ProducerOptions{Logger: testLogger(t)})
	require.NoError(t, err)
	pr, err := p.Produce(ctx, "pending", "x")
	require.NoError(t, err)
	require.NoError(t, p.Close())
	require.NoError(t, p.Close(), "Close is idempotent")
	_, err = pr.Wait(ctx)
	require.ErrorIs(t, err, ErrClosed)
	_, err = p.Produce(ctx, "later", "x")
	require.ErrorIs(t, err, ErrClosed)
	require.ErrorIs(t, p.Enqueue(ctx, "later", "x"), ErrClosed)
	_, err = p.ProduceBatch(ctx, []Job[string]{{ID: "later", Request: "x"}})
	require.ErrorIs(t, err, ErrClosed)
}

func TestProducerCloseFlushesAccepted(t *testing.T) {
	client := realRedis(t)
	ctx := context.Background()
	q := queueName(t)
	p, err := NewProducer[int, int](client, q, &ProducerOptions{Logger: testLogger(t)})
	require.NoError(t, err)
	var wg sync.WaitGroup
	var ok atomic.Int64
	for i := range 500 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if p.Enqueue(ctx, fmt.Sprint(i), i) == nil {
				ok.Add(1)
			}
		}()
	}
	// Close while calls are in flight: every call that returned nil is in Redis.
	require.NoError(t, p.Close())
	wg.Wait()
	require.Equal(t, ok.Load(), client.XLen(ctx, "streamq:{"+q+"}:stream").Val())
}
