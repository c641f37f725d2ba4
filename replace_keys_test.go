package streamq

import (
	"context"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/streamq/streamq/internal/keys"
)

// TestReplaceOnKeyedRequests: Replace and keyed requests (Key). With
// KeyLimit 1 and key k's one slot held by a running job:
//   - Replace on an id waiting for its key's turn (record "P%") is refused
//     with ErrInvalidOptions and leaves the waiting job as it was (it failed
//     with a Redis error, "Invalid stream ID", after reading "%" as an
//     entry id);
//   - Key combined with Replace is refused at once (it was already; the
//     error now names Replace);
//   - Replace on a keyed entry nobody has read yet is refused (it deleted the
//     entry and appended a new one, leaving the old entry's slot taken for
//     good: key k never ran again).
//
// Every keyed job then runs once, k never has two handlers at once, and
// no slot is left once the queue drains.
func TestReplaceOnKeyedRequests(t *testing.T) {
	t.Parallel()
	client := realRedis(t)
	ctx := context.Background()
	q := queueName(t)
	p := newStringProducer(t, client, q)

	runs := newKeyRuns()
	var mu sync.Mutex
	started := map[string]int{}
	unblock := make(chan struct{})
	opts := fastOpts(t, "replacekeys", 30*time.Second)
	opts.Workers, opts.KeyLimit = 4, 1
	c, err := NewConsumer(client, q, func(ctx context.Context, m *Message[string]) (string, error) {
		done := runs.start(m.Key)
		defer done()
		mu.Lock()
		started[m.ID]++
		mu.Unlock()
		if m.ID == "blocker" {
			<-unblock
		}
		time.Sleep(3 * time.Millisecond)
		return "ran:" + m.Payload, nil
	}, opts)
	require.NoError(t, err)
	require.NoError(t, c.writeKeySettings(ctx)) // KeyLimit before the first produce

	// A keyed entry that nobody has read yet (no consumer runs): Replace
	// must not delete it from under its slot.
	unread := mustProduce(t, p, "unread", "v1", Key("u"))
	_, err = p.Produce(ctx, "unread", "v2", Replace())
	assert.ErrorIs(t, err, ErrInvalidOptions, "Replace on a keyed entry not read yet")

	stop := runConsumer(t, c)
	defer stop()
	v, err := unread.Wait(waitCtx(t, 10*time.Second))
	require.NoError(t, err)
	require.Equal(t, "ran:v1", v)

	blocker := mustProduce(t, p, "blocker", "x", Key("k"))
	eventually(t, 10*time.Second, func() bool { mu.Lock(); defer mu.Unlock(); return started["blocker"] == 1 }, "the blocker did not start")
	waiting := mustProduce(t, p, "waiting", "v1", Key("k"))
	_, err = p.Produce(ctx, "waiting", "v2", Replace())
	assert.ErrorIs(t, err, ErrInvalidOptions, "Replace on a keyed request waiting for its key's turn")
	_, err = p.Produce(ctx, "both", "x", Key("k"), Replace())
	assert.ErrorIs(t, err, ErrInvalidOptions, "Key with Replace")

	close(unblock)
	for _, pr := range []*Promise[string]{blocker, waiting} {
		_, err := pr.Wait(waitCtx(t, 10*time.Second))
		require.NoError(t, err)
	}
	v, err = waiting.Wait(waitCtx(t, time.Second))
	require.NoError(t, err)
	require.Equal(t, "ran:v1", v)

	// Key u is free again: a new job of it runs.
	after := mustProduce(t, p, "after", "x", Key("u"))
	_, err = after.Wait(waitCtx(t, 10*time.Second))
	require.NoError(t, err, "key u's slot was left taken")

	mu.Lock()
	for _, id := range []string{"unread", "blocker", "waiting", "after"} {
		require.Equal(t, 1, started[id], "runs of %s", id)
	}
	require.Zero(t, started["both"])
	mu.Unlock()
	require.Equal(t, 1, runs.mostOf("k"), "handlers of key k at once (KeyLimit 1)")
	eventually(t, 10*time.Second, func() bool { return len(fairKeysLeft(t, client, q)) == 1 },
		"fair-queuing keys left after the drain: %v", fairKeysLeft(t, client, q))
}

// TestReplaceQueuedRetryKeepsItsGroup: a retry of the answering group that
// was promoted and not read yet (its consumers stopped) is replaced in the
// stream, and the new entry keeps field "g" as a retry waiting in the
// schedule does: a fan-out group, which ran the first attempt and skips the
// answering group's retries, does not run the replacement; and the old
// entry's start count leaves the start-count hash. Before, the new entry
// lost "g" and the fan-out group ran the id a second time, and the start
// count of the deleted entry stayed in the hash for good.
func TestReplaceQueuedRetryKeepsItsGroup(t *testing.T) {
	t.Parallel()
	client := realRedis(t)
	ctx := context.Background()
	q := queueName(t)
	var mu sync.Mutex
	audited := []string{}
	failed := make(chan struct{}, 10)
	answer := func() *Consumer[string, string] {
		o := fastOpts(t, "main", 30*time.Second)
		o.RetryBackoff, o.MaxDeliveries = time.Hour, 5
		c, err := NewConsumer(client, q, func(ctx context.Context, m *Message[string]) (string, error) {
			if m.Payload == "v1" {
				failed <- struct{}{}
				return "", errors.New("fails, with retries left")
			}
			return "ran:" + m.Payload, nil
		}, o)
		require.NoError(t, err)
		return c
	}
	audit := func() *Consumer[string, string] {
		c, err := NewConsumer(client, q, func(ctx context.Context, m *Message[string]) (string, error) {
			mu.Lock()
			audited = append(audited, m.Payload)
			mu.Unlock()
			return "", nil
		}, &ConsumerOptions{Group: "audit", Fanout: true, ReadBlock: 50 * time.Millisecond, Logger: testLogger(t)})
		require.NoError(t, err)
		return c
	}
	aud := audit()
	stopA, stopF := runConsumer(t, answer()), runConsumer(t, aud)
	// The fan-out group's marker is set before the first request: otherwise
	// the answering group's retry can acknowledge and delete the entry before
	// the fan-out group exists, and that group never sees it.
	select {
	case <-aud.Ready():
	case <-time.After(10 * time.Second):
		t.Fatal("the fan-out consumer was not ready in 10s")
	}
	p := newStringProducer(t, client, q)
	first := mustProduce(t, p, "j", "v1")
	<-failed
	eventually(t, 10*time.Second, func() bool { mu.Lock(); defer mu.Unlock(); return len(audited) == 1 }, "the fan-out group did not run the first attempt")
	ks, err := keys.Shards(q, 1)
	require.NoError(t, err)
	k := ks[0]
	eventually(t, 10*time.Second, func() bool { return strings.HasPrefix(client.Get(ctx, k.Record("j")).Val(), "P@") }, "no retry scheduled")
	stopA()
	stopF()

	a, err := NewAdmin(client, q, nil)
	require.NoError(t, err)
	require.NoError(t, a.RunNow(ctx, "j")) // promoted: an entry nobody has read
	rec := client.Get(ctx, k.Record("j")).Val()
	old := strings.TrimPrefix(rec, "P")
	require.Equal(t, "1", client.HGet(ctx, k.Starts(DefaultGroup), old).Val(), "the promoted retry's start count")
	second := mustProduce(t, p, "j", "v2", Replace())
	require.Equal(t, DedupInflight, second.Deduplicated())
	newEntry := second.EntryID()
	require.Equal(t, "P"+newEntry, client.Get(ctx, k.Record("j")).Val(), "replaced in the stream")
	require.False(t, client.HExists(ctx, k.Starts(DefaultGroup), old).Val(), "the deleted entry's start count is left in the hash")

	runConsumer(t, answer())
	runConsumer(t, audit())
	for _, pr := range []*Promise[string]{first, second} {
		v, err := pr.Wait(waitCtx(t, 10*time.Second))
		require.NoError(t, err)
		require.Equal(t, "ran:v2", v)
	}
	// The fan-out group has read the replacement (skipped or run).
	eventually(t, 10*time.Second, func() bool {
		groups, err := client.XInfoGroups(ctx, k.Stream).Result()
		if err != nil {
			return false
		}
		for _, g := range groups {
			if g.Name == "audit" && (g.LastDeliveredID != newEntry || g.Pending != 0) {
				return false
			}
		}
		return true
	}, "the fan-out group did not read the replacement")
	mu.Lock()
	defer mu.Unlock()
	require.Equal(t, []string{"v1"}, audited, "the fan-out group's runs")
}
