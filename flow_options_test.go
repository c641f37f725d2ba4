package streamq

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// TestFlowChildrenStartInLevelOrder: a flow whose children are of the
// three levels, produced before any consumer runs (a backlog), starts them
// in level order: the first start is a high child, and with StrictPriority
// every high child starts before any normal one and every normal before any
// low. Each child runs at its level, and the parent (Priority high) runs
// last, at its level.
func TestFlowChildrenStartInLevelOrder(t *testing.T) {
	t.Parallel()
	client := realRedis(t)
	for _, strict := range []bool{false, true} {
		t.Run(fmt.Sprintf("strict=%v", strict), func(t *testing.T) {
			q := NewQueue[string, string](queueName(t))
			p, err := q.NewProducer(client, &ProducerOptions{Logger: testLogger(t)})
			require.NoError(t, err)
			t.Cleanup(func() { _ = p.Close() })
			const per = 20
			var kids []Child
			for i := range per {
				for _, lvl := range []PriorityLevel{PriorityLow, PriorityNormal, PriorityHigh} {
					id := fmt.Sprintf("%s-%02d", levelPrefix[lvl], i)
					kids = append(kids, ChildOf(q, id, id, Priority(lvl)))
				}
			}
			pr, err := p.ProduceFlow(context.Background(), "parent", "p", kids,
				&FlowOptions{Parent: []ProduceOption{Priority(PriorityHigh)}})
			require.NoError(t, err)
			var log levelLog
			opts := fastOpts(t, "flowlevels", 10*time.Second)
			opts.Workers, opts.StrictPriority = 1, strict
			c, err := q.NewConsumer(client, func(ctx context.Context, m *Message[string]) (string, error) {
				log.add(m)
				return "", nil
			}, opts)
			require.NoError(t, err)
			runConsumer(t, c)
			_, err = waitFor(t, pr)
			require.NoError(t, err)
			order := log.snapshot()
			require.Len(t, order, 3*per+1)
			t.Logf("first starts: %v", order[:12])
			require.Truef(t, strings.HasPrefix(order[0], "h-"), "the first start is %s: %v", order[0], order)
			require.Equal(t, "parent", order[3*per], "the parent runs last")
			if strict {
				for i, id := range order[:3*per] {
					want := []string{"h-", "n-", "l-"}[i/per]
					require.Truef(t, strings.HasPrefix(id, want), "start %d is %s: %v", i, id, order)
				}
			}
			log.mu.Lock()
			defer log.mu.Unlock()
			for id, lvl := range log.pri {
				want := PriorityHigh
				switch {
				case strings.HasPrefix(id, "n-"):
					want = PriorityNormal
				case strings.HasPrefix(id, "l-"):
					want = PriorityLow
				}
				require.Equal(t, want, lvl, "%s ran at its level", id)
			}
		})
	}
}

// TestFlowDelayedChildAndParent: a child produced with After(d) starts no
// earlier than d after the produce, and its outcome still releases the
// parent; a parent with After(dp), released before dp by its children, runs
// no earlier than dp after the produce (a parent with At in the past runs at
// once). While the delayed child waits, the waiting parent's Admin.Job shows
// it without an outcome: ErrChildPending, through ChildResultOf too.
func TestFlowDelayedChildAndParent(t *testing.T) {
	t.Parallel()
	client := realRedis(t)
	ctx := context.Background()
	q := NewQueue[string, string](queueName(t))
	p, err := q.NewProducer(client, &ProducerOptions{Logger: testLogger(t)})
	require.NoError(t, err)
	t.Cleanup(func() { _ = p.Close() })
	var mu sync.Mutex
	started := map[string]time.Time{}
	c, err := q.NewConsumer(client, func(ctx context.Context, m *Message[string]) (string, error) {
		mu.Lock()
		started[m.ID] = time.Now()
		mu.Unlock()
		return m.ID + "!", nil
	}, fastOpts(t, "flowdelay", 10*time.Second))
	require.NoError(t, err)
	runConsumer(t, c)

	const d, dp = 600 * time.Millisecond, 900 * time.Millisecond
	at := time.Now()
	pr, err := p.ProduceFlow(ctx, "parent-1", "p", []Child{
		ChildOf(q, "now-1", "x"),
		ChildOf(q, "later-1", "x", After(d)),
	}, nil)
	require.NoError(t, err)
	admin, err := q.NewAdmin(client, nil)
	require.NoError(t, err)
	info, err := admin.Job(ctx, "parent-1")
	require.NoError(t, err)
	require.Len(t, info.Children, 2)
	require.ErrorIs(t, info.Children[1].Err, ErrChildPending, "the delayed child has no outcome yet")
	_, err = ChildResultOf(q, info.Children[1])
	require.True(t, errors.Is(err, ErrChildPending), "ChildResultOf: %v", err)
	_, err = waitFor(t, pr)
	require.NoError(t, err)
	mu.Lock()
	later, parent := started["later-1"].Sub(at), started["parent-1"].Sub(at)
	mu.Unlock()
	t.Logf("child After(%v) started %v after the produce, the parent %v", d, later.Round(time.Millisecond), parent.Round(time.Millisecond))
	require.GreaterOrEqual(t, later, d, "the delayed child started early")
	require.GreaterOrEqual(t, parent, later, "the parent ran before its delayed child")

	// A delayed parent whose children finish first waits for its time.
	at = time.Now()
	pr, err = p.ProduceFlow(ctx, "parent-2", "p", []Child{ChildOf(q, "now-2", "x")},
		&FlowOptions{Parent: []ProduceOption{After(dp)}})
	require.NoError(t, err)
	_, err = waitFor(t, pr)
	require.NoError(t, err)
	mu.Lock()
	child, parent := started["now-2"].Sub(at), started["parent-2"].Sub(at)
	mu.Unlock()
	t.Logf("parent After(%v) started %v after the produce, its child %v", dp, parent.Round(time.Millisecond), child.Round(time.Millisecond))
	require.GreaterOrEqual(t, parent, dp, "the delayed parent started early")

	// At in the past: no wait.
	pr, err = p.ProduceFlow(ctx, "parent-3", "p", []Child{ChildOf(q, "now-3", "x")},
		&FlowOptions{Parent: []ProduceOption{At(time.Now().Add(-time.Hour))}})
	require.NoError(t, err)
	got, err := waitFor(t, pr)
	require.NoError(t, err)
	require.Equal(t, "parent-3!", got)
}

// TestFlowInterceptorSeesEveryNode: a produce interceptor sees one call
// holding the flow's parent and every node below it (a nested flow's too),
// each with its queue; the headers it sets reach each request's handler, so
// a trace context spans the whole flow. Only the parent's EntryID is set,
// when it was appended at once.
func TestFlowInterceptorSeesEveryNode(t *testing.T) {
	t.Parallel()
	client := realRedis(t)
	ctx := context.Background()
	q, other := NewQueue[string, string](queueName(t)), NewQueue[string, string](queueName(t))
	var seen [][]string
	p, err := q.NewProducer(client, &ProducerOptions{Logger: testLogger(t), Interceptors: []ProduceInterceptor{
		func(ctx context.Context, msgs []*Outgoing, next func(context.Context) error) error {
			var call []string
			for _, m := range msgs {
				call = append(call, m.Queue+"/"+m.ID)
				if m.Headers == nil {
					m.Headers = map[string]string{}
				}
				m.Headers["trace"] = "t-" + m.ID
			}
			seen = append(seen, call)
			return next(ctx)
		},
	}})
	require.NoError(t, err)
	t.Cleanup(func() { _ = p.Close() })
	var mu sync.Mutex
	traces := map[string]string{}
	handler := func(ctx context.Context, m *Message[string]) (string, error) {
		mu.Lock()
		traces[m.ID] = m.Headers["trace"]
		mu.Unlock()
		return "", nil
	}
	for _, qq := range []Queue[string, string]{q, other} {
		c, err := qq.NewConsumer(client, handler, fastOpts(t, "flowic", 10*time.Second))
		require.NoError(t, err)
		runConsumer(t, c)
	}
	pr, err := p.ProduceFlow(ctx, "root", "p", []Child{
		ChildOf(q, "a", "x", Headers(map[string]string{"own": "1"})),
		ChildFlow(other, "b", "x", []Child{ChildOf(q, "b1", "x"), ChildOf(other, "b2", "x", Priority(PriorityHigh))}, nil),
	}, nil)
	require.NoError(t, err)
	_, err = waitFor(t, pr)
	require.NoError(t, err)
	require.Equal(t, [][]string{{
		q.Name() + "/root", q.Name() + "/a", other.Name() + "/b", q.Name() + "/b1", other.Name() + "/b2",
	}}, seen)
	mu.Lock()
	defer mu.Unlock()
	require.Equal(t, map[string]string{"root": "t-root", "a": "t-a", "b": "t-b", "b1": "t-b1", "b2": "t-b2"}, traces)
}

// TestFlowNewLevelIsTold: a consumer already running (ClaimInterval 10 s)
// starts a flow's nodes of a level whose stream did not exist at once: the
// flow call that appends a child to a new level's stream, and the
// completion that releases a parent onto one, tell the consumers on the
// wake channel, as a produce does.
func TestFlowNewLevelIsTold(t *testing.T) {
	t.Parallel()
	client := realRedis(t)
	ctx := context.Background()
	q := NewQueue[string, string](queueName(t))
	p, err := q.NewProducer(client, &ProducerOptions{Logger: testLogger(t)})
	require.NoError(t, err)
	t.Cleanup(func() { _ = p.Close() })
	opts := fastOpts(t, "flowtold", 30*time.Second)
	opts.ClaimInterval = 10 * time.Second
	c, err := q.NewConsumer(client, func(ctx context.Context, m *Message[string]) (string, error) {
		return m.Priority.String(), nil
	}, opts)
	require.NoError(t, err)
	runConsumer(t, c)
	for _, tc := range []struct {
		name          string
		child, parent PriorityLevel
	}{{"parent released onto a new level", PriorityNormal, PriorityHigh}, {"child on a new level", PriorityLow, PriorityNormal}} {
		at := time.Now()
		pr, err := p.ProduceFlow(ctx, "parent-"+tc.child.String(), "p", []Child{ChildOf(q, "child-"+tc.child.String(), "x", Priority(tc.child))},
			&FlowOptions{Parent: []ProduceOption{Priority(tc.parent)}})
		require.NoError(t, err)
		wctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		got, err := pr.Wait(wctx)
		cancel()
		require.NoError(t, err, "%s: not started within 5 s (ClaimInterval %v)", tc.name, opts.ClaimInterval)
		require.Equal(t, tc.parent.String(), got)
		t.Logf("%s: the flow ran in %v", tc.name, time.Since(at).Round(time.Millisecond))
	}
}

// TestFlowCancelReachesDelayedAndLeveledChildren: Admin.Cancel of a waiting
// parent cancels its children that wait in the schedule (After) or are
// queued on a level's stream, as it does the others.
func TestFlowCancelReachesDelayedAndLeveledChildren(t *testing.T) {
	t.Parallel()
	client := realRedis(t)
	ctx := context.Background()
	q := NewQueue[string, string](queueName(t))
	p, err := q.NewProducer(client, &ProducerOptions{Logger: testLogger(t)})
	require.NoError(t, err)
	t.Cleanup(func() { _ = p.Close() })
	// No consumer: every child stays scheduled or queued.
	pr, err := p.ProduceFlow(ctx, "root", "p", []Child{
		ChildOf(q, "high", "x", Priority(PriorityHigh)),
		ChildOf(q, "later", "x", After(time.Hour)),
		ChildOf(q, "low-later", "x", Priority(PriorityLow), After(time.Hour)),
	}, &FlowOptions{Parent: []ProduceOption{Priority(PriorityLow)}})
	require.NoError(t, err)
	admin, err := q.NewAdmin(client, nil)
	require.NoError(t, err)
	info, err := admin.Job(ctx, "later")
	require.NoError(t, err)
	require.Equal(t, JobScheduled, info.State)
	info, err = admin.Job(ctx, "high")
	require.NoError(t, err)
	require.Equal(t, JobQueued, info.State)
	require.Equal(t, PriorityHigh, info.Priority)
	require.NoError(t, admin.Cancel(ctx, "root"))
	_, err = waitFor(t, pr)
	require.ErrorIs(t, err, ErrCanceled)
	for _, id := range []string{"root", "high", "later", "low-later"} {
		rec := client.Get(ctx, "streamq:{"+q.Name()+"}:id:"+id).Val()
		require.True(t, strings.HasPrefix(rec, "C"), "%s: %q", id, rec)
	}
	require.Zero(t, client.ZCard(ctx, "streamq:{"+q.Name()+"}:schedule").Val(), "the delayed children left the schedule")
	require.Zero(t, client.XLen(ctx, levelStreams(q.Name())[levelHigh]).Val(), "the queued high child's entry is deleted")
}
