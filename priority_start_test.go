package streamq

import (
	"context"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// TestPriorityFirstHighStartsAtOnce: a queue whose consumer runs through a
// low backlog has never used the high level (no stream yet); the first high
// request starts within firstLevelBound of its produce (or, delayed, of its
// due time), far below ClaimInterval (set to 10 s here): the call that
// creates the level's stream (produce.lua, or promote.lua for a delayed
// request) tells the consumers on the shard's wake channel, instead of their
// noticing it at their next check.
func TestPriorityFirstHighStartsAtOnce(t *testing.T) {
	t.Parallel()
	const firstLevelBound = time.Second
	const delay = 200 * time.Millisecond
	client := realRedis(t)
	for _, delayed := range []bool{false, true} {
		t.Run(fmt.Sprintf("delayed=%v", delayed), func(t *testing.T) {
			q := queueName(t)
			p := newStringProducer(t, client, q)
			produceLevel(t, p, "low", 3000, PriorityLow)
			var lowStarts atomic.Int64
			started := make(chan time.Time, 1)
			opts := fastOpts(t, "first", 30*time.Second)
			opts.Workers, opts.ClaimInterval = 1, 10*time.Second
			c, err := NewConsumer(client, q, func(ctx context.Context, m *Message[string]) (string, error) {
				if m.ID == "urgent" {
					started <- time.Now()
				} else {
					lowStarts.Add(1)
					// Each low job takes a millisecond of work, so the
					// backlog lasts 3 s, longer than delay + firstLevelBound
					// on any server: a request that started within the
					// bound cannot have waited for the backlog to drain
					// (with no-op handlers a fast server drained it during
					// the delay).
					time.Sleep(time.Millisecond)
				}
				return "", nil
			}, opts)
			require.NoError(t, err)
			runConsumer(t, c)
			eventually(t, 20*time.Second, func() bool { return lowStarts.Load() >= 100 }, "the backlog never started")
			n, err := client.Exists(context.Background(), levelStreams(q)[levelHigh]).Result()
			require.NoError(t, err)
			require.Zero(t, n, "the high level's stream exists before the first high request")
			at := time.Now()
			popts := []ProduceOption{Priority(PriorityHigh)}
			if delayed {
				popts = append(popts, After(delay))
				at = at.Add(delay)
			}
			pr := mustProduce(t, p, "urgent", "x", popts...)
			defer pr.Release()
			var took time.Duration
			select {
			case s := <-started:
				took = s.Sub(at)
			case <-time.After(opts.ClaimInterval + 5*time.Second):
				t.Fatal("the high request never started")
			}
			t.Logf("first high request started %v after it was due, behind %d low ones (ClaimInterval %v, bound %v)",
				took.Round(time.Microsecond), 3000-lowStarts.Load(), opts.ClaimInterval, firstLevelBound)
			require.Less(t, took, firstLevelBound, "the new level was noticed by polling, not told")
			require.Less(t, lowStarts.Load(), int64(3000), "the high request waited for the backlog")
		})
	}
}

// TestPriorityBacklogAtStartInLevelOrder: with requests waiting on the high
// and normal levels (and low) before Run, the first start is a high one: the
// levels whose streams exist at Run's start are read from the start and the
// queue's first take waits for each level's first read, so the weights
// order the takes from the first one. With StrictPriority every high
// request starts before any normal one, and every normal before any low.
func TestPriorityBacklogAtStartInLevelOrder(t *testing.T) {
	t.Parallel()
	client := realRedis(t)
	for _, strict := range []bool{false, true} {
		t.Run(fmt.Sprintf("strict=%v", strict), func(t *testing.T) {
			q := queueName(t)
			p := newStringProducer(t, client, q)
			const per = 30
			produceLevel(t, p, "n", per, PriorityNormal)
			produceLevel(t, p, "h", per, PriorityHigh)
			produceLevel(t, p, "l", per, PriorityLow)
			var log levelLog
			opts := fastOpts(t, "start", 10*time.Second)
			opts.Workers, opts.StrictPriority = 1, strict
			c, err := NewConsumer(client, q, func(ctx context.Context, m *Message[string]) (string, error) {
				log.add(m)
				return "", nil
			}, opts)
			require.NoError(t, err)
			runConsumer(t, c)
			eventually(t, 20*time.Second, func() bool { return len(log.snapshot()) == 3*per }, "not every request ran")
			order := log.snapshot()
			t.Logf("first starts: %v", order[:12])
			require.Truef(t, strings.HasPrefix(order[0], "h-"), "the first start is %s: %v", order[0], order)
			if strict {
				for i, id := range order {
					want := []string{"h-", "n-", "l-"}[i/per]
					require.Truef(t, strings.HasPrefix(id, want), "start %d is %s: %v", i, id, order)
				}
			}
		})
	}
}

// TestPriorityBacklogAtStartFewPlaces: with fewer places than feeders (3
// shards × 3 levels, Prefetch 2), a backlog on every level at Run's start
// still runs: the start hold, which waits for feeders that may get no place
// before the workers free one, ends within maxStartHold.
func TestPriorityBacklogAtStartFewPlaces(t *testing.T) {
	t.Parallel()
	client := realRedis(t)
	q := queueName(t)
	p, err := NewProducer[string, string](client, q, &ProducerOptions{Shards: 3, Logger: testLogger(t)})
	require.NoError(t, err)
	t.Cleanup(func() { _ = p.Close() })
	const per = 20
	for _, lvl := range []PriorityLevel{PriorityNormal, PriorityHigh, PriorityLow} {
		produceLevel(t, p, levelPrefix[lvl], per, lvl)
	}
	var log levelLog
	opts := fastOpts(t, "few", 10*time.Second)
	opts.Workers, opts.Prefetch, opts.Shards = 1, 2, 3
	c, err := NewConsumer(client, q, func(ctx context.Context, m *Message[string]) (string, error) {
		log.add(m)
		return "", nil
	}, opts)
	require.NoError(t, err)
	start := time.Now()
	runConsumer(t, c)
	eventually(t, 30*time.Second, func() bool { return len(log.snapshot()) >= 1 }, "nothing started")
	first := time.Since(start)
	eventually(t, 30*time.Second, func() bool { return len(log.snapshot()) == 3*per }, "not every request ran")
	t.Logf("first start %v after Run, all %d in %v", first.Round(time.Millisecond), 3*per, time.Since(start).Round(time.Millisecond))
}

// TestPriorityBacklogAtStartInLevelOrderMulti: the same in a MultiConsumer
// (two queues, each with requests waiting on the high and normal levels
// before Run, one worker): each queue's first start is a high one.
func TestPriorityBacklogAtStartInLevelOrderMulti(t *testing.T) {
	t.Parallel()
	client := realRedis(t)
	const per = 10
	var log levelLog
	var queues []MultiQueue
	for i := range 2 {
		q := fmt.Sprintf("%s-%d", queueName(t), i)
		p := newStringProducer(t, client, q)
		produceLevel(t, p, fmt.Sprintf("n%d", i), per, PriorityNormal)
		produceLevel(t, p, fmt.Sprintf("h%d", i), per, PriorityHigh)
		c, err := NewConsumer(client, q, func(ctx context.Context, m *Message[string]) (string, error) {
			log.add(m)
			return "", nil
		}, fastOpts(t, "multi", 10*time.Second))
		require.NoError(t, err)
		queues = append(queues, MultiQueue{Consumer: c, Weight: 1})
	}
	m, err := NewMultiConsumer(&MultiOptions{Workers: 1}, queues...)
	require.NoError(t, err)
	runMulti(t, m)
	eventually(t, 20*time.Second, func() bool { return len(log.snapshot()) == 4*per }, "not every request ran")
	order := log.snapshot()
	t.Logf("first starts: %v", order[:8])
	for i := range 2 {
		for _, id := range order {
			if strings.HasPrefix(id, fmt.Sprintf("h%d-", i)) {
				break
			}
			require.Falsef(t, strings.HasPrefix(id, fmt.Sprintf("n%d-", i)), "queue %d started %s before its high requests: %v", i, id, order)
		}
	}
}
