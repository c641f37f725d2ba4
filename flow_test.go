package streamq

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/streamq/streamq/internal/keys"
	"github.com/stretchr/testify/require"
)

// flowRig is a parent queue and a second child queue, each with a consumer:
// children answer "<id>!" (or fail when fail says so), the parent answers
// with its children's results joined.
type flowRig struct {
	parentQ, otherQ Queue[string, string]
	p               *Producer[string, string]
	childRuns       sync.Map // child id -> *atomic.Int64
	childDone       sync.Map // child id -> true, set before the handler returns
	parentRuns      atomic.Int64
	parentSaw       atomic.Value // []ChildResult
	early           atomic.Int64 // parents that ran before a child's handler finished
	fail            func(id string) bool
	hold            chan struct{} // children wait on it when not nil
}

func newFlowRig(t *testing.T, client *redis.Client) *flowRig {
	t.Helper()
	rig := &flowRig{parentQ: NewQueue[string, string](queueName(t)), otherQ: NewQueue[string, string](queueName(t)),
		fail: func(string) bool { return false }}
	var err error
	rig.p, err = rig.parentQ.NewProducer(client, &ProducerOptions{Logger: testLogger(t)})
	require.NoError(t, err)
	t.Cleanup(func() { _ = rig.p.Close() })
	child := func(ctx context.Context, m *Message[string]) (string, error) {
		if rig.hold != nil {
			<-rig.hold
		}
		v, _ := rig.childRuns.LoadOrStore(m.ID, new(atomic.Int64))
		v.(*atomic.Int64).Add(1)
		rig.childDone.Store(m.ID, true)
		if rig.fail(m.ID) {
			return "", Permanent(errors.New("child " + m.ID + " broke"))
		}
		return m.Payload + "!", nil
	}
	parentOrChild := func(ctx context.Context, m *Message[string]) (string, error) {
		if !strings.HasPrefix(m.ID, "parent") {
			return child(ctx, m)
		}
		rig.parentRuns.Add(1)
		kids, err := m.Children(ctx)
		if err != nil {
			return "", err
		}
		rig.parentSaw.Store(kids)
		var out []string
		for _, k := range kids {
			if _, ok := rig.childDone.Load(k.ID); !ok {
				rig.early.Add(1)
			}
			r, err := ChildResultOf(rig.otherQ, k)
			if err != nil {
				out = append(out, k.ID+"=error")
				continue
			}
			out = append(out, r)
		}
		return strings.Join(out, ","), nil
	}
	c1, err := rig.parentQ.NewConsumer(client, parentOrChild, &ConsumerOptions{Workers: 4, Logger: testLogger(t)})
	require.NoError(t, err)
	runConsumer(t, c1)
	c2, err := rig.otherQ.NewConsumer(client, child, &ConsumerOptions{Workers: 4, Logger: testLogger(t)})
	require.NoError(t, err)
	runConsumer(t, c2)
	return rig
}

// children returns n children alternating between the two queues.
func (rig *flowRig) children(prefix string, n int) []Child {
	out := make([]Child, n)
	for i := range out {
		q := rig.parentQ
		if i%2 == 1 {
			q = rig.otherQ
		}
		id := fmt.Sprintf("%s-c%d", prefix, i)
		out[i] = ChildOf(q, id, id)
	}
	return out
}

func waitFor[T any](t *testing.T, pr *Promise[T]) (T, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	return pr.Wait(ctx)
}

func TestFlowParentRunsOnceAfterItsChildren(t *testing.T) {
	backends(t, func(t *testing.T, client *redis.Client) {
		rig := newFlowRig(t, client)
		ctx := context.Background()
		pr, err := rig.p.ProduceFlow(ctx, "parent-1", "p", rig.children("f1", 10), nil)
		require.NoError(t, err)
		require.Empty(t, pr.EntryID(), "the parent waits: no entry yet")
		got, err := waitFor(t, pr)
		require.NoError(t, err)
		var want []string
		for i := range 10 {
			want = append(want, fmt.Sprintf("f1-c%d!", i))
		}
		require.Equal(t, strings.Join(want, ","), got)
		require.EqualValues(t, 1, rig.parentRuns.Load())
		require.Zero(t, rig.early.Load(), "the parent ran before a child finished")
		kids := rig.parentSaw.Load().([]ChildResult)
		require.Len(t, kids, 10)
		require.Equal(t, rig.otherQ.Name(), kids[1].Queue)
		for i := range 10 {
			v, _ := rig.childRuns.Load(fmt.Sprintf("f1-c%d", i))
			require.EqualValues(t, 1, v.(*atomic.Int64).Load())
		}

		// Producing the flow again attaches to the stored outcome.
		again, err := rig.p.ProduceFlow(ctx, "parent-1", "p", rig.children("f1", 10), nil)
		require.NoError(t, err)
		require.Equal(t, DedupStored, again.Deduplicated())
		got2, err := waitFor(t, again)
		require.NoError(t, err)
		require.Equal(t, got, got2)
		require.EqualValues(t, 1, rig.parentRuns.Load())
	})
}

func TestFlowProducedByTwoProducersRunsEachOnce(t *testing.T) {
	backends(t, func(t *testing.T, client *redis.Client) {
		rig := newFlowRig(t, client)
		rig.hold = make(chan struct{})
		p2, err := rig.parentQ.NewProducer(client, &ProducerOptions{Logger: testLogger(t)})
		require.NoError(t, err)
		defer p2.Close()
		ctx := context.Background()
		var prs [2]*Promise[string]
		var errs [2]error
		var wg sync.WaitGroup
		for i, p := range []*Producer[string, string]{rig.p, p2} {
			wg.Go(func() { prs[i], errs[i] = p.ProduceFlow(ctx, "parent-2", "p", rig.children("f2", 6), nil) })
		}
		wg.Wait()
		require.NoError(t, errs[0])
		require.NoError(t, errs[1])
		// A child of the flow produced on its own while in flight is the
		// same child: attached, not run again.
		alone, err := NewProducer[string, string](client, rig.otherQ.Name(), &ProducerOptions{Logger: testLogger(t)})
		require.NoError(t, err)
		defer alone.Close()
		cp, err := alone.Produce(ctx, "f2-c1", "other payload")
		require.NoError(t, err)
		require.Equal(t, DedupInflight, cp.Deduplicated())
		// A plain Produce of the waiting parent's id attaches to it.
		pp, err := p2.Produce(ctx, "parent-2", "other")
		require.NoError(t, err)
		require.Equal(t, DedupInflight, pp.Deduplicated())
		require.Empty(t, pp.EntryID())
		defer pp.Release()
		// A second flow cannot adopt a child in flight outside it.
		_, err = rig.p.ProduceFlow(ctx, "parent-2b", "p", []Child{ChildOf(rig.otherQ, "f2-c1", "x")}, nil)
		require.ErrorIs(t, err, ErrChildInFlight)
		close(rig.hold)
		r0, err := waitFor(t, prs[0])
		require.NoError(t, err)
		r1, err := waitFor(t, prs[1])
		require.NoError(t, err)
		require.Equal(t, r0, r1)
		c1, err := waitFor(t, cp)
		require.NoError(t, err)
		require.Equal(t, "f2-c1!", c1)
		require.EqualValues(t, 1, rig.parentRuns.Load())
		for i := range 6 {
			v, _ := rig.childRuns.Load(fmt.Sprintf("f2-c%d", i))
			require.EqualValues(t, 1, v.(*atomic.Int64).Load())
		}
	})
}

func TestFlowChildFailingForGood(t *testing.T) {
	backends(t, func(t *testing.T, client *redis.Client) {
		t.Run("fail the parent", func(t *testing.T) {
			rig := newFlowRig(t, client)
			rig.fail = func(id string) bool { return id == "f3-c1" || id == "f3-c4" }
			pr, err := rig.p.ProduceFlow(context.Background(), "parent-3", "p", rig.children("f3", 5), nil)
			require.NoError(t, err)
			_, err = waitFor(t, pr)
			require.ErrorIs(t, err, ErrFailed)
			require.ErrorIs(t, err, ErrChildFailed)
			require.Contains(t, err.Error(), rig.otherQ.Name()+"/f3-c1: child f3-c1 broke")
			require.Contains(t, err.Error(), rig.parentQ.Name()+"/f3-c4: child f3-c4 broke")
			require.NotContains(t, err.Error(), "f3-c2")
			require.Zero(t, rig.parentRuns.Load(), "the parent must not run")
		})
		t.Run("run anyway", func(t *testing.T) {
			rig := newFlowRig(t, client)
			rig.fail = func(id string) bool { return id == "f4-c1" }
			pr, err := rig.p.ProduceFlow(context.Background(), "parent-4", "p", rig.children("f4", 3), &FlowOptions{Policy: RunAnyway})
			require.NoError(t, err)
			got, err := waitFor(t, pr)
			require.NoError(t, err)
			require.Equal(t, "f4-c0!,f4-c1=error,f4-c2!", got)
			kids := rig.parentSaw.Load().([]ChildResult)
			require.ErrorIs(t, kids[1].Err, ErrDeadLettered)
			require.Contains(t, kids[1].Err.Error(), "child f4-c1 broke")
			require.EqualValues(t, 1, rig.parentRuns.Load())
		})
	})
}

func TestFlowWithChildrenDoneRunsTheParentAtOnce(t *testing.T) {
	backends(t, func(t *testing.T, client *redis.Client) {
		rig := newFlowRig(t, client)
		ctx := context.Background()
		other, err := rig.otherQ.NewProducer(client, &ProducerOptions{Logger: testLogger(t)})
		require.NoError(t, err)
		defer other.Close()
		kids := rig.children("f5", 4)
		for i := range 4 {
			p := rig.p
			if i%2 == 1 {
				p = other
			}
			id := fmt.Sprintf("f5-c%d", i)
			pr, err := p.Produce(ctx, id, id)
			require.NoError(t, err)
			_, err = waitFor(t, pr)
			require.NoError(t, err)
		}
		pr, err := rig.p.ProduceFlow(ctx, "parent-5", "p", kids, nil)
		require.NoError(t, err)
		require.NotEmpty(t, pr.EntryID(), "released in the same step")
		got, err := waitFor(t, pr)
		require.NoError(t, err)
		require.Equal(t, "f5-c0!,f5-c1!,f5-c2!,f5-c3!", got)
		for i := range 4 {
			v, _ := rig.childRuns.Load(fmt.Sprintf("f5-c%d", i))
			require.EqualValues(t, 1, v.(*atomic.Int64).Load(), "a done child does not run again")
		}
	})
}

func TestFlowAdminShowsTheWaitingParent(t *testing.T) {
	client, _ := miniRedis(t)
	rig := newFlowRig(t, client)
	rig.hold = make(chan struct{})
	ctx := context.Background()
	pr, err := rig.p.ProduceFlow(ctx, "parent-6", "p", rig.children("f6", 2), nil)
	require.NoError(t, err)
	a, err := rig.parentQ.NewAdmin(client, nil)
	require.NoError(t, err)
	info, err := a.Job(ctx, "parent-6")
	require.NoError(t, err)
	require.Equal(t, JobWaiting, info.State)
	require.Len(t, info.Children, 2)
	require.Equal(t, "f6-c1", info.Children[1].ID)
	require.ErrorIs(t, info.Children[1].Err, ErrChildPending)
	close(rig.hold)
	_, err = waitFor(t, pr)
	require.NoError(t, err)
}

func TestFlowRefusals(t *testing.T) {
	client, _ := miniRedis(t)
	ctx := context.Background()
	q := NewQueue[string, string](queueName(t))
	p, err := q.NewProducer(client, nil)
	require.NoError(t, err)
	defer p.Close()
	_, err = p.ProduceFlow(ctx, "p", "x", nil, nil)
	require.ErrorIs(t, err, ErrInvalidOptions)
	_, err = p.ProduceFlow(ctx, "p", "x", []Child{ChildOf(q, "c", "y", RetryFailed())}, nil)
	require.ErrorIs(t, err, ErrInvalidOptions)
	_, err = p.ProduceFlow(ctx, "p", "x", []Child{ChildOf(q, "c", "y", Throttle(time.Second))}, nil)
	require.ErrorIs(t, err, ErrInvalidOptions)
	_, err = p.ProduceFlow(ctx, "p", "x", []Child{ChildOf(q, "c", "y")}, &FlowOptions{Parent: []ProduceOption{Debounce(time.Second, time.Second)}})
	require.ErrorIs(t, err, ErrInvalidOptions)
	_, err = p.ProduceFlow(ctx, "p", "x", []Child{ChildOf(q, "c", "y", Priority(7))}, nil)
	require.ErrorIs(t, err, ErrInvalidOptions)
	// An invalid key, on a child or on the parent (keys are taken: see
	// TestFairKeysFlow).
	_, err = p.ProduceFlow(ctx, "p", "x", []Child{ChildOf(q, "c", "y", Key(""))}, nil)
	require.ErrorIs(t, err, ErrInvalidOptions)
	_, err = p.ProduceFlow(ctx, "p", "x", []Child{ChildOf(q, "c", "y")}, &FlowOptions{Parent: []ProduceOption{Key("")}})
	require.ErrorIs(t, err, ErrInvalidOptions)
	_, err = p.ProduceFlow(ctx, "p", "x", []Child{ChildOf(q, "", "y")}, nil)
	require.ErrorIs(t, err, ErrInvalidID)
	_, err = p.ProduceFlow(ctx, "p", "x", []Child{ChildOf(q, "c", "y")}, &FlowOptions{Policy: 7})
	require.ErrorIs(t, err, ErrInvalidOptions)
	_, err = p.ProduceFlow(ctx, "p", "x", []Child{RawChild("a{b", "c", []byte(`"y"`))}, nil)
	require.ErrorIs(t, err, ErrInvalidOptions)
	_, err = p.ProduceFlow(ctx, "p", "x", []Child{ChildFlow(q, "c", "y", nil, nil)}, nil)
	require.ErrorIs(t, err, ErrInvalidOptions)
	// On a cluster, a child in another slot is refused before any write.
	p.sharded = true
	_, err = p.ProduceFlow(ctx, "p", "x", []Child{RawChild(q.Name()+"-other", "c", []byte(`"y"`))}, nil)
	require.ErrorIs(t, err, ErrCrossSlot)
	require.Zero(t, client.Exists(ctx, "streamq:{"+q.Name()+"}:id:p").Val())
}

func TestProgressReachesWaitingCallersInOrder(t *testing.T) {
	backends(t, func(t *testing.T, client *redis.Client) {
		ctx := context.Background()
		q := NewQueue[string, string](queueName(t))
		reported := make(chan struct{})
		finish := make(chan struct{})
		c, err := q.NewConsumer(client, func(ctx context.Context, m *Message[string]) (string, error) {
			for i := 1; i <= 100; i++ {
				if err := m.Progress(ctx, i); err != nil {
					return "", err
				}
			}
			close(reported)
			<-finish
			return "done", nil
		}, &ConsumerOptions{Logger: testLogger(t)})
		require.NoError(t, err)
		var callers [3]*Promise[string]
		for i := range 2 {
			p, err := q.NewProducer(client, &ProducerOptions{Logger: testLogger(t)})
			require.NoError(t, err)
			defer p.Close()
			callers[i], err = p.Produce(ctx, "job", "x")
			require.NoError(t, err)
		}
		got := make([][]int, 2)
		var wg sync.WaitGroup
		for i := range 2 {
			ch := callers[i].Progress()
			wg.Go(func() {
				for b := range ch {
					var v int
					require.NoError(t, json.Unmarshal(b, &v))
					got[i] = append(got[i], v)
				}
			})
		}
		runConsumer(t, c)
		<-reported
		// A caller attaching late gets the latest value.
		late, err := q.NewProducer(client, &ProducerOptions{Logger: testLogger(t)})
		require.NoError(t, err)
		defer late.Close()
		callers[2], err = late.Produce(ctx, "job", "x")
		require.NoError(t, err)
		select {
		case b := <-callers[2].Progress():
			require.Equal(t, "100", string(b))
		case <-time.After(10 * time.Second):
			t.Fatal("the late caller got no progress value")
		}
		a, err := q.NewAdmin(client, nil)
		require.NoError(t, err)
		info, err := a.Job(ctx, "job")
		require.NoError(t, err)
		require.Equal(t, "100", string(info.Progress))
		close(finish)
		for i := range 2 {
			_, err := waitFor(t, callers[i])
			require.NoError(t, err)
		}
		wg.Wait() // the channels close with the completion
		for i := range 2 {
			require.NotEmpty(t, got[i])
			require.Equal(t, 100, got[i][len(got[i])-1], "the last value is never dropped")
			for j := 1; j < len(got[i]); j++ {
				require.Greater(t, got[i][j], got[i][j-1], "values arrive in order")
			}
		}
	})
}

func TestProgressNoticeParsing(t *testing.T) {
	id, seq, v, err := parseProgressNotice("3:a:b2:125:hello")
	require.NoError(t, err)
	require.Equal(t, "a:b", id)
	require.EqualValues(t, 12, seq)
	require.Equal(t, "hello", v)
	_, _, _, err = parseProgressNotice("3:abc1:0")
	require.Error(t, err)
	// An old listener reading a progress notice finds no length prefix.
	require.Error(t, parseNotice("~3:a:b2:125:hello", func(string, string) { t.Fatal("resolved") }))
}

func TestFlowNestedAndChains(t *testing.T) {
	backends(t, func(t *testing.T, client *redis.Client) {
		ctx := context.Background()
		A, B := NewQueue[string, string](queueName(t)), NewQueue[string, string](queueName(t))
		var runs sync.Map
		handler := func(ctx context.Context, m *Message[string]) (string, error) {
			v, _ := runs.LoadOrStore(m.ID, new(atomic.Int64))
			v.(*atomic.Int64).Add(1)
			if strings.HasSuffix(m.ID, "-x") {
				return "", Permanent(errors.New("x broke"))
			}
			kids, err := m.Children(ctx)
			if err != nil {
				return "", err
			}
			if kids == nil {
				return m.Payload + "!", nil
			}
			var parts []string
			for _, k := range kids {
				r, err := ChildResultOf(A, k)
				if err != nil {
					return "", err
				}
				parts = append(parts, r)
			}
			return m.Payload + "(" + strings.Join(parts, ",") + ")", nil
		}
		for _, q := range []Queue[string, string]{A, B} {
			c, err := q.NewConsumer(client, handler, &ConsumerOptions{Workers: 4, Logger: testLogger(t)})
			require.NoError(t, err)
			runConsumer(t, c)
		}
		p, err := A.NewProducer(client, &ProducerOptions{Logger: testLogger(t)})
		require.NoError(t, err)
		defer p.Close()

		// A tree over both queues, with a chain e -> d -> c under the root.
		pr, err := p.ProduceFlow(ctx, "n-root", "root", []Child{
			ChildOf(A, "n-a", "a"),
			ChildFlow(B, "n-b", "b", []Child{ChildOf(A, "n-b1", "b1"), ChildOf(B, "n-b2", "b2")}, nil),
			ChildFlow(A, "n-c", "c", []Child{ChildFlow(B, "n-d", "d", []Child{ChildOf(A, "n-e", "e")}, nil)}, nil),
		}, nil)
		require.NoError(t, err)
		got, err := waitFor(t, pr)
		require.NoError(t, err)
		require.Equal(t, "root(a!,b(b1!,b2!),c(d(e!)))", got)
		runs.Range(func(k, v any) bool {
			require.EqualValues(t, 1, v.(*atomic.Int64).Load(), "%v ran more than once", k)
			return true
		})

		// A nested parent failed by its child fails its own parent.
		pr, err = p.ProduceFlow(ctx, "n2-root", "root", []Child{
			ChildOf(A, "n2-a", "a"),
			ChildFlow(B, "n2-b", "b", []Child{ChildOf(A, "n2-x", "x")}, nil),
		}, nil)
		require.NoError(t, err)
		_, err = waitFor(t, pr)
		require.ErrorIs(t, err, ErrChildFailed)
		require.Contains(t, err.Error(), B.Name()+"/n2-b: a child of the flow failed: "+A.Name()+"/n2-x: x broke")
		_, ran := runs.Load("n2-b")
		require.False(t, ran, "a parent failed by its children does not run")
		_, ran = runs.Load("n2-root")
		require.False(t, ran)

		// An id given twice is refused before anything is written.
		_, err = p.ProduceFlow(ctx, "n3-root", "root", []Child{ChildOf(A, "n3-a", "a"), ChildFlow(B, "n3-b", "b", []Child{ChildOf(A, "n3-a", "a")}, nil)}, nil)
		require.ErrorIs(t, err, ErrInvalidOptions)
		require.Zero(t, client.Exists(ctx, "streamq:{"+A.Name()+"}:id:n3-root", "streamq:{"+A.Name()+"}:id:n3-a").Val())
	})
}

func TestFlowCancelParentCancelsItsWaitingChildren(t *testing.T) {
	backends(t, func(t *testing.T, client *redis.Client) {
		ctx := context.Background()
		A, B := NewQueue[string, string](queueName(t)), NewQueue[string, string](queueName(t))
		p, err := A.NewProducer(client, &ProducerOptions{Logger: testLogger(t)})
		require.NoError(t, err)
		defer p.Close()
		// No consumer yet: every child stays queued.
		pr, err := p.ProduceFlow(ctx, "k-root", "root", []Child{
			ChildOf(A, "k-a", "a"),
			ChildOf(B, "k-b", "b"),
			ChildFlow(B, "k-c", "c", []Child{ChildOf(A, "k-d", "d")}, nil),
		}, nil)
		require.NoError(t, err)
		a, err := A.NewAdmin(client, nil)
		require.NoError(t, err)
		require.NoError(t, a.Cancel(ctx, "k-root"))
		_, err = waitFor(t, pr)
		require.ErrorIs(t, err, ErrCanceled)
		for _, c := range []struct{ q, id string }{{A.Name(), "k-a"}, {B.Name(), "k-b"}, {B.Name(), "k-c"}, {A.Name(), "k-d"}} {
			rec := client.Get(ctx, "streamq:{"+c.q+"}:id:"+c.id).Val()
			require.True(t, strings.HasPrefix(rec, "C"), "%s: %q", c.id, rec)
		}
		require.Zero(t, client.XLen(ctx, "streamq:{"+A.Name()+"}:stream").Val())
		require.Zero(t, client.XLen(ctx, "streamq:{"+B.Name()+"}:stream").Val())
		st, err := a.Stats(ctx)
		require.NoError(t, err)
		require.EqualValues(t, 3, st.Canceled, "k-root, k-a, k-d")
		// Cancelling again changes nothing.
		require.NoError(t, a.Cancel(ctx, "k-root"))
		st, err = a.Stats(ctx)
		require.NoError(t, err)
		require.EqualValues(t, 3, st.Canceled)
	})
}

func TestFlowCancelledChildFailsItsParent(t *testing.T) {
	backends(t, func(t *testing.T, client *redis.Client) {
		rig := newFlowRig(t, client)
		retried := make(chan struct{})
		var once sync.Once
		// A child on a third queue asks for a retry in an hour: it waits in
		// the schedule.
		ctx := context.Background()
		other := NewQueue[string, string](queueName(t))
		c, err := other.NewConsumer(client, func(ctx context.Context, m *Message[string]) (string, error) {
			once.Do(func() { close(retried) })
			return "", RetryAfter(errors.New("later"), time.Hour)
		}, &ConsumerOptions{Logger: testLogger(t)})
		require.NoError(t, err)
		runConsumer(t, c)
		pr, err := rig.p.ProduceFlow(ctx, "parent-k2", "p", []Child{ChildOf(rig.parentQ, "k2-a", "a"), ChildOf(other, "k2-b", "b")}, nil)
		require.NoError(t, err)
		<-retried
		a, err := other.NewAdmin(client, nil)
		require.NoError(t, err)
		eventually(t, 10*time.Second, func() bool {
			info, err := a.Job(ctx, "k2-b")
			return err == nil && info.State == JobRetrying
		}, "the child was not scheduled for its retry")
		require.NoError(t, a.Cancel(ctx, "k2-b"))
		_, err = waitFor(t, pr)
		require.ErrorIs(t, err, ErrChildFailed)
		require.Contains(t, err.Error(), other.Name()+"/k2-b: canceled by Admin.Cancel")
		require.Zero(t, rig.parentRuns.Load())
	})
}

func TestProgressBackstopReadsTheStoredValue(t *testing.T) {
	client, _ := miniRedis(t)
	ctx := context.Background()
	q := queueName(t)
	p, err := NewProducer[string, string](client, q, &ProducerOptions{Logger: testLogger(t)})
	require.NoError(t, err)
	defer p.Close()
	pr, err := p.Produce(ctx, "job", "x") // no consumer: it stays queued
	require.NoError(t, err)
	ch := pr.Progress()
	// A value whose notice was lost (a resubscription): the check after it
	// reads the stored one.
	require.NoError(t, client.Set(ctx, "streamq:{"+q+"}:progress:job", "7:\"seven\"", 0).Err())
	require.NoError(t, p.checkWaiting(ctx))
	select {
	case v := <-ch:
		require.Equal(t, `"seven"`, string(v))
	case <-time.After(10 * time.Second):
		t.Fatal("no progress value")
	}
	// An older value changes nothing; a released promise's channel closes.
	require.NoError(t, client.Set(ctx, "streamq:{"+q+"}:progress:job", "6:\"six\"", 0).Err())
	require.NoError(t, p.checkWaiting(ctx))
	pr.Release()
	_, open := <-ch
	require.False(t, open)
}

func TestChildResultJSONRoundTrip(t *testing.T) {
	in := []ChildResult{{Queue: "q", ID: "a", Result: []byte(`"ok"`)}, {Queue: "q", ID: "b", Err: &RequestError{Message: "boom"}}}
	b, err := json.Marshal(JobInfo{ID: "p", State: JobWaiting, Children: in})
	require.NoError(t, err)
	require.Contains(t, string(b), `"result_text":"\"ok\""`)
	require.Contains(t, string(b), `"error":"streamq: request failed: boom"`)
	var out JobInfo
	require.NoError(t, json.Unmarshal(b, &out))
	require.Len(t, out.Children, 2)
	require.Equal(t, in[0], out.Children[0])
	require.EqualError(t, out.Children[1].Err, "streamq: request failed: boom")
}

// testClusterFlow: on a cluster, a flow on the parent's unsharded queue runs
// (its keys share the slot), progress travels by SPUBLISH, and a child in
// another slot is refused before anything is written.
func testClusterFlow(t *testing.T, client redis.UniversalClient) {
	ctx := context.Background()
	Q := NewQueue[string, string](queueName(t))
	c, err := Q.NewConsumer(client, func(ctx context.Context, m *Message[string]) (string, error) {
		kids, err := m.Children(ctx)
		if err != nil {
			return "", err
		}
		if kids == nil {
			if err := m.Progress(ctx, m.Payload); err != nil {
				return "", err
			}
			return m.Payload + "!", nil
		}
		var parts []string
		for _, k := range kids {
			r, err := ChildResultOf(Q, k)
			if err != nil {
				return "", err
			}
			parts = append(parts, r)
		}
		return m.Payload + "(" + strings.Join(parts, ",") + ")", nil
	}, &ConsumerOptions{Workers: 4, Logger: testLogger(t)})
	require.NoError(t, err)
	runConsumer(t, c)
	p, err := Q.NewProducer(client, &ProducerOptions{Logger: testLogger(t)})
	require.NoError(t, err)
	defer p.Close()
	pr, err := p.ProduceFlow(ctx, "root", "r", []Child{
		ChildOf(Q, "a", "a"),
		ChildFlow(Q, "b", "b", []Child{ChildOf(Q, "b1", "b1")}, nil),
	}, nil)
	require.NoError(t, err)
	got, err := waitFor(t, pr)
	require.NoError(t, err)
	require.Equal(t, "r(a!,b(b1!))", got)
	// Progress travels by SPUBLISH: a promise listening when the handler
	// reports gets the value (the handler reports its payload).
	a, err := Q.NewAdmin(client, nil)
	require.NoError(t, err)
	info, err := a.Job(ctx, "a")
	require.NoError(t, err)
	require.Equal(t, `"a"`, string(info.Progress))
	hold := make(chan struct{})
	c2, err := NewQueue[string, string](Q.Name()+"-p").NewConsumer(client, func(ctx context.Context, m *Message[string]) (string, error) {
		if err := m.Progress(ctx, 42); err != nil {
			return "", err
		}
		<-hold
		return "", nil
	}, &ConsumerOptions{Logger: testLogger(t)})
	require.NoError(t, err)
	p2, err := NewQueue[string, string](Q.Name()+"-p").NewProducer(client, &ProducerOptions{Logger: testLogger(t)})
	require.NoError(t, err)
	defer p2.Close()
	pp, err := p2.Produce(ctx, "pg", "x")
	require.NoError(t, err)
	ch := pp.Progress()
	runConsumer(t, c2)
	select {
	case v := <-ch:
		require.Equal(t, "42", string(v))
	case <-time.After(10 * time.Second):
		t.Fatal("no progress value")
	}
	close(hold)
	_, err = waitFor(t, pp)
	require.NoError(t, err)

	_, err = p.ProduceFlow(ctx, "root2", "r", []Child{ChildOf(NewQueue[string, string](queueName(t)), "x", "x")}, nil)
	require.ErrorIs(t, err, ErrCrossSlot)
	require.Zero(t, client.Exists(ctx, "streamq:{"+Q.Name()+"}:id:root2").Val())
}

func TestFlowChildRetriedKeepsItsParent(t *testing.T) {
	backends(t, func(t *testing.T, client *redis.Client) {
		rig := newFlowRig(t, client)
		var failed sync.Map
		rig.fail = func(id string) bool { return false }
		// A third queue whose child fails once and is retried through the
		// schedule: its entry keeps its parent (retry.lua copies the fields).
		other := NewQueue[string, string](queueName(t))
		c, err := other.NewConsumer(client, func(ctx context.Context, m *Message[string]) (string, error) {
			if _, again := failed.LoadOrStore(m.ID, true); !again {
				return "", RetryAfter(errors.New("once"), 50*time.Millisecond)
			}
			return m.Payload + "?", nil
		}, &ConsumerOptions{Logger: testLogger(t)})
		require.NoError(t, err)
		runConsumer(t, c)
		pr, err := rig.p.ProduceFlow(context.Background(), "parent-r", "p", []Child{
			ChildOf(rig.parentQ, "r-a", "a"), ChildOf(other, "r-b", "b"),
		}, nil)
		require.NoError(t, err)
		got, err := waitFor(t, pr)
		require.NoError(t, err)
		require.Equal(t, "a!,b?", got)
	})
}

func TestFlowOnShardedQueues(t *testing.T) {
	// A single server: the parent and its children may be on different
	// shards (hash tags); the completing script names every key it touches.
	client := realRedis(t)
	ctx := context.Background()
	q := queueName(t)
	var runs atomic.Int64
	c, err := NewConsumer(client, q, func(ctx context.Context, m *Message[string]) (string, error) {
		runs.Add(1)
		kids, err := m.Children(ctx)
		if err != nil || kids == nil {
			return m.Payload, err
		}
		return fmt.Sprintf("%d children", len(kids)), nil
	}, &ConsumerOptions{Shards: 3, Workers: 4, Logger: testLogger(t)})
	require.NoError(t, err)
	runConsumer(t, c)
	p, err := NewProducer[string, string](client, q, &ProducerOptions{Shards: 3, Logger: testLogger(t)})
	require.NoError(t, err)
	defer p.Close()
	var kids []Child
	for i := range 12 {
		kids = append(kids, RawChild(q, fmt.Sprintf("s-%d", i), []byte(`"x"`)))
	}
	pr, err := p.ProduceFlow(ctx, "s-root", "r", kids, nil)
	require.NoError(t, err)
	got, err := waitFor(t, pr)
	require.NoError(t, err)
	require.Equal(t, "12 children", got)
	require.EqualValues(t, 13, runs.Load())
}

func TestFlowKeysOfAnotherType(t *testing.T) {
	backends(t, func(t *testing.T, client *redis.Client) {
		ctx := context.Background()
		rig := newFlowRig(t, client)
		// A child's stream of another type: refused before any write.
		third := queueName(t)
		require.NoError(t, client.Set(ctx, "streamq:{"+third+"}:stream", "x", 0).Err())
		_, err := rig.p.ProduceFlow(ctx, "parent-w", "p", []Child{ChildOf(rig.parentQ, "w-c0", "a"), RawChild(third, "w-c1", []byte(`"b"`))}, nil)
		require.ErrorIs(t, err, ErrWrongType)
		require.Zero(t, client.Exists(ctx, "streamq:{"+rig.parentQ.Name()+"}:id:parent-w", "streamq:{"+rig.parentQ.Name()+"}:id:w-c0").Val())
		// A flow hash overwritten by another program while the children run:
		// their completions still record their outcomes (the parent waits).
		rig.hold = make(chan struct{})
		pr, err := rig.p.ProduceFlow(ctx, "parent-w2", "p", []Child{ChildOf(rig.parentQ, "w2-a", "a")}, nil)
		require.NoError(t, err)
		defer pr.Release()
		require.NoError(t, client.Set(ctx, "streamq:{"+rig.parentQ.Name()+"}:flow:parent-w2", "x", 0).Err())
		cp, err := rig.p.Produce(ctx, "w2-a", "a")
		require.NoError(t, err)
		close(rig.hold)
		got, err := waitFor(t, cp)
		require.NoError(t, err)
		require.Equal(t, "a!", got)
		require.Zero(t, rig.parentRuns.Load())
	})
}

// TestFlowChildrenStageWrites: the children of a flow stage writes (Tx) and
// the parent does too; every write is applied once, in the completion that
// records each child's outcome (which also counts it in its flow) and the
// parent's. complete.lua then carries both sections in one ARGV[9]
// (":<children>" and "/<staged>"), and the flow keys sit between the records
// and the staged keys.
func TestFlowChildrenStageWrites(t *testing.T) {
	backends(t, func(t *testing.T, client *redis.Client) {
		ctx := context.Background()
		q := NewQueue[int, int](queueName(t))
		k, err := keys.New(q.Name())
		require.NoError(t, err)
		total, parents, done := k.TxKey("total"), k.TxKey("parents"), k.TxKey("done")
		c, err := q.NewConsumer(client, func(ctx context.Context, m *Message[int]) (int, error) {
			tx := m.Tx()
			if tx.Key("total") != total {
				return 0, Permanent(fmt.Errorf("Tx.Key names %q, not %q", tx.Key("total"), total))
			}
			if strings.HasPrefix(m.ID, "parent") {
				kids, err := m.Children(ctx)
				if err != nil {
					return 0, err
				}
				sum := 0
				for _, k := range kids {
					v, err := ChildResultOf(q, k)
					if err != nil {
						return 0, err
					}
					sum += v
				}
				return sum, tx.Incr(parents)
			}
			if err := tx.IncrBy(total, int64(m.Payload)); err != nil {
				return 0, err
			}
			return m.Payload, tx.SAdd(done, m.ID)
		}, &ConsumerOptions{Workers: 4, Logger: testLogger(t)})
		require.NoError(t, err)
		runConsumer(t, c)
		p, err := q.NewProducer(client, &ProducerOptions{Logger: testLogger(t)})
		require.NoError(t, err)
		defer p.Close()
		var prs []*Promise[int]
		want := 0
		for f := range 5 {
			var kids []Child
			for i := range 8 {
				kids = append(kids, ChildOf(q, fmt.Sprintf("c%d-%d", f, i), f*10+i))
				want += f*10 + i
			}
			pr, err := p.ProduceFlow(ctx, fmt.Sprintf("parent-%d", f), 0, kids, nil)
			require.NoError(t, err)
			prs = append(prs, pr)
		}
		got := 0
		for _, pr := range prs {
			v, err := waitFor(t, pr)
			require.NoError(t, err)
			got += v
		}
		require.Equal(t, want, got, "each parent saw its children's results")
		n, err := client.Get(ctx, total).Int()
		require.NoError(t, err)
		require.Equal(t, want, n, "every child's INCRBY applied once")
		require.EqualValues(t, 40, client.SCard(ctx, done).Val())
		np, err := client.Get(ctx, parents).Int()
		require.NoError(t, err)
		require.Equal(t, 5, np, "every parent's INCR applied once")
	})
}

// TestFlowCancelRacingARetryCountsTheChild cancels a flow's child that
// runs when Cancel begins and waits in the retry set when cancel.lua runs
// (a hook in Cancel moves it there in between): the cancellation counts in
// the flow (the parent is released, and fails), whatever Cancel read before.
func TestFlowCancelRacingARetryCountsTheChild(t *testing.T) {
	t.Parallel()
	client := realRedis(t)
	ctx := context.Background()
	q := NewQueue[string, string](queueName(t))
	running, release := make(chan struct{}), make(chan struct{})
	var first sync.Once
	c, err := q.NewConsumer(client, func(ctx context.Context, m *Message[string]) (string, error) {
		if m.ID == "rc-child" {
			first.Do(func() { close(running) })
			<-release
			return "", RetryAfter(errors.New("later"), time.Hour)
		}
		return "parent ran", nil
	}, fastOpts(t, "c1", 2*time.Second))
	require.NoError(t, err)
	runConsumer(t, c)
	p := newStringProducer(t, client, q.Name())
	pr, err := p.ProduceFlow(ctx, "rc-parent", "p", []Child{ChildOf(q, "rc-child", "c")}, nil)
	require.NoError(t, err)
	<-running
	a, err := q.NewAdmin(client, nil)
	require.NoError(t, err)
	k, _ := keys.New(q.Name())
	var moved sync.Once
	a.beforeCancel = func() {
		moved.Do(func() {
			close(release)
			eventually(t, 10*time.Second, func() bool {
				return strings.HasPrefix(client.Get(ctx, k.Record("rc-child")).Val(), "P@")
			}, "the child was not put in the retry set")
		})
	}
	require.NoError(t, a.Cancel(ctx, "rc-child"))
	got := client.HGet(ctx, k.Flow("rc-parent"), "k:"+k.Record("rc-child")).Val()
	require.True(t, strings.HasPrefix(got, "C"), "the cancelled child is not counted in its flow: %q", got)
	_, err = waitFor(t, pr)
	require.ErrorIs(t, err, ErrChildFailed)
}

// TestFlowRequeuedParentKeepsItsChildren dead-letters a flow's parent and
// requeues it: the dead letter keeps the entry's flow fields, so the
// requeued parent's handler still reads its children.
func TestFlowRequeuedParentKeepsItsChildren(t *testing.T) {
	backends(t, func(t *testing.T, client *redis.Client) {
		ctx := context.Background()
		q := NewQueue[string, string](queueName(t))
		var runs atomic.Int64
		seen := make(chan []ChildResult, 2)
		c, err := q.NewConsumer(client, func(ctx context.Context, m *Message[string]) (string, error) {
			if m.ID != "rq-parent" {
				return m.Payload + "!", nil
			}
			kids, err := m.Children(ctx)
			if err != nil {
				return "", err
			}
			seen <- kids
			if runs.Add(1) == 1 {
				return "", Permanent(errors.New("parent broke"))
			}
			return "parent ok", nil
		}, fastOpts(t, "c1", 2*time.Second))
		require.NoError(t, err)
		runConsumer(t, c)
		p := newStringProducer(t, client, q.Name())
		pr, err := p.ProduceFlow(ctx, "rq-parent", "p", []Child{ChildOf(q, "rq-a", "a")}, nil)
		require.NoError(t, err)
		_, err = waitFor(t, pr)
		require.ErrorIs(t, err, ErrDeadLettered)
		require.Len(t, <-seen, 1)
		a, err := q.NewAdmin(client, nil)
		require.NoError(t, err)
		dls, err := a.DeadLetters(ctx, "", 10)
		require.NoError(t, err)
		require.Len(t, dls, 1)
		_, err = a.Requeue(ctx, dls[0].DeadLetterID)
		require.NoError(t, err)
		again, err := p.Produce(ctx, "rq-parent", "p")
		require.NoError(t, err)
		got, err := waitFor(t, again)
		require.NoError(t, err)
		require.Equal(t, "parent ok", got)
		kids := <-seen
		require.Len(t, kids, 1, "the requeued parent ran as a plain job")
		require.Equal(t, "rq-a", kids[0].ID)
		require.Equal(t, `"a!"`, string(kids[0].Result))
	})
}

// TestProgressOfAnEarlierRunDoesNotReachANewRequest produces an id again
// after its earlier request was forgotten (Admin.Forget), and after its
// record expired (ResultTTL): the earlier run's progress is not the new
// request's, neither in Admin.Job nor on its promise.
func TestProgressOfAnEarlierRunDoesNotReachANewRequest(t *testing.T) {
	for _, path := range []string{"forget", "expiry"} {
		t.Run(path, func(t *testing.T) {
			t.Parallel()
			client := realRedis(t)
			ctx := context.Background()
			q := NewQueue[string, string](queueName(t))
			k, _ := keys.New(q.Name())
			gate := make(chan struct{})
			var opened sync.Once
			open := func() { opened.Do(func() { close(gate) }) }
			var runs atomic.Int64
			o := fastOpts(t, "c1", 2*time.Second)
			o.ResultTTL = time.Hour
			if path == "expiry" {
				o.ResultTTL = 300 * time.Millisecond
			}
			c, err := q.NewConsumer(client, func(ctx context.Context, m *Message[string]) (string, error) {
				if runs.Add(1) == 1 {
					return "first", m.Progress(ctx, "old run")
				}
				<-gate // the new request reports nothing
				return "second", nil
			}, o)
			require.NoError(t, err)
			runConsumer(t, c)
			t.Cleanup(open) // before the consumer stops
			p := newStringProducer(t, client, q.Name())
			pr, err := p.Produce(ctx, "job", "x")
			require.NoError(t, err)
			_, err = waitFor(t, pr)
			require.NoError(t, err)
			a, err := q.NewAdmin(client, nil)
			require.NoError(t, err)
			if path == "forget" {
				require.NoError(t, a.Forget(ctx, "job", false))
			} else {
				eventually(t, 10*time.Second, func() bool {
					return client.Exists(ctx, k.Record("job")).Val() == 0
				}, "the record did not expire")
			}
			pr2, err := p.Produce(ctx, "job", "x")
			require.NoError(t, err)
			ch := pr2.Progress()
			eventually(t, 10*time.Second, func() bool { return runs.Load() == 2 }, "the new request did not start")
			info, err := a.Job(ctx, "job")
			require.NoError(t, err)
			require.Equal(t, JobRunning, info.State)
			require.Nil(t, info.Progress, "Admin.Job shows the earlier run's progress")
			open()
			_, err = waitFor(t, pr2)
			require.NoError(t, err)
			for v := range ch {
				t.Fatalf("the new request's promise got the earlier run's progress %q", v)
			}
		})
	}
}

// TestProgressAskedAfterCompletionGetsTheStoredValue asks for the progress
// of a request that completed already: the channel gives the stored last
// value, then closes.
func TestProgressAskedAfterCompletionGetsTheStoredValue(t *testing.T) {
	backends(t, func(t *testing.T, client *redis.Client) {
		ctx := context.Background()
		q := NewQueue[string, string](queueName(t))
		c, err := q.NewConsumer(client, func(ctx context.Context, m *Message[string]) (string, error) {
			return "done", m.Progress(ctx, 42)
		}, fastOpts(t, "c1", 2*time.Second))
		require.NoError(t, err)
		runConsumer(t, c)
		p := newStringProducer(t, client, q.Name())
		pr, err := p.Produce(ctx, "job", "x")
		require.NoError(t, err)
		_, err = waitFor(t, pr)
		require.NoError(t, err)
		check := func(pr *Promise[string]) {
			var got []string
			timeout := time.After(10 * time.Second)
			for ch := pr.Progress(); ch != nil; {
				select {
				case v, ok := <-ch:
					if !ok {
						ch = nil
						continue
					}
					got = append(got, string(v))
				case <-timeout:
					t.Fatal("the progress channel did not close")
				}
			}
			require.Equal(t, []string{"42"}, got)
		}
		check(pr)
		// A promise of the stored outcome (another producer) too.
		other := newStringProducer(t, client, q.Name())
		stored, err := other.Produce(ctx, "job", "x")
		require.NoError(t, err)
		require.Equal(t, DedupStored, stored.Deduplicated())
		check(stored)
	})
}
