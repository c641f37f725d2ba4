package streamq

import (
	"context"
	"errors"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"
)

// entriesOf returns the entry ids of the stream whose field id is id.
func entriesOf(t *testing.T, client *redis.Client, stream, id string) []string {
	t.Helper()
	msgs, err := client.XRange(context.Background(), stream, "-", "+").Result()
	require.NoError(t, err)
	var out []string
	for _, m := range msgs {
		if m.Values["id"] == id {
			out = append(out, m.ID)
		}
	}
	return out
}

// TestAdminRequeueWhileTheIdRunsAgain is the case of the issue: an id ends in
// the dead letters, is produced again with RetryFailed (as docs/producing.md
// advises) and runs, and meanwhile the old dead letter is requeued. Before,
// Requeue appended a second entry and overwrote the in-flight record: two
// entries, three handler runs. Now it refuses with ErrRequeueInFlight, adds
// nothing and leaves the dead letter; the request runs twice in all.
func TestAdminRequeueWhileTheIdRunsAgain(t *testing.T) {
	t.Parallel()
	client := realRedis(t)
	ctx := context.Background()
	q := queueName(t)
	var mu sync.Mutex
	runs := 0
	running := make(chan struct{}, 1)
	release := make(chan struct{})
	c, err := NewConsumer(client, q, func(ctx context.Context, m *Message[string]) (string, error) {
		mu.Lock()
		runs++
		n := runs
		mu.Unlock()
		if n == 1 {
			return "", Permanent(errors.New("first try fails"))
		}
		running <- struct{}{}
		<-release
		return "done", nil
	}, &ConsumerOptions{Name: "w", Workers: 4, ReadBlock: 50 * time.Millisecond, Logger: testLogger(t)})
	require.NoError(t, err)
	stop := runConsumer(t, c)
	defer stop()
	var releaseOnce sync.Once
	defer releaseOnce.Do(func() { close(release) }) // before stop, also when the test fails
	p := newStringProducer(t, client, q)
	pr, err := p.Produce(ctx, "dup", "payload")
	require.NoError(t, err)
	_, err = pr.Wait(waitCtx(t, 20*time.Second))
	require.ErrorIs(t, err, ErrDeadLettered)

	admin, err := NewAdmin(client, q, nil)
	require.NoError(t, err)
	dls, err := admin.DeadLetters(ctx, "", 10)
	require.NoError(t, err)
	require.Len(t, dls, 1)
	stream, dead, _, _ := firstShardKeys(t, admin)

	pr, err = p.Produce(ctx, "dup", "payload", RetryFailed())
	require.NoError(t, err)
	<-running
	rec := client.Get(ctx, "streamq:{"+q+"}:id:dup").Val()
	running2 := entriesOf(t, client, stream, "dup")
	require.Len(t, running2, 1)

	_, err = admin.Requeue(ctx, dls[0].DeadLetterID)
	require.Equal(t, running2, entriesOf(t, client, stream, "dup"), "Requeue appended a second entry for an id in flight")
	require.ErrorIs(t, err, ErrRequeueInFlight)
	require.ErrorContains(t, err, running2[0], "the error names the entry in flight")
	require.Equal(t, rec, client.Get(ctx, "streamq:{"+q+"}:id:dup").Val(), "the in-flight record is untouched")
	require.EqualValues(t, 1, client.XLen(ctx, dead).Val(), "the refused dead letter stays")

	releaseOnce.Do(func() { close(release) })
	res, err := pr.Wait(waitCtx(t, 20*time.Second))
	require.NoError(t, err)
	require.Equal(t, "done", res)
	eventually(t, 10*time.Second, func() bool {
		return client.XLen(ctx, stream).Val() == 0
	}, "the stream empties")
	s, err := admin.Stats(ctx)
	require.NoError(t, err)
	require.Zero(t, s.Scheduled)
	require.Zero(t, s.Groups[0].Pending)
	mu.Lock()
	require.Equal(t, 2, runs, "nothing is left that could run it a third time")
	mu.Unlock()

	// Once the request finished, the old dead letter can be requeued: it
	// runs again, as asked.
	entry, err := admin.Requeue(ctx, dls[0].DeadLetterID)
	require.NoError(t, err)
	require.NotEmpty(t, entry)
	<-running // the third run (release is closed: it may have finished already)
	stop()
	mu.Lock()
	require.Equal(t, 3, runs)
	mu.Unlock()
}

// TestAdminRequeueWhileTheIdIsScheduled: the same with the id produced again
// for later (its record "P@<due>"): Requeue refuses, and neither the stream
// nor the schedule gets a second copy.
func TestAdminRequeueWhileTheIdIsScheduled(t *testing.T) {
	t.Parallel()
	client := realRedis(t)
	ctx := context.Background()
	q := queueName(t)
	dls := deadLetters(t, client, q, "later")
	p := newStringProducer(t, client, q)
	_, err := p.Produce(ctx, "later", "again", RetryFailed(), After(time.Hour))
	require.NoError(t, err)
	admin, err := NewAdmin(client, q, nil)
	require.NoError(t, err)
	stream, dead, _, _ := firstShardKeys(t, admin)
	rec := client.Get(ctx, "streamq:{"+q+"}:id:later").Val()
	require.True(t, strings.HasPrefix(rec, "P@"), rec)

	_, err = admin.Requeue(ctx, dls[0].DeadLetterID)
	require.Empty(t, entriesOf(t, client, stream, "later"), "Requeue appended an entry for an id waiting in the schedule")
	require.ErrorIs(t, err, ErrRequeueInFlight)
	require.ErrorContains(t, err, "schedule")
	require.Equal(t, rec, client.Get(ctx, "streamq:{"+q+"}:id:later").Val())
	require.EqualValues(t, 1, client.XLen(ctx, dead).Val())
	s, err := admin.Stats(ctx)
	require.NoError(t, err)
	require.EqualValues(t, 1, s.Scheduled)
}

// TestAdminDeadLetterIDWithoutSeq: a dead-letter id without its "-seq" part
// is refused by Requeue, DeadLetter and PurgeDeadLetters. Before, Redis read
// "<ms>" as a range (XRANGE <ms> <ms> matches every entry of that
// millisecond) and as "<ms>-0" for XDEL, so Requeue appended a dead letter
// and deleted another.
func TestAdminDeadLetterIDWithoutSeq(t *testing.T) {
	t.Parallel()
	client := realRedis(t)
	ctx := context.Background()
	q := queueName(t)
	admin, err := NewAdmin(client, q, nil)
	require.NoError(t, err)
	dls := deadLetters(t, client, q, "a")
	stream, dead, _, _ := firstShardKeys(t, admin)
	// Another dead letter in the same millisecond.
	ms, seq, _ := strings.Cut(dls[0].DeadLetterID, "-")
	n, err := strconv.Atoi(seq)
	require.NoError(t, err)
	require.NoError(t, client.XAdd(ctx, &redis.XAddArgs{Stream: dead, ID: ms + "-" + strconv.Itoa(n+1),
		Values: []any{"id", "b", "entry", "1-1", "p", "x", "error", "e", "deliveries", "1", "consumer", "c", "at", "1"}}).Err())
	before, err := client.XRange(ctx, dead, "-", "+").Result()
	require.NoError(t, err)
	require.Len(t, before, 2)

	_, err = admin.Requeue(ctx, ms)
	require.Empty(t, entriesOf(t, client, stream, "a"), "a dead letter was requeued for an id it does not have")
	require.ErrorIs(t, err, ErrInvalidDeadLetterID)
	require.ErrorContains(t, err, "-<seq>")
	_, err = admin.DeadLetter(ctx, ms)
	require.ErrorIs(t, err, ErrInvalidDeadLetterID)
	_, err = admin.PurgeDeadLetters(ctx, ms)
	require.ErrorIs(t, err, ErrInvalidDeadLetterID)
	after, err := client.XRange(ctx, dead, "-", "+").Result()
	require.NoError(t, err)
	require.Equal(t, before, after, "the dead letters are untouched")
}
