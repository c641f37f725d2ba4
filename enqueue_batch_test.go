package streamq

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"
)

// cmdLog records every command a client sends, as text.
type cmdLog struct {
	mu   sync.Mutex
	cmds []string
}

func (h *cmdLog) DialHook(next redis.DialHook) redis.DialHook { return next }

func (h *cmdLog) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		h.see(cmd)
		return next(ctx, cmd)
	}
}

func (h *cmdLog) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		for _, cmd := range cmds {
			h.see(cmd)
		}
		return next(ctx, cmds)
	}
}

func (h *cmdLog) see(cmd redis.Cmder) {
	h.mu.Lock()
	h.cmds = append(h.cmds, fmt.Sprint(cmd.Args()...))
	h.mu.Unlock()
}

// scriptCalls returns the commands that ran a script (EVALSHA, EVAL), with
// from replaced by to.
func (h *cmdLog) scriptCalls(from, to string) []string {
	h.mu.Lock()
	defer h.mu.Unlock()
	var out []string
	for _, c := range h.cmds {
		if strings.HasPrefix(c, "evalsha") || strings.HasPrefix(c, "eval ") {
			out = append(out, strings.ReplaceAll(c, from, to))
		}
	}
	return out
}

// enqueueBatchJobs is a batch of every kind of job: plain, a duplicate id
// within the batch, delayed, high and low priority, with a deadline.
func enqueueBatchJobs(n int) []Job[string] {
	var jobs []Job[string]
	for i := range n {
		jobs = append(jobs, Job[string]{ID: fmt.Sprint("j-", i), Request: fmt.Sprint(i)})
	}
	return append(jobs,
		Job[string]{ID: "j-0", Request: "again"},
		Job[string]{ID: "later", Request: "x", Options: []ProduceOption{After(50 * time.Millisecond)}},
		Job[string]{ID: "high", Request: "x", Options: []ProduceOption{Priority(PriorityHigh)}},
		Job[string]{ID: "low", Request: "x", Options: []ProduceOption{Priority(PriorityLow)}},
		Job[string]{ID: "due", Request: "x", Options: []ProduceOption{Deadline(time.UnixMilli(4102444800000))}},
	)
}

// TestEnqueueBatchSendsProduceBatchsCalls: EnqueueBatch sends exactly the
// script calls ProduceBatch sends for the same jobs (one produce.lua call,
// all or nothing), and nothing for waiting: no subscription, no promise,
// nothing held by the producer once it returned. Every job then runs once.
func TestEnqueueBatchSendsProduceBatchsCalls(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	base := realRedis(t)
	logs := [2]*cmdLog{{}, {}}
	queues := [2]string{queueName(t) + "-produce", queueName(t) + "-enqueue"}
	var producers [2]*Producer[string, string]
	for i := range logs {
		client := sameServer(base)
		t.Cleanup(func() { _ = client.Close() })
		client.AddHook(logs[i])
		producers[i] = newStringProducer(t, client, queues[i])
		// An idle producer sends a batch on its own connection (direct.go).
		producers[i].direct.client.AddHook(logs[i])
	}
	const n = 200
	prs, err := producers[0].ProduceBatch(ctx, enqueueBatchJobs(n))
	require.NoError(t, err)
	for _, pr := range prs {
		pr.Release()
	}
	require.NoError(t, producers[1].EnqueueBatch(ctx, enqueueBatchJobs(n)))

	produced := logs[0].scriptCalls(queues[0], queues[1])
	enqueued := logs[1].scriptCalls(queues[1], queues[1])
	require.Len(t, enqueued, 1, "one produce.lua call: %v", enqueued)
	require.Equal(t, produced, enqueued, "the same script calls")
	require.False(t, producers[1].subscribed.Load(), "EnqueueBatch subscribed")
	require.Zero(t, producers[1].waiters.len(), "EnqueueBatch holds calls")

	var runs atomic.Int64
	c, err := NewConsumer(base, queues[1], func(ctx context.Context, m *Message[string]) (string, error) {
		runs.Add(1)
		return "", nil
	}, fastOpts(t, "w", 10*time.Second))
	require.NoError(t, err)
	stop := runConsumer(t, c)
	want := int64(n + 4) // the duplicate of j-0 is one request
	eventually(t, 20*time.Second, func() bool { return runs.Load() == want }, "not every job ran")
	stop()
	// Done ids are recorded as they are: nil error, nothing appended again.
	require.NoError(t, producers[1].EnqueueBatch(ctx, enqueueBatchJobs(3)))
	for _, s := range levelStreams(queues[1]) {
		require.Zero(t, base.XLen(ctx, s).Val(), "a done id was appended again to %s", s)
	}
	require.Equal(t, want, runs.Load())
}

// TestEnqueueBatchAllOrNothing: an EnqueueBatch with an invalid job (its
// record key holds another program's value) records none of its jobs, and
// says so; limits are checked before anything is sent.
func TestEnqueueBatchAllOrNothing(t *testing.T) {
	backends(t, func(t *testing.T, client *redis.Client) {
		ctx := context.Background()
		q := queueName(t)
		p := newStringProducer(t, client, q)
		require.NoError(t, client.HSet(ctx, recordKey(q, "taken"), "f", "v").Err())
		err := p.EnqueueBatch(ctx, []Job[string]{
			{ID: "a", Request: "x"},
			{ID: "b", Request: "x", Options: []ProduceOption{Priority(PriorityHigh)}},
			{ID: "taken", Request: "x"},
		})
		require.ErrorIs(t, err, ErrWrongType)
		for _, s := range levelStreams(q) {
			require.Zero(t, client.XLen(ctx, s).Val(), "%s", s)
		}
		require.Zero(t, client.Exists(ctx, recordKey(q, "a"), recordKey(q, "b")).Val())

		p2, err := NewProducer[string, string](client, q, &ProducerOptions{MaxBatchItems: 2, Logger: testLogger(t)})
		require.NoError(t, err)
		t.Cleanup(func() { _ = p2.Close() })
		err = p2.EnqueueBatch(ctx, enqueueBatchJobs(3))
		require.ErrorIs(t, err, ErrBatchTooLarge)
		require.ErrorContains(t, err, "split the batch")
		require.NoError(t, p.EnqueueBatch(ctx, nil))
	})
}

// TestEnqueueBatchInterceptors: a produce interceptor sees an EnqueueBatch's
// jobs, the headers it sets are stored with them, and it reads their entry
// ids after next.
func TestEnqueueBatchInterceptors(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	client := realRedis(t)
	q := queueName(t)
	var seen []*Outgoing
	p, err := NewProducer[string, string](client, q, &ProducerOptions{Logger: testLogger(t),
		Interceptors: []ProduceInterceptor{func(ctx context.Context, msgs []*Outgoing, next func(context.Context) error) error {
			for _, m := range msgs {
				m.Headers = map[string]string{"tenant": "t1"}
			}
			err := next(ctx)
			seen = msgs
			return err
		}}})
	require.NoError(t, err)
	t.Cleanup(func() { _ = p.Close() })
	require.NoError(t, p.EnqueueBatch(ctx, []Job[string]{{ID: "a", Request: "x"}, {ID: "b", Request: "y"}}))
	require.Len(t, seen, 2)
	entries, err := client.XRange(ctx, streamKey(q), "-", "+").Result()
	require.NoError(t, err)
	require.Len(t, entries, 2)
	for i, e := range entries {
		require.Equal(t, e.ID, seen[i].EntryID, "entry id of %s", seen[i].ID)
		require.Contains(t, fmt.Sprint(e.Values), "tenant")
	}
}
