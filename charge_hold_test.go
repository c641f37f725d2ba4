package streamq

import (
	"context"
	"errors"
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

// chargeFault fails the start charges of one start-count hash while on: an
// HSET of the hash, or a charge.lua call on it. The command is sent first,
// and Redis applies it; only its reply is replaced by an error, as when a
// reply is lost: the consumer cannot tell whether the start was counted.
type chargeFault struct {
	starts  string
	on      atomic.Bool
	failed  atomic.Int64 // commands
	entries atomic.Int64 // the entries they charged
}

// failingCharges returns a client of base's server on which every start
// charge of single-shard queue q fails (the fault is on), and the fault.
func failingCharges(t *testing.T, base *redis.Client, q string) (*redis.Client, *chargeFault) {
	t.Helper()
	client := sameServer(base)
	t.Cleanup(func() { _ = client.Close() })
	shards, err := keys.Shards(q, 1)
	require.NoError(t, err)
	fault := &chargeFault{starts: shards[0].Starts(DefaultGroup)}
	fault.on.Store(true)
	client.AddHook(fault)
	return client, fault
}

func (h *chargeFault) DialHook(next redis.DialHook) redis.DialHook { return next }

func (h *chargeFault) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		err := next(ctx, cmd)
		if h.inject(cmd) {
			return cmd.Err()
		}
		return err
	}
}

func (h *chargeFault) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		err := next(ctx, cmds)
		for _, cmd := range cmds {
			if h.inject(cmd) && err == nil {
				err = cmd.Err()
			}
		}
		return err
	}
}

// inject replaces cmd's reply by an error when it is a charge of the hash
// and the fault is on.
func (h *chargeFault) inject(cmd redis.Cmder) bool {
	if !h.on.Load() {
		return false
	}
	args := cmd.Args()
	name, _ := args[0].(string)
	charge, entries := false, 0
	switch {
	case name == "hset" && len(args) > 1:
		key, _ := args[1].(string)
		charge, entries = key == h.starts, (len(args)-2)/2
	case len(args) > 4 && isScript(args, scripts.Charge):
		key, _ := args[4].(string) // KEYS[2]
		charge, entries = key == h.starts, (len(args)-8)/2
	}
	if charge {
		h.failed.Add(1)
		h.entries.Add(int64(entries))
		cmd.SetErr(errors.New("injected fault: start charge failed"))
	}
	return charge
}

// idOnShard returns an id that prefix+n makes, of the given shard of two.
func idOnShard(shard int, prefix string) string {
	for i := 0; ; i++ {
		if id := prefix + strconv.Itoa(i); keys.ShardOf(id, 2) == shard {
			return id
		}
	}
}

// TestFailingStartChargeDoesNotHoldTheWorker: shard 1's start charges fail.
// The one worker takes a job of shard 1 first; its charge fails, and a job
// of shard 0 produced meanwhile must still run. Once shard 1's charges
// work again, its job runs, once, counted as its first start. Before, the
// worker retried the charge until Run ended, and shard 0 ran nothing.
// Cases: the plain HSET of a fresh entry's count and charge.lua (both with
// replies Redis applied but the consumer never saw), and a start-count key
// of the wrong type charged through charge.lua on the committer's own
// connections.
func TestFailingStartChargeDoesNotHoldTheWorker(t *testing.T) {
	for _, tc := range []struct {
		name       string
		checkOwner bool
		wrongType  bool
	}{
		{name: "hset"},
		{name: "charge.lua", checkOwner: true},
		{name: "wrongtype", checkOwner: true, wrongType: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			backends(t, func(t *testing.T, base *redis.Client) {
				testFailingStartCharge(t, base, tc.checkOwner, tc.wrongType)
			})
		})
	}
}

func testFailingStartCharge(t *testing.T, base *redis.Client, checkOwner, wrongType bool) {
	ctx := context.Background()
	client := sameServer(base)
	t.Cleanup(func() { _ = client.Close() })
	q := queueName(t)
	shards, err := keys.Shards(q, 2)
	require.NoError(t, err)
	starts := shards[1].Starts(DefaultGroup)
	fault := &chargeFault{starts: starts}
	if wrongType {
		require.NoError(t, base.Set(ctx, starts, "not a hash", 0).Err())
	} else {
		fault.on.Store(true)
		client.AddHook(fault)
	}
	stuck, other := idOnShard(1, "stuck"), idOnShard(0, "other")

	var mu sync.Mutex
	ran := map[string][]int{} // id: the Deliveries of each start
	c, err := NewConsumer(client, q, func(ctx context.Context, m *Message[string]) (string, error) {
		mu.Lock()
		ran[m.ID] = append(ran[m.ID], m.Deliveries)
		mu.Unlock()
		return m.Payload, nil
	}, &ConsumerOptions{replyWait: !wrongType, checkOwner: checkOwner, Shards: 2, Workers: 1, Prefetch: 8,
		ReadBlock: 50 * time.Millisecond, ShutdownTimeout: time.Second, Logger: testLogger(t)})
	require.NoError(t, err)
	runConsumer(t, c)
	ranOf := func(id string) []int {
		mu.Lock()
		defer mu.Unlock()
		return append([]int(nil), ran[id]...)
	}

	p, err := NewProducer[string, string](base, q, &ProducerOptions{Shards: 2, Logger: testLogger(t)})
	require.NoError(t, err)
	defer p.Close()
	prStuck, err := p.Produce(ctx, stuck, "s")
	require.NoError(t, err)
	// The consumer read it, and its only worker took it: nothing else was
	// in the ring.
	eventually(t, 10*time.Second, func() bool {
		n, err := base.XPending(ctx, shards[1].Stream, DefaultGroup).Result()
		return err == nil && n.Count == 1 && (wrongType || fault.failed.Load() > 0)
	}, "the job of shard 1 was read and its charge failed")

	pr, err := p.Produce(ctx, other, "o")
	require.NoError(t, err)
	v, err := waitFor(t, pr)
	require.NoError(t, err, "a job of shard 0 did not run while a start charge of shard 1 failed")
	require.Equal(t, "o", v)
	require.Empty(t, ranOf(stuck), "shard 1's job started while its charge failed")

	// Shard 1 recovers: its job runs, counted once.
	if wrongType {
		require.NoError(t, base.Del(ctx, starts).Err())
	} else {
		fault.on.Store(false)
	}
	v, err = waitFor(t, prStuck)
	require.NoError(t, err, "shard 1's job did not run after its charges worked again")
	require.Equal(t, "s", v)
	require.Equal(t, []int{1}, ranOf(stuck), "shard 1's job ran once, as its first start")
	require.Equal(t, []int{1}, ranOf(other))
	n, err := base.HExists(ctx, starts, mustEntryID(t, prStuck)).Result()
	require.NoError(t, err)
	require.False(t, n, "the completed entry's start count is left behind")
}

// mustEntryID returns the entry id of a produced request.
func mustEntryID(t *testing.T, pr *Promise[string]) string {
	t.Helper()
	id := pr.EntryID()
	require.NotEmpty(t, id)
	return id
}

// TestHeldStartIsReleasedAtShutdown: a job whose start charge failed (Redis
// counted it, the reply was lost) waits for its shard, not in a worker;
// when the consumer stops meanwhile, the entry is released as unstarted,
// and the release takes back the count Redis kept: the next consumer runs
// it as its first start.
func TestHeldStartIsReleasedAtShutdown(t *testing.T) {
	backends(t, func(t *testing.T, base *redis.Client) {
		ctx := context.Background()
		q := queueName(t)
		client, fault := failingCharges(t, base, q)
		h := newStartsHandler()
		optsA := fastOpts(t, "A", 30*time.Second)
		optsA.replyWait, optsA.Workers, optsA.MaxDeliveries, optsA.ShutdownTimeout = true, 1, 1, time.Second
		a, err := NewConsumer(client, q, h.handle, optsA)
		require.NoError(t, err)
		stop := runConsumer(t, a)
		ids := []string{"held"}
		prs := produceAll(t, newStringProducer(t, base, q), ids)
		eventually(t, 10*time.Second, func() bool { return fault.failed.Load() >= 2 },
			"the job's charge failed, and failed again when retried")
		stop()
		// Released: another consumer takes it at once, and it counts no
		// start (MaxDeliveries 1 would dead-letter it unrun).
		n, err := base.HExists(ctx, fault.starts, mustEntryID(t, prs[0])).Result()
		require.NoError(t, err)
		require.False(t, n, "the release did not take back the start count of the held job")
		optsB := fastOpts(t, "B", 30*time.Second)
		optsB.MaxDeliveries = 1
		b, err := NewConsumer(base, q, h.handle, optsB)
		require.NoError(t, err)
		runConsumer(t, b)
		requireResults(t, base, q, ids, prs, time.Now().Add(10*time.Second))
		h.requireFirstStarts(t, ids)
		requireNoDeadLetters(t, base, q)
	})
}

// TestMultiFailingStartChargeHoldsOnlyItsQueue: in a pool of one worker,
// queue A's start charges fail; queue B's requests still run, and A's runs
// once its charges work again.
func TestMultiFailingStartChargeHoldsOnlyItsQueue(t *testing.T) {
	t.Parallel()
	base := realRedis(t)
	qa, qb := queueName(t), queueName(t)
	client, fault := failingCharges(t, base, qa)
	var startsA atomic.Int64
	ca, err := NewConsumer(client, qa, func(ctx context.Context, m *Message[string]) (string, error) {
		startsA.Add(1)
		return "a:" + m.Payload, nil
	}, replyWaitOpts(fastOpts(t, "hold", 10*time.Second)))
	require.NoError(t, err)
	cb, err := NewConsumer(client, qb, func(ctx context.Context, m *Message[string]) (string, error) {
		return "b:" + m.Payload, nil
	}, replyWaitOpts(fastOpts(t, "hold", 10*time.Second)))
	require.NoError(t, err)
	m, err := NewMultiConsumer(&MultiOptions{Workers: 1},
		MultiQueue{Consumer: ca, Weight: 10}, MultiQueue{Consumer: cb, Weight: 1})
	require.NoError(t, err)
	runMulti(t, m)

	prA := mustProduce(t, newStringProducer(t, base, qa), "a0", "x")
	eventually(t, 10*time.Second, func() bool { return fault.failed.Load() > 0 }, "queue A's charge failed")
	prB := mustProduce(t, newStringProducer(t, base, qb), "b0", "y")
	v, err := waitFor(t, prB)
	require.NoError(t, err, "queue B's request did not run while queue A's start charge failed")
	require.Equal(t, "b:y", v)
	require.Zero(t, startsA.Load())
	fault.on.Store(false)
	v, err = waitFor(t, prA)
	require.NoError(t, err)
	require.Equal(t, "a:x", v)
	require.Equal(t, int64(1), startsA.Load())
}

// TestFailingShardIsChargedOneSlotAtATime: while a shard's start charges
// fail, its slots wait aside and one of them at a time is charged again,
// once per back-off, not all of them each time (with a node that does not
// answer, each would hold a worker for the client's timeout). Once charges
// work again, every job runs once, as its first start.
func TestFailingShardIsChargedOneSlotAtATime(t *testing.T) {
	t.Parallel()
	base := realRedis(t)
	q := queueName(t)
	client, fault := failingCharges(t, base, q)
	h := newStartsHandler()
	opts := fastOpts(t, "A", 30*time.Second)
	opts.replyWait, opts.Workers, opts.Prefetch = true, 4, 8
	c, err := NewConsumer(client, q, h.handle, opts)
	require.NoError(t, err)
	runConsumer(t, c)
	ids := []string{"j0", "j1", "j2", "j3", "j4", "j5"}
	prs := produceAll(t, newStringProducer(t, base, q), ids)
	eventually(t, 20*time.Second, func() bool { return fault.failed.Load() >= 6 }, "charges failed 6 times")
	// The first charges: at most one entry per worker (the others are held
	// once one failed); after them, one entry per failed charge (a probe
	// may share a tick with a first charge still queued: one more).
	extra := fault.entries.Load() - fault.failed.Load()
	t.Logf("%d charges of %d entries", fault.failed.Load(), fault.entries.Load())
	require.LessOrEqual(t, extra, int64(opts.Workers),
		"%d charges of %d entries: held slots were charged together", fault.failed.Load(), fault.entries.Load())
	fault.on.Store(false)
	requireResults(t, base, q, ids, prs, time.Now().Add(10*time.Second))
	h.requireFirstStarts(t, ids)
}
