package streamq

import (
	"context"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/streamq/streamq/internal/keys"
	"github.com/streamq/streamq/internal/scripts"
)

// leaseStall is a go-redis hook that holds every lease.lua call on one
// stream (its KEYS[1]) until the test releases it or the call's ctx ends,
// as a hung cluster node or a connection stalled until ReadTimeout would.
// lease.lua calls on other streams pass, and are counted while a call is
// held.
type leaseStall struct {
	stream  string
	release chan struct{} // closed by the test
	once    sync.Once
	held    chan struct{} // closed when the first call is held
	holding atomic.Bool
	others  atomic.Int64 // other streams' lease.lua calls answered while one was held
}

func newLeaseStall(stream string) *leaseStall {
	return &leaseStall{stream: stream, release: make(chan struct{}), held: make(chan struct{})}
}

func (h *leaseStall) DialHook(next redis.DialHook) redis.DialHook { return next }

func (h *leaseStall) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}

func (h *leaseStall) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		args := cmd.Args()
		if len(args) < 4 || !isScript(args, scripts.Lease) {
			return next(ctx, cmd)
		}
		if !isScriptOn(args, h.stream, scripts.Lease) {
			err := next(ctx, cmd)
			if err == nil && h.holding.Load() {
				h.others.Add(1)
			}
			return err
		}
		h.once.Do(func() { h.holding.Store(true); close(h.held) })
		select {
		case <-h.release:
		case <-ctx.Done():
			cmd.SetErr(ctx.Err())
			return ctx.Err()
		}
		return next(ctx, cmd)
	}
}

func (h *leaseStall) unblock() {
	select {
	case <-h.release:
	default:
		h.holding.Store(false)
		close(h.release)
	}
}

// TestStalledLeaseOfOneShardDelaysNoOther: the lease renewals of a
// consumer's shard 0 hang (its node or connection stalled) while a handler
// of shard 1 runs for three times MinIdle and another consumer runs claim
// passes. Shard 1's renewals go on, so its job runs once, on the first
// consumer, with its context never cancelled. Before, renewals went shard by
// shard on the lease goroutine: shard 1's waited behind shard 0's hung call,
// its lease lapsed, and the other consumer claimed and ran the job.
func TestStalledLeaseOfOneShardDelaysNoOther(t *testing.T) {
	t.Parallel()
	base := realRedis(t)
	ctx := context.Background()
	q := queueName(t)
	shards, err := keys.Shards(q, 2)
	require.NoError(t, err)
	const minIdle = 2 * time.Second
	stall := newLeaseStall(shards[0].Stream)
	clientA := sameServer(base)
	t.Cleanup(func() { _ = clientA.Close() })
	clientA.AddHook(stall)

	stuck, long := idOnShard(0, "stuck"), idOnShard(1, "long")
	var mu sync.Mutex
	runsA, runsB := map[string]int{}, map[string]int{}
	causes := map[string]error{}
	started := make(chan struct{}, 2)
	optsA := fastOpts(t, "A", minIdle)
	optsA.Shards, optsA.Workers = 2, 2
	a, err := NewConsumer(clientA, q, func(ctx context.Context, m *Message[string]) (string, error) {
		mu.Lock()
		runsA[m.ID]++
		mu.Unlock()
		select {
		case started <- struct{}{}:
		default:
		}
		select {
		case <-time.After(3 * minIdle): // the work itself
		case <-ctx.Done():
		}
		mu.Lock()
		causes[m.ID] = context.Cause(ctx)
		mu.Unlock()
		return "A:" + m.Payload, nil
	}, optsA)
	require.NoError(t, err)
	runConsumer(t, a)
	t.Cleanup(stall.unblock) // before A stops

	p, err := NewProducer[string, string](base, q, &ProducerOptions{Shards: 2, Logger: testLogger(t)})
	require.NoError(t, err)
	t.Cleanup(func() { _ = p.Close() })
	_, err = p.Produce(ctx, stuck, "s")
	require.NoError(t, err)
	prLong, err := p.Produce(ctx, long, "l")
	require.NoError(t, err)
	for range 2 {
		<-started
	}
	select {
	case <-stall.held:
	case <-time.After(10 * time.Second):
		t.Fatal("no lease renewal of shard 0 was sent")
	}

	optsB := fastOpts(t, "B", minIdle)
	optsB.Shards = 2
	b, err := NewConsumer(base, q, func(ctx context.Context, m *Message[string]) (string, error) {
		mu.Lock()
		runsB[m.ID]++
		mu.Unlock()
		return "B:" + m.Payload, nil
	}, optsB)
	require.NoError(t, err)
	runConsumer(t, b)        // claims every 100 ms
	t.Cleanup(stall.unblock) // before either stops

	got, err := prLong.Wait(waitCtx(t, 30*time.Second))
	require.NoError(t, err)
	mu.Lock()
	defer mu.Unlock()
	require.Equal(t, "A:l", got, "shard 1's job was claimed by the other consumer while shard 0's renewal hung")
	require.Equal(t, 1, runsA[long], "runs of shard 1's job on the consumer that read it")
	require.Zero(t, runsB[long], "the other consumer ran shard 1's job")
	require.NoError(t, causes[long], "shard 1's handler was cancelled")
	t.Logf("shard 1's leases renewed %d times while shard 0's renewal hung", stall.others.Load())
	require.NotZero(t, stall.others.Load(), "no renewal of shard 1 while shard 0's hung")
}

// TestStalledLeaseOfOneShardHoldsNoOtherRelease: a consumer stops while the
// lease renewal of its shard 0 hangs and it holds prefetched entries of
// shard 1 that never started. Shard 1's entries are released at once, and
// the next consumer runs them long before its MinIdle (30 s). Before, the
// release waited for the renewal in flight (run.renewing) until shutdown's
// hard bound, and then failed with the cancelled background context.
func TestStalledLeaseOfOneShardHoldsNoOtherRelease(t *testing.T) {
	t.Parallel()
	base := realRedis(t)
	ctx := context.Background()
	q := queueName(t)
	shards, err := keys.Shards(q, 2)
	require.NoError(t, err)
	stall := newLeaseStall(shards[0].Stream)
	clientA := sameServer(base)
	t.Cleanup(func() { _ = clientA.Close() })
	clientA.AddHook(stall)

	p, err := NewProducer[string, string](base, q, &ProducerOptions{Shards: 2, Logger: testLogger(t)})
	require.NoError(t, err)
	t.Cleanup(func() { _ = p.Close() })
	_, err = p.Produce(ctx, idOnShard(0, "stuck"), "p-stuck")
	require.NoError(t, err)
	var ids []string
	var prs []*Promise[string]
	for i := 0; len(ids) < 4; i++ {
		id := idOnShard(1, "job"+strconv.Itoa(i)+"-")
		if slices.Contains(ids, id) {
			continue
		}
		pr, err := p.Produce(ctx, id, "p-"+id)
		require.NoError(t, err)
		ids, prs = append(ids, id), append(prs, pr)
	}

	// A runs one job at a time and holds the other four entries unstarted;
	// its first renewal (after MinIdle/3) hangs on shard 0.
	release := make(chan struct{})
	started := make(chan struct{}, 1)
	optsA := fastOpts(t, "A", 3*time.Second)
	optsA.Shards, optsA.Workers, optsA.Prefetch, optsA.holdPrefetch = 2, 1, 8, true
	optsA.ShutdownTimeout = 2 * time.Second
	a, err := NewConsumer(clientA, q, func(ctx context.Context, m *Message[string]) (string, error) {
		select {
		case started <- struct{}{}:
		default:
		}
		<-release
		return "r:" + m.Payload, nil
	}, optsA)
	require.NoError(t, err)
	ctxA, cancelA := context.WithCancel(ctx)
	doneA := make(chan error, 1)
	go func() { doneA <- a.Run(ctxA) }()
	stopA := func() {
		cancelA() // first: the workers start nothing more
		select {
		case <-release:
		default:
			close(release)
		}
		select {
		case err := <-doneA:
			require.NoError(t, err)
		case <-time.After(30 * time.Second):
			t.Error("A did not stop within 30s")
		}
		a.waitBackground()
	}
	t.Cleanup(func() {
		if ctxA.Err() == nil {
			stall.unblock()
			stopA()
		}
	})
	<-started
	eventually(t, 10*time.Second, func() bool {
		n := int64(0)
		for _, k := range shards {
			sum, err := base.XPending(ctx, k.Stream, DefaultGroup).Result()
			if err != nil {
				return false
			}
			n += sum.Consumers["A"]
		}
		return n == 5
	}, "A never held all five entries")
	select {
	case <-stall.held:
	case <-time.After(10 * time.Second):
		t.Fatal("no lease renewal of shard 0 was sent")
	}
	stopA()

	h := newStartsHandler()
	optsB := fastOpts(t, "B", 30*time.Second)
	optsB.Shards = 2
	b, err := NewConsumer(base, q, h.handle, optsB)
	require.NoError(t, err)
	runConsumer(t, b)
	wctx := waitCtx(t, 10*time.Second)
	for i, pr := range prs {
		got, err := pr.Wait(wctx)
		require.NoError(t, err, "shard 1's id %s was not released while shard 0's renewal hung", ids[i])
		require.Equal(t, "r:p-"+ids[i], got)
	}
	// At least three never started on A (its one worker ran one job), and
	// B ran each of those as a first start: the release counted nothing.
	h.mu.Lock()
	defer h.mu.Unlock()
	onB := 0
	for _, id := range ids {
		if seen := h.seen[id]; seen != nil {
			require.Equal(t, []int{1}, seen, "Deliveries seen by the runs of %s", id)
			onB++
		}
	}
	require.GreaterOrEqual(t, onB, 3, "shard 1's released entries run by the next consumer")
}
