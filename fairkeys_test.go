package streamq

import (
	"context"
	"errors"
	"fmt"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/streamq/streamq/internal/redistest"
)

// fairKeysLeft lists the fair-queuing keys of queue q that exist.
func fairKeysLeft(t *testing.T, client *redis.Client, q string) []string {
	t.Helper()
	ks, err := client.Keys(context.Background(), "streamq:{"+q+"}:keys:*").Result()
	require.NoError(t, err)
	sort.Strings(ks)
	return ks
}

// TestFairKeysRunEveryJobAndLeaveNothing: keyed jobs produced every way
// (Produce, Enqueue, Send, ProduceBatch, delayed, retried) run once each,
// their handlers see their key, their callers get their results, and once
// the queue drains no fair-queuing key is left in Redis.
func TestFairKeysRunEveryJobAndLeaveNothing(t *testing.T) {
	backends(t, func(t *testing.T, client *redis.Client) {
		ctx := context.Background()
		q := queueName(t)
		p := newStringProducer(t, client, q)
		var mu sync.Mutex
		keyOf := map[string]string{}
		runs := map[string]int{}
		opts := fastOpts(t, "fair", 5*time.Second)
		opts.Workers = 4
		opts.KeyWindow = 3
		opts.KeyLimit = 2
		c, err := NewConsumer(client, q, func(ctx context.Context, m *Message[string]) (string, error) {
			mu.Lock()
			keyOf[m.ID] = m.Key
			runs[m.ID]++
			n := runs[m.ID]
			mu.Unlock()
			if m.ID == "retry" && n == 1 {
				return "", RetryAfter(errors.New("again"), 10*time.Millisecond)
			}
			return "r:" + m.Payload, nil
		}, opts)
		require.NoError(t, err)
		var promises []*Promise[string]
		want := map[string]string{}
		for i := range 12 {
			id, key := fmt.Sprint("p", i), fmt.Sprint("k", i%3)
			want[id] = key
			promises = append(promises, mustProduce(t, p, id, id, Key(key)))
		}
		jobs := []Job[string]{}
		for i := range 6 {
			id, key := fmt.Sprint("b", i), fmt.Sprint("k", i%2)
			want[id] = key
			jobs = append(jobs, Job[string]{ID: id, Request: id, Options: []ProduceOption{Key(key)}})
		}
		bp, err := p.ProduceBatch(ctx, jobs)
		require.NoError(t, err)
		promises = append(promises, bp...)
		require.NoError(t, p.Enqueue(ctx, "e", "e", Key("k9")))
		want["e"] = "k9"
		require.NoError(t, p.Send(ctx, "s", "s", Key("k9")))
		want["s"] = "k9"
		promises = append(promises, mustProduce(t, p, "later", "later", Key("k1"), After(50*time.Millisecond)))
		want["later"] = "k1"
		promises = append(promises, mustProduce(t, p, "retry", "retry", Key("k0")))
		want["retry"] = "k0"
		promises = append(promises, mustProduce(t, p, "plain", "plain"))
		want["plain"] = ""
		runConsumer(t, c)
		for _, pr := range promises {
			v, err := pr.Wait(waitCtx(t, 20*time.Second))
			require.NoError(t, err)
			require.Equal(t, "r:"+pr.ID(), v)
		}
		eventually(t, 10*time.Second, func() bool {
			mu.Lock()
			defer mu.Unlock()
			return len(runs) == len(want)
		}, "not every job ran")
		require.NoError(t, p.Flush(ctx))
		mu.Lock()
		for id, key := range want {
			require.Equal(t, key, keyOf[id], "the key of %s", id)
			n := 1
			if id == "retry" {
				n = 2
			}
			require.Equal(t, n, runs[id], "runs of %s", id)
		}
		mu.Unlock()
		eventually(t, 5*time.Second, func() bool { return len(fairKeysLeft(t, client, q)) == 1 },
			"fair-queuing keys left after the drain: %v", fairKeysLeft(t, client, q))
		require.Equal(t, []string{"streamq:{" + q + "}:keys:cfg"}, fairKeysLeft(t, client, q), "only the settings stay")
	})
}

// TestFairKeysInvalid: keys follow the rules of ids, and combinations that
// keyed jobs do not support are refused before anything is sent.
func TestFairKeysInvalid(t *testing.T) {
	client, _ := miniRedis(t)
	p := newStringProducer(t, client, queueName(t))
	ctx := context.Background()
	for name, opts := range map[string][]ProduceOption{
		"empty":    {Key("")},
		"long":     {Key(string(make([]byte, MaxKeyLen+1)))},
		"throttle": {Key("a"), Throttle(time.Second)},
	} {
		_, err := p.Produce(ctx, "x", "x", opts...)
		require.ErrorIs(t, err, ErrInvalidOptions, name)
	}
	_, err := NewConsumer(client, queueName(t), func(ctx context.Context, m *Message[string]) (string, error) { return "", nil },
		&ConsumerOptions{KeyLimit: -1})
	require.ErrorIs(t, err, ErrInvalidOptions)
}

// TestFairKeysRoundRobin: with one worker and a window of one, a key's
// backlog and other keys' jobs start in turns: after the backlog's first
// jobs, every later key's job starts within one turn of the keys.
func TestFairKeysRoundRobin(t *testing.T) {
	backends(t, func(t *testing.T, client *redis.Client) {
		q := queueName(t)
		p := newStringProducer(t, client, q)
		// The window, stored before the jobs come.
		a, err := NewAdmin(client, q, nil)
		require.NoError(t, err)
		require.NoError(t, a.SetKeyDefaults(context.Background(), 0, 1))
		for i := range 20 {
			mustProduce(t, p, fmt.Sprint("a", i), "x", Key("A")).Release()
		}
		for _, k := range []string{"B", "C", "D"} {
			for i := range 3 {
				mustProduce(t, p, fmt.Sprint(k, i), "x", Key(k)).Release()
			}
		}
		var mu sync.Mutex
		var order []string
		opts := fastOpts(t, "rr", 5*time.Second)
		opts.KeyWindow = 1
		c, err := NewConsumer(client, q, func(ctx context.Context, m *Message[string]) (string, error) {
			mu.Lock()
			order = append(order, m.Key)
			mu.Unlock()
			return "", nil
		}, opts)
		require.NoError(t, err)
		runConsumer(t, c)
		eventually(t, 10*time.Second, func() bool { mu.Lock(); defer mu.Unlock(); return len(order) == 29 }, "not every job ran")
		mu.Lock()
		defer mu.Unlock()
		got := ""
		for _, k := range order {
			got += k
		}
		// The first A was appended at once (the window was free); then the
		// keys take turns in the order they first waited.
		require.Equal(t, "AABCDABCDABCD"+"AAAAAAAAAAAAAAAA", got)
	})
}

// TestFairKeysLimitParksKey: a key at its limit waits outside the stream
// while other keys run (no head-of-line blocking), and its slots come back
// with its outcomes.
func TestFairKeysLimitParksKey(t *testing.T) {
	backends(t, func(t *testing.T, client *redis.Client) {
		q := queueName(t)
		p := newStringProducer(t, client, q)
		release := make(chan struct{})
		var running, most atomic.Int64
		var others atomic.Int64
		opts := fastOpts(t, "limit", 5*time.Second)
		opts.Workers = 6
		opts.KeyLimit = 2
		c, err := NewConsumer(client, q, func(ctx context.Context, m *Message[string]) (string, error) {
			if m.Key != "slow" {
				others.Add(1)
				return "", nil
			}
			n := running.Add(1)
			for {
				old := most.Load()
				if n <= old || most.CompareAndSwap(old, n) {
					break
				}
			}
			<-release
			running.Add(-1)
			return "", nil
		}, opts)
		require.NoError(t, err)
		runConsumer(t, c)
		<-c.Ready() // KeyLimit is stored
		for i := range 6 {
			mustProduce(t, p, fmt.Sprint("slow", i), "x", Key("slow")).Release()
		}
		eventually(t, 10*time.Second, func() bool { return running.Load() == 2 }, "the slow key did not start")
		for i := range 20 {
			mustProduce(t, p, fmt.Sprint("fast", i), "x", Key(fmt.Sprint("f", i%4))).Release()
		}
		eventually(t, 10*time.Second, func() bool { return others.Load() == 20 }, "other keys were blocked by a key at its limit")
		require.Equal(t, int64(2), running.Load())
		close(release)
		eventually(t, 10*time.Second, func() bool { return len(fairKeysLeft(t, client, q)) == 1 }, "the slow key never drained")
		require.Equal(t, int64(2), most.Load(), "at most KeyLimit handlers of one key at once")
	})
}

// TestFairKeysAdmin: an operator sees the keys with the most waiting jobs
// and one key by name, pauses a key (its jobs wait, other keys run) and
// resumes it, and raises a key's limit.
func TestFairKeysAdmin(t *testing.T) {
	backends(t, func(t *testing.T, client *redis.Client) {
		ctx := context.Background()
		q := queueName(t)
		p := newStringProducer(t, client, q)
		a, err := NewAdmin(client, q, nil)
		require.NoError(t, err)
		require.NoError(t, a.PauseKey(ctx, "big"))
		for i := range 30 {
			mustProduce(t, p, fmt.Sprint("big", i), "x", Key("big")).Release()
		}
		for i := range 3 {
			mustProduce(t, p, fmt.Sprint("small", i), "x", Key("small")).Release()
		}
		top, err := a.TopKeys(ctx, 1)
		require.NoError(t, err)
		require.Equal(t, []KeyStat{{Key: "big", Waiting: 30, Paused: true, Weight: 1}}, top)
		small, err := a.KeyStats(ctx, "small")
		require.NoError(t, err)
		require.Equal(t, KeyStat{Key: "small", Running: 3, Weight: 1}, small, "a key with free slots appends at once")
		var bigRuns, smallRuns atomic.Int64
		c, err := NewConsumer(client, q, func(ctx context.Context, m *Message[string]) (string, error) {
			if m.Key == "big" {
				bigRuns.Add(1)
			} else {
				smallRuns.Add(1)
			}
			return "", nil
		}, fastOpts(t, "admin", 5*time.Second))
		require.NoError(t, err)
		runConsumer(t, c)
		eventually(t, 10*time.Second, func() bool { return smallRuns.Load() == 3 }, "the other key did not run")
		require.Zero(t, bigRuns.Load(), "a paused key's jobs wait")
		require.NoError(t, a.SetKeyLimit(ctx, "big", 5))
		require.NoError(t, a.ResumeKey(ctx, "big"))
		eventually(t, 10*time.Second, func() bool { return bigRuns.Load() == 30 }, "the resumed key did not drain")
		eventually(t, 10*time.Second, func() bool {
			st, err := a.KeyStats(ctx, "big")
			return err == nil && st.Running == 0
		}, "the slots of the drained key did not come back")
		st, err := a.KeyStats(ctx, "big")
		require.NoError(t, err)
		require.Equal(t, KeyStat{Key: "big", Limit: 5, Weight: 1}, st)
		top, err = a.TopKeys(ctx, 10)
		require.NoError(t, err)
		require.Empty(t, top, "a drained key is not stored")
	})
}

// TestFairKeysBacklogDoesNotDelayOtherKeys: key A has a backlog of 50,000
// jobs, then keys B..K get 10 jobs each, produced round by round; 8 workers,
// K = 11 keys with work, W = DefaultKeyWindow. Job j (0-based) of a key
// waits behind at most W + (j+1)·(K−1) + j other jobs that had not started
// when its produce returned and start before it in the stream's order:
//
//   - W: the entries holding slots when produce.lua ran. The job itself
//     waited (or, when the window had room and its key nothing waiting, took
//     a slot at once and has at most W−1 ahead of it).
//   - (j+1)·(K−1) + j: the entries appended after that and before the job.
//     At most j jobs of its key wait ahead of it (its key's earlier ones), so
//     it is appended at its key's (j+1)-th turn at the latest. A key with
//     waiting jobs stays in keys:ready, once (it enters only when its list is
//     created), and each turn LMOVEs the head to the end, a key that becomes
//     active entering at the end too: so before each of those turns every
//     other key takes at most one turn, K−1 in all, of one append (weight 1);
//     the j turns before its own append its key's j earlier jobs. While the
//     key waits, the ring is not empty, so the window is full after every
//     script (each release pumps until it is full or the ring empty): no job
//     appends at its produce meanwhile, and a complete.lua call that releases
//     n slots appends n jobs, still in turns.
//
// Only first starts (Deliveries 1) of entries with a smaller entry id count:
// a re-delivered entry starts again, and an entry appended after the job can
// start first, because workers take entries in stream order but their
// handlers begin in the order the Go and OS schedulers run them (a worker
// descheduled between its take and its handler is passed by whatever the
// others start meanwhile: 108 starts beside a CPU burner). The policy bounds
// neither, so both are logged, with the total starts and milliseconds before
// the worst job, not asserted.
func TestFairKeysBacklogDoesNotDelayOtherKeys(t *testing.T) {
	t.Parallel()
	client := realRedis(t)
	ctx := context.Background()
	q := queueName(t)
	p := newStringProducer(t, client, q)
	const backlog, perKey, workers = 50000, 10, 8
	others := []string{"B", "C", "D", "E", "F", "G", "H", "I", "J", "K"}
	for start := 0; start < backlog; start += 500 {
		batch := make([]Job[string], 0, 500)
		for i := start; i < start+500; i++ {
			batch = append(batch, Job[string]{ID: fmt.Sprint("a", i), Request: "x", Options: []ProduceOption{Key("A")}})
		}
		_, err := p.ProduceBatch(ctx, batch)
		require.NoError(t, err)
	}
	// started records every start in order (index n-1 for start n): the
	// entry id and whether it was a re-delivery.
	type startRec struct {
		eid   [2]uint64
		again bool
	}
	var starts atomic.Int64
	var mu sync.Mutex
	started := map[int64]startRec{}
	startedAt := map[string]int64{}
	startedTime := map[string]time.Time{}
	opts := fastOpts(t, "fairness", 10*time.Second)
	opts.Workers = workers
	c, err := NewConsumer(client, q, func(ctx context.Context, m *Message[string]) (string, error) {
		n := starts.Add(1)
		now := time.Now()
		eid, err := parseEntryID(m.EntryID)
		if err != nil {
			return "", Permanent(err)
		}
		mu.Lock()
		started[n] = startRec{eid, m.Deliveries > 1}
		if m.Key != "A" {
			startedAt[m.ID], startedTime[m.ID] = n, now
		}
		mu.Unlock()
		return "", nil
	}, opts)
	require.NoError(t, err)
	runConsumer(t, c)
	eventually(t, 20*time.Second, func() bool { return starts.Load() >= 2000 }, "the backlog never started")
	// Each job's starts are counted from right after its produce returned
	// (starts while the call was on its way to Redis came before the job
	// and must not count), its time from right before the call.
	before := map[string]int64{}
	at := map[string]time.Time{}
	var prs []*Promise[string]
	for j := range perKey {
		for _, k := range others {
			id := fmt.Sprint(k, j)
			at[id] = time.Now()
			prs = append(prs, mustProduce(t, p, id, "x", Key(k)))
			before[id] = starts.Load()
		}
	}
	for _, pr := range prs {
		_, err := pr.Wait(waitCtx(t, 30*time.Second))
		require.NoError(t, err)
	}
	mu.Lock()
	defer mu.Unlock()
	keysWithWork := int64(len(others) + 1)
	worstAhead, worstSlack, worstAll, worstBehind, worstAgain := int64(0), int64(1<<62), int64(0), int64(0), int64(0)
	worstMs := time.Duration(0)
	for j := range perKey {
		bound := DefaultKeyWindow + int64(j+1)*(keysWithWork-1) + int64(j)
		for _, k := range others {
			id := fmt.Sprint(k, j)
			own := started[startedAt[id]].eid
			var ahead, behind, again int64
			for n := before[id] + 1; n < startedAt[id]; n++ {
				s := started[n]
				switch {
				case s.again:
					again++
				case entryIDLess(s.eid, own):
					ahead++
				default:
					behind++
				}
			}
			require.LessOrEqual(t, ahead, bound, "job %d of key %s started after %d first starts of entries ahead of it (%d of entries behind it)", j, k, ahead, behind)
			worstAhead, worstSlack = max(worstAhead, ahead), min(worstSlack, bound-ahead)
			worstAll, worstBehind, worstAgain = max(worstAll, startedAt[id]-before[id]-1), max(worstBehind, behind), max(worstAgain, again)
			worstMs = max(worstMs, startedTime[id].Sub(at[id]))
		}
	}
	require.Less(t, starts.Load(), int64(backlog), "the other keys did not wait for the backlog")
	t.Logf("A: %d jobs of backlog, B..K: %d jobs each, %d workers, window %d: the worst job of B..K started after %d first starts of "+
		"entries ahead of it (its bound: W+(j+1)*(K-1)+j, closest %d under it); in all after at most %d other starts, %d of entries "+
		"behind it and %d re-deliveries, and %v after its produce; %d of A's backlog had started",
		backlog, perKey, workers, DefaultKeyWindow, worstAhead, worstSlack, worstAll, worstBehind, worstAgain,
		worstMs.Round(time.Millisecond), starts.Load()-int64(len(others)*perKey))
}

// parseEntryID splits a stream entry id "<ms>-<seq>".
func parseEntryID(id string) ([2]uint64, error) {
	a, b, ok := strings.Cut(id, "-")
	ms, err1 := strconv.ParseUint(a, 10, 64)
	seq, err2 := strconv.ParseUint(b, 10, 64)
	if !ok || err1 != nil || err2 != nil {
		return [2]uint64{}, fmt.Errorf("not an entry id: %q", id)
	}
	return [2]uint64{ms, seq}, nil
}

// entryIDLess reports whether entry id a comes before b in their stream.
func entryIDLess(a, b [2]uint64) bool { return a[0] < b[0] || a[0] == b[0] && a[1] < b[1] }

// TestFairKeysScale: 10,000 keys with 5 jobs each drain about as fast as
// the same 50,000 jobs without keys (the figures are logged; the machine's
// load decides them, so only the drain is asserted), and once drained no
// keyed structure is left: Redis's memory is back where the unkeyed run
// left it.
func TestFairKeysScale(t *testing.T) {
	if testing.Short() {
		t.Skip("50,000 jobs twice")
	}
	ctx := context.Background()
	proc, err := redistest.StartProcess(ctx)
	require.NoError(t, err)
	t.Cleanup(func() { _ = proc.Stop() })
	client := redis.NewClient(&redis.Options{Addr: proc.Addr(), PoolSize: 64})
	t.Cleanup(func() { _ = client.Close() })
	const nkeys, perKey = 10000, 5
	drain := func(keyed bool) (time.Duration, int64) {
		q := queueName(t)
		p := newStringProducer(t, client, q)
		for start := 0; start < nkeys*perKey; start += 500 {
			batch := make([]Job[string], 0, 500)
			for i := start; i < start+500; i++ {
				j := Job[string]{ID: fmt.Sprint("j", i), Request: "x"}
				if keyed {
					j.Options = []ProduceOption{Key(fmt.Sprint("key", i%nkeys))}
				}
				batch = append(batch, j)
			}
			prs, err := p.ProduceBatch(ctx, batch)
			require.NoError(t, err)
			for _, pr := range prs {
				pr.Release()
			}
		}
		var done atomic.Int64
		opts := fastOpts(t, "scale", 10*time.Second)
		opts.Workers = 8
		opts.DiscardResults = true
		opts.ResultTTL = time.Millisecond
		c, err := NewConsumer(client, q, func(ctx context.Context, m *Message[string]) (string, error) {
			done.Add(1)
			return "", nil
		}, opts)
		require.NoError(t, err)
		at := time.Now()
		stop := runConsumer(t, c)
		eventually(t, 120*time.Second, func() bool { return done.Load() == nkeys*perKey }, "the queue did not drain")
		took := time.Since(at)
		stop()
		eventually(t, 10*time.Second, func() bool { return len(fairKeysLeft(t, client, q)) == 0 }, "keyed state left: %v", fairKeysLeft(t, client, q))
		// The records expire (ResultTTL 1 ms): wait until only the stream
		// and its bookkeeping remain.
		eventually(t, 30*time.Second, func() bool { return client.DBSize(ctx).Val() < 20 }, "records left: %d keys", client.DBSize(ctx).Val())
		require.NoError(t, client.Del(ctx, streamKey(q)).Err())
		return took, usedMemory(t, client)
	}
	base := usedMemory(t, client)
	plain, plainMem := drain(false)
	keyed, keyedMem := drain(true)
	ratio := plain.Seconds() / keyed.Seconds()
	t.Logf("50,000 jobs, 8 workers: without keys %v (%.0f jobs/s), %d keys x %d jobs %v (%.0f jobs/s): %.2fx; used_memory: %d before, %d after the plain drain, %d after the keyed drain",
		plain.Round(time.Millisecond), float64(nkeys*perKey)/plain.Seconds(), nkeys, perKey, keyed.Round(time.Millisecond),
		float64(nkeys*perKey)/keyed.Seconds(), ratio, base, plainMem, keyedMem)
}

// TestFairKeysCancelAndForget: cancelling or forgetting a keyed job waiting
// for its key's turn drops it, and forgetting one queued in the stream gives
// back its slot; Admin.Job reports a waiting one as queued.
func TestFairKeysCancelAndForget(t *testing.T) {
	backends(t, func(t *testing.T, client *redis.Client) {
		ctx := context.Background()
		q := queueName(t)
		p := newStringProducer(t, client, q)
		a, err := NewAdmin(client, q, nil)
		require.NoError(t, err)
		mustProduce(t, p, "queued", "x", Key("k")).Release() // appended at once
		require.NoError(t, a.PauseKey(ctx, "k"))
		mustProduce(t, p, "waiting", "x", Key("k")).Release()
		mustProduce(t, p, "forgotten", "x", Key("k")).Release()
		mustProduce(t, p, "runs", "x", Key("k")).Release()
		info, err := a.Job(ctx, "waiting")
		require.NoError(t, err)
		require.Equal(t, JobQueued, info.State)
		require.NoError(t, a.Cancel(ctx, "waiting"))
		require.NoError(t, a.Forget(ctx, "queued", false))
		err = a.Forget(ctx, "forgotten", false)
		require.NoError(t, err)
		st, err := a.KeyStats(ctx, "k")
		require.NoError(t, err)
		require.Equal(t, int64(0), st.Running, "the forgotten entry's slot is back")
		var mu sync.Mutex
		var ran []string
		c, err := NewConsumer(client, q, func(ctx context.Context, m *Message[string]) (string, error) {
			mu.Lock()
			ran = append(ran, m.ID)
			mu.Unlock()
			return "", nil
		}, fastOpts(t, "cancel", 5*time.Second))
		require.NoError(t, err)
		runConsumer(t, c)
		require.NoError(t, a.ResumeKey(ctx, "k"))
		eventually(t, 10*time.Second, func() bool { mu.Lock(); defer mu.Unlock(); return len(ran) == 1 }, "the last job did not run")
		eventually(t, 5*time.Second, func() bool { return len(fairKeysLeft(t, client, q)) == 0 }, "keyed state left: %v", fairKeysLeft(t, client, q))
		mu.Lock()
		defer mu.Unlock()
		require.Equal(t, []string{"runs"}, ran)
	})
}

// TestFairKeysRequeueKeepsKey: a keyed job's dead letter keeps its key and
// level, and Requeue runs it again under that key (taking its key's turn
// and limit) on that level.
func TestFairKeysRequeueKeepsKey(t *testing.T) {
	backends(t, func(t *testing.T, client *redis.Client) {
		for _, lvl := range []PriorityLevel{PriorityNormal, PriorityHigh} {
			ctx := context.Background()
			q := queueName(t)
			p := newStringProducer(t, client, q)
			a, err := NewAdmin(client, q, nil)
			require.NoError(t, err)
			var mu sync.Mutex
			keys := []string{}
			c, err := NewConsumer(client, q, func(ctx context.Context, m *Message[string]) (string, error) {
				mu.Lock()
				keys = append(keys, fmt.Sprint(m.Key, "/", m.Priority))
				n := len(keys)
				mu.Unlock()
				if n == 1 {
					return "", Permanent(errors.New("first time"))
				}
				return "ok", nil
			}, fastOpts(t, "requeue", 5*time.Second))
			require.NoError(t, err)
			stop := runConsumer(t, c)
			_, err = mustProduce(t, p, "job", "x", Key("tenant"), Priority(lvl)).Wait(waitCtx(t, 10*time.Second))
			require.Error(t, err)
			dls, err := a.DeadLetters(ctx, "", 10)
			require.NoError(t, err)
			require.Len(t, dls, 1)
			_, err = a.Requeue(ctx, dls[0].DeadLetterID)
			require.NoError(t, err)
			eventually(t, 10*time.Second, func() bool { mu.Lock(); defer mu.Unlock(); return len(keys) == 2 }, "the requeued job did not run")
			mu.Lock()
			want := fmt.Sprint("tenant/", lvl)
			require.Equal(t, []string{want, want}, keys)
			mu.Unlock()
			eventually(t, 5*time.Second, func() bool { return len(fairKeysLeft(t, client, q)) == 0 }, "keyed state left: %v", fairKeysLeft(t, client, q))
			stop()
		}
	})
}

// TestFairKeysWeightTurns: a key of weight 3 appends three jobs per turn
// even when each outcome frees one place of the window at a time (window
// one here; the default window of 128 is full the same way under a
// backlog), so it gets three starts for every one of the other keys.
func TestFairKeysWeightTurns(t *testing.T) {
	backends(t, func(t *testing.T, client *redis.Client) {
		ctx := context.Background()
		q := queueName(t)
		p := newStringProducer(t, client, q)
		a, err := NewAdmin(client, q, nil)
		require.NoError(t, err)
		require.NoError(t, a.SetKeyDefaults(ctx, 0, 1))
		require.NoError(t, a.SetKeyWeight(ctx, "A", 3))
		for i := range 12 {
			mustProduce(t, p, fmt.Sprint("a", i), "x", Key("A")).Release()
		}
		for _, k := range []string{"B", "C"} {
			for i := range 4 {
				mustProduce(t, p, fmt.Sprint(k, i), "x", Key(k)).Release()
			}
		}
		var mu sync.Mutex
		var order strings.Builder
		opts := fastOpts(t, "weights", 5*time.Second)
		opts.KeyWindow = 1
		c, err := NewConsumer(client, q, func(ctx context.Context, m *Message[string]) (string, error) {
			mu.Lock()
			order.WriteString(m.Key)
			mu.Unlock()
			return "", nil
		}, opts)
		require.NoError(t, err)
		runConsumer(t, c)
		eventually(t, 10*time.Second, func() bool { mu.Lock(); defer mu.Unlock(); return order.Len() == 20 }, "not every job ran")
		mu.Lock()
		defer mu.Unlock()
		// The first A was appended at once; then A takes three per turn.
		require.Equal(t, "A"+"AAABC"+"AAABC"+"AAABC"+"AABC", order.String())
		require.Zero(t, client.Exists(ctx, "streamq:{"+q+"}:keys:turn").Val(), "no turn is left once every key is done")
	})
}
