package streamq

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// keyRuns counts the handlers of each key running at once, and the most.
type keyRuns struct {
	mu      sync.Mutex
	running map[string]int
	most    map[string]int
}

func newKeyRuns() *keyRuns { return &keyRuns{running: map[string]int{}, most: map[string]int{}} }

// start counts a start of key k and returns the function that counts its end.
func (r *keyRuns) start(k string) func() {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.running[k]++
	r.most[k] = max(r.most[k], r.running[k])
	return func() {
		r.mu.Lock()
		r.running[k]--
		r.mu.Unlock()
	}
}

func (r *keyRuns) mostOf(k string) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.most[k]
}

// TestFairKeysPriorityLevels: keyed jobs of the high level take their key's
// turns like any keyed job and, on their turn, go to the high level's
// stream: behind a normal backlog of 3000 jobs (2 ms each, 2 workers), a
// keyed high job waiting for its key's one slot starts once the key's
// normal job completes, long before the backlog drains, although that
// completion's turn is what creates the high level's stream and
// ClaimInterval is 10 s (the completion tells the consumers). A delayed, a
// retried and a run-now keyed high job keep their key and level, a batch appending a
// normal and a high keyed entry in one step (entry ids may be equal across
// streams) gives each its own slot, KeyLimit 1 holds for every key, and
// nothing of the keys is left after the drain.
func TestFairKeysPriorityLevels(t *testing.T) {
	t.Parallel()
	client := realRedis(t)
	ctx := context.Background()
	q := queueName(t)
	p := newStringProducer(t, client, q)
	runs := newKeyRuns()
	var normalStarts atomic.Int64
	var backlogAtHigh atomic.Int64
	backlogAtHigh.Store(-1)
	var mu sync.Mutex
	level := map[string]PriorityLevel{}
	starts := map[string]int{}
	opts := fastOpts(t, "levels", 30*time.Second)
	opts.Workers, opts.ClaimInterval, opts.KeyLimit = 2, 10*time.Second, 1
	c, err := NewConsumer(client, q, func(ctx context.Context, m *Message[string]) (string, error) {
		if m.Key == "" {
			normalStarts.Add(1)
			time.Sleep(2 * time.Millisecond) // the backlog lasts 3 s or more

			return "", nil
		}
		done := runs.start(m.Key)
		defer done()
		mu.Lock()
		level[m.ID] = m.Priority
		starts[m.ID]++
		n := starts[m.ID]
		mu.Unlock()
		if m.ID == "ah" {
			backlogAtHigh.Store(normalStarts.Load())
		}
		if m.ID == "retry" && n == 1 {
			return "", RetryAfter(errors.New("again"), 20*time.Millisecond)
		}
		time.Sleep(2 * time.Millisecond) // a key's next job could overlap, were the limit not kept
		return "", nil
	}, opts)
	require.NoError(t, err)
	require.NoError(t, c.writeKeySettings(ctx)) // KeyLimit before the first produce

	var promises []*Promise[string]
	// Key a: a normal job at the head of the normal stream, then a high one
	// waiting for the key's slot; then the backlog.
	promises = append(promises, mustProduce(t, p, "a0", "x", Key("a")))
	promises = append(promises, mustProduce(t, p, "ah", "x", Key("a"), Priority(PriorityHigh)))
	produceLevel(t, p, "n", 3000, PriorityNormal)
	runConsumer(t, c)
	_, err = promises[1].Wait(waitCtx(t, 30*time.Second))
	require.NoError(t, err)
	at := backlogAtHigh.Load()
	t.Logf("the keyed high job started after %d of 3000 backlog jobs", at)
	require.GreaterOrEqual(t, at, int64(0))
	require.Less(t, at, int64(3000), "the keyed high job waited for the normal backlog")

	// After the high level's stream exists: key b, a delayed high job and a retried high one.
	promises = append(promises, mustProduce(t, p, "later", "x", Key("b"), Priority(PriorityHigh), After(50*time.Millisecond)))
	promises = append(promises, mustProduce(t, p, "retry", "x", Key("b"), Priority(PriorityHigh)))
	// Key e: a job due in an hour, run now by an operator.
	promises = append(promises, mustProduce(t, p, "now", "x", Key("e"), Priority(PriorityHigh), After(time.Hour)))
	a, err := NewAdmin(client, q, nil)
	require.NoError(t, err)
	require.NoError(t, a.RunNow(ctx, "now"))
	// Keys c and d: one call appends a normal and a high keyed entry.
	bp, err := p.ProduceBatch(ctx, []Job[string]{
		{ID: "c0", Request: "x", Options: []ProduceOption{Key("c")}},
		{ID: "d0", Request: "x", Options: []ProduceOption{Key("d"), Priority(PriorityHigh)}},
		{ID: "c1", Request: "x", Options: []ProduceOption{Key("c"), Priority(PriorityLow)}},
		{ID: "d1", Request: "x", Options: []ProduceOption{Key("d")}},
	})
	require.NoError(t, err)
	promises = append(promises, bp...)

	for _, pr := range promises {
		_, err := pr.Wait(waitCtx(t, 30*time.Second))
		require.NoError(t, err, pr.ID())
	}
	eventually(t, 30*time.Second, func() bool { return normalStarts.Load() == 3000 }, "the backlog did not drain")

	mu.Lock()
	want := map[string]PriorityLevel{"a0": PriorityNormal, "ah": PriorityHigh, "later": PriorityHigh, "retry": PriorityHigh, "now": PriorityHigh,
		"c0": PriorityNormal, "c1": PriorityLow, "d0": PriorityHigh, "d1": PriorityNormal}
	for id, l := range want {
		require.Equal(t, l, level[id], "the level of %s", id)
	}
	require.Equal(t, 2, starts["retry"])
	mu.Unlock()
	for _, k := range []string{"a", "b", "c", "d", "e"} {
		require.Equal(t, 1, runs.mostOf(k), "handlers of key %s at once (KeyLimit 1)", k)
	}
	eventually(t, 10*time.Second, func() bool { return len(fairKeysLeft(t, client, q)) == 1 },
		"fair-queuing keys left after the drain: %v", fairKeysLeft(t, client, q))
	require.Equal(t, []string{fmt.Sprintf("streamq:{%s}:keys:cfg", q)}, fairKeysLeft(t, client, q))
}
