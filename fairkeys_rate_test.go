package streamq

import (
	"context"
	"errors"
	"fmt"
	"sort"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/streamq/streamq/internal/keys"
	"github.com/streamq/streamq/internal/scripts"
)

// TestFairKeysRateLimit: every key's rate (ConsumerOptions.KeyRate, 10 per
// second, burst 2) holds key A's backlog of 30 jobs to its rate, counted
// on the Redis server's clock (the ids of its entries, stamped at their
// append): in any second at most 10 + 2 appends, and the backlog spans at
// least 2.8 s. Key B, lifted by its own rate (Admin.SetKeyRate), produced
// behind A's backlog, drains while A's backlog still waits: A's rate holds
// back no other key. A held key is woken at its time by the promoter (no
// release or produce pumps it after B drained), KeyStats shows its rate
// and that it is held, and nothing of the keys is left after the drain.
func TestFairKeysRateLimit(t *testing.T) {
	t.Parallel()
	client := realRedis(t)
	ctx := context.Background()
	q := queueName(t)
	p := newStringProducer(t, client, q)
	a, err := NewAdmin(client, q, nil)
	require.NoError(t, err)

	const perKey, n, burst, backlog = time.Second, 10, 2, 30
	var mu sync.Mutex
	var aAppends []int64
	aStartedAtBDone := -1
	bDone := 0
	opts := fastOpts(t, "rate", 30*time.Second)
	opts.Workers = 4
	opts.KeyRate = &RateLimit{N: n, Per: perKey, Burst: burst}
	c, err := NewConsumer(client, q, func(ctx context.Context, m *Message[string]) (string, error) {
		mu.Lock()
		defer mu.Unlock()
		switch m.Key {
		case "A":
			aAppends = append(aAppends, entryMillis(t, m.EntryID))
		case "B":
			bDone++
			if bDone == 20 {
				aStartedAtBDone = len(aAppends)
			}
		}
		return "", nil
	}, opts)
	require.NoError(t, err)
	require.NoError(t, c.writeKeySettings(ctx)) // KeyRate before the first produce
	require.NoError(t, a.SetKeyRate(ctx, "B", &RateLimit{N: 100000, Per: time.Second, Burst: 1000}))

	// A's backlog in one call (one clock reading): Burst jobs enter the
	// stream, the key is held for the rest.
	var jobs []Job[string]
	for i := range backlog {
		jobs = append(jobs, Job[string]{ID: fmt.Sprint("a", i), Request: "x", Options: []ProduceOption{Key("A")}})
	}
	promises, err := p.ProduceBatch(ctx, jobs)
	require.NoError(t, err)
	for i := range 20 {
		promises = append(promises, mustProduce(t, p, fmt.Sprint("b", i), "x", Key("B")))
	}
	st, err := a.KeyStats(ctx, "A")
	require.NoError(t, err)
	require.Equal(t, &RateLimit{N: n, Per: perKey, Burst: burst}, st.Rate)
	require.True(t, st.Held, "key A over its rate is held: %+v", st)
	top, err := a.TopKeys(ctx, 5)
	require.NoError(t, err)
	require.Equal(t, "A", top[0].Key)
	require.True(t, top[0].Held)

	runConsumer(t, c)
	for _, pr := range promises {
		_, err := pr.Wait(waitCtx(t, 30*time.Second))
		require.NoError(t, err, pr.ID())
	}
	mu.Lock()
	t.Logf("when key B drained, %d of key A's %d jobs had started", aStartedAtBDone, backlog)
	require.GreaterOrEqual(t, aStartedAtBDone, 0)
	require.Less(t, aStartedAtBDone, backlog, "key B waited for key A's backlog")
	ms := append([]int64(nil), aAppends...)
	mu.Unlock()
	require.Len(t, ms, backlog)
	sort.Slice(ms, func(i, j int) bool { return ms[i] < ms[j] })
	for i := range ms {
		in := sort.Search(len(ms), func(j int) bool { return ms[j] >= ms[i]+perKey.Milliseconds() }) - i
		require.LessOrEqual(t, in, n+burst, "key A's appends in the second from %d", ms[i])
	}
	span := time.Duration(ms[len(ms)-1]-ms[0]) * time.Millisecond
	t.Logf("key A's %d appends spanned %v on the server's clock", backlog, span)
	require.GreaterOrEqual(t, span, time.Duration(backlog-burst)*perKey/n-time.Millisecond)
	eventually(t, 10*time.Second, func() bool { return len(fairKeysLeft(t, client, q)) == 1 },
		"fair-queuing keys left after the drain: %v", fairKeysLeft(t, client, q))
	require.Equal(t, []string{fmt.Sprintf("streamq:{%s}:keys:cfg", q)}, fairKeysLeft(t, client, q))
}

// TestFairKeysRateInvalid: a per-key rate is validated as RateLimit, at
// NewConsumer and by Admin.SetKeyRate.
func TestFairKeysRateInvalid(t *testing.T) {
	client, _ := miniRedis(t)
	q := queueName(t)
	for _, rl := range []*RateLimit{{N: 0, Per: time.Second}, {N: 1}, {N: 2, Per: time.Second, Burst: 3}} {
		_, err := NewConsumer(client, q, func(ctx context.Context, m *Message[string]) (string, error) { return "", nil },
			&ConsumerOptions{KeyRate: rl})
		require.ErrorIs(t, err, ErrInvalidOptions)
		require.Contains(t, err.Error(), "KeyRate")
		a, err := NewAdmin(client, q, nil)
		require.NoError(t, err)
		err = a.SetKeyRate(context.Background(), "k", rl)
		require.True(t, errors.Is(err, ErrInvalidOptions), "%v", err)
	}
}

// TestFairKeysRateChange: a key held back by its own rate (1 per hour)
// runs its waiting jobs at once when an operator removes that rate, and
// nothing of the keys is left after the drain, the rate's state included.
func TestFairKeysRateChange(t *testing.T) {
	t.Parallel()
	client := realRedis(t)
	ctx := context.Background()
	q := queueName(t)
	p := newStringProducer(t, client, q)
	a, err := NewAdmin(client, q, nil)
	require.NoError(t, err)
	require.NoError(t, a.SetKeyRate(ctx, "slow", &RateLimit{N: 1, Per: time.Hour}))
	c, err := NewConsumer(client, q, func(ctx context.Context, m *Message[string]) (string, error) { return "", nil },
		fastOpts(t, "rate-change", 30*time.Second))
	require.NoError(t, err)
	runConsumer(t, c)
	var promises []*Promise[string]
	for i := range 3 {
		promises = append(promises, mustProduce(t, p, fmt.Sprint("s", i), "x", Key("slow")))
	}
	_, err = promises[0].Wait(waitCtx(t, 10*time.Second))
	require.NoError(t, err)
	st, err := a.KeyStats(ctx, "slow")
	require.NoError(t, err)
	require.True(t, st.Held, "%+v", st)
	require.Equal(t, int64(2), st.Waiting)
	require.NoError(t, a.SetKeyRate(ctx, "slow", nil))
	for _, pr := range promises[1:] {
		_, err := pr.Wait(waitCtx(t, 10*time.Second))
		require.NoError(t, err)
	}
	// The key's rate was the only setting: the settings hash goes with it.
	eventually(t, 10*time.Second, func() bool { return len(fairKeysLeft(t, client, q)) == 0 },
		"fair-queuing keys left after the drain: %v", fairKeysLeft(t, client, q))
}

// Keys that their rate held back go back into the ring in bounded chunks:
// promote.lua moved every due key of keys:timed in one ZREM and one RPUSH,
// and Lua's unpack refuses more than about 8,000 values, so 9,000 keys due
// at once (every key of a busy queue under one KeyRate) failed every
// promote.lua call of the shard: no scheduled job, retry or held key ran
// again until an operator stepped in.
func TestFairKeysManyTimedKeysPromote(t *testing.T) {
	t.Parallel()
	client := realRedis(t)
	ctx := context.Background()
	k, err := keys.New(queueName(t))
	require.NoError(t, err)
	timed := k.KeysTimed()
	const n = 9000
	holdKeys(t, client, timed, n)
	keyList := []string{k.Stream, k.Schedule, k.ScheduleData, k.Retry, k.Stream, k.Stream,
		k.LevelStream(levelNames[levelHigh]), k.LevelStream(levelNames[levelLow])}
	for range n/1000 + 2 {
		_, err := scripts.Promote.Run(ctx, client, keyList, promoteBatch, startsTTL.Milliseconds(),
			"", 0, k.Wake, "PUBLISH").Int64Slice()
		require.NoError(t, err)
	}
	// The keys have nothing waiting: each left the ring at its turn.
	require.Zero(t, client.Exists(ctx, timed, k.KeysReady()).Val(), "keys left in keys:timed or keys:ready")
}

// holdKeys puts n keys (with nothing waiting) in keys:timed, due long ago.
func holdKeys(t *testing.T, client *redis.Client, timed string, n int) {
	t.Helper()
	members := make([]redis.Z, n)
	for i := range members {
		members[i] = redis.Z{Score: 1, Member: fmt.Sprintf("key-%d", i)}
	}
	require.NoError(t, client.ZAdd(context.Background(), timed, members...).Err())
}

// The same for a change of the queue's defaults, which puts every held key
// back into the ring (fairadmin.lua): one RPUSH of them all failed past
// about 8,000 keys, so SetKeyRateDefault and SetKeyDefaults did nothing.
func TestFairKeysManyTimedKeysDefaultsChange(t *testing.T) {
	t.Parallel()
	client := realRedis(t)
	ctx := context.Background()
	q := queueName(t)
	k, err := keys.New(q)
	require.NoError(t, err)
	a, err := NewAdmin(client, q, nil)
	require.NoError(t, err)
	holdKeys(t, client, k.KeysTimed(), 9000)
	require.NoError(t, a.SetKeyRateDefault(ctx, nil))
	require.Zero(t, client.Exists(ctx, k.KeysTimed(), k.KeysReady()).Val(), "keys left in keys:timed or keys:ready")
}

// TopKeys looks at a bounded number of keys per shard: with 10,000 keys in
// the ring it read every one of them (an LLEN, HGET, ZSCORE each), 37-56 ms
// of the server per call, which the dashboard makes every 2 s.
func TestAdminTopKeysBoundedWork(t *testing.T) {
	t.Parallel()
	client := privateRedis(t)
	ctx := context.Background()

	q := queueName(t)
	k, err := keys.New(q)
	require.NoError(t, err)
	pipe := client.Pipeline()
	const n = 10000
	for i := range n {
		key := fmt.Sprintf("key-%d", i)
		for range i % 3 { // 0 to 2 more jobs: key-2, key-5, ... wait longest
			pipe.RPush(ctx, k.KeyQueue(key), "x")
		}
		pipe.RPush(ctx, k.KeyQueue(key), "x")
		pipe.RPush(ctx, k.KeysReady(), key)
	}
	_, err = pipe.Exec(ctx)
	require.NoError(t, err)
	a, err := NewAdmin(client, q, nil)
	require.NoError(t, err)

	var top []KeyStat
	d := commandDelta(t, client, func() {
		top, err = a.TopKeys(ctx, 10)
		require.NoError(t, err)
	})
	require.LessOrEqual(t, d["llen"], int64(2000), "keys looked at: %v", d)
	require.Len(t, top, 10)
	for _, s := range top {
		require.Equal(t, int64(3), s.Waiting, "%+v", s) // the deepest among those looked at
	}
	// A key beyond the scan is still read exactly by KeyStats.
	st, err := a.KeyStats(ctx, fmt.Sprintf("key-%d", n-1))
	require.NoError(t, err)
	require.Equal(t, int64(1+(n-1)%3), st.Waiting)
}
