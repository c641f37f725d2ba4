package streamq

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// TestDedupModesFirstRequestOfALevelStartsAtOnce: the first request of a
// priority level, appended by a Throttle produce, a Replace produce (a new
// run) or a Replace follow-up (of a run that ended, or of a failed attempt
// with retries left), starts
// without waiting for the consumers' next check for the level's stream
// (ClaimInterval, 30 s here), as one produced plainly does: the append that
// creates the level's stream announces it. Before, those appends created the
// stream silently and each request waited for the check (the calls below
// timed out).
func TestDedupModesFirstRequestOfALevelStartsAtOnce(t *testing.T) {
	t.Parallel()
	client := realRedis(t)
	for _, tc := range []struct {
		name string
		run  func(t *testing.T, p *Producer[string, string], held chan string, release chan struct{}) *Promise[string]
	}{
		{"throttle", func(t *testing.T, p *Producer[string, string], _ chan string, _ chan struct{}) *Promise[string] {
			return mustProduce(t, p, "t", "x", Throttle(time.Minute), Priority(PriorityHigh))
		}},
		{"replace new run", func(t *testing.T, p *Producer[string, string], _ chan string, _ chan struct{}) *Promise[string] {
			return mustProduce(t, p, "r", "x", Replace(), Priority(PriorityLow))
		}},
		{"replace follow-up", func(t *testing.T, p *Producer[string, string], held chan string, release chan struct{}) *Promise[string] {
			first := mustProduce(t, p, "f", "hold")
			require.Equal(t, "f", <-held)
			pr := mustProduce(t, p, "f", "x", Replace(), Priority(PriorityHigh))
			close(release)
			_ = first
			return pr
		}},
		{"replace follow-up of a failed attempt", func(t *testing.T, p *Producer[string, string], held chan string, release chan struct{}) *Promise[string] {
			mustProduce(t, p, "g", "holdfail")
			require.Equal(t, "g", <-held)
			pr := mustProduce(t, p, "g", "x", Replace(), Priority(PriorityLow))
			close(release)
			return pr
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			q := queueName(t)
			held, release := make(chan string, 1), make(chan struct{})
			opts := fastOpts(t, "levels", 30*time.Second)
			opts.ClaimInterval = 30 * time.Second
			c, err := NewConsumer(client, q, func(ctx context.Context, m *Message[string]) (string, error) {
				if m.Payload == "hold" || m.Payload == "holdfail" {
					held <- m.ID
					<-release
				}
				if m.Payload == "holdfail" {
					return "", errors.New("failed with retries left")
				}
				return "ran:" + m.Payload, nil
			}, opts)
			require.NoError(t, err)
			runConsumer(t, c)
			p := newStringProducer(t, client, q)
			warm := mustProduce(t, p, "warm", "x") // the consumer runs, its level feeders wait
			_, err = warm.Wait(waitCtx(t, 10*time.Second))
			require.NoError(t, err)

			pr := tc.run(t, p, held, release)
			v, err := pr.Wait(waitCtx(t, 5*time.Second))
			require.NoError(t, err, "the first request of a level waited for the check")
			require.Equal(t, "ran:x", v)
		})
	}
}

// TestDedupModesForgetEndsTheThrottleWindow: Admin.Forget of an id in an
// open Throttle window makes the next Throttle produce run it again, as
// Forget promises ("producing the id again runs it again"), also when the
// outcome had expired already (Forget then reports ErrNotFound). Before, the
// window's key outlived the record and the produce failed with
// ErrRecordLost.
func TestDedupModesForgetEndsTheThrottleWindow(t *testing.T) {
	t.Parallel()
	client := realRedis(t)
	ctx := context.Background()
	q := queueName(t)
	opts := fastOpts(t, "forget", time.Second)
	c, err := NewConsumer(client, q, func(ctx context.Context, m *Message[string]) (string, error) {
		return "ran:" + m.Payload, nil
	}, opts)
	require.NoError(t, err)
	runConsumer(t, c)
	p := newStringProducer(t, client, q)
	a, err := NewAdmin(client, q, nil)
	require.NoError(t, err)
	ks, err := a.shards(ctx)
	require.NoError(t, err)

	first := mustProduce(t, p, "t", "v1", Throttle(time.Hour))
	v, err := first.Wait(waitCtx(t, 10*time.Second))
	require.NoError(t, err)
	require.Equal(t, "ran:v1", v)
	require.NoError(t, a.Forget(ctx, "t", false))
	again := mustProduce(t, p, "t", "v2", Throttle(time.Hour))
	require.Equal(t, DedupNone, again.Deduplicated(), "the produce after Forget")
	v, err = again.Wait(waitCtx(t, 10*time.Second))
	require.NoError(t, err, "the produce after Forget")
	require.Equal(t, "ran:v2", v)

	// The outcome expired inside the window: Forget finds no record, and
	// still ends the window.
	require.NoError(t, client.Del(ctx, ks[0].Record("t")).Err())
	require.ErrorIs(t, a.Forget(ctx, "t", false), ErrNotFound)
	third := mustProduce(t, p, "t", "v3", Throttle(time.Hour))
	v, err = third.Wait(waitCtx(t, 10*time.Second))
	require.NoError(t, err, "the produce after Forget of an expired outcome")
	require.Equal(t, "ran:v3", v)
}

// TestReplaceFindsItsOwnEntryWhenIDsCollideAcrossLevels: Replace of a queued
// request looks its entry up by entry id among the levels' streams, and
// entry ids are per stream: a request on the default level can have the
// same entry id as one on the high level. Before, the lookup took the first
// stream with that id, the default level's: Replace of the high request
// deleted the default request's unread entry (that request was lost) and
// appended the new payload, while the high request's old entry ran too.
func TestReplaceFindsItsOwnEntryWhenIDsCollideAcrossLevels(t *testing.T) {
	t.Parallel()
	client := realRedis(t)
	ctx := context.Background()
	q, p, n, h := collidingPair(t, client, "n-payload", "h-old")
	r, err := p.Produce(ctx, "h", "h-new", Priority(PriorityHigh), Replace())
	require.NoError(t, err)

	var mu sync.Mutex
	ran := map[string][]string{}
	c, err := NewConsumer(client, q, func(_ context.Context, m *Message[string]) (string, error) {
		mu.Lock()
		defer mu.Unlock()
		ran[m.ID] = append(ran[m.ID], m.Payload)
		return m.Payload, nil
	}, &ConsumerOptions{Workers: 2, ReadBlock: 50 * time.Millisecond, Logger: testLogger(t)})
	require.NoError(t, err)
	runConsumer(t, c)
	for _, pr := range []*Promise[string]{n, h, r} {
		_, err := pr.Wait(waitCtx(t, 10*time.Second))
		require.NoError(t, err, "request %s", pr.ID())
	}
	out, err := r.Wait(waitCtx(t, time.Second))
	require.NoError(t, err)
	require.Equal(t, "h-new", out)
	mu.Lock()
	defer mu.Unlock()
	require.Equal(t, []string{"n-payload"}, ran["n"], "the default level's request ran, once")
	require.Equal(t, []string{"h-new"}, ran["h"], "the high request ran once, with the new payload")
}
