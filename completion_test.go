package streamq

import (
	"context"
	"crypto/sha1"
	"encoding/hex"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/streamq/streamq/internal/keys"
	"github.com/streamq/streamq/internal/redistest"
	"github.com/streamq/streamq/internal/scripts"
)

// completeFault fails runs of complete.lua whose first key is one of the
// given streams (while enabled), and counts the runs that failed for any reason.
type completeFault struct {
	mu      sync.Mutex
	streams map[string]bool
	failed  atomic.Int64
}

func (h *completeFault) set(streams ...string) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.streams = map[string]bool{}
	for _, s := range streams {
		h.streams[s] = true
	}
}

func (h *completeFault) DialHook(next redis.DialHook) redis.DialHook { return next }

// ProcessPipelineHook fails the complete.lua calls of a pipeline (the
// committer's ticks) as ProcessHook does, and sends the rest.
func (h *completeFault) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		rest := cmds[:0:0]
		var complete []redis.Cmder
		for _, cmd := range cmds {
			if h.injected(cmd) {
				continue
			}
			if isScript(cmd.Args(), scripts.Complete) {
				complete = append(complete, cmd)
			}
			rest = append(rest, cmd)
		}
		if len(rest) == 0 {
			return cmds[0].Err()
		}
		err := next(ctx, rest)
		for _, cmd := range complete {
			if cmd.Err() != nil {
				h.failed.Add(1)
			}
		}
		return err
	}
}

// injected fails cmd when it is a complete.lua call on a failing stream.
func (h *completeFault) injected(cmd redis.Cmder) bool {
	args := cmd.Args()
	if len(args) < 4 || !isScript(args, scripts.Complete) {
		return false
	}
	stream, _ := args[3].(string)
	h.mu.Lock()
	fail := h.streams[stream]
	h.mu.Unlock()
	if fail {
		h.failed.Add(1)
		cmd.SetErr(errors.New("injected fault: shard unreachable"))
	}
	return fail
}

func (h *completeFault) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if h.injected(cmd) {
			return cmd.Err()
		}
		err := next(ctx, cmd)
		if err != nil && len(cmd.Args()) >= 4 && isScript(cmd.Args(), scripts.Complete) {
			h.failed.Add(1)
		}
		return err
	}
}

// isScriptOn reports whether an EVAL/EVALSHA command runs one of ss with
// stream as its first key.
func isScriptOn(args []any, stream string, ss ...*redis.Script) bool {
	if len(args) < 4 {
		return false
	}
	if key, _ := args[3].(string); key != stream { // KEYS[1]
		return false
	}
	for _, s := range ss {
		if isScript(args, s) {
			return true
		}
	}
	return false
}

// isScript reports whether an EVAL/EVALSHA command runs s.
func isScript(args []any, s *redis.Script) bool {
	name, _ := args[0].(string)
	body, _ := args[1].(string)
	switch strings.ToLower(name) {
	case "evalsha":
		return body == s.Hash()
	case "eval":
		sum := sha1.Sum([]byte(body))
		return hex.EncodeToString(sum[:]) == s.Hash()
	}
	return false
}

// TestFailingShardStallsOnlyItself: shard 1's completions fail; shard 0 keeps
// completing, and the entries the consumer holds never exceed Prefetch. With
// batches that do not fill, a worker whose next start travelled with a shard
// 1 result waited behind the failing send until shutdown, and so, one by one,
// did every worker.
func TestFailingShardStallsOnlyItself(t *testing.T) {
	for _, batch := range []int{4, 2, 0} {
		t.Run(fmt.Sprintf("MaxCompleteBatch=%d", batch), func(t *testing.T) { testFailingShardStallsOnlyItself(t, batch) })
	}
}

func testFailingShardStallsOnlyItself(t *testing.T, completeBatch int) {
	ctx := context.Background()
	base := realRedis(t)
	client := sameServer(base)
	t.Cleanup(func() { _ = client.Close() })
	q := queueName(t)
	shards, err := keys.Shards(q, 2)
	require.NoError(t, err)
	fault := &completeFault{}
	fault.set(shards[1].Stream)
	client.AddHook(fault)
	const prefetch = 32
	c, err := NewConsumer(client, q, func(ctx context.Context, m *Message[int]) (int, error) {
		return m.Payload, nil
	}, &ConsumerOptions{replyWait: true, Shards: 2, Workers: 8, Prefetch: prefetch, MaxCompleteBatch: completeBatch,
		ReadBlock: 50 * time.Millisecond, ShutdownTimeout: time.Second, Logger: testLogger(t)})
	require.NoError(t, err)
	stop := runConsumer(t, c)

	p, err := NewProducer[int, int](base, q, &ProducerOptions{Shards: 2, Logger: testLogger(t)})
	require.NoError(t, err)
	defer p.Close()
	const n = 1200
	var shard0 []*Promise[int]
	jobs := make([]Job[int], 0, 100)
	for i := 0; i < n; i++ {
		jobs = append(jobs, Job[int]{ID: "j" + strconv.Itoa(i), Request: i})
		if len(jobs) == cap(jobs) || i == n-1 {
			prs, err := p.ProduceBatch(ctx, jobs)
			require.NoError(t, err)
			for _, pr := range prs {
				if keys.ShardOf(pr.ID(), 2) == 0 {
					shard0 = append(shard0, pr)
				}
			}
			jobs = jobs[:0]
		}
	}

	// Sample what the consumer holds: entries read and not acknowledged.
	held := func() int64 {
		var total int64
		for _, k := range shards {
			s, err := base.XPending(ctx, k.Stream, DefaultGroup).Result()
			if err == nil {
				total += s.Count
			}
		}
		return total
	}
	var maxHeld atomic.Int64
	sampleDone := make(chan struct{})
	stopSampling := make(chan struct{})
	go func() {
		defer close(sampleDone)
		for {
			maxHeld.Store(max(maxHeld.Load(), held()))
			select {
			case <-stopSampling:
				return
			case <-time.After(2 * time.Millisecond):
			}
		}
	}()

	wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	completed := 0
	for _, pr := range shard0 {
		if _, err := pr.Wait(wctx); err != nil {
			break
		}
		completed++
	}
	close(stopSampling)
	<-sampleDone
	t.Logf("shard 0 completed %d of %d while shard 1 failed; max held %d (Prefetch %d)",
		completed, len(shard0), maxHeld.Load(), prefetch)
	require.Equal(t, len(shard0), completed, "shard 0 stalled while only shard 1 failed")
	require.LessOrEqual(t, maxHeld.Load(), int64(prefetch), "the consumer held more entries than Prefetch")
	require.Positive(t, fault.failed.Load(), "shard 1's completions were refused")

	// Shard 1 recovers: everything completes.
	fault.set()
	stop()
	c2, err := NewConsumer(client, q, func(ctx context.Context, m *Message[int]) (int, error) {
		return m.Payload, nil
	}, &ConsumerOptions{Shards: 2, Workers: 8, Prefetch: prefetch, MinIdle: 100 * time.Millisecond,
		ClaimInterval: 20 * time.Millisecond, ReadBlock: 50 * time.Millisecond, Logger: testLogger(t)})
	require.NoError(t, err)
	runConsumer(t, c2)
	eventually(t, 30*time.Second, func() bool { return held() == 0 }, "shard 1 drains once it recovers")
}

// TestFailingCompletionsDoNotHoldWorkers: while a shard's outcomes fail to
// record, a worker still starts what it holds (each start charged on its
// own), up to the places the consumer has. Before, a start that travelled
// with a result waited behind the failing send: one worker stopped after
// three jobs and stayed stopped until shutdown.
func TestFailingCompletionsDoNotHoldWorkers(t *testing.T) {
	ctx := context.Background()
	base := realRedis(t)
	client := sameServer(base)
	t.Cleanup(func() { _ = client.Close() })
	q := queueName(t)
	fault := &completeFault{}
	fault.set(streamKey(q))
	client.AddHook(fault)

	const prefetch = 8
	p, err := NewProducer[int, int](base, q, &ProducerOptions{Logger: testLogger(t)})
	require.NoError(t, err)
	defer p.Close()
	jobs := make([]Job[int], 20)
	for i := range jobs {
		jobs[i] = Job[int]{ID: "j" + strconv.Itoa(i), Request: i}
	}
	_, err = p.ProduceBatch(ctx, jobs)
	require.NoError(t, err)

	var ran atomic.Int64
	c, err := NewConsumer(client, q, func(ctx context.Context, m *Message[int]) (int, error) {
		ran.Add(1)
		return m.Payload, nil
	}, &ConsumerOptions{replyWait: true, Workers: 1, Prefetch: prefetch, ReadBlock: 50 * time.Millisecond,
		ShutdownTimeout: time.Second, Logger: testLogger(t),
		holdPrefetch: true}) // the places are Prefetch, not what the read-ahead reached
	require.NoError(t, err)
	runConsumer(t, c)
	eventually(t, 10*time.Second, func() bool { return ran.Load() == prefetch },
		"the worker did not run the %d entries it could hold while outcomes failed", prefetch)
	require.Positive(t, fault.failed.Load())
}

// TestQueueDrainsUnderOOM: with maxmemory reached (noeviction), a consumer
// still starts (its group and shard count exist) and completes the queue.
func TestQueueDrainsUnderOOM(t *testing.T) {
	ctx := context.Background()
	srv := redistest.Start(t)
	client := srv.Client(t)
	q := queueName(t)
	// First use: the shard count and the group exist.
	warm, err := NewConsumer(client, q, func(ctx context.Context, m *Message[int]) (int, error) {
		return m.Payload, nil
	}, &ConsumerOptions{ReadBlock: 50 * time.Millisecond, Logger: testLogger(t)})
	require.NoError(t, err)
	stopWarm := runConsumer(t, warm)
	eventually(t, 10*time.Second, func() bool {
		g, err := client.XInfoGroups(ctx, "streamq:{"+q+"}:stream").Result()
		return err == nil && len(g) == 1
	}, "group created")
	stopWarm()

	p, err := NewProducer[int, int](client, q, &ProducerOptions{Logger: testLogger(t)})
	require.NoError(t, err)
	defer p.Close()
	const n = 300
	var prs []*Promise[int]
	for i := 0; i < n; i += 100 {
		jobs := make([]Job[int], 0, 100)
		for j := i; j < i+100; j++ {
			jobs = append(jobs, Job[int]{ID: "m" + strconv.Itoa(j), Request: j})
		}
		part, err := p.ProduceBatch(ctx, jobs)
		require.NoError(t, err)
		prs = append(prs, part...)
	}
	// Fill memory past 4 MB, then cap it there.
	pad := strings.Repeat("x", 1000)
	for i := 0; ; i++ {
		pipe := client.Pipeline()
		for j := range 500 {
			pipe.Set(ctx, fmt.Sprintf("junk:%d:%d", i, j), pad, 0)
		}
		_, err := pipe.Exec(ctx)
		require.NoError(t, err)
		if usedMemory(t, client) > 4<<20 {
			break
		}
	}
	require.NoError(t, client.ConfigSet(ctx, "maxmemory-policy", "noeviction").Err())
	require.NoError(t, client.ConfigSet(ctx, "maxmemory", "4mb").Err())
	t.Cleanup(func() { client.ConfigSet(context.Background(), "maxmemory", "0") })
	err = client.Set(ctx, "probe", "x", 0).Err()
	require.Error(t, err)
	require.Contains(t, err.Error(), "OOM", "the server refuses writes")

	// A delayed request's first write is its record: refused for memory, not
	// taken for another program's key (it was ErrWrongType).
	_, err = p.Produce(ctx, "later", 1, After(time.Hour))
	require.Error(t, err)
	require.NotErrorIs(t, err, ErrWrongType)
	require.Contains(t, err.Error(), "OOM")
	_, err = p.ProduceBatch(ctx, []Job[int]{{ID: "later2", Request: 2, Options: []ProduceOption{After(time.Hour)}}})
	require.Error(t, err)
	require.NotErrorIs(t, err, ErrWrongType)
	require.Contains(t, err.Error(), "OOM")
	// A duplicate writes nothing, so it is answered under OOM too.
	dup, err := p.Produce(ctx, "m0", 0)
	require.NoError(t, err)
	require.Equal(t, DedupInflight, dup.Deduplicated())
	dup.Release()

	c, err := NewConsumer(client, q, func(ctx context.Context, m *Message[int]) (int, error) {
		return m.Payload + 1, nil
	}, &ConsumerOptions{replyWait: true, ReadBlock: 50 * time.Millisecond, Logger: testLogger(t)})
	require.NoError(t, err)
	runConsumer(t, c)
	wctx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	for i, pr := range prs {
		got, err := pr.Wait(wctx)
		require.NoError(t, err, "request %d did not complete under OOM", i)
		require.Equal(t, i+1, got)
	}
	eventually(t, 10*time.Second, func() bool {
		return client.XLen(ctx, "streamq:{"+q+"}:stream").Val() == 0
	}, "the queue drains")
}

// TestRetriedCompletionWritesItsDeadLetter: the first completion attempt of a
// dead letter fails (the dead-letter key holds a string); once the key is
// fixed, the retry writes exactly one dead letter.
func TestRetriedCompletionWritesItsDeadLetter(t *testing.T) {
	ctx := context.Background()
	base := realRedis(t)
	client := sameServer(base)
	t.Cleanup(func() { _ = client.Close() })
	fault := &completeFault{}
	client.AddHook(fault)
	q := queueName(t)
	k, err := keys.New(q)
	require.NoError(t, err)
	require.NoError(t, base.Set(ctx, k.DeadLetter, "not a stream", 0).Err())

	c, err := NewConsumer(client, q, func(ctx context.Context, m *Message[int]) (int, error) {
		return 0, Permanent(errors.New("bad request"))
	}, &ConsumerOptions{replyWait: true, ReadBlock: 50 * time.Millisecond, Logger: testLogger(t)})
	require.NoError(t, err)
	runConsumer(t, c)
	p, err := NewProducer[int, int](base, q, &ProducerOptions{Logger: testLogger(t)})
	require.NoError(t, err)
	defer p.Close()
	pr, err := p.Produce(ctx, "poison", 1)
	require.NoError(t, err)
	eventually(t, 10*time.Second, func() bool { return fault.failed.Load() > 0 }, "a completion attempt failed")
	require.NoError(t, base.Del(ctx, k.DeadLetter).Err())

	wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	_, err = pr.Wait(wctx)
	require.ErrorIs(t, err, ErrDeadLettered)
	eventually(t, 10*time.Second, func() bool { return base.XPending(ctx, k.Stream, DefaultGroup).Val().Count == 0 },
		"the entry is acknowledged")
	dl, err := base.XRange(ctx, k.DeadLetter, "-", "+").Result()
	require.NoError(t, err, "the dead-letter stream exists")
	require.Len(t, dl, 1, "exactly one dead letter")
	require.Equal(t, "poison", dl[0].Values["id"])
}

// TestCompleteAfterScriptFlush: a server that lost its scripts (a restart,
// SCRIPT FLUSH) answers the committer's complete.lua call with NOSCRIPT;
// the call is sent again as an EVAL with the source, and the outcome is
// recorded.
func TestCompleteAfterScriptFlush(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	client := realRedis(t)
	q := queueName(t)
	p := newStringProducer(t, client, q)
	c, err := NewConsumer(client, q, func(_ context.Context, m *Message[string]) (string, error) {
		return "done " + m.Payload, nil
	}, &ConsumerOptions{Logger: testLogger(t), ReadBlock: 50 * time.Millisecond})
	require.NoError(t, err)
	runConsumer(t, c)
	for _, id := range []string{"a", "b"} {
		require.NoError(t, client.ScriptFlush(ctx).Err())
		pr, err := p.Produce(ctx, id, id)
		require.NoError(t, err)
		wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		got, err := pr.Wait(wctx)
		cancel()
		require.NoError(t, err)
		require.Equal(t, "done "+id, got)
	}
}

// TestRedeliveredEntryOfAFailingShardDoesNotHoldTheWorker: shard 1's
// outcomes fail to record. The one worker completes a job of shard 1 (its
// outcome waits), then takes a retry of shard 1 (a redelivered entry, which
// waits for the worker's last outcome of its shard before it starts). That
// wait must not hold the worker while the outcome cannot be recorded: a job
// of shard 0 produced meanwhile still runs. Before, the worker waited until
// Run ended, and shard 0 ran nothing.
func TestRedeliveredEntryOfAFailingShardDoesNotHoldTheWorker(t *testing.T) {
	ctx := context.Background()
	base := realRedis(t)
	client := sameServer(base)
	t.Cleanup(func() { _ = client.Close() })
	q := queueName(t)
	shards, err := keys.Shards(q, 2)
	require.NoError(t, err)
	fault := &completeFault{}
	fault.set(shards[1].Stream)
	client.AddHook(fault)
	idOn := func(shard int, prefix string) string {
		for i := 0; ; i++ {
			if id := prefix + strconv.Itoa(i); keys.ShardOf(id, 2) == shard {
				return id
			}
		}
	}
	retried, done, other := idOn(1, "retried"), idOn(1, "done"), idOn(0, "other")

	var mu sync.Mutex
	ran := map[string]int{}
	c, err := NewConsumer(client, q, func(ctx context.Context, m *Message[string]) (string, error) {
		mu.Lock()
		ran[m.ID]++
		mu.Unlock()
		if m.ID == retried && m.Deliveries == 1 {
			return "", RetryAfter(errors.New("once more"), 300*time.Millisecond)
		}
		return m.Payload, nil
	}, &ConsumerOptions{replyWait: true, Shards: 2, Workers: 1, Prefetch: 8,
		ReadBlock: 50 * time.Millisecond, ShutdownTimeout: time.Second, Logger: testLogger(t)})
	require.NoError(t, err)
	runConsumer(t, c)

	p, err := NewProducer[string, string](base, q, &ProducerOptions{Shards: 2, Logger: testLogger(t)})
	require.NoError(t, err)
	defer p.Close()
	// The retry's first attempt, then a job whose outcome cannot be recorded.
	_, err = p.ProduceBatch(ctx, []Job[string]{{ID: retried, Request: "r"}, {ID: done, Request: "d"}})
	require.NoError(t, err)
	ranOf := func(id string) int {
		mu.Lock()
		defer mu.Unlock()
		return ran[id]
	}
	eventually(t, 10*time.Second, func() bool { return ranOf(retried) == 1 && ranOf(done) == 1 },
		"both jobs of shard 1 ran once")
	// The retry is read again (the consumer holds it and the stuck job).
	eventually(t, 10*time.Second, func() bool {
		pending, err := base.XPendingExt(ctx, &redis.XPendingExtArgs{Stream: shards[1].Stream, Group: DefaultGroup,
			Start: "-", End: "+", Count: 10}).Result()
		if err != nil || len(pending) != 2 {
			return false
		}
		for _, pe := range pending {
			e, err := base.XRange(ctx, shards[1].Stream, pe.ID, pe.ID).Result()
			if err == nil && len(e) == 1 && e[0].Values[keys.FieldStarts] != nil {
				return true // the promoted retry, carrying its start count
			}
		}
		return false
	}, "the retry of shard 1 was read again")

	pr, err := p.Produce(ctx, other, "o")
	require.NoError(t, err)
	v, err := waitFor(t, pr)
	require.NoError(t, err, "a job of shard 0 did not run while a retry of failing shard 1 waited")
	require.Equal(t, "o", v)
	require.Positive(t, fault.failed.Load())
}
