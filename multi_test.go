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

// multiJob and multiDone are the request and result types of one queue of
// the multi-queue tests, beside queues of strings: each queue keeps its own.
type multiJob struct{ N int }
type multiDone struct{ Twice int }

// runMulti runs m until the test ends (or stop is called), then checks that
// Run returned nil and waits for its consumers' background calls.
func runMulti(t testing.TB, m *MultiConsumer) (stop func()) {
	t.Helper()
	return runUntilStopped(t, "MultiConsumer", m.Run, func() {
		for _, q := range m.queues {
			if c, ok := q.Consumer.(interface{ waitBackground() }); ok {
				c.waitBackground()
			}
		}
	})
}

// seedBatches produces n requests (ids prefix-00000...) in batches, fast;
// it keeps the promises when keep is set, else releases them.
func seedBatches[Req, Resp any](t testing.TB, p *Producer[Req, Resp], prefix string, n int, keep bool,
	req func(i int) Req, opts ...ProduceOption) (ids []string, prs []*Promise[Resp]) {
	t.Helper()
	for len(ids) < n {
		var jobs []Job[Req]
		for i := len(ids); i < n && len(jobs) < 500; i++ {
			jobs = append(jobs, Job[Req]{ID: fmt.Sprintf("%s-%05d", prefix, i), Request: req(i), Options: opts})
		}
		batch, err := p.ProduceBatch(context.Background(), jobs)
		require.NoError(t, err)
		for i, pr := range batch {
			ids = append(ids, jobs[i].ID)
			if keep {
				prs = append(prs, pr)
			} else {
				pr.Release()
			}
		}
	}
	return ids, prs
}

func newProducerOf[Req, Resp any](t testing.TB, client *redis.Client, q string) *Producer[Req, Resp] {
	t.Helper()
	p, err := NewProducer[Req, Resp](client, q, &ProducerOptions{Logger: testLogger(t)})
	require.NoError(t, err)
	t.Cleanup(func() { _ = p.Close() })
	return p
}

func strPayload(i int) string { return fmt.Sprint("x", i) }

// multiLog records the queue of every handler start, in order.
type multiLog struct {
	mu    sync.Mutex
	order []int
	ids   []string
}

func (l *multiLog) add(q int, id string) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.order = append(l.order, q)
	l.ids = append(l.ids, id)
	return len(l.order)
}

func (l *multiLog) len() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return len(l.order)
}

func (l *multiLog) snapshot() ([]int, []string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]int(nil), l.order...), append([]string(nil), l.ids...)
}

// TestMultiWeightedShares (issue 25): three queues of different request
// types with backlogs of 18,000, 9,000 and 3,000 and weights 6:3:1 over one
// pool of 4 workers: while every queue has work left, each queue's share of
// the handler starts is within 10% of its weight's (60%, 30%, 10%).
func TestMultiWeightedShares(t *testing.T) {
	t.Parallel()
	client := realRedis(t)
	totals := [3]int{18000, 9000, 3000}
	weights := [3]int{6, 3, 1}
	names := [3]string{queueName(t), queueName(t), queueName(t)}
	seeded := time.Now()
	pa := newProducerOf[multiJob, multiDone](t, client, names[0])
	seedBatches(t, pa, "a", totals[0], false, func(i int) multiJob { return multiJob{N: i} })
	pb := newProducerOf[string, string](t, client, names[1])
	seedBatches(t, pb, "b", totals[1], false, strPayload)
	pc := newProducerOf[[]int, int](t, client, names[2])
	seedBatches(t, pc, "c", totals[2], false, func(i int) []int { return []int{i, i} })
	t.Logf("seeded %d requests in %v", totals[0]+totals[1]+totals[2], time.Since(seeded).Round(time.Millisecond))

	var log multiLog
	ca, err := NewConsumer(client, names[0], func(ctx context.Context, m *Message[multiJob]) (multiDone, error) {
		log.add(0, m.ID)
		return multiDone{Twice: 2 * m.Payload.N}, nil
	}, fastOpts(t, "shares", 10*time.Second))
	require.NoError(t, err)
	cb, err := NewConsumer(client, names[1], func(ctx context.Context, m *Message[string]) (string, error) {
		log.add(1, m.ID)
		return m.Payload, nil
	}, fastOpts(t, "shares", 10*time.Second))
	require.NoError(t, err)
	cc, err := NewConsumer(client, names[2], func(ctx context.Context, m *Message[[]int]) (int, error) {
		log.add(2, m.ID)
		return len(m.Payload), nil
	}, fastOpts(t, "shares", 10*time.Second))
	require.NoError(t, err)
	m, err := NewMultiConsumer(&MultiOptions{Workers: 4},
		MultiQueue{Consumer: ca, Weight: weights[0]},
		MultiQueue{Consumer: cb, Weight: weights[1]},
		MultiQueue{Consumer: cc, Weight: weights[2]})
	require.NoError(t, err)
	all := totals[0] + totals[1] + totals[2]
	started := time.Now()
	stop := runMulti(t, m)
	eventually(t, 28*time.Second, func() bool { return log.len() >= all*9/10 }, "too few starts: %v of %d",
		lazyString(func() string { return fmt.Sprint(log.len()) }), all)
	took := time.Since(started)
	stop()
	order, _ := log.snapshot()

	// The window: while every queue has work left (none started its whole
	// backlog), at most the first 90% of the starts.
	window := all * 9 / 10
	var counts [3]int
	for i, q := range order[:window] {
		counts[q]++
		if counts[q] == totals[q] {
			window = i + 1
			break
		}
	}
	t.Logf("%d starts in %v (%.0f/s); over the first %d: shares %.4f, %.4f, %.4f (weights 6:3:1 give 0.6, 0.3, 0.1)",
		len(order), took.Round(time.Millisecond), float64(len(order))/took.Seconds(), window,
		float64(counts[0])/float64(window), float64(counts[1])/float64(window), float64(counts[2])/float64(window))
	require.GreaterOrEqual(t, window, all/2, "a queue ran out of work early: %v", counts)
	for q := range counts {
		want := float64(weights[q]) / 10
		require.InDelta(t, want, float64(counts[q])/float64(window), want*0.1, "share of queue %d", q)
	}
	// Spread evenly, not in bursts: the third queue has its share in each
	// tenth of the window too (within 40%: the choice is among the queues
	// with entries read ahead, so when a loaded machine leaves one queue's
	// feeder behind for a moment, the others take its starts; a full suite
	// beside two benchmark programs gave 342 of 2,700 in one tenth, 27% over).
	tenth := window / 10
	for k := range 10 {
		n := 0
		for _, q := range order[k*tenth : (k+1)*tenth] {
			if q == 2 {
				n++
			}
		}
		require.InDelta(t, float64(tenth)/10, float64(n), float64(tenth)/25, "queue 2's starts in tenth %d of the window", k)
	}
}

// TestMultiStrict: with Strict, no request of a lower queue starts while a
// higher queue has one waiting: with every backlog produced before Run and
// one worker, the starts are all of the highest queue, then the next, then
// the lowest, whatever order the queues are given in.
func TestMultiStrict(t *testing.T) {
	t.Parallel()
	client := realRedis(t)
	const per = 300
	names := [3]string{queueName(t), queueName(t), queueName(t)} // weights 1, 3, 2
	var log multiLog
	var cs []QueueConsumer
	for i, q := range names {
		p := newStringProducer(t, client, q)
		seedBatches(t, p, fmt.Sprint("q", i), per, false, strPayload)
		c, err := NewConsumer(client, q, func(ctx context.Context, m *Message[string]) (string, error) {
			log.add(i, m.ID)
			return "", nil
		}, fastOpts(t, "strict", 10*time.Second))
		require.NoError(t, err)
		cs = append(cs, c)
	}
	m, err := NewMultiConsumer(&MultiOptions{Workers: 1, Strict: true},
		MultiQueue{Consumer: cs[0], Weight: 1},
		MultiQueue{Consumer: cs[1], Weight: 3},
		MultiQueue{Consumer: cs[2], Weight: 2})
	require.NoError(t, err)
	runMulti(t, m)
	eventually(t, 25*time.Second, func() bool { return log.len() >= 3*per }, "too few starts: %v", lazyString(func() string {
		order, ids := log.snapshot()
		var counts [3]int
		for _, q := range order {
			counts[q]++
		}
		var rs []string
		for _, q := range names {
			sum, _ := client.XPending(context.Background(), streamKey(q), DefaultGroup).Result()
			gs, _ := client.XInfoGroups(context.Background(), streamKey(q)).Result()
			rs = append(rs, fmt.Sprintf("len %d pending %+v groups %+v", client.XLen(context.Background(), streamKey(q)).Val(), sum, gs))
		}
		return fmt.Sprint(counts, rs, " last ", ids[max(0, len(ids)-3):], " ", ringState(m))
	}))
	order, ids := log.snapshot()
	require.Len(t, order, 3*per)
	wantOrder := []int{1, 2, 0}
	for i, q := range order {
		require.Equalf(t, wantOrder[i/per], q, "start %d is %s (queue %d) while queue %d had work waiting; starts %v",
			i, ids[i], q, wantOrder[i/per], lazyString(func() string { return fmt.Sprint(ids[max(0, i-5):min(len(ids), i+5)]) }))
	}
	for i := range ids {
		// Each queue's requests start in their order.
		require.Equal(t, fmt.Sprintf("q%d-%05d", wantOrder[i/per], i%per), ids[i])
	}
}

// TestMultiPausedQueueHoldsNoWorker: a paused queue holds neither the
// pool's only worker nor the others' reads (the other queue's requests all
// complete, weighted or strict, paused before Run or mid-run with a backlog
// in the ring), and its requests run after Resume; a slow rate-limited
// queue holds at most one worker, so the other queue's requests complete
// while it has started only a few.
func TestMultiPausedQueueHoldsNoWorker(t *testing.T) {
	t.Parallel()
	client := realRedis(t)
	for _, strict := range []bool{false, true} {
		t.Run(fmt.Sprintf("paused/strict=%v", strict), func(t *testing.T) {
			t.Parallel()
			pausedQueueHoldsNoWorker(t, client, strict)
		})
	}
	t.Run("pausedMidRun/strict", func(t *testing.T) {
		t.Parallel()
		pausedMidRunStrict(t, client)
	})
	t.Run("rateLimited", func(t *testing.T) {
		t.Parallel()
		qa, qb := queueName(t), queueName(t)
		const nA, nB = 40, 300
		seedBatches(t, newStringProducer(t, client, qa), "a", nA, false, strPayload)
		_, prsB := seedBatches(t, newStringProducer(t, client, qb), "b", nB, true, strPayload)
		var startsA atomic.Int64
		optsA := fastOpts(t, "limited", 10*time.Second)
		optsA.RateLimit = &RateLimit{N: 5, Per: time.Second}
		ca, err := NewConsumer(client, qa, func(ctx context.Context, m *Message[string]) (string, error) {
			startsA.Add(1)
			return "", nil
		}, optsA)
		require.NoError(t, err)
		cb, err := NewConsumer(client, qb, func(ctx context.Context, m *Message[string]) (string, error) {
			return "b:" + m.Payload, nil
		}, fastOpts(t, "limited", 10*time.Second))
		require.NoError(t, err)
		// The limited queue has the larger weight: both workers would take
		// its slots and wait for its tokens.
		m, err := NewMultiConsumer(&MultiOptions{Workers: 2},
			MultiQueue{Consumer: ca, Weight: 5}, MultiQueue{Consumer: cb, Weight: 1})
		require.NoError(t, err)
		begun := time.Now()
		runMulti(t, m)
		for i, pr := range prsB {
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
			_, err := pr.Wait(ctx)
			cancel()
			if err != nil {
				t.Logf("b %d not done after 2s: %s", i, ringState(m))
				_, err = pr.Wait(waitCtx(t, 20*time.Second))
			}
			require.NoError(t, err, "b %d", i)
		}
		took := time.Since(begun)
		a := startsA.Load()
		t.Logf("the unlimited queue's %d requests completed in %v while the limited queue (5/s) started %d", nB, took.Round(time.Millisecond), a)
		require.Less(t, a, int64(nA/2), "the unlimited queue waited for the limited one's tokens")
		eventually(t, 10*time.Second, func() bool { return startsA.Load() >= a+2 }, "the limited queue starts nothing")
	})
}

// TestMultiOwnGroupsAndDeadLetters: each queue of a MultiConsumer keeps its
// own options: its group, MaxDeliveries and dead-letter stream, and its
// callers get results of its own type.
func TestMultiOwnGroupsAndDeadLetters(t *testing.T) {
	t.Parallel()
	client := realRedis(t)
	ctx := context.Background()
	qa, qb := queueName(t), queueName(t)
	pa := newProducerOf[multiJob, multiDone](t, client, qa)
	pb := newStringProducer(t, client, qb)
	_, prsA := seedBatches(t, pa, "a", 50, true, func(i int) multiJob { return multiJob{N: i} })
	_, prsB := seedBatches(t, pb, "b", 50, true, strPayload)
	badA, err := pa.Produce(ctx, "bad-a", multiJob{N: -1})
	require.NoError(t, err)
	badB := mustProduce(t, pb, "bad-b", "x")
	var mu sync.Mutex
	badStarts := map[string][]int{}
	optsA := fastOpts(t, "own", 10*time.Second)
	optsA.MaxDeliveries = 2
	ca, err := NewConsumer(client, qa, func(ctx context.Context, m *Message[multiJob]) (multiDone, error) {
		if m.Payload.N < 0 {
			mu.Lock()
			badStarts[m.ID] = append(badStarts[m.ID], m.Deliveries)
			mu.Unlock()
			return multiDone{}, errors.New("a fails")
		}
		return multiDone{Twice: 2 * m.Payload.N}, nil
	}, optsA)
	require.NoError(t, err)
	optsB := fastOpts(t, "own", 10*time.Second)
	optsB.MaxDeliveries, optsB.Group = 4, "bgroup"
	cb, err := NewConsumer(client, qb, func(ctx context.Context, m *Message[string]) (string, error) {
		if m.ID == "bad-b" {
			mu.Lock()
			badStarts[m.ID] = append(badStarts[m.ID], m.Deliveries)
			mu.Unlock()
			return "", errors.New("b fails")
		}
		return "b:" + m.Payload, nil
	}, optsB)
	require.NoError(t, err)
	m, err := NewMultiConsumer(&MultiOptions{Workers: 3}, MultiQueue{Consumer: ca, Weight: 2}, MultiQueue{Consumer: cb})
	require.NoError(t, err)
	runMulti(t, m)

	for i, pr := range prsA {
		got, err := pr.Wait(waitCtx(t, 20*time.Second))
		require.NoError(t, err)
		require.Equal(t, multiDone{Twice: 2 * i}, got)
	}
	for i, pr := range prsB {
		got, err := pr.Wait(waitCtx(t, 20*time.Second))
		require.NoError(t, err)
		require.Equal(t, fmt.Sprint("b:x", i), got)
	}
	_, err = badA.Wait(waitCtx(t, 20*time.Second))
	require.ErrorIs(t, err, ErrDeadLettered)
	_, err = badB.Wait(waitCtx(t, 20*time.Second))
	require.ErrorIs(t, err, ErrDeadLettered)
	mu.Lock()
	require.Equal(t, map[string][]int{"bad-a": {1, 2}, "bad-b": {1, 2, 3, 4}}, badStarts)
	mu.Unlock()

	for _, tc := range []struct {
		q, group, id string
		deliveries   int
	}{{qa, DefaultGroup, "bad-a", 2}, {qb, "bgroup", "bad-b", 4}} {
		admin, err := NewAdmin(client, tc.q, nil)
		require.NoError(t, err)
		dls, err := admin.DeadLetters(ctx, "", 10)
		require.NoError(t, err)
		require.Len(t, dls, 1, "dead letters of %s", tc.q)
		require.Equal(t, tc.id, dls[0].ID)
		require.Equal(t, tc.deliveries, dls[0].Deliveries)
		require.Contains(t, dls[0].Error, strings.TrimPrefix(tc.id, "bad-")+" fails", "the handler's last error")
		groups, err := client.XInfoGroups(ctx, streamKey(tc.q)).Result()
		require.NoError(t, err)
		require.Len(t, groups, 1)
		require.Equal(t, tc.group, groups[0].Name, "the queue's own group")
	}
}

// TestMultiConsumerValidation: NewMultiConsumer refuses what cannot work,
// with ErrInvalidOptions; Run refuses to run twice, or with a consumer that
// runs already, and a member's own Run refuses while the MultiConsumer runs.
func TestMultiConsumerValidation(t *testing.T) {
	t.Parallel()
	client, _ := miniRedis(t)
	handler := func(ctx context.Context, m *Message[string]) (string, error) { return m.Payload, nil }
	consumer := func(q string, o *ConsumerOptions) *Consumer[string, string] {
		t.Helper()
		if o == nil {
			o = &ConsumerOptions{}
		}
		o.Logger, o.ReadBlock = testLogger(t), 20*time.Millisecond
		c, err := NewConsumer(client, q, handler, o)
		require.NoError(t, err)
		return c
	}
	qa, qb := queueName(t), queueName(t)
	a, b := consumer(qa, nil), consumer(qb, nil)
	var nilConsumer *Consumer[string, string]
	sharded4, sharded2 := consumer(queueName(t), &ConsumerOptions{Shards: 4}), consumer(queueName(t), &ConsumerOptions{Shards: 2})
	for _, tc := range []struct {
		name   string
		opts   *MultiOptions
		queues []MultiQueue
		want   string
	}{
		{"no queues", nil, nil, "at least one"},
		{"nil consumer", nil, []MultiQueue{{Consumer: a}, {}}, "MultiQueue[1].Consumer is nil"},
		{"typed nil consumer", nil, []MultiQueue{{Consumer: nilConsumer}}, "MultiQueue[0].Consumer is nil"},
		{"negative weight", nil, []MultiQueue{{Consumer: a, Weight: -1}}, "Weight is -1"},
		{"weight too large", nil, []MultiQueue{{Consumer: a, Weight: MaxQueueWeight + 1}}, "Weight is 1001"},
		{"queue twice", nil, []MultiQueue{{Consumer: a}, {Consumer: b}, {Consumer: consumer(qa, nil)}}, "given twice"},
		{"prefetch below shards", &MultiOptions{Prefetch: 5}, []MultiQueue{{Consumer: sharded4}, {Consumer: sharded2}}, "shards"},
		{"prefetch below workers", &MultiOptions{Workers: 8, Prefetch: 4}, []MultiQueue{{Consumer: a}}, "Workers"},
		{"negative workers", &MultiOptions{Workers: -1}, []MultiQueue{{Consumer: a}}, "Workers"},
		{"too many workers", &MultiOptions{Workers: MaxWorkers + 1}, []MultiQueue{{Consumer: a}}, "MaxWorkers"},
	} {
		m, err := NewMultiConsumer(tc.opts, tc.queues...)
		require.ErrorIs(t, err, ErrInvalidOptions, tc.name)
		require.ErrorContains(t, err, tc.want, tc.name)
		require.Nil(t, m, tc.name)
	}
	// What is accepted: the bounds, and one queue read by two groups.
	for _, tc := range []struct {
		opts   *MultiOptions
		queues []MultiQueue
	}{
		{&MultiOptions{Prefetch: 6}, []MultiQueue{{Consumer: sharded4}, {Consumer: sharded2}}},
		{nil, []MultiQueue{{Consumer: a, Weight: MaxQueueWeight}, {Consumer: consumer(qa, &ConsumerOptions{Group: "other", Fanout: true})}}},
	} {
		_, err := NewMultiConsumer(tc.opts, tc.queues...)
		require.NoError(t, err)
	}

	// A member that runs on its own: Run refuses, and leaves the other
	// members free.
	m, err := NewMultiConsumer(nil, MultiQueue{Consumer: a}, MultiQueue{Consumer: b})
	require.NoError(t, err)
	stopB := runConsumer(t, b)
	<-b.Ready()
	err = m.Run(context.Background())
	require.ErrorContains(t, err, "already running")
	require.ErrorContains(t, err, qb)
	stopB()
	stopA := runConsumer(t, a) // the failed Run released a
	<-a.Ready()
	stopA()

	// While the MultiConsumer runs, its members' own Run and a second Run
	// are refused.
	p := newStringProducer(t, client, qa)
	runMulti(t, m)
	select {
	case <-m.Ready():
	case <-time.After(10 * time.Second):
		t.Fatal("the MultiConsumer never became ready")
	}
	require.ErrorContains(t, a.Run(context.Background()), "already running")
	require.ErrorContains(t, b.Run(context.Background()), "already running")
	require.ErrorContains(t, m.Run(context.Background()), "already running")
	got, err := mustProduce(t, p, "one", "still works").Wait(waitCtx(t, 10*time.Second))
	require.NoError(t, err)
	require.Equal(t, "still works", got)
}

// TestMultiPriorityLevelsInsideQueues: a queue of a MultiConsumer keeps its
// priority levels: a high-priority request produced behind a low backlog of
// its queue starts after at most one read-ahead's worth of them, while the
// other queue's backlog runs beside it.
func TestMultiPriorityLevelsInsideQueues(t *testing.T) {
	t.Parallel()
	client := realRedis(t)
	qa, qb := queueName(t), queueName(t)
	pa := newStringProducer(t, client, qa)
	// The queue uses the high level already: its stream exists.
	_, err := mustProduce(t, pa, "warm", "x", Priority(PriorityHigh)).Wait(waitCtx(t, 100*time.Millisecond))
	require.ErrorIs(t, err, context.DeadlineExceeded, "no consumer yet")
	produceLevel(t, pa, "low", 5000, PriorityLow)
	seedBatches(t, newStringProducer(t, client, qb), "b", 5000, false, strPayload)
	var lowStarts, bStarts atomic.Int64
	var urgentAt atomic.Int64
	urgentAt.Store(-1)
	var urgentLevel atomic.Value
	ca, err := NewConsumer(client, qa, func(ctx context.Context, m *Message[string]) (string, error) {
		switch {
		case m.ID == "urgent":
			urgentAt.Store(lowStarts.Load())
			urgentLevel.Store(m.Priority)
		case strings.HasPrefix(m.ID, "low"):
			lowStarts.Add(1)
		}
		return "", nil
	}, fastOpts(t, "levels", 10*time.Second))
	require.NoError(t, err)
	cb, err := NewConsumer(client, qb, func(ctx context.Context, m *Message[string]) (string, error) {
		bStarts.Add(1)
		return "", nil
	}, fastOpts(t, "levels", 10*time.Second))
	require.NoError(t, err)
	const workers = 2
	m, err := NewMultiConsumer(&MultiOptions{Workers: workers}, MultiQueue{Consumer: ca}, MultiQueue{Consumer: cb})
	require.NoError(t, err)
	runMulti(t, m)
	eventually(t, 20*time.Second, func() bool { return lowStarts.Load() >= 200 }, "the backlog never started")
	r := m.lastPool.Load().ring
	r.mu.Lock()
	target := r.target
	r.mu.Unlock()
	before := lowStarts.Load()
	pr := mustProduce(t, pa, "urgent", "x", Priority(PriorityHigh))
	_, err = pr.Wait(waitCtx(t, 20*time.Second))
	require.NoError(t, err)
	jumped := urgentAt.Load() - before
	t.Logf("a high request produced behind %d low ones of its queue started after %d of them (read-ahead target %d); the other queue started %d meanwhile",
		5000-before, jumped, target, bStarts.Load())
	require.Equal(t, PriorityHigh, urgentLevel.Load())
	require.LessOrEqual(t, jumped, int64(target+workers), "within one read-ahead's worth of low requests")
	require.Less(t, lowStarts.Load(), int64(5000), "the high request did not wait for the backlog")
	require.Positive(t, bStarts.Load(), "the other queue ran beside it")
}

// ringState describes the latest Run's shared ring, for failure messages.
func ringState(m *MultiConsumer) string {
	p := m.lastPool.Load()
	if p == nil {
		return "no run"
	}
	r := p.ring
	r.mu.Lock()
	defer r.mu.Unlock()
	r.qmu.Lock()
	defer r.qmu.Unlock()
	var qs []string
	for i := range r.qs {
		q := &r.qs[i]
		qs = append(qs, fmt.Sprintf("{queued %d paused %v waiting %v out %d backlog %v}", q.n, q.paused, q.waiting,
			r.queueOut(i), r.backlog[classOf(i, 0):classOf(i+1, 0)]))
	}
	for i, q := range p.queues {
		if run, ok := q.(*run[string, string]); ok {
			run.places.mu.Lock()
			qs[i] += fmt.Sprintf(" places free %v of %v", run.places.free, run.places.max)
			run.places.mu.Unlock()
		}
	}
	return fmt.Sprintf("ring free %d target %d settled %d held %d feeders %d queues %v", r.free, r.target, r.settled, r.held, r.shards, qs)
}

// pausedQueueHoldsNoWorker: queue A, paused before Run, has the larger
// weight (with strict, it comes first): B's requests all complete, none of
// A's start, and A's complete after Resume.
func pausedQueueHoldsNoWorker(t *testing.T, client *redis.Client, strict bool) {
	ctx := context.Background()
	qa, qb := queueName(t), queueName(t)
	admin, err := NewAdmin(client, qa, nil)
	require.NoError(t, err)
	require.NoError(t, admin.Pause(ctx))
	_, prsA := seedBatches(t, newStringProducer(t, client, qa), "a", 20, true, strPayload)
	_, prsB := seedBatches(t, newStringProducer(t, client, qb), "b", 200, true, strPayload)
	var startsA atomic.Int64
	ca, err := NewConsumer(client, qa, func(ctx context.Context, m *Message[string]) (string, error) {
		startsA.Add(1)
		return "a:" + m.Payload, nil
	}, fastOpts(t, "paused", 10*time.Second))
	require.NoError(t, err)
	cb, err := NewConsumer(client, qb, func(ctx context.Context, m *Message[string]) (string, error) {
		return "b:" + m.Payload, nil
	}, fastOpts(t, "paused", 10*time.Second))
	require.NoError(t, err)
	// A has the larger weight: the worker would take its slots first.
	m, err := NewMultiConsumer(&MultiOptions{Workers: 1, Strict: strict},
		MultiQueue{Consumer: ca, Weight: 10}, MultiQueue{Consumer: cb, Weight: 1})
	require.NoError(t, err)
	runMulti(t, m)
	for i, pr := range prsB {
		got, err := pr.Wait(waitCtx(t, 20*time.Second))
		require.NoError(t, err, "b %d: the paused queue held the worker: %s", i, lazyString(func() string { return ringState(m) }))
		require.Equal(t, fmt.Sprint("b:x", i), got)
	}
	require.Zero(t, startsA.Load(), "a paused queue's request started")
	require.NoError(t, admin.Resume(ctx))
	for i, pr := range prsA {
		got, err := pr.Wait(waitCtx(t, 20*time.Second))
		require.NoError(t, err, "a %d after Resume", i)
		require.Equal(t, fmt.Sprint("a:x", i), got)
	}
}

// pausedMidRunStrict: with Strict, the highest queue is paused while its
// backlog runs (its slots wait in the ring, its stream backlogged): the
// lower queue, which read nothing so far, reads and completes meanwhile,
// and the high queue starts nothing from the moment its consumer has seen
// the pause until Resume. The pause is seen only at the consumer's next
// check (PauseCheckInterval), by which time a fast server could have run the
// whole backlog, so the high queue's handler holds the only worker until
// the pause has been seen.
func pausedMidRunStrict(t *testing.T, client *redis.Client) {
	ctx := context.Background()
	qa, qb := queueName(t), queueName(t)
	const nA, holdAt = 3000, 100
	seedBatches(t, newStringProducer(t, client, qa), "a", nA, false, strPayload)
	_, prsB := seedBatches(t, newStringProducer(t, client, qb), "b", 100, true, strPayload)
	admin, err := NewAdmin(client, qa, nil)
	require.NoError(t, err)
	var startsA, startsB atomic.Int64
	held, hold := make(chan struct{}), make(chan struct{})
	ca, err := NewConsumer(client, qa, func(ctx context.Context, m *Message[string]) (string, error) {
		if startsA.Add(1) == holdAt {
			close(held)
			select {
			case <-hold:
			case <-ctx.Done():
			}
		}
		return "", nil
	}, fastOpts(t, "midrun", 10*time.Second))
	require.NoError(t, err)
	cb, err := NewConsumer(client, qb, func(ctx context.Context, m *Message[string]) (string, error) {
		startsB.Add(1)
		return "b:" + m.Payload, nil
	}, fastOpts(t, "midrun", 10*time.Second))
	require.NoError(t, err)
	m, err := NewMultiConsumer(&MultiOptions{Workers: 1, Strict: true},
		MultiQueue{Consumer: ca, Weight: 2}, MultiQueue{Consumer: cb, Weight: 1})
	require.NoError(t, err)
	runMulti(t, m)
	var once sync.Once
	release := func() { once.Do(func() { close(hold) }) }
	t.Cleanup(release) // before runMulti's stop, which waits for the handler

	select {
	case <-held:
	case <-waitCtx(t, 20*time.Second).Done():
		t.Fatalf("the high queue started %d of %d requests: %s", startsA.Load(), holdAt, ringState(m))
	}
	require.Zero(t, startsB.Load(), "strict: the low queue started while the high one had a backlog")
	require.NoError(t, admin.Pause(ctx))
	eventually(t, 20*time.Second, func() bool { return pauseSeen(m, 0) }, "the high queue's consumer never saw the pause")
	release()
	for i, pr := range prsB {
		got, err := pr.Wait(waitCtx(t, 20*time.Second))
		require.NoError(t, err, "b %d: the paused high queue kept the low one from reading: %s", i, lazyString(func() string { return ringState(m) }))
		require.Equal(t, fmt.Sprint("b:x", i), got)
	}
	require.Equal(t, int64(holdAt), startsA.Load(), "the high queue started requests after its consumer had seen the pause")
	require.NoError(t, admin.Resume(ctx))
	eventually(t, 20*time.Second, func() bool { return startsA.Load() > holdAt }, "the high queue never resumed")
}

// pauseSeen reports whether queue qi of m's latest run has seen its pause:
// the ring gives none of its slots to a worker, and its gate holds a worker
// that took one before.
func pauseSeen(m *MultiConsumer, qi int) bool {
	p := m.lastPool.Load()
	if p == nil {
		return false
	}
	r := p.ring
	r.mu.Lock()
	r.qmu.Lock()
	paused := r.qs[qi].paused
	r.qmu.Unlock()
	r.mu.Unlock()
	run, ok := p.queues[qi].(*run[string, string])
	return paused && ok && !run.pause.isOpen()
}

// failReads is a client hook that fails every XREADGROUP and script call
// while on is set.
type failReads struct{ on atomic.Bool }

func (h *failReads) DialHook(next redis.DialHook) redis.DialHook { return next }

func (h *failReads) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if name := strings.ToLower(cmd.Name()); h.on.Load() && (name == "xreadgroup" || name == "evalsha" || name == "eval") {
			err := errors.New("injected: reads fail")
			cmd.SetErr(err)
			return err
		}
		return next(ctx, cmd)
	}
}

func (h *failReads) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}

// TestMultiFailingQueueStallsOnlyItself: with Strict, the highest queue's
// reads and scripts fail from its first read on (its Redis, here its client,
// fails): the lower queue's requests still complete, and the high queue's
// once its calls work again.
func TestMultiFailingQueueStallsOnlyItself(t *testing.T) {
	t.Parallel()
	client := realRedis(t)
	qa, qb := queueName(t), queueName(t)
	_, prsA := seedBatches(t, newStringProducer(t, client, qa), "a", 20, true, strPayload)
	_, prsB := seedBatches(t, newStringProducer(t, client, qb), "b", 100, true, strPayload)
	hook := &failReads{}
	hook.on.Store(true)
	clientA := ownClient(t, client)
	clientA.AddHook(hook)
	ca, err := NewConsumer(clientA, qa, func(ctx context.Context, m *Message[string]) (string, error) {
		return "a:" + m.Payload, nil
	}, fastOpts(t, "failing", 10*time.Second))
	require.NoError(t, err)
	cb, err := NewConsumer(client, qb, func(ctx context.Context, m *Message[string]) (string, error) {
		return "b:" + m.Payload, nil
	}, fastOpts(t, "failing", 10*time.Second))
	require.NoError(t, err)
	m, err := NewMultiConsumer(&MultiOptions{Workers: 1, Strict: true},
		MultiQueue{Consumer: ca, Weight: 2}, MultiQueue{Consumer: cb, Weight: 1})
	require.NoError(t, err)
	runMulti(t, m)
	for i, pr := range prsB {
		got, err := pr.Wait(waitCtx(t, 20*time.Second))
		require.NoError(t, err, "b %d: the failing high queue kept the low one from reading: %s", i, lazyString(func() string { return ringState(m) }))
		require.Equal(t, fmt.Sprint("b:x", i), got)
	}
	hook.on.Store(false)
	for i, pr := range prsA {
		got, err := pr.Wait(waitCtx(t, 20*time.Second))
		require.NoError(t, err, "a %d", i)
		require.Equal(t, fmt.Sprint("a:x", i), got)
	}
}
