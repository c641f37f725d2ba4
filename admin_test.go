package streamq

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/streamq/streamq/internal/faultproxy"
	"github.com/streamq/streamq/internal/scripts"
)

// deadLetters runs a consumer that refuses every request for good, produces
// ids, waits until each is dead-lettered, stops the consumer and returns the
// dead letters.
func deadLetters(t *testing.T, client *redis.Client, q string, ids ...string) []DeadLetter {
	t.Helper()
	ctx := context.Background()
	c, err := NewConsumer(client, q, func(ctx context.Context, m *Message[string]) (string, error) {
		return "", Permanent(errors.New("refused"))
	}, &ConsumerOptions{ReadBlock: 50 * time.Millisecond, TrimInterval: -1, Logger: testLogger(t)})
	require.NoError(t, err)
	stop := runConsumer(t, c)
	p := newStringProducer(t, client, q)
	for _, id := range ids {
		pr, err := p.Produce(ctx, id, "payload of "+id)
		require.NoError(t, err)
		_, err = pr.Wait(waitCtx(t, 20*time.Second))
		require.ErrorIs(t, err, ErrDeadLettered)
	}
	stop()
	admin, err := NewAdmin(client, q, nil)
	require.NoError(t, err)
	dls, err := admin.DeadLetters(ctx, "", 100)
	require.NoError(t, err)
	require.Len(t, dls, len(ids))
	return dls
}

// TestAdminRequeueUsesInflightTTL: the requeued request's in-flight record
// lives AdminOptions.InflightTTL, not the default 24h.
func TestAdminRequeueUsesInflightTTL(t *testing.T) {
	t.Parallel()
	client := realRedis(t)
	ctx := context.Background()
	q := queueName(t)
	dls := deadLetters(t, client, q, "r1")

	_, err := NewAdmin(client, q, &AdminOptions{InflightTTL: -time.Second})
	require.ErrorIs(t, err, ErrInvalidOptions)
	const ttl = 90 * time.Second
	admin, err := NewAdmin(client, q, &AdminOptions{InflightTTL: ttl})
	require.NoError(t, err)
	entry, err := admin.Requeue(ctx, dls[0].DeadLetterID)
	require.NoError(t, err)
	rec := "streamq:{" + q + "}:id:r1"
	require.Equal(t, "P"+entry, client.Get(ctx, rec).Val())
	got := client.PTTL(ctx, rec).Val()
	require.Greater(t, got, time.Duration(0))
	require.LessOrEqual(t, got, ttl, "the record's TTL is the admin's InflightTTL")
}

// TestAdminRequeueReplyLost: the server runs requeue.lua but the reply is lost,
// and go-redis sends the script again. Requeue must report the entry it
// created, not ErrNotFound, and create only one.
func TestAdminRequeueReplyLost(t *testing.T) {
	t.Parallel()
	direct := realRedis(t)
	ctx := context.Background()
	q := queueName(t)
	dls := deadLetters(t, direct, q, "lost-reply")

	proxy, err := faultproxy.New(direct.Options().Addr)
	require.NoError(t, err)
	t.Cleanup(func() { _ = proxy.Close() })
	client := redis.NewClient(&redis.Options{Addr: proxy.Addr()})
	t.Cleanup(func() { _ = client.Close() })
	// Load the script so the call is an EVALSHA naming it.
	require.NoError(t, scripts.Requeue.Load(ctx, client).Err())
	fired := proxy.CutReplyTo([]byte(scripts.Requeue.Hash()))

	admin, err := NewAdmin(client, q, nil)
	require.NoError(t, err)
	stream, dead, _, _ := firstShardKeys(t, admin)
	entry, err := admin.Requeue(ctx, dls[0].DeadLetterID)
	select {
	case <-fired:
	default:
		t.Fatal("the fault did not fire: the test proves nothing")
	}
	require.NoError(t, err, "the server requeued it")
	msgs, err := direct.XRange(ctx, stream, "-", "+").Result()
	require.NoError(t, err)
	var entries []string
	for _, m := range msgs {
		if m.Values["id"] == "lost-reply" {
			entries = append(entries, m.ID)
		}
	}
	require.Equal(t, []string{entry}, entries, "one new entry, the one Requeue returned")
	require.Zero(t, direct.XLen(ctx, dead).Val())
	require.Equal(t, "P"+entry, direct.Get(ctx, "streamq:{"+q+"}:id:lost-reply").Val())

	// Asking again (a caller's own retry) gives the same answer, and the
	// entry is not added twice.
	again, err := admin.Requeue(ctx, dls[0].DeadLetterID)
	require.NoError(t, err)
	require.Equal(t, entry, again)
	require.EqualValues(t, 1, direct.XLen(ctx, stream).Val())

	// A dead letter that never existed is still not found.
	_, err = admin.Requeue(ctx, "1-1")
	require.ErrorIs(t, err, ErrNotFound)
}

// TestAdminStatsLagAfterDuplicateProduce: a duplicate Produce appends
// nothing, so Redis's lag stays right; a queued entry forgotten (deleted past
// the group's position) makes Redis report no lag (nil), and Stats still
// counts the entries not yet delivered.
func TestAdminStatsLagAfterDuplicateProduce(t *testing.T) {
	t.Parallel()
	client := realRedis(t)
	ctx := context.Background()
	q := queueName(t)
	stream := "streamq:{" + q + "}:stream"
	require.NoError(t, client.XGroupCreateMkStream(ctx, stream, DefaultGroup, "0").Err())
	p := newStringProducer(t, client, q)
	for i := range 4 {
		require.NoError(t, p.Enqueue(ctx, fmt.Sprintf("lag-%d", i), "x"))
	}
	admin, err := NewAdmin(client, q, nil)
	require.NoError(t, err)
	s, err := admin.Stats(ctx)
	require.NoError(t, err)
	require.Len(t, s.Groups, 1)
	require.EqualValues(t, 4, s.Groups[0].Lag)

	require.NoError(t, p.Enqueue(ctx, "lag-1", "x")) // a duplicate: nothing appended
	groups, err := client.XInfoGroups(ctx, stream).Result()
	require.NoError(t, err)
	require.EqualValues(t, 4, groups[0].Lag, "Redis's own lag")
	require.NoError(t, admin.Forget(ctx, "lag-1", false)) // XDEL of a queued entry
	groups, err = client.XInfoGroups(ctx, stream).Result()
	require.NoError(t, err)
	require.EqualValues(t, -1, groups[0].Lag, "Redis cannot tell the lag now (the case under test)")
	s, err = admin.Stats(ctx)
	require.NoError(t, err)
	require.EqualValues(t, 3, s.Length)
	require.EqualValues(t, 3, s.Groups[0].Lag, "entries not yet delivered")

	// Once some are delivered, the lag goes down.
	_, err = client.XReadGroup(ctx, &redis.XReadGroupArgs{Group: DefaultGroup, Consumer: "c", Streams: []string{stream, ">"}, Count: 2, Block: -1}).Result()
	require.NoError(t, err)
	s, err = admin.Stats(ctx)
	require.NoError(t, err)
	require.EqualValues(t, 1, s.Groups[0].Lag)
	require.EqualValues(t, 2, s.Groups[0].Pending)
}

// TestAdminStatsLagOfADrainedQueue (issue: Stats.Lag counts deduplicated
// produces): 5 ids produced and completed, then produced again, leave an
// empty, drained stream, whose lag is 0.
func TestAdminStatsLagOfADrainedQueue(t *testing.T) {
	t.Parallel()
	client := realRedis(t)
	ctx := context.Background()
	q := queueName(t)
	c, err := NewConsumer(client, q, func(ctx context.Context, m *Message[string]) (string, error) {
		return "ok", nil
	}, fastOpts(t, "lag", time.Second))
	require.NoError(t, err)
	runConsumer(t, c)
	p := newStringProducer(t, client, q)
	for range 2 {
		for i := range 5 {
			_, err := mustProduce(t, p, fmt.Sprintf("job-%d", i), "x").Wait(waitCtx(t, 20*time.Second))
			require.NoError(t, err)
		}
	}
	admin, err := NewAdmin(client, q, nil)
	require.NoError(t, err)
	s, err := admin.Stats(ctx)
	require.NoError(t, err)
	require.Len(t, s.Groups, 1)
	require.Equal(t, [3]int64{0, 0, 0}, [3]int64{s.Length, s.Groups[0].Pending, s.Groups[0].Lag}, "length, pending, lag")
}

// TestAdminStatsLagAfterUnreadEntriesDeleted: Redis 7.0 computes a group's
// lag as entries added minus entries read, so entries deleted before the
// group read them (Admin.Forget or Cancel of a queued request, a plain XDEL)
// stay in it for good. Stats reports the entries really after the group's
// position: with one group, with a pending entry, and with two groups (the
// faster one's delivered entries kept for the other).
func TestAdminStatsLagAfterUnreadEntriesDeleted(t *testing.T) {
	t.Parallel()
	client := realRedis(t)
	ctx := context.Background()
	q := queueName(t)
	admin, err := NewAdmin(client, q, nil)
	require.NoError(t, err)
	stream, _, _, _ := firstShardKeys(t, admin)
	add := func(n int) []string {
		t.Helper()
		var ids []string
		for i := range n {
			id, err := client.XAdd(ctx, &redis.XAddArgs{Stream: stream, Values: []any{"id", fmt.Sprint(i), "p", "x"}}).Result()
			require.NoError(t, err)
			ids = append(ids, id)
		}
		return ids
	}
	read := func(group string) []string {
		t.Helper()
		res, err := client.XReadGroup(ctx, &redis.XReadGroupArgs{Group: group, Consumer: "c", Streams: []string{stream, ">"}, Count: 1000, Block: -1}).Result()
		if errors.Is(err, redis.Nil) {
			return nil
		}
		require.NoError(t, err)
		var ids []string
		for _, m := range res[0].Messages {
			ids = append(ids, m.ID)
		}
		return ids
	}
	lags := func() (redisLag, statsLag map[string]int64) {
		t.Helper()
		groups, err := client.XInfoGroups(ctx, stream).Result()
		require.NoError(t, err)
		redisLag = map[string]int64{}
		for _, g := range groups {
			redisLag[g.Name] = g.Lag
		}
		s, err := admin.Stats(ctx)
		require.NoError(t, err)
		statsLag = map[string]int64{}
		for _, g := range s.Groups {
			statsLag[g.Name] = g.Lag
		}
		return redisLag, statsLag
	}
	require.NoError(t, client.XGroupCreateMkStream(ctx, stream, "g", "0").Err())

	// One group: 3 delivered, 2 of them completed (acknowledged and
	// deleted), then 2 queued ones forgotten (deleted unread).
	done := read("g")
	require.Empty(t, done)
	delivered := add(3)
	require.Equal(t, delivered, read("g"))
	require.NoError(t, client.XAck(ctx, stream, "g", delivered[:2]...).Err())
	require.NoError(t, client.XDel(ctx, stream, delivered[:2]...).Err())
	require.NoError(t, client.XDel(ctx, stream, add(2)...).Err())
	// A new entry is read: Redis counts on from its inflated figure.
	require.Len(t, read("g"), 0)
	require.Len(t, add(1), 1)
	require.Len(t, read("g"), 1)
	redisLag, statsLag := lags()
	require.EqualValues(t, 2, redisLag["g"], "Redis counts the 2 deleted unread entries (the case under test)")
	require.EqualValues(t, 0, statsLag["g"], "nothing after the group's position")

	// Drained: acknowledged and deleted, the stream empty.
	pend, err := client.XPendingExt(ctx, &redis.XPendingExtArgs{Stream: stream, Group: "g", Start: "-", End: "+", Count: 10}).Result()
	require.NoError(t, err)
	for _, pe := range pend {
		require.NoError(t, client.XAck(ctx, stream, "g", pe.ID).Err())
		require.NoError(t, client.XDel(ctx, stream, pe.ID).Err())
	}
	redisLag, statsLag = lags()
	require.EqualValues(t, 2, redisLag["g"], "the case under test")
	require.EqualValues(t, 0, statsLag["g"], "an empty stream")

	// Entries that are really there count.
	add(3)
	_, statsLag = lags()
	require.EqualValues(t, 3, statsLag["g"])
	held := read("g")
	require.Len(t, held, 3)

	// Two groups: h has read nothing, so the entries g acknowledges stay
	// (g's length minus pending cannot tell).
	require.NoError(t, client.XGroupCreate(ctx, stream, "h", "0").Err())
	ack := func(ids []string) {
		t.Helper()
		require.NoError(t, client.XAck(ctx, stream, "g", ids...).Err())
	}
	ack(held)
	add(4)
	ack(read("g"))
	require.NoError(t, client.XDel(ctx, stream, add(2)...).Err())
	require.Len(t, add(1), 1)
	ack(read("g"))
	length := client.XLen(ctx, stream).Val()
	require.EqualValues(t, 8, length)
	redisLag, statsLag = lags()
	require.EqualValues(t, 4, redisLag["g"], "the case under test")
	require.EqualValues(t, 0, statsLag["g"])
	require.EqualValues(t, length, statsLag["h"])
	add(2)
	_, statsLag = lags()
	require.EqualValues(t, 2, statsLag["g"])
	require.EqualValues(t, length+2, statsLag["h"])
}

// TestAdminStatsLagWithALongHistory: when more than lagCountLimit entries
// sit at or before the group's position (another group still needs them),
// the lag is counted from the other side.
func TestAdminStatsLagWithALongHistory(t *testing.T) {
	t.Parallel()
	client := realRedis(t)
	ctx := context.Background()
	q := queueName(t)
	admin, err := NewAdmin(client, q, nil)
	require.NoError(t, err)
	stream, _, _, _ := firstShardKeys(t, admin)
	const history, ahead = lagCountLimit + 500, 5
	pipe := client.Pipeline()
	for i := range history + ahead {
		pipe.XAdd(ctx, &redis.XAddArgs{Stream: stream, Values: []any{"id", fmt.Sprint(i), "p", "x"}})
	}
	_, err = pipe.Exec(ctx)
	require.NoError(t, err)
	require.NoError(t, client.XGroupCreate(ctx, stream, "g", "0").Err())
	read, err := client.XReadGroup(ctx, &redis.XReadGroupArgs{Group: "g", Consumer: "c", Streams: []string{stream, ">"}, Count: history, Block: -1}).Result()
	require.NoError(t, err)
	require.Len(t, read[0].Messages, history)
	rest, err := client.XRange(ctx, stream, "("+read[0].Messages[history-1].ID, "+").Result()
	require.NoError(t, err)
	require.Len(t, rest, ahead)
	require.NoError(t, client.XDel(ctx, stream, rest[1].ID).Err())
	groups, err := client.XInfoGroups(ctx, stream).Result()
	require.NoError(t, err)
	require.EqualValues(t, -1, groups[0].Lag, "Redis cannot tell the lag (the case under test)")

	s, err := admin.Stats(ctx)
	require.NoError(t, err)
	require.Len(t, s.Groups, 1)
	require.EqualValues(t, ahead-1, s.Groups[0].Lag)
}
