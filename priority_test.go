package streamq

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"syscall"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/streamq/streamq/internal/crashtest"
	"github.com/streamq/streamq/internal/keys"
)

// levelStreams returns the streams of queue q's levels (one shard): default,
// high, low.
func levelStreams(q string) [numLevels]string {
	var s [numLevels]string
	for l, name := range levelNames {
		s[l] = streamKey(q)
		if name != "" {
			s[l] += ":" + name
		}
	}
	return s
}

// levelPrefix maps a level to the id prefix the tests give its requests.
var levelPrefix = map[PriorityLevel]string{PriorityHigh: "h", PriorityNormal: "n", PriorityLow: "l"}

// levelLog records the handler starts of a test in order.
type levelLog struct {
	mu  sync.Mutex
	ids []string
	pri map[string]PriorityLevel
}

func (s *levelLog) add(m *Message[string]) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.ids = append(s.ids, m.ID)
	if s.pri == nil {
		s.pri = map[string]PriorityLevel{}
	}
	s.pri[m.ID] = m.Priority
}

func (s *levelLog) snapshot() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]string(nil), s.ids...)
}

// TestPriorityLevelsKeepTheirLevel: requests produced at each level (alone,
// in a coalesced call, in an atomic batch mixing levels, delayed, retried)
// run with their level, from their level's stream; the default level uses
// the queue's one stream and creates no other.
func TestPriorityLevelsKeepTheirLevel(t *testing.T) {
	backends(t, func(t *testing.T, client *redis.Client) {
		ctx := context.Background()
		q := queueName(t)
		p := newStringProducer(t, client, q)
		var log levelLog
		var failedOnce sync.Map
		c, err := NewConsumer(client, q, func(ctx context.Context, m *Message[string]) (string, error) {
			log.add(m)
			if strings.HasSuffix(m.ID, "-retry") {
				if _, again := failedOnce.LoadOrStore(m.ID, true); !again {
					return "", RetryAfter(errors.New("once more"), 10*time.Millisecond)
				}
			}
			return m.Priority.String(), nil
		}, fastOpts(t, "levels", time.Second))
		require.NoError(t, err)
		runConsumer(t, c)

		// Only the default level: no other stream.
		plain := mustProduce(t, p, "n-plain", "x")
		got, err := plain.Wait(waitCtx(t, 20*time.Second))
		require.NoError(t, err)
		require.Equal(t, "normal", got)
		streams := levelStreams(q)
		require.EqualValues(t, 0, client.Exists(ctx, streams[levelHigh], streams[levelLow]).Val(),
			"a queue without priorities has only its default stream")

		var prs []*Promise[string]
		var ids []string
		want := map[string]PriorityLevel{}
		add := func(id string, pr *Promise[string], lvl PriorityLevel) {
			ids, prs, want[id] = append(ids, id), append(prs, pr), lvl
		}
		for _, lvl := range []PriorityLevel{PriorityHigh, PriorityNormal, PriorityLow} {
			for _, kind := range []string{"now", "delayed", "retry"} {
				id := levelPrefix[lvl] + "-" + kind
				opts := []ProduceOption{Priority(lvl)}
				if kind == "delayed" {
					opts = append(opts, After(30*time.Millisecond))
				}
				add(id, mustProduce(t, p, id, "x", opts...), lvl)
			}
		}
		var items []Job[string]
		for i, lvl := range []PriorityLevel{PriorityLow, PriorityHigh, PriorityNormal, PriorityHigh} {
			id := fmt.Sprintf("%s-batch%d", levelPrefix[lvl], i)
			items = append(items, Job[string]{ID: id, Request: "x", Options: []ProduceOption{Priority(lvl)}})
			want[id] = lvl
		}
		batch, err := p.ProduceBatch(ctx, items)
		require.NoError(t, err)
		for i, pr := range batch {
			add(items[i].ID, pr, want[items[i].ID])
		}
		for i, pr := range prs {
			got, err := pr.Wait(waitCtx(t, 20*time.Second))
			require.NoError(t, err, ids[i])
			require.Equal(t, want[ids[i]].String(), got, "the handler saw %s's level", ids[i])
		}
		log.mu.Lock()
		for id, lvl := range want {
			require.Equal(t, lvl, log.pri[id], id)
		}
		log.mu.Unlock()
		require.EqualValues(t, 2, client.Exists(ctx, streams[levelHigh], streams[levelLow]).Val(),
			"each level used has its stream")

		_, err = p.Produce(ctx, "bad", "x", Priority(7))
		require.ErrorIs(t, err, ErrInvalidOptions)
	})
}

// TestPriorityDedupAcrossLevels: an id produced at two levels is one request
// (one record for all levels), run once, alone, in one call, in a batch.
func TestPriorityDedupAcrossLevels(t *testing.T) {
	backends(t, func(t *testing.T, client *redis.Client) {
		ctx := context.Background()
		q := queueName(t)
		p := newStringProducer(t, client, q)
		first := mustProduce(t, p, "same", "a", Priority(PriorityLow))
		require.Equal(t, DedupNone, first.Deduplicated())
		second := mustProduce(t, p, "same", "b", Priority(PriorityHigh))
		require.Equal(t, DedupInflight, second.Deduplicated())
		third := mustProduce(t, p, "same", "c")
		require.Equal(t, DedupInflight, third.Deduplicated())
		batch, err := p.ProduceBatch(ctx, []Job[string]{
			{ID: "pair", Request: "a", Options: []ProduceOption{Priority(PriorityHigh)}},
			{ID: "pair", Request: "b", Options: []ProduceOption{Priority(PriorityLow)}},
		})
		require.NoError(t, err)
		streams := levelStreams(q)
		require.EqualValues(t, 1, client.XLen(ctx, streams[levelLow]).Val(), "one entry for \"same\"")
		require.EqualValues(t, 1, client.XLen(ctx, streams[levelHigh]).Val(), "one entry for \"pair\"")
		require.Zero(t, client.XLen(ctx, streams[levelNormal]).Val())

		var runs sync.Map
		c, err := NewConsumer(client, q, func(ctx context.Context, m *Message[string]) (string, error) {
			n, _ := runs.LoadOrStore(m.ID, new(atomic.Int64))
			n.(*atomic.Int64).Add(1)
			return m.Payload + "@" + m.Priority.String(), nil
		}, fastOpts(t, "dedup", time.Second))
		require.NoError(t, err)
		runConsumer(t, c)
		for _, pr := range []*Promise[string]{first, second, third} {
			got, err := pr.Wait(waitCtx(t, 20*time.Second))
			require.NoError(t, err)
			require.Equal(t, "a@low", got, "every caller gets the one run's result")
		}
		for _, pr := range batch {
			got, err := pr.Wait(waitCtx(t, 20*time.Second))
			require.NoError(t, err)
			require.Equal(t, "a@high", got)
		}
		runs.Range(func(k, v any) bool {
			require.EqualValues(t, 1, v.(*atomic.Int64).Load(), "runs of %v", k)
			return true
		})
	})
}

// gatedOrder produces a gate request, holds the consumer's only worker in
// its handler until perLevel requests of each level (in one batch, lowest
// level first) are all in the consumer's ring, then lets it go and returns
// the order in which the rest started.
func gatedOrder(t *testing.T, client *redis.Client, strict bool, perLevel int) []string {
	t.Helper()
	ctx := context.Background()
	q := queueName(t)
	p := newStringProducer(t, client, q)
	// Create each level's stream first, so the consumer's feeders read them
	// from the start.
	var warm []*Promise[string]
	for _, lvl := range []PriorityLevel{PriorityHigh, PriorityLow} {
		warm = append(warm, mustProduce(t, p, "warm-"+lvl.String(), "x", Priority(lvl)))
	}
	gate, gateStarted := make(chan struct{}), make(chan struct{})
	var log levelLog
	opts := fastOpts(t, "gated", 5*time.Second)
	opts.Workers, opts.Prefetch, opts.StrictPriority, opts.holdPrefetch = 1, 1000, strict, true
	c, err := NewConsumer(client, q, func(ctx context.Context, m *Message[string]) (string, error) {
		if m.ID == "gate" {
			close(gateStarted)
			select {
			case <-gate:
			case <-ctx.Done():
			}
		} else if !strings.HasPrefix(m.ID, "warm") {
			log.add(m)
		}
		return "", nil
	}, opts)
	require.NoError(t, err)
	runConsumer(t, c)
	for _, pr := range warm {
		_, err := pr.Wait(waitCtx(t, 20*time.Second))
		require.NoError(t, err)
	}
	g := mustProduce(t, p, "gate", "x")
	select {
	case <-gateStarted:
	case <-time.After(20 * time.Second):
		t.Fatal("the gate request never started")
	}
	var items []Job[string]
	for i := range perLevel {
		for _, lvl := range []PriorityLevel{PriorityLow, PriorityNormal, PriorityHigh} {
			items = append(items, Job[string]{ID: fmt.Sprintf("%s-%03d", levelPrefix[lvl], i), Request: "x",
				Options: []ProduceOption{Priority(lvl)}})
		}
	}
	prs, err := p.ProduceBatch(ctx, items)
	require.NoError(t, err)
	streams := levelStreams(q)
	held := func() (pending [numLevels]int64, queued [numLevels]int) {
		for l, s := range streams {
			if sum, err := client.XPending(ctx, s, DefaultGroup).Result(); err == nil {
				pending[l] = sum.Count
			}
		}
		r := c.lastRun.Load()
		r.ring.qmu.Lock()
		for l := range numLevels {
			queued[l] = r.ring.qs[0].q[l].n
		}
		r.ring.qmu.Unlock()
		return pending, queued
	}
	want := [numLevels]int{perLevel, perLevel, perLevel}
	eventually(t, 20*time.Second, func() bool {
		pending, queued := held()
		return pending == [numLevels]int64{int64(1 + perLevel), int64(perLevel), int64(perLevel)} && queued == want
	}, "the consumer never held every request in its ring: %v", lazyString(func() string {
		p, q := held()
		r := c.lastRun.Load()
		r.ring.mu.Lock()
		defer r.ring.mu.Unlock()
		r.places.mu.Lock()
		defer r.places.mu.Unlock()
		return fmt.Sprintf("pending %v, queued %v, ring free %d target %d settled %d feeders %d, places free %v",
			p, q, r.ring.free, r.ring.target, r.ring.settled, r.ring.shards, r.places.free)
	}))
	close(gate)
	for _, pr := range append(prs, g) {
		_, err := pr.Wait(waitCtx(t, 20*time.Second))
		require.NoError(t, err)
	}
	return log.snapshot()
}

// TestPriorityStrictOrder: with StrictPriority, no request of a lower level
// starts while one of a higher level waits in the ring: with all of them in
// the ring at once, every high one starts first, then normal, then low.
func TestPriorityStrictOrder(t *testing.T) {
	t.Parallel()
	const per = 20
	order := gatedOrder(t, realRedis(t), true, per)
	require.Len(t, order, 3*per)
	for i, id := range order {
		want := levelPrefix[levelValue[levelOrder[i/per]]]
		require.Truef(t, strings.HasPrefix(id, want+"-"), "start %d is %s: %v", i, id, order)
	}
}

// TestPriorityWeightedOrder: by default, with every level waiting in the
// ring, each round of 10 starts takes 6 high, 3 normal and 1 low (the
// weights), and each level's requests start in their order.
func TestPriorityWeightedOrder(t *testing.T) {
	t.Parallel()
	const per = 20
	order := gatedOrder(t, realRedis(t), false, per)
	require.Len(t, order, 3*per)
	w := DefaultPriorityWeights
	round := w[0] + w[1] + w[2]
	// Rounds while the high level lasts (per/w[0] of them).
	for r := range per / w[0] {
		counts := map[string]int{}
		for _, id := range order[r*round : (r+1)*round] {
			counts[id[:1]]++
		}
		require.Equal(t, map[string]int{"h": w[0], "n": w[1], "l": w[2]}, counts, "round %d: %v", r, order)
	}
	last := map[string]int{}
	for _, id := range order {
		var i int
		_, err := fmt.Sscanf(id[2:], "%d", &i)
		require.NoError(t, err)
		if prev, ok := last[id[:1]]; ok {
			require.Greater(t, i, prev, "level %s in order: %v", id[:1], order)
		}
		last[id[:1]] = i
	}
}

// lazyString formats as what its function returns, when formatted.
type lazyString func() string

func (f lazyString) String() string { return f() }

// produceLevel appends n requests of one level in batches and returns their
// ids.
func produceLevel(t *testing.T, p *Producer[string, string], prefix string, n int, lvl PriorityLevel) []string {
	t.Helper()
	ids := make([]string, 0, n)
	for len(ids) < n {
		var jobs []Job[string]
		for i := len(ids); i < n && len(jobs) < 500; i++ {
			jobs = append(jobs, Job[string]{ID: fmt.Sprintf("%s-%05d", prefix, i), Request: "x", Options: []ProduceOption{Priority(lvl)}})
		}
		prs, err := p.ProduceBatch(context.Background(), jobs)
		require.NoError(t, err)
		for i, pr := range prs {
			pr.Release()
			ids = append(ids, jobs[i].ID)
		}
	}
	return ids
}

// TestPriorityHighJumpsBacklog (issue 25): with 10,000 low-priority requests
// queued and one worker, a high-priority request produced afterwards starts
// after at most one read-ahead's worth of them (the ring's target: the low
// requests already read); here it is measured, with the read-ahead at that
// moment. A level used for the first time while the consumer runs is
// noticed at once (the produce that creates its stream tells the consumers;
// TestPriorityFirstHighStartsAtOnce bounds it), within ClaimInterval at
// worst.
func TestPriorityHighJumpsBacklog(t *testing.T) {
	t.Parallel()
	client := realRedis(t)
	for _, firstUse := range []bool{false, true} {
		t.Run(fmt.Sprintf("firstUse=%v", firstUse), func(t *testing.T) {
			q := queueName(t)
			p := newStringProducer(t, client, q)
			if !firstUse {
				// The queue uses the level already: its stream exists.
				_, err := mustProduce(t, p, "warm", "x", Priority(PriorityHigh)).Wait(waitCtx(t, time.Second))
				require.ErrorIs(t, err, context.DeadlineExceeded, "no consumer yet")
			}
			produceLevel(t, p, "low", 10000, PriorityLow)
			var lowStarts atomic.Int64
			var urgentAt atomic.Int64 // low starts before the urgent request started
			urgentAt.Store(-1)
			opts := fastOpts(t, "backlog", 10*time.Second)
			opts.Workers = 1
			c, err := NewConsumer(client, q, func(ctx context.Context, m *Message[string]) (string, error) {
				switch {
				case m.ID == "urgent":
					urgentAt.Store(lowStarts.Load())
				case strings.HasPrefix(m.ID, "low"):
					lowStarts.Add(1)
				}
				return "", nil
			}, opts)
			require.NoError(t, err)
			runConsumer(t, c)
			eventually(t, 20*time.Second, func() bool { return lowStarts.Load() >= 200 }, "the backlog never started")
			r := c.lastRun.Load()
			r.ring.mu.Lock()
			target := r.ring.target
			r.ring.mu.Unlock()
			before := lowStarts.Load()
			at := time.Now()
			pr := mustProduce(t, p, "urgent", "x", Priority(PriorityHigh))
			// What the ring guarantees starts when the request is in it: how
			// soon its feeder's read wakes up and admits it depends on the
			// machine's scheduling, during which low requests keep starting.
			// So count from the moment it is seen queued in the ring (or,
			// when a worker took it before this loop saw it, from the
			// produce).
			inRing := before
		watch:
			for urgentAt.Load() < 0 {
				select {
				case <-pr.Done():
					break watch
				default:
				}
				if r.ring.classQueued(classOf(0, levelHigh)) > 0 {
					inRing = lowStarts.Load()
					break
				}
				runtime.Gosched()
			}
			_, err = pr.Wait(waitCtx(t, 20*time.Second))
			require.NoError(t, err)
			took := time.Since(at)
			jumped := urgentAt.Load() - inRing
			t.Logf("high request produced behind %d low ones started after %d of them once in the ring (%d after the produce), in %v (read-ahead target %d, Prefetch %d, ClaimInterval %v)",
				10000-before, jumped, urgentAt.Load()-before, took.Round(time.Millisecond), target, c.opts.Prefetch, opts.ClaimInterval)
			if firstUse {
				require.Less(t, took, opts.ClaimInterval+5*time.Second, "a new level is noticed within about ClaimInterval")
			} else {
				require.LessOrEqual(t, jumped, int64(target+opts.Workers), "within one read-ahead's worth of low requests")
			}
			require.Less(t, lowStarts.Load(), int64(10000), "the high request did not wait for the backlog")
		})
	}
}

// TestPriorityLowNotStarved: under a constant high-priority load (a high
// backlog far larger than what runs), the low level keeps its share of the
// starts: at least its weight's share of the takes while both levels wait
// in the ring (1 in 7 with normal empty: 6:1), less the read-ahead's slack.
// With StrictPriority it gets none while high requests wait.
func TestPriorityLowNotStarved(t *testing.T) {
	t.Parallel()
	client := realRedis(t)
	for _, strict := range []bool{false, true} {
		t.Run(fmt.Sprintf("strict=%v", strict), func(t *testing.T) {
			q := queueName(t)
			p := newStringProducer(t, client, q)
			produceLevel(t, p, "low", 1000, PriorityLow)
			produceLevel(t, p, "high", 6000, PriorityHigh)
			const sample = 2000
			var starts, counted, low atomic.Int64
			opts := fastOpts(t, "starve", 10*time.Second)
			opts.Workers, opts.StrictPriority = 2, strict
			var c *Consumer[string, string]
			// The weights share the takes while both levels have entries in
			// the ring; a level whose feeder lags on a loaded machine leaves
			// the takes to the other meanwhile (a low share of 0.183 against
			// 0.143 +- 0.036 once in a full run when every start counted). So
			// a start counts only when the other level still had entries in
			// the ring as it began.
			otherQueued := func(own PriorityLevel) bool {
				other := PriorityHigh
				if own == PriorityHigh {
					other = PriorityLow
				}
				return levelsQueued(c, levelOf[other])
			}
			c, err := NewConsumer(client, q, func(ctx context.Context, m *Message[string]) (string, error) {
				isLow := strings.HasPrefix(m.ID, "low")
				if strict {
					if n := starts.Add(1); n > 200 && n <= 200+sample && isLow {
						low.Add(1) // after the start-up, while the high backlog lasts
					}
					return "", nil
				}
				own := PriorityHigh
				if isLow {
					own = PriorityLow
				}
				if starts.Add(1) > 200 && otherQueued(own) && counted.Add(1) <= sample && isLow {
					low.Add(1)
				}
				return "", nil
			}, opts)
			require.NoError(t, err)
			runConsumer(t, c)
			if strict {
				eventually(t, 25*time.Second, func() bool { return starts.Load() >= 200+sample }, "too few starts")
			} else {
				eventually(t, 25*time.Second, func() bool { return counted.Load() >= sample }, "too few starts: %v", lazyString(func() string {
					return fmt.Sprintf("%d started, %d counted", starts.Load(), counted.Load())
				}))
			}
			share := float64(low.Load()) / sample
			w := DefaultPriorityWeights
			want := float64(w[2]) / float64(w[0]+w[2])
			t.Logf("strict=%v: low share of %d starts under a high backlog: %.3f (weights give %.3f)", strict, sample, share, want)
			if strict {
				require.Zero(t, low.Load(), "strict: no low start while high requests wait")
			} else {
				require.InDelta(t, want, share, want*0.25, "the low level keeps its share")
			}
		})
	}
}

// levelPending sums the pending entries of consumer name (all consumers when
// name is "") over the streams of q's levels.
func levelPending(t *testing.T, client *redis.Client, q, name string) int64 {
	t.Helper()
	var n int64
	for _, s := range levelStreams(q) {
		sum, err := client.XPending(context.Background(), s, DefaultGroup).Result()
		if isNoGroup(err) {
			continue
		}
		require.NoError(t, err)
		if name == "" {
			n += sum.Count
		} else {
			n += sum.Consumers[name]
		}
	}
	return n
}

// TestCrashPriorityLevelsLoseNothing: a consumer holding requests of every
// level (in its ring and in running handlers) is SIGKILLed; another consumer
// claims them from each level's stream and runs each once, at its level,
// counting starts exactly: the killed consumer's running handlers start
// their second time, the rest their first.
func TestCrashPriorityLevelsLoseNothing(t *testing.T) {
	t.Parallel()
	client := realRedis(t)
	ctx := context.Background()
	q := queueName(t)
	const per, workers = 100, 4
	const minIdle = time.Second
	p := newStringProducer(t, client, q)
	var ids []string
	var prs []*Promise[string]
	want := map[string]PriorityLevel{}
	for _, lvl := range []PriorityLevel{PriorityLow, PriorityNormal, PriorityHigh} {
		var jobs []Job[string]
		for i := range per {
			id := fmt.Sprintf("%s-%03d", levelPrefix[lvl], i)
			jobs = append(jobs, Job[string]{ID: id, Request: "p-" + id, Options: []ProduceOption{Priority(lvl)}})
			ids, want[id] = append(ids, id), lvl
		}
		batch, err := p.ProduceBatch(ctx, jobs)
		require.NoError(t, err)
		prs = append(prs, batch...)
	}
	child := crashtest.Start(t, "TestCrashHelperProcess", crashConfig{
		Addr: sharedAddr(t), Queue: q, Mode: "block", Name: "doomed",
		Workers: workers, Prefetch: len(ids), MinIdle: minIdle, MaxDeliveries: 5,
	})
	// The child reads ahead as far as its ring's target lets it (which grows
	// only while workers wait), so how many it holds depends on timing: wait
	// until it holds entries of every level and runs its workers' handlers.
	holdsEveryLevel := func() bool {
		for _, s := range levelStreams(q) {
			sum, err := client.XPending(ctx, s, DefaultGroup).Result()
			if err != nil || sum.Consumers["doomed"] == 0 {
				return false
			}
		}
		return true
	}
	eventually(t, 30*time.Second, func() bool {
		return client.SCard(ctx, startedKey(q)).Val() == workers && holdsEveryLevel()
	}, "the child never held requests of every level while running %d handlers", workers)
	held := levelPending(t, client, q, "doomed")
	started, err := client.SMembers(ctx, startedKey(q)).Result()
	require.NoError(t, err)
	child.Kill()
	require.True(t, child.KilledBy(syscall.SIGKILL))
	killedAt := time.Now()

	h := newCountingHandler()
	var mu sync.Mutex
	got := map[string]PriorityLevel{}
	c, err := NewConsumer(client, q, func(ctx context.Context, m *Message[string]) (string, error) {
		mu.Lock()
		got[m.ID] = m.Priority
		mu.Unlock()
		return h.handle(ctx, m)
	}, &ConsumerOptions{
		Name: "survivor", Workers: workers, MinIdle: minIdle,
		ClaimInterval: 100 * time.Millisecond, ReadBlock: 100 * time.Millisecond, Logger: testLogger(t),
	})
	require.NoError(t, err)
	runConsumer(t, c)
	requireResults(t, client, q, ids, prs, killedAt.Add(minIdle+30*time.Second))
	t.Logf("%d requests of 3 levels, %d held by a SIGKILLed consumer (%d running: %v), completed %v after the kill",
		len(ids), held, workers, started, time.Since(killedAt).Round(time.Millisecond))
	h.requireOnceEach(t, ids)
	// Known defect: a shard's levels share one start-count hash keyed by
	// entry id, and entry ids are per stream, so entries of two levels
	// appended in the same millisecond share a count. The exact counts are
	// checked when this run's ids do not collide; otherwise the run says so.
	// Exact whether or not entry ids repeat across the level streams (each
	// stream has its own start counts).
	t.Logf("entry ids in two level streams: %d", len(sharedEntryIDs(prs)))
	require.Equal(t, map[int]int{1: len(ids) - workers, 2: workers}, h.deliveries)
	mu.Lock()
	require.Equal(t, want, got, "each request ran at its level")
	mu.Unlock()
	for _, s := range levelStreams(q) {
		require.Zero(t, client.XLen(ctx, s).Val(), "%s not empty", s)
	}
	require.Zero(t, levelPending(t, client, q, ""))
}

// TestCrashPriorityPoisonCountsExactly: a high-priority request that kills
// its consumer at every start is dead-lettered after exactly MaxDeliveries
// starts (the first two retried through the schedule, keeping its level),
// while requests of every level around it complete.
func TestCrashPriorityPoisonCountsExactly(t *testing.T) {
	t.Parallel()
	client := realRedis(t)
	ctx := context.Background()
	q := queueName(t)
	const maxDeliveries = 4
	p := newStringProducer(t, client, q)
	var ids []string
	var prs []*Promise[string]
	var poison *Promise[string]
	for i := range 60 {
		lvl := levelValue[i%numLevels]
		id := fmt.Sprintf("%s-%03d", levelPrefix[lvl], i)
		ids, prs = append(ids, id), append(prs, mustProduce(t, p, id, "p-"+id, Priority(lvl)))
		if i == 30 {
			poison = mustProduce(t, p, "poison", "p-poison", Priority(PriorityHigh))
		}
	}
	cfg := crashConfig{
		Addr: sharedAddr(t), Queue: q, Mode: "retrypoison", Name: "poisoned",
		Workers: 1, Prefetch: 1, MinIdle: 2 * time.Second, MaxDeliveries: maxDeliveries,
	}
	all := append(append([]*Promise[string](nil), prs...), poison)
	deadline := time.Now().Add(60 * time.Second)
	crashes := 0
	for {
		child := crashtest.Start(t, "TestCrashHelperProcess", cfg)
		done := make(chan struct{})
		go func() {
			defer close(done)
			for _, pr := range all {
				<-pr.Done()
			}
		}()
		select {
		case <-child.Done():
			require.True(t, child.KilledBy(syscall.SIGKILL), "child ended otherwise: %s", child.Output())
			crashes++
			require.Less(t, crashes, 3*maxDeliveries, "crash loop does not end")
			continue
		case <-done:
			child.Kill()
		case <-time.After(time.Until(deadline)):
			child.Kill()
			t.Fatalf("callers still waiting after 60s and %d crashes", crashes)
		}
		break
	}
	requireResults(t, client, q, ids, prs, time.Now().Add(10*time.Second))
	_, err := poison.Wait(ctx)
	require.ErrorIs(t, err, ErrDeadLettered)
	seen, err := client.LRange(ctx, poisonSeenKey(q), 0, -1).Result()
	require.NoError(t, err)
	// Two retries through the schedule, then a start per crash.
	require.Equal(t, []string{"r1", "r2", "3", "4"}, seen, "starts seen by the poison's handler")
	require.Equal(t, maxDeliveries-2, crashes)
	admin, err := NewAdmin(client, q, nil)
	require.NoError(t, err)
	dls, err := admin.DeadLetters(ctx, "", 10)
	require.NoError(t, err)
	require.Len(t, dls, 1)
	require.Equal(t, maxDeliveries, dls[0].Deliveries)
	for _, s := range levelStreams(q) {
		require.Zero(t, client.XLen(ctx, s).Val(), "%s not empty", s)
	}
}

// TestPriorityAdmin: Stats splits the depth by level (only once a level other
// than the default is used, highest first, in JSON by name); Job finds a
// request on any level's stream, queued or running; Forget deletes a queued
// request's entry on its level's stream; Cancel removes a delayed one.
func TestPriorityAdmin(t *testing.T) {
	backends(t, func(t *testing.T, client *redis.Client) {
		ctx := context.Background()
		q := queueName(t)
		p := newStringProducer(t, client, q)
		admin, err := NewAdmin(client, q, nil)
		require.NoError(t, err)
		mustProduce(t, p, "n-1", "x")
		s, err := admin.Stats(ctx)
		require.NoError(t, err)
		require.Nil(t, s.Levels, "no split without levels")
		require.EqualValues(t, 1, s.Length)

		produceLevel(t, p, "h", 3, PriorityHigh)
		produceLevel(t, p, "l", 2, PriorityLow)
		mustProduce(t, p, "l-later", "x", Priority(PriorityLow), After(time.Hour))
		s, err = admin.Stats(ctx)
		require.NoError(t, err)
		require.EqualValues(t, 6, s.Length, "every level's entries")
		require.Equal(t, []LevelStats{{Priority: PriorityHigh, Length: 3}, {Priority: PriorityNormal, Length: 1}, {Priority: PriorityLow, Length: 2}}, s.Levels)
		require.EqualValues(t, 1, s.Scheduled)
		b, err := json.Marshal(s.Levels)
		require.NoError(t, err)
		require.JSONEq(t, `[{"priority":"high","length":3,"pending":0},{"priority":"normal","length":1,"pending":0},{"priority":"low","length":2,"pending":0}]`, string(b))

		for _, id := range []string{"h-00000", "l-00001", "n-1"} {
			info, err := admin.Job(ctx, id)
			require.NoError(t, err)
			require.Equal(t, JobQueued, info.State, id)
		}
		require.NoError(t, admin.Forget(ctx, "l-00001", false))
		require.EqualValues(t, 1, client.XLen(ctx, levelStreams(q)[levelLow]).Val(), "the entry left its level's stream")
		info, err := admin.Job(ctx, "l-later")
		require.NoError(t, err)
		require.Equal(t, JobScheduled, info.State)
		require.NoError(t, admin.Cancel(ctx, "l-later"))

		// Running: held by a consumer, on the high level's stream.
		hold := make(chan struct{})
		running := make(chan string, 10)
		opts := fastOpts(t, "admin", 5*time.Second)
		opts.Workers = 5 // every request runs at once
		c, err := NewConsumer(client, q, func(ctx context.Context, m *Message[string]) (string, error) {
			running <- m.ID
			select {
			case <-hold:
			case <-ctx.Done():
			}
			return "", nil
		}, opts)
		require.NoError(t, err)
		runConsumer(t, c)
		first := ""
		for !strings.HasPrefix(first, "h-") {
			first = <-running
		}
		info, err = admin.Job(ctx, first)
		require.NoError(t, err)
		require.Equal(t, JobRunning, info.State)
		require.Equal(t, "admin", info.Consumer)
		s, err = admin.Stats(ctx)
		require.NoError(t, err)
		require.NotNil(t, s.Levels)
		require.Positive(t, s.Levels[0].Pending, "the high level's entry is pending")
		close(hold)
	})
}

// levelHook counts the commands that name a priority level's stream.
type levelHook struct {
	mu   sync.Mutex
	cmds map[string]int
}

func (h *levelHook) DialHook(next redis.DialHook) redis.DialHook { return next }

func (h *levelHook) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		h.see(cmd)
		return next(ctx, cmd)
	}
}

func (h *levelHook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		for _, cmd := range cmds {
			h.see(cmd)
		}
		return next(ctx, cmds)
	}
}

func (h *levelHook) see(cmd redis.Cmder) {
	for _, a := range cmd.Args() {
		if s, ok := a.(string); ok && (strings.HasSuffix(s, ":stream:high") || strings.HasSuffix(s, ":stream:low")) {
			h.mu.Lock()
			h.cmds[strings.ToLower(cmd.Name())]++
			h.mu.Unlock()
			return
		}
	}
}

// TestPriorityUnusedLevelsCostNothing: a consumer of a queue that never uses
// priorities sends nothing to the level streams but one EXISTS per level and
// ClaimInterval (and promote.lua names them, to append a retry at its
// level), and the queue has no other key than before.
//
// The EXISTS of a level are: one at Run's start (findLevels), one when the
// shard's wake subscription starts (the promoter's signalLevel, as after
// every (re)subscription: a creation notice may have been missed), and one
// per ClaimInterval of awaitLevel's timer, which starts after Run's start
// and again after each look. So at most 2 + ⌊elapsed/ClaimInterval⌋ per
// level. The bound was one less per level: most runs reached it exactly,
// and a run whose timer looked once more within the elapsed time passed
// it: beside two CPU burners the test failed 6 of 200 runs (6 EXISTS in
// under 130 ms against a bound of 4), and 0 of 400 with this bound.
func TestPriorityUnusedLevelsCostNothing(t *testing.T) {
	t.Parallel()
	client := realRedis(t)
	h := &levelHook{cmds: map[string]int{}}
	client.AddHook(h)
	q := queueName(t)
	p := newStringProducer(t, client, q)
	var runs atomic.Int64
	opts := fastOpts(t, "plain", 5*time.Second)
	c, err := NewConsumer(client, q, func(ctx context.Context, m *Message[string]) (string, error) {
		runs.Add(1)
		if m.ID == "retry" && m.Deliveries == 1 {
			return "", RetryAfter(errors.New("again"), 10*time.Millisecond)
		}
		return "", nil
	}, opts)
	require.NoError(t, err)
	start := time.Now()
	stop := runConsumer(t, c)
	for i := range 200 {
		mustProduce(t, p, fmt.Sprint(i), "x").Release()
	}
	_, err = mustProduce(t, p, "retry", "x").Wait(waitCtx(t, 20*time.Second))
	require.NoError(t, err)
	eventually(t, 20*time.Second, func() bool { return runs.Load() == 202 }, "not every request ran")
	stop()
	elapsed := time.Since(start)
	h.mu.Lock()
	defer h.mu.Unlock()
	exists := h.cmds["exists"]
	delete(h.cmds, "exists")
	delete(h.cmds, "evalsha")
	delete(h.cmds, "eval")
	require.Empty(t, h.cmds, "commands on level streams of a plain queue")
	maxChecks := 2 * (2 + int(elapsed/opts.ClaimInterval))
	require.LessOrEqual(t, exists, maxChecks, "at most 2 + %v/%v EXISTS per level", elapsed, opts.ClaimInterval)
	t.Logf("plain queue: %d EXISTS of level streams in %v (ClaimInterval %v), nothing else", exists, elapsed.Round(time.Millisecond), opts.ClaimInterval)
	keys, err := client.Keys(context.Background(), "streamq:{"+q+"}:stream*").Result()
	require.NoError(t, err)
	require.Equal(t, []string{streamKey(q)}, keys)
}

// TestPriorityBatchRejectedLeavesNoLevelStream: an atomic batch that fails on
// an invalid item undoes its appends to every level's stream, and deletes
// the level streams it created.
func TestPriorityBatchRejectedLeavesNoLevelStream(t *testing.T) {
	backends(t, func(t *testing.T, client *redis.Client) {
		ctx := context.Background()
		q := queueName(t)
		p := newStringProducer(t, client, q)
		mustProduce(t, p, "existing", "x", Priority(PriorityLow))
		require.NoError(t, client.HSet(ctx, recordKey(q, "taken"), "f", "v").Err())
		_, err := p.ProduceBatch(ctx, []Job[string]{
			{ID: "a", Request: "x", Options: []ProduceOption{Priority(PriorityHigh)}},
			{ID: "b", Request: "x", Options: []ProduceOption{Priority(PriorityLow)}},
			{ID: "c", Request: "x"},
			{ID: "taken", Request: "x", Options: []ProduceOption{Priority(PriorityHigh)}},
		})
		require.ErrorIs(t, err, ErrWrongType)
		streams := levelStreams(q)
		require.Zero(t, client.Exists(ctx, streams[levelHigh]).Val(), "the high stream the batch created is gone")
		require.EqualValues(t, 1, client.XLen(ctx, streams[levelLow]).Val(), "only the earlier entry")
		require.Zero(t, client.XLen(ctx, streams[levelNormal]).Val())
		require.Zero(t, client.Exists(ctx, recordKey(q, "a"), recordKey(q, "b"), recordKey(q, "c")).Val())
	})
}

// TestPriorityShardedQueue: on a queue of 3 shards, each level has a stream
// per shard, under the shard's hash tag, and every request runs once at its
// level.
func TestPriorityShardedQueue(t *testing.T) {
	t.Parallel()
	client := realRedis(t)
	ctx := context.Background()
	q := queueName(t)
	p, err := NewProducer[string, string](client, q, &ProducerOptions{Shards: 3, Logger: testLogger(t)})
	require.NoError(t, err)
	defer p.Close()
	var prs []*Promise[string]
	want := map[string]string{}
	for i := range 90 {
		lvl := levelValue[i%numLevels]
		id := fmt.Sprintf("%s-%02d", levelPrefix[lvl], i)
		prs, want[id] = append(prs, mustProduce(t, p, id, "x", Priority(lvl))), lvl.String()
	}
	opts := fastOpts(t, "sharded", 5*time.Second)
	opts.Shards, opts.Workers = 3, 4
	var runs sync.Map
	c, err := NewConsumer(client, q, func(ctx context.Context, m *Message[string]) (string, error) {
		n, _ := runs.LoadOrStore(m.ID, new(atomic.Int64))
		n.(*atomic.Int64).Add(1)
		return m.Priority.String(), nil
	}, opts)
	require.NoError(t, err)
	runConsumer(t, c)
	for i, pr := range prs {
		got, err := pr.Wait(waitCtx(t, 20*time.Second))
		require.NoError(t, err)
		id := fmt.Sprintf("%s-%02d", levelPrefix[levelValue[i%numLevels]], i)
		require.Equal(t, want[id], got, id)
	}
	runs.Range(func(k, v any) bool {
		require.EqualValues(t, 1, v.(*atomic.Int64).Load(), "runs of %v", k)
		return true
	})
	keys, err := client.Keys(ctx, "streamq:shard:{"+q+"/*}:stream*").Result()
	require.NoError(t, err)
	require.Len(t, keys, 9, "3 levels x 3 shards: %v", keys)
}

// TestPriorityTrimsEveryLevel: the trim removes acknowledged entries from
// every level's stream (here with the fan-out marker set, so completions
// leave them to the trim).
func TestPriorityTrimsEveryLevel(t *testing.T) {
	t.Parallel()
	client, _ := miniRedis(t)
	ctx := context.Background()
	q := queueName(t)
	p := newStringProducer(t, client, q)
	opts := fastOpts(t, "fan", 5*time.Second)
	opts.Fanout, opts.Group = true, "audit"
	c, err := NewConsumer(client, q, func(ctx context.Context, m *Message[string]) (string, error) { return "", nil }, opts)
	require.NoError(t, err)
	for _, lvl := range []PriorityLevel{PriorityHigh, PriorityNormal, PriorityLow} {
		produceLevel(t, p, levelPrefix[lvl], 20, lvl)
	}
	stop := runConsumer(t, c)
	streams := levelStreams(q)
	eventually(t, 20*time.Second, func() bool {
		for _, s := range streams {
			groups, err := client.XInfoGroups(ctx, s).Result()
			if err != nil || len(groups) != 1 || groups[0].Pending != 0 || groups[0].LastDeliveredID != client.XInfoStream(ctx, s).Val().LastGeneratedID {
				return false
			}
		}
		return true
	}, "the fan-out group never acknowledged every level's entries")
	stop()
	for _, s := range streams {
		require.EqualValues(t, 20, client.XLen(ctx, s).Val(), "a fan-out group leaves entries to the trim")
	}
	n, err := c.Trim(ctx)
	require.NoError(t, err)
	require.EqualValues(t, 60, n)
	for _, s := range streams {
		require.Zero(t, client.XLen(ctx, s).Val(), s)
	}
}

// TestPriorityWeightedShares: with a backlog on every level, the starts
// follow the weights 6:3:1, each level's share within 10% of its weight's,
// over 3,000 starts.
func TestPriorityWeightedShares(t *testing.T) {
	t.Parallel()
	client := realRedis(t)
	q := queueName(t)
	p := newStringProducer(t, client, q)
	for _, lvl := range []PriorityLevel{PriorityLow, PriorityNormal, PriorityHigh} {
		produceLevel(t, p, levelPrefix[lvl], 3500, lvl)
	}
	// The weights share the takes while every level has entries in the ring
	// (read ahead); a level whose feeder lags on a loaded machine leaves the
	// takes to the others meanwhile. So a start counts only when the other
	// levels still had entries in the ring as it began (its own level had
	// the one it took): low got 333 of 3000 against 300 +- 30 in a CI run
	// when every start counted.
	const skip, sample = 200, 3000
	var starts, counted atomic.Int64
	var mu sync.Mutex
	counts := map[PriorityLevel]int{}
	opts := fastOpts(t, "shares", 10*time.Second)
	opts.Workers = 4
	var c *Consumer[string, string]
	othersQueued := func(own PriorityLevel) bool {
		var others []int
		for l := range numLevels {
			if l != levelOf[own] {
				others = append(others, l)
			}
		}
		return levelsQueued(c, others...)
	}
	c, err := NewConsumer(client, q, func(ctx context.Context, m *Message[string]) (string, error) {
		if starts.Add(1) > skip && othersQueued(m.Priority) {
			mu.Lock()
			if counted.Load() < sample {
				counts[m.Priority]++
				counted.Add(1)
			}
			mu.Unlock()
		}
		return "", nil
	}, opts)
	require.NoError(t, err)
	runConsumer(t, c)
	// Counting ends when a level's backlog runs out (high's first, at weight
	// 6), and on a loaded machine many starts may go uncounted before that
	// (a feeder lagging). Then every level gets another backlog, a few
	// times at most.
	ks, err := keys.New(q)
	require.NoError(t, err)
	levelStreams := []string{ks.Stream, ks.LevelStream(levelNames[levelHigh]), ks.LevelStream(levelNames[levelLow])}
	rounds := 1
	state := lazyString(func() string {
		lens := make([]int64, len(levelStreams))
		for i, s := range levelStreams {
			lens[i] = client.XLen(context.Background(), s).Val()
		}
		return fmt.Sprintf("%d started, %d counted, %d backlogs produced, entries left (normal, high, low) %v", starts.Load(), counted.Load(), rounds, lens)
	})
	eventually(t, 60*time.Second, func() bool {
		if counted.Load() >= sample {
			return true
		}
		for _, s := range levelStreams {
			if rounds < 4 && client.XLen(context.Background(), s).Val() == 0 {
				for _, lvl := range []PriorityLevel{PriorityLow, PriorityNormal, PriorityHigh} {
					produceLevel(t, p, fmt.Sprintf("%s%d", levelPrefix[lvl], rounds), 3500, lvl)
				}
				rounds++
				break
			}
		}
		return false
	}, "too few starts: %v", state)
	mu.Lock()
	defer mu.Unlock()
	w := DefaultPriorityWeights
	sum := w[0] + w[1] + w[2]
	t.Logf("starts of %d under backlogs on every level: high %d, normal %d, low %d (weights %v)",
		sample, counts[PriorityHigh], counts[PriorityNormal], counts[PriorityLow], w)
	for i, lvl := range []PriorityLevel{PriorityHigh, PriorityNormal, PriorityLow} {
		want := float64(sample * w[i] / sum)
		require.InDelta(t, want, counts[lvl], want*0.1, "%s", lvl)
	}
}

// TestPriorityRunNowKeepsTheLevel: Admin.RunNow appends a delayed request to
// its level's stream.
func TestPriorityRunNowKeepsTheLevel(t *testing.T) {
	backends(t, func(t *testing.T, client *redis.Client) {
		ctx := context.Background()
		q := queueName(t)
		p := newStringProducer(t, client, q)
		pr := mustProduce(t, p, "later", "x", Priority(PriorityLow), After(time.Hour))
		admin, err := NewAdmin(client, q, nil)
		require.NoError(t, err)
		require.NoError(t, admin.RunNow(ctx, "later"))
		require.EqualValues(t, 1, client.XLen(ctx, levelStreams(q)[levelLow]).Val())
		c, err := NewConsumer(client, q, func(ctx context.Context, m *Message[string]) (string, error) {
			return m.Priority.String(), nil
		}, fastOpts(t, "runnow", 5*time.Second))
		require.NoError(t, err)
		runConsumer(t, c)
		got, err := pr.Wait(waitCtx(t, 20*time.Second))
		require.NoError(t, err)
		require.Equal(t, "low", got)
	})
}

// TestPriorityFewPlacesEveryLevelReads: with fewer places than level
// feeders (Prefetch 1, three levels), a level whose stream drained must not
// keep the shard's only place: its feeder gave it back after each empty
// blocking read and took it again before the feeders waiting for it woke,
// so a request retried onto the high level (appended after every level had
// drained) waited forever. Every request completes, the retried one after
// exactly three starts.
func TestPriorityFewPlacesEveryLevelReads(t *testing.T) {
	t.Parallel()
	client := realRedis(t)
	q := queueName(t)
	p := newStringProducer(t, client, q)
	var prs []*Promise[string]
	for i := range 30 {
		prs = append(prs, mustProduce(t, p, fmt.Sprint("r", i), "x", Priority(levelValue[i%numLevels])))
	}
	retried := mustProduce(t, p, "retried", "x", Priority(PriorityHigh))
	var starts atomic.Int32
	c, err := NewConsumer(client, q, func(ctx context.Context, m *Message[string]) (string, error) {
		if m.ID == "retried" {
			starts.Add(1)
			if m.Deliveries < 3 {
				return "", RetryAfter(errors.New("later"), 20*time.Millisecond)
			}
		}
		return "ok", nil
	}, &ConsumerOptions{Workers: 1, Prefetch: 1, ClaimInterval: 50 * time.Millisecond, ReadBlock: 50 * time.Millisecond,
		RetryBackoff: 10 * time.Millisecond, TrimInterval: -1, Logger: testLogger(t)})
	require.NoError(t, err)
	defer runConsumer(t, c)()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	for _, pr := range append(prs, retried) {
		_, err := pr.Wait(ctx)
		require.NoError(t, err, "a level was never read again")
	}
	require.EqualValues(t, 3, starts.Load())
}

// sharedEntryIDs returns the entry ids that more than one of prs has (each
// promise's own entry: the same id in two level streams).
func sharedEntryIDs(prs []*Promise[string]) []string {
	seen := map[string]int{}
	var shared []string
	for _, pr := range prs {
		if seen[pr.EntryID()]++; seen[pr.EntryID()] == 2 {
			shared = append(shared, pr.EntryID())
		}
	}
	return shared
}

// TestPriorityStartCountsApartWhenEntryIDsCollide: a high and a normal
// request whose entries have the same id (appended in the same millisecond,
// each in its level's stream) keep separate start counts. The normal one
// completes while the high one runs; the high one then fails once: its
// count must still say one start while it runs (Admin.Job), and its rerun
// must be its second start.
func TestPriorityStartCountsApartWhenEntryIDsCollide(t *testing.T) {
	t.Parallel()
	client := realRedis(t)
	ctx := context.Background()

	q, _, n, h := collidingPair(t, client, "x", "x")

	hStarted, release := make(chan struct{}), make(chan struct{})
	var hRuns atomic.Int32
	c, err := NewConsumer(client, q, func(ctx context.Context, m *Message[string]) (string, error) {
		if m.ID == "n" {
			<-hStarted // both entries started: both counts written
			return "n", nil
		}
		if hRuns.Add(1) == 1 {
			close(hStarted)
			<-release
			return "", RetryAfter(errors.New("once more"), time.Millisecond)
		}
		return strconv.Itoa(m.Deliveries), nil
	}, &ConsumerOptions{Name: "collide", Workers: 2, MinIdle: 30 * time.Second,
		ReadBlock: 100 * time.Millisecond, TrimInterval: -1, Logger: testLogger(t)})
	require.NoError(t, err)
	runConsumer(t, c)
	letGo := sync.OnceFunc(func() { close(release) })
	t.Cleanup(letGo) // before the consumer stops, should an assertion fail

	_, err = n.Wait(waitCtx(t, 20*time.Second))
	require.NoError(t, err)
	admin, err := NewAdmin(client, q, nil)
	require.NoError(t, err)
	info, err := admin.Job(ctx, "h")
	require.NoError(t, err)
	assert.Equal(t, 1, info.Deliveries, "the running high request's start count after the normal one completed")

	letGo()
	got, err := h.Wait(waitCtx(t, 20*time.Second))
	require.NoError(t, err)
	require.Equal(t, "2", got, "the high request's rerun is its second start")
}

// collidingPair produces, in one batch, request "n" (payload np, default
// level) and request "h" (payload hp, high level) on fresh queues until both
// entries get one entry id (the batch's script appends both in one
// millisecond; entry ids are per stream), and returns the queue, its
// producer and both promises.
func collidingPair(t *testing.T, client *redis.Client, np, hp string) (string, *Producer[string, string], *Promise[string], *Promise[string]) {
	t.Helper()
	for attempt := 0; ; attempt++ {
		require.Less(t, attempt, 50, "no batch gave both entries one id")
		q := queueName(t)
		p := newStringProducer(t, client, q)
		prs, err := p.ProduceBatch(context.Background(), []Job[string]{
			{ID: "n", Request: np},
			{ID: "h", Request: hp, Options: []ProduceOption{Priority(PriorityHigh)}},
		})
		require.NoError(t, err)
		if prs[0].EntryID() == prs[1].EntryID() {
			return q, p, prs[0], prs[1]
		}
	}
}

// levelsQueued reports whether every one of levels has entries in the ring
// of c's latest run (queue 0): the priority tests count a start only while
// the levels it competes with were there to take instead.
func levelsQueued(c *Consumer[string, string], levels ...int) bool {
	r := c.lastRun.Load()
	if r == nil {
		return false
	}
	for _, l := range levels {
		if r.ring.classQueued(classOf(0, l)) == 0 {
			return false
		}
	}
	return true
}
