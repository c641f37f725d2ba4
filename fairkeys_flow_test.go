package streamq

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/streamq/streamq/internal/keys"
)

// TestFairKeysFlow: a flow whose nodes have keys, with KeyLimit 1. Every
// child (keys a and b, one of them high, one delayed, and an inner flow of
// key b whose own child has key a) takes its key's turns and runs once;
// the parent, of key z, runs once after all of them. When its last child
// completes, another job of key z holds z's one slot, so the released
// parent waits for its key's turn (record "P%") and runs once that job
// completes. No key ever has two handlers at once, and nothing of the keys
// is left after the drain.
func TestFairKeysFlow(t *testing.T) {
	t.Parallel()
	client := realRedis(t)
	ctx := context.Background()
	qn := queueName(t)
	q := NewQueue[string, string](qn)
	p, err := q.NewProducer(client, nil)
	require.NoError(t, err)
	defer p.Close()
	ks, err := keys.Shards(qn, 1)
	require.NoError(t, err)
	parentRec := ks[0].Record("parent")

	runs := newKeyRuns()
	var mu sync.Mutex
	started := map[string]int{}
	childrenDone := 0
	childrenAtParent := -1
	childCount := 8
	unblock := make(chan struct{})
	opts := fastOpts(t, "flow", 30*time.Second)
	opts.Workers, opts.KeyLimit = 4, 1
	c, err := q.NewConsumer(client, func(ctx context.Context, m *Message[string]) (string, error) {
		done := runs.start(m.Key)
		defer done()
		mu.Lock()
		started[m.ID]++
		if m.ID == "parent" {
			childrenAtParent = childrenDone
		}
		mu.Unlock()
		if m.ID == "blocker" {
			<-unblock
		}
		time.Sleep(3 * time.Millisecond) // a key's next job could overlap, were the limit not kept
		mu.Lock()
		if m.ID != "parent" && m.ID != "blocker" {
			childrenDone++
		}
		mu.Unlock()
		return "r:" + m.ID, nil
	}, opts)
	require.NoError(t, err)
	require.NoError(t, c.writeKeySettings(ctx)) // KeyLimit before the first produce
	runConsumer(t, c)

	// The blocker holds key z's slot until the parent waits for it.
	blocker := mustProduceOn(t, p, "blocker", Key("z"))
	eventually(t, 10*time.Second, func() bool { mu.Lock(); defer mu.Unlock(); return started["blocker"] == 1 }, "the blocker did not start")

	children := []Child{
		ChildOf(q, "a1", "x", Key("a")),
		ChildOf(q, "a2", "x", Key("a"), Priority(PriorityHigh)),
		ChildOf(q, "a3", "x", Key("a"), After(30*time.Millisecond)),
		ChildOf(q, "b1", "x", Key("b")),
		ChildOf(q, "b2", "x", Key("b")),
		ChildFlow(q, "inner", "x", []Child{ChildOf(q, "a4", "x", Key("a"))}, &FlowOptions{Parent: []ProduceOption{Key("b")}}),
		ChildOf(q, "plain", "x"),
	}
	pr, err := p.ProduceFlow(ctx, "parent", "x", children, &FlowOptions{Parent: []ProduceOption{Key("z")}})
	require.NoError(t, err)

	eventually(t, 20*time.Second, func() bool { mu.Lock(); defer mu.Unlock(); return childrenDone == childCount },
		"the children did not all run")
	eventually(t, 10*time.Second, func() bool { return client.Get(ctx, parentRec).Val() == "P%" },
		"the released parent does not wait for its key's turn: record %q", client.Get(ctx, parentRec).Val())
	mu.Lock()
	require.Zero(t, started["parent"], "the parent ran while its key was at its limit")
	mu.Unlock()
	close(unblock)
	v, err := pr.Wait(waitCtx(t, 20*time.Second))
	require.NoError(t, err)
	require.Equal(t, "r:parent", v)
	_, err = blocker.Wait(waitCtx(t, 10*time.Second))
	require.NoError(t, err)

	mu.Lock()
	require.Equal(t, childCount, childrenAtParent, "the parent started before all its children completed")
	for _, id := range []string{"a1", "a2", "a3", "a4", "b1", "b2", "inner", "plain", "parent", "blocker"} {
		require.Equal(t, 1, started[id], "runs of %s", id)
	}
	mu.Unlock()
	for _, k := range []string{"a", "b", "z"} {
		require.Equal(t, 1, runs.mostOf(k), "handlers of key %s at once (KeyLimit 1)", k)
	}
	eventually(t, 10*time.Second, func() bool { return len(fairKeysLeft(t, client, qn)) == 1 },
		"fair-queuing keys left after the drain: %v", fairKeysLeft(t, client, qn))
	require.Equal(t, []string{fmt.Sprintf("streamq:{%s}:keys:cfg", qn)}, fairKeysLeft(t, client, qn))
}

// mustProduceOn produces request "x" with id on p.
func mustProduceOn(t *testing.T, p *Producer[string, string], id string, opts ...ProduceOption) *Promise[string] {
	t.Helper()
	pr, err := p.Produce(context.Background(), id, "x", opts...)
	require.NoError(t, err)
	return pr
}

// TestFairKeysFlowCancelWaitingChild: Admin.Cancel of a keyed child that
// waits for its key's turn (record "P%": another job holds its key's one
// slot) counts the child's cancelled outcome in its flow, so the parent
// (RunAnyway) runs once its other child is done, without waiting for the key. Before, the
// cancellation found no parent in the schedule's data, counted nothing, and
// the parent waited until its record expired.
func TestFairKeysFlowCancelWaitingChild(t *testing.T) {
	t.Parallel()
	client := realRedis(t)
	ctx := context.Background()
	qn := queueName(t)
	q := NewQueue[string, string](qn)
	p, err := q.NewProducer(client, nil)
	require.NoError(t, err)
	defer p.Close()
	ks, err := keys.Shards(qn, 1)
	require.NoError(t, err)
	a, err := q.NewAdmin(client, nil)
	require.NoError(t, err)

	var mu sync.Mutex
	started := map[string]int{}
	unblock := make(chan struct{})
	opts := fastOpts(t, "flowcancel", 30*time.Second)
	opts.Workers, opts.KeyLimit = 4, 1
	c, err := q.NewConsumer(client, func(ctx context.Context, m *Message[string]) (string, error) {
		mu.Lock()
		started[m.ID]++
		mu.Unlock()
		if m.ID == "blocker" {
			<-unblock
		}
		return "r:" + m.ID, nil
	}, opts)
	require.NoError(t, err)
	require.NoError(t, c.writeKeySettings(ctx))
	runConsumer(t, c)
	defer func() {
		select {
		case <-unblock:
		default:
			close(unblock)
		}
	}()

	blocker := mustProduceOn(t, p, "blocker", Key("k"))
	eventually(t, 10*time.Second, func() bool { mu.Lock(); defer mu.Unlock(); return started["blocker"] == 1 }, "the blocker did not start")
	pr, err := p.ProduceFlow(ctx, "parent", "x", []Child{
		ChildOf(q, "keyed", "x", Key("k")),
		ChildOf(q, "plain", "x"),
	}, &FlowOptions{Policy: RunAnyway})
	require.NoError(t, err)
	eventually(t, 10*time.Second, func() bool { mu.Lock(); defer mu.Unlock(); return started["plain"] == 1 }, "the plain child did not run")
	require.Equal(t, "P%", client.Get(ctx, ks[0].Record("keyed")).Val(), "the keyed child waits for its key's turn")

	require.NoError(t, a.Cancel(ctx, "keyed"))
	v, err := pr.Wait(waitCtx(t, 10*time.Second))
	require.NoError(t, err, "the parent after its waiting keyed child was cancelled")
	require.Equal(t, "r:parent", v)

	close(unblock)
	_, err = blocker.Wait(waitCtx(t, 10*time.Second))
	require.NoError(t, err)
	eventually(t, 10*time.Second, func() bool { return len(fairKeysLeft(t, client, qn)) == 1 },
		"fair-queuing keys left after the drain: %v", fairKeysLeft(t, client, qn))
	mu.Lock()
	defer mu.Unlock()
	require.Zero(t, started["keyed"], "the cancelled child ran")
	require.Equal(t, 1, started["parent"])
}

// TestCancelWaitingKeyedRecordInNoList: a record saying "P%" whose job is
// in no key's list (a state no script leaves, e.g. keys deleted by hand) is
// still cancelled by Admin.Cancel, without a parent.
func TestCancelWaitingKeyedRecordInNoList(t *testing.T) {
	backends(t, func(t *testing.T, client *redis.Client) {
		ctx := context.Background()
		qn := queueName(t)
		p := newStringProducer(t, client, qn)
		mustProduceOn(t, p, "warm") // records the shard count
		ks, err := keys.Shards(qn, 1)
		require.NoError(t, err)
		require.NoError(t, client.Set(ctx, ks[0].Record("lone"), "P%", time.Minute).Err())
		a, err := NewAdmin(client, qn, nil)
		require.NoError(t, err)
		require.NoError(t, a.Cancel(ctx, "lone"))
		require.Equal(t, "C", client.Get(ctx, ks[0].Record("lone")).Val()[:1])
	})
}
