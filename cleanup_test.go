package streamq

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"
	"github.com/streamq/streamq/internal/keys"
	"github.com/stretchr/testify/require"
)

// Tests of the cleanup guarantees: trimming never removes what a group still
// needs, idle consumer names are pruned without losing pending entries, Stats
// reports the queue's state, and record keys always carry a TTL.

// cleanupBackends runs fn against miniredis and against the shared real
// redis-server. mini is nil on the real server.
func cleanupBackends(t *testing.T, fn func(t *testing.T, client *redis.Client, mini *miniredis.Miniredis)) {
	t.Run("miniredis", func(t *testing.T) {
		t.Parallel()
		c, m := miniRedis(t)
		fn(t, c, m)
	})
	t.Run("redis", func(t *testing.T) {
		t.Parallel()
		fn(t, realRedis(t), nil)
	})
}

// streamEntries returns the stream's entries in order, as a map from entry id
// to request id plus the ordered entry ids.
func streamEntries(t *testing.T, client *redis.Client, stream string) (ids []string, rid map[string]string) {
	t.Helper()
	msgs, err := client.XRange(context.Background(), stream, "-", "+").Result()
	require.NoError(t, err)
	rid = make(map[string]string, len(msgs))
	for _, m := range msgs {
		ids = append(ids, m.ID)
		s, ok := m.Values[keys.FieldID].(string)
		require.True(t, ok, "entry %s has no %q field: %v", m.ID, keys.FieldID, m.Values)
		rid[m.ID] = s
	}
	return ids, rid
}

func TestTrimKeepsWhatALaggingGroupNeeds(t *testing.T) {
	cleanupBackends(t, func(t *testing.T, client *redis.Client, _ *miniredis.Miniredis) {
		ctx := context.Background()
		q := queueName(t)
		admin, err := NewAdmin(client, q, nil)
		require.NoError(t, err)
		stream, _, _, _ := firstShardKeys(t, admin)
		p, err := NewProducer[int, int](client, q, &ProducerOptions{Logger: testLogger(t)})
		require.NoError(t, err)
		defer p.Close()
		var handled atomic.Int64
		c, err := NewConsumer(client, q, func(ctx context.Context, m *Message[int]) (int, error) {
			handled.Add(1)
			return m.Payload, nil
		}, &ConsumerOptions{Group: "a", Workers: 4, TrimInterval: 10 * time.Millisecond, Logger: testLogger(t)})
		require.NoError(t, err)

		const n = 600
		for i := range n {
			require.NoError(t, p.Enqueue(ctx, fmt.Sprintf("j%d", i), i))
		}
		all, _ := streamEntries(t, client, stream)
		require.Len(t, all, n)

		// No group at all: nothing is known to be done, nothing is trimmed.
		removed, err := c.Trim(ctx)
		require.NoError(t, err)
		require.Zero(t, removed)
		require.EqualValues(t, n, client.XLen(ctx, stream).Val())

		// Group b reads the first 200 entries and acknowledges none; it has not
		// read the other 400.
		require.NoError(t, client.XGroupCreate(ctx, stream, "b", "0").Err())
		got, err := client.XReadGroup(ctx, &redis.XReadGroupArgs{
			Group: "b", Consumer: "b1", Streams: []string{stream, ">"}, Count: 200, Block: -1,
		}).Result()
		require.NoError(t, err)
		require.Len(t, got[0].Messages, 200)

		// Group a handles everything, trimming every 10ms as it goes.
		stop := runConsumer(t, c)
		eventually(t, 30*time.Second, func() bool { return handled.Load() == n }, "group a handled %d of %d", handled.Load(), n)
		eventually(t, 30*time.Second, func() bool {
			st, err := admin.Stats(ctx)
			require.NoError(t, err)
			for _, g := range st.Groups {
				if g.Name == "a" {
					return g.Pending == 0
				}
			}
			return false
		}, "group a still has pending entries")
		for range 3 {
			_, err := c.Trim(ctx)
			require.NoError(t, err)
		}
		stop()

		// Every entry is still there, with its fields: b has the first 200
		// pending and has not read the rest.
		left, rid := streamEntries(t, client, stream)
		require.Equal(t, all, left, "entries that group b has pending or unread were removed")

		// b acknowledges its first 100: trimming may now remove those, and only
		// those (real Redis removes whole macro-nodes, so possibly fewer).
		require.NoError(t, client.XAck(ctx, stream, "b", all[:100]...).Err())
		removed, err = c.Trim(ctx)
		require.NoError(t, err)
		left, _ = streamEntries(t, client, stream)
		require.EqualValues(t, n-len(left), removed)
		require.LessOrEqual(t, removed, int64(100))
		require.Equal(t, all[removed:], left, "trim removed something other than a prefix of what b acknowledged")

		// b reads the rest: every entry is there, with its payload.
		got, err = client.XReadGroup(ctx, &redis.XReadGroupArgs{
			Group: "b", Consumer: "b1", Streams: []string{stream, ">"}, Count: 1000, Block: -1,
		}).Result()
		require.NoError(t, err)
		require.Len(t, got[0].Messages, 400)
		for i, m := range got[0].Messages {
			require.Equal(t, all[200+i], m.ID)
			require.Equal(t, rid[m.ID], m.Values[keys.FieldID])
			require.NotNil(t, m.Values[keys.FieldPayload], "entry %s lost its payload", m.ID)
		}

		// Once b has acknowledged everything, trimming empties the stream.
		require.NoError(t, client.XAck(ctx, stream, "b", all[100:]...).Err())
		removed, err = c.Trim(ctx)
		require.NoError(t, err)
		require.EqualValues(t, len(left), removed)
		require.Zero(t, client.XLen(ctx, stream).Val())
	})
}

func TestTrimConcurrentWithAppendsLosesNothing(t *testing.T) {
	cleanupBackends(t, func(t *testing.T, client *redis.Client, mini *miniredis.Miniredis) {
		ctx := context.Background()
		q := queueName(t)
		admin, err := NewAdmin(client, q, nil)
		require.NoError(t, err)
		stream, _, _, _ := firstShardKeys(t, admin)
		const producers = 4
		perProducer := 1000
		if mini != nil {
			perProducer = 250 // miniredis serialises every command; keep its run short
		}
		n := producers * perProducer

		// Group a is the streamq consumer. One request in seven fails its first
		// delivery, so its entry must survive the trims until it is redelivered.
		var mu sync.Mutex
		succeeded := make(map[string]int, n)
		attempts := make(map[string]int, n)
		var done atomic.Int64
		c, err := NewConsumer(client, q, func(ctx context.Context, m *Message[int]) (int, error) {
			mu.Lock()
			defer mu.Unlock()
			attempts[m.ID]++
			if m.Payload%7 == 0 && m.Deliveries == 1 {
				return 0, RetryAfter(errors.New("not yet"), 5*time.Millisecond)
			}
			succeeded[m.ID]++
			done.Add(1)
			return m.Payload, nil
		}, &ConsumerOptions{Group: "a", Workers: 4, ClaimInterval: 20 * time.Millisecond,
			TrimInterval: 10 * time.Millisecond, Logger: testLogger(t)})
		require.NoError(t, err)
		require.NoError(t, client.XGroupCreateMkStream(ctx, stream, "a", "0").Err())
		// Group b reads by itself, a little behind, and checks that every entry
		// still has its fields when it gets there.
		require.NoError(t, client.XGroupCreate(ctx, stream, "b", "0").Err())

		stopCtx, stopAll := context.WithCancel(ctx)
		defer stopAll()
		var bg sync.WaitGroup
		var trims, trimmed atomic.Int64
		bg.Add(1)
		go func() { // a trimmer racing everything else
			defer bg.Done()
			for stopCtx.Err() == nil {
				r, err := c.Trim(stopCtx)
				if err != nil && stopCtx.Err() == nil {
					t.Errorf("trim: %v", err)
					return
				}
				trims.Add(1)
				trimmed.Add(r)
			}
		}()
		bSeen := make(map[string]int, n)
		var bCount atomic.Int64
		var bAcked atomic.Value // the last entry id group b acknowledged
		bg.Add(1)
		go func() {
			defer bg.Done()
			for stopCtx.Err() == nil {
				res, err := client.XReadGroup(stopCtx, &redis.XReadGroupArgs{
					Group: "b", Consumer: "b1", Streams: []string{stream, ">"}, Count: 50, Block: 50 * time.Millisecond,
				}).Result()
				if errors.Is(err, redis.Nil) || stopCtx.Err() != nil {
					continue
				}
				if err != nil {
					t.Errorf("group b read: %v", err)
					return
				}
				var ids []string
				for _, m := range res[0].Messages {
					id, ok := m.Values[keys.FieldID].(string)
					if !ok {
						t.Errorf("group b read entry %s without its fields: it was trimmed before b read it", m.ID)
						continue
					}
					ids = append(ids, m.ID)
					if g, ok := m.Values[keys.FieldGroup].(string); ok && g != "b" {
						continue // another group's retry, as a consumer of b would skip it
					}
					bSeen[id]++
					bCount.Add(1)
				}
				time.Sleep(time.Millisecond) // lag a little behind group a
				if err := client.XAck(stopCtx, stream, "b", ids...).Err(); err != nil && stopCtx.Err() == nil {
					t.Errorf("group b ack: %v", err)
					return
				}
				if len(ids) > 0 && stopCtx.Err() == nil {
					bAcked.Store(ids[len(ids)-1])
				}
			}
		}()
		stop := runConsumer(t, c)

		var prod sync.WaitGroup
		for pi := range producers {
			prod.Add(1)
			go func() {
				defer prod.Done()
				p, err := NewProducer[int, int](client, q, &ProducerOptions{Logger: testLogger(t)})
				if err != nil {
					t.Error(err)
					return
				}
				defer p.Close()
				for i := range perProducer {
					v := pi*perProducer + i
					if err := p.Enqueue(ctx, fmt.Sprintf("c%d", v), v); err != nil {
						t.Error(err)
						return
					}
				}
			}()
		}
		prod.Wait()
		eventually(t, 60*time.Second, func() bool { return done.Load() == int64(n) && bCount.Load() == int64(n) },
			"handled %d by group a and %d by group b of %d", done.Load(), bCount.Load(), n)
		// Group a's last retries are entries too, which group b reads (and
		// skips) after it counted every request: the final trim can empty the
		// stream only once b acknowledged up to the last entry.
		eventually(t, 30*time.Second, func() bool {
			last, err := client.XRevRangeN(ctx, stream, "+", "-", 1).Result()
			if err != nil || len(last) == 0 {
				return err == nil
			}
			acked, _ := bAcked.Load().(string)
			return acked != "" && !streamIDLess(acked, last[0].ID)
		}, "group b has not acknowledged up to the stream's last entry")
		stop()
		stopAll()
		bg.Wait()

		mu.Lock()
		defer mu.Unlock()
		require.Len(t, succeeded, n)
		require.Len(t, bSeen, n)
		retried := 0
		for i := range n {
			id := fmt.Sprintf("c%d", i)
			require.Equal(t, 1, succeeded[id], "group a completed %s %d times", id, succeeded[id])
			require.Equal(t, 1, bSeen[id], "group b read %s %d times", id, bSeen[id])
			if i%7 == 0 {
				require.GreaterOrEqual(t, attempts[id], 2, "%s should have been redelivered", id)
				retried++
			}
		}
		t.Logf("%d trims removed %d entries while %d requests (%d retried) ran through two groups",
			trims.Load(), trimmed.Load(), n, retried)

		// Both groups are done: trimming empties the stream.
		_, err = c.Trim(ctx)
		require.NoError(t, err)
		require.Zero(t, client.XLen(ctx, stream).Val())
	})
}

// streamIDLess reports whether stream id a comes before b.
func streamIDLess(a, b string) bool {
	parse := func(id string) (uint64, uint64) {
		ms, seq, _ := strings.Cut(id, "-")
		m, _ := strconv.ParseUint(ms, 10, 64)
		q, _ := strconv.ParseUint(seq, 10, 64)
		return m, q
	}
	am, aq := parse(a)
	bm, bq := parse(b)
	return am < bm || (am == bm && aq < bq)
}

func TestPruneConsumersRemovesOnlyIdleEmptyConsumers(t *testing.T) {
	cleanupBackends(t, func(t *testing.T, client *redis.Client, mini *miniredis.Miniredis) {
		ctx := context.Background()
		q := queueName(t)
		admin, err := NewAdmin(client, q, nil)
		require.NoError(t, err)
		stream, _, _, _ := firstShardKeys(t, admin)
		const group, idle = "g", time.Second
		c, err := NewConsumer(client, q, func(ctx context.Context, m *Message[int]) (int, error) { return 0, nil },
			&ConsumerOptions{Group: group, Name: "me", ConsumerIdleTimeout: idle, Logger: testLogger(t)})
		require.NoError(t, err)

		// A stream with three entries, held pending by "holder".
		require.NoError(t, client.XGroupCreateMkStream(ctx, stream, group, "0").Err())
		for i := range 3 {
			require.NoError(t, client.XAdd(ctx, &redis.XAddArgs{Stream: stream, Values: []any{keys.FieldID, fmt.Sprint(i), keys.FieldPayload, "1"}}).Err())
		}
		start := time.Now()
		readAs := func(name string, count int64) []redis.XMessage {
			res, err := client.XReadGroup(ctx, &redis.XReadGroupArgs{
				Group: group, Consumer: name, Streams: []string{stream, ">"}, Count: count, Block: -1,
			}).Result()
			if errors.Is(err, redis.Nil) {
				return nil
			}
			require.NoError(t, err)
			return res[0].Messages
		}
		require.Len(t, readAs("holder", 3), 3)

		// 200 consumers that came and went: half read one entry and acknowledged
		// it, half were made by XGROUP CREATECONSUMER (a read that finds nothing
		// does not create a consumer in Redis 7.0). miniredis gives consumers made
		// by CREATECONSUMER no idle time, so there every one reads an entry.
		names := make(map[string]bool, 200)
		for i := range 200 {
			name := fmt.Sprintf("gone-%d-%x", i, rand.Uint64())
			names[name] = true
			if i%2 == 0 || mini != nil {
				require.NoError(t, client.XAdd(ctx, &redis.XAddArgs{Stream: stream, Values: []any{keys.FieldID, name, keys.FieldPayload, "1"}}).Err())
				got := readAs(name, 1)
				require.Len(t, got, 1)
				require.NoError(t, client.XAck(ctx, stream, group, got[0].ID).Err())
			} else {
				require.NoError(t, client.XGroupCreateConsumer(ctx, stream, group, name).Err())
			}
		}
		if mini != nil {
			require.NoError(t, client.XAdd(ctx, &redis.XAddArgs{Stream: stream, Values: []any{keys.FieldID, "me", keys.FieldPayload, "1"}}).Err())
			got := readAs("me", 1)
			require.Len(t, got, 1)
			require.NoError(t, client.XAck(ctx, stream, group, got[0].ID).Err())
		} else {
			require.NoError(t, client.XGroupCreateConsumer(ctx, stream, group, "me").Err())
		}

		deleted := map[string]bool{}
		prune := func() {
			got, err := c.PruneConsumers(ctx)
			require.NoError(t, err)
			for _, name := range got {
				require.False(t, deleted[name], "%s deleted twice", name)
				deleted[name] = true
			}
		}
		// Before ConsumerIdleTimeout has passed, nobody is old enough.
		prune()
		if time.Since(start) < idle {
			require.Empty(t, deleted)
		}

		consumers := func() map[string]int64 {
			list, err := client.XInfoConsumers(ctx, stream, group).Result()
			require.NoError(t, err)
			out := make(map[string]int64, len(list))
			for _, ci := range list {
				out[ci.Name] = ci.Pending
			}
			return out
		}
		if mini != nil {
			// miniredis reports every consumer's idle time as -1 (unknown), even
			// after reads and a clock jump, so PruneConsumers, which deletes only
			// consumers known to be idle long enough, deletes none there.
			mini.SetTime(time.Now().Add(2 * idle))
			prune()
			require.Empty(t, deleted)
			require.Len(t, consumers(), 202)
			return
		}
		eventually(t, 30*time.Second, func() bool {
			prune()
			return len(consumers()) == 2
		}, "consumers left: %d", len(consumers()))

		require.Equal(t, names, deleted)
		require.Equal(t, map[string]int64{"holder": 3, "me": 0}, consumers())
		// The holder's entries can still be claimed: nothing was lost.
		claimed, _, err := client.XAutoClaim(ctx, &redis.XAutoClaimArgs{
			Stream: stream, Group: group, Consumer: "me", Start: "0-0", Count: 10,
		}).Result()
		require.NoError(t, err)
		require.Len(t, claimed, 3)
	})
}

func TestStatsOfAConstructedQueue(t *testing.T) {
	cleanupBackends(t, func(t *testing.T, client *redis.Client, mini *miniredis.Miniredis) {
		ctx := context.Background()
		q := queueName(t)
		admin, err := NewAdmin(client, q, nil)
		require.NoError(t, err)
		stream, dead, _, _ := firstShardKeys(t, admin)

		// A queue that does not exist yet is not found (a typo in a name
		// must not look like an idle queue).
		st, err := admin.Stats(ctx)
		require.ErrorIs(t, err, ErrNotFound)
		require.Equal(t, Stats{}, st)

		p, err := NewProducer[int, int](client, q, &ProducerOptions{Logger: testLogger(t)})
		require.NoError(t, err)
		defer p.Close()
		for i := range 10 {
			require.NoError(t, p.Enqueue(ctx, fmt.Sprintf("s%d", i), i))
		}
		ids, _ := streamEntries(t, client, stream)
		require.Len(t, ids, 10)
		for i := range 3 {
			require.NoError(t, client.XAdd(ctx, &redis.XAddArgs{Stream: dead,
				Values: []any{"id", fmt.Sprintf("d%d", i), "entry", "1-1", "p", "x", "error", "boom", "deliveries", "5"}}).Err())
		}

		// Group g: c1 reads 4 and acknowledges 1, c2 reads 2: 5 pending, 6
		// delivered, 4 not yet delivered. Group h starts at the end.
		require.NoError(t, client.XGroupCreate(ctx, stream, "g", "0").Err())
		require.NoError(t, client.XGroupCreate(ctx, stream, "h", "$").Err())
		for _, r := range []struct {
			name  string
			count int64
		}{{"c1", 4}, {"c2", 2}} {
			res, err := client.XReadGroup(ctx, &redis.XReadGroupArgs{
				Group: "g", Consumer: r.name, Streams: []string{stream, ">"}, Count: r.count, Block: -1,
			}).Result()
			require.NoError(t, err)
			require.Len(t, res[0].Messages, int(r.count))
		}
		require.NoError(t, client.XAck(ctx, stream, "g", ids[0]).Err())
		// ids[2] has been idle for two minutes; the others just got delivered.
		const idle = 2 * time.Minute
		require.NoError(t, client.Do(ctx, "XCLAIM", stream, "g", "c1", 0, ids[2], "IDLE", idle.Milliseconds(), "JUSTID").Err())
		before := time.Now()

		st, err = admin.Stats(ctx)
		require.NoError(t, err)
		require.EqualValues(t, 10, st.Length)
		require.EqualValues(t, 3, st.DeadLetters)
		require.Len(t, st.Groups, 2)
		byName := map[string]GroupStats{}
		for _, g := range st.Groups {
			byName[g.Name] = g
		}
		g, h := byName["g"], byName["h"]
		// Two consumers read; whether one counts as live or stale depends on
		// how the backend dates the XCLAIM above (miniredis backdates c1).
		require.EqualValues(t, 2, g.Consumers+g.StaleConsumers)
		require.EqualValues(t, 5, g.Pending)
		require.GreaterOrEqual(t, g.OldestPendingAge, idle)
		require.Less(t, g.OldestPendingAge, idle+time.Since(before)+time.Minute)
		require.EqualValues(t, 0, h.Consumers)
		require.EqualValues(t, 0, h.Pending)
		require.Zero(t, h.OldestPendingAge)
		if mini == nil { // miniredis does not compute lag
			require.EqualValues(t, 4, g.Lag)
			require.EqualValues(t, 0, h.Lag)
		}

		// Deleting an entry g has not read yet makes Redis's lag unknowable
		// (nil); Stats counts it.
		require.NoError(t, client.XDel(ctx, stream, ids[8]).Err())
		st, err = admin.Stats(ctx)
		require.NoError(t, err)
		require.EqualValues(t, 9, st.Length)
		for _, gs := range st.Groups {
			byName[gs.Name] = gs
		}
		if mini == nil {
			require.EqualValues(t, 3, byName["g"].Lag)
			require.EqualValues(t, 0, byName["h"].Lag)
		}
		require.EqualValues(t, 5, byName["g"].Pending)
	})
}

// scanRecords returns every record key of the queue with its value and PTTL.
// A key that expires between SCAN and PTTL is left out.
func scanRecords(t *testing.T, client *redis.Client, admin *Admin) map[string]struct {
	val  string
	pttl time.Duration
} {
	t.Helper()
	ctx := context.Background()
	_, _, _, pattern := firstShardKeys(t, admin)
	out := map[string]struct {
		val  string
		pttl time.Duration
	}{}
	iter := client.Scan(ctx, 0, pattern, 1000).Iterator()
	for iter.Next(ctx) {
		key := iter.Val()
		val, err := client.Get(ctx, key).Result()
		if errors.Is(err, redis.Nil) {
			continue
		}
		require.NoError(t, err)
		pttl, err := client.PTTL(ctx, key).Result()
		require.NoError(t, err)
		if pttl == -2 { // expired since
			continue
		}
		out[key] = struct {
			val  string
			pttl time.Duration
		}{val, pttl}
	}
	require.NoError(t, iter.Err())
	return out
}

func TestRecordsAlwaysHaveATTL(t *testing.T) {
	for _, discard := range []bool{false, true} {
		t.Run(fmt.Sprintf("DiscardResults=%v", discard), func(t *testing.T) {
			cleanupBackends(t, func(t *testing.T, client *redis.Client, mini *miniredis.Miniredis) {
				ctx := context.Background()
				q := queueName(t)
				admin, err := NewAdmin(client, q, nil)
				require.NoError(t, err)
				const inflightTTL, resultTTL, n = 10 * time.Minute, 3 * time.Second, 60
				p, err := NewProducer[int, int](client, q, &ProducerOptions{InflightTTL: inflightTTL, Logger: testLogger(t)})
				require.NoError(t, err)
				defer p.Close()
				for i := range n {
					require.NoError(t, p.Enqueue(ctx, fmt.Sprintf("r%d", i), i))
				}

				// In flight: "P<entry id>", expiring within InflightTTL.
				recs := scanRecords(t, client, admin)
				require.Len(t, recs, n)
				for key, r := range recs {
					require.True(t, strings.HasPrefix(r.val, "P"), "%s = %q", key, r.val)
					require.Greater(t, r.pttl, resultTTL, "%s", key)
					require.LessOrEqual(t, r.pttl, inflightTTL, "%s", key)
				}

				c, err := NewConsumer(client, q, func(ctx context.Context, m *Message[int]) (int, error) {
					if m.Payload%10 == 9 {
						return 0, Permanent(errors.New("no"))
					}
					return m.Payload * 2, nil
				}, &ConsumerOptions{ResultTTL: resultTTL, DiscardResults: discard, Logger: testLogger(t)})
				require.NoError(t, err)
				stop := runConsumer(t, c)
				stream, _, _, _ := firstShardKeys(t, admin)
				eventually(t, 30*time.Second, func() bool {
					st, err := admin.Stats(ctx)
					require.NoError(t, err)
					return st.DeadLetters == n/10 && len(st.Groups) == 1 && st.Groups[0].Pending == 0 &&
						client.XLen(ctx, stream).Val() == 0
				}, "requests not all completed")
				stop()

				// Completed: every record expires within ResultTTL, none lives forever.
				recs = scanRecords(t, client, admin)
				if mini == nil {
					require.NotEmpty(t, recs)
				} else {
					require.Len(t, recs, n)
				}
				for key, r := range recs {
					require.Greater(t, r.pttl, time.Duration(0), "%s has no TTL (PTTL %v)", key, r.pttl)
					require.LessOrEqual(t, r.pttl, resultTTL, "%s", key)
					i := 0
					_, err := fmt.Sscanf(key[strings.LastIndex(key, ":")+1:], "r%d", &i)
					require.NoError(t, err)
					switch {
					case i%10 == 9:
						require.True(t, strings.HasPrefix(r.val, "L"), "%s = %q", key, r.val)
					case discard:
						require.Equal(t, "N", r.val, "%s", key)
					default:
						require.Equal(t, fmt.Sprintf("R%d", 2*i), r.val, "%s", key)
					}
				}

				// Once the TTL has passed, none is left.
				if mini != nil {
					mini.FastForward(resultTTL)
				}
				eventually(t, 30*time.Second, func() bool { return len(scanRecords(t, client, admin)) == 0 },
					"record keys outlived their TTL")
			})
		})
	}
}
