package streamq

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"sort"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/streamq/streamq/internal/keys"
)

// levelEntry is one entry seedLevels wrote.
type levelEntry struct {
	id      string
	ms, seq uint64
	src     int // level*shards+shard, as Admin.Jobs breaks ties
	level   PriorityLevel
}

// seedLevels writes, into each of the three level streams of each of two
// shards, perSource running entries (read by the default group) and then
// perSource queued ones. Every stream uses the same explicit entry ids, so
// entries of one id lie in all six streams: the merge must break the ties.
func seedLevels(t *testing.T, client *redis.Client, q string, perSource int) (queued, running []levelEntry) {
	t.Helper()
	ctx := context.Background()
	const shards = 2
	ks, err := keys.Shards(q, shards)
	require.NoError(t, err)
	require.NoError(t, client.Set(ctx, keys.Meta(q), shards, 0).Err())
	require.NoError(t, client.Set(ctx, keys.AnsweringGroup(q), DefaultGroup, 0).Err())
	for level := range numLevels {
		for shard, k := range ks {
			k = k.AtLevel(levelNames[level])
			src := level*shards + shard
			require.NoError(t, client.XGroupCreateMkStream(ctx, k.Stream, DefaultGroup, "0").Err())
			add := func(kind string, ms uint64, i int) levelEntry {
				e := levelEntry{id: fmt.Sprintf("%s-%s-%d-%d", kind, levelValue[level], shard, i), ms: ms + uint64(i/3), seq: uint64(i % 3), src: src, level: levelValue[level]}
				vals := []any{"id", e.id, "p", "x"}
				if levelNames[level] != "" {
					vals = append(vals, keys.FieldPriority, levelNames[level])
				}
				require.NoError(t, client.XAdd(ctx, &redis.XAddArgs{Stream: k.Stream, ID: fmt.Sprintf("%d-%d", e.ms, e.seq), Values: vals}).Err())
				return e
			}
			for i := range perSource {
				// Three entries per millisecond: ids repeat across streams.
				running = append(running, add("run", 1000, i))
			}
			_, err := client.XReadGroup(ctx, &redis.XReadGroupArgs{Group: DefaultGroup, Consumer: "w1", Streams: []string{k.Stream, ">"}, Count: int64(perSource), Block: -1}).Result()
			require.NoError(t, err)
			for i := range perSource {
				queued = append(queued, add("que", 2000, i))
			}
		}
	}
	return queued, running
}

// inEntryOrder sorts entries as Admin.Jobs lists queued and running jobs: by
// entry id, then by stream (level, then shard).
func inEntryOrder(es []levelEntry) []string {
	es = append([]levelEntry(nil), es...)
	sort.Slice(es, func(i, j int) bool {
		a, b := es[i], es[j]
		if a.ms != b.ms {
			return a.ms < b.ms
		}
		if a.seq != b.seq {
			return a.seq < b.seq
		}
		return a.src < b.src
	})
	out := make([]string, len(es))
	for i, e := range es {
		out[i] = e.id
	}
	return out
}

// TestAdminJobsPriorityLevels: queued and running jobs in the streams of all
// three priority levels of two shards, with entry ids repeated across the
// six streams, are each listed exactly once paging forward and back (page
// sizes that split ties included), in entry order, with their level and
// shard; Total counts every level; a cursor survives an insert before it
// and the deletion of its own entry.
func TestAdminJobsPriorityLevels(t *testing.T) {
	backends(t, func(t *testing.T, client *redis.Client) {
		ctx := context.Background()
		q := queueName(t)
		queued, running := seedLevels(t, client, q, 6)
		a, err := NewAdmin(client, q, nil)
		require.NoError(t, err)
		byID := map[string]levelEntry{}
		for _, e := range append(append([]levelEntry(nil), queued...), running...) {
			byID[e.id] = e
		}
		for _, c := range []struct {
			state JobState
			want  []levelEntry
		}{{JobQueued, queued}, {JobRunning, running}} {
			order := inEntryOrder(c.want)
			for _, limit := range []int{1, 4, 7, 1000} {
				fwd, back, pages := walk(t, a, JobsQuery{State: c.state, Limit: limit})
				require.Equal(t, order, fwd, "%s limit %d: every level, once, in entry order", c.state, limit)
				require.Equal(t, fwd, back, "%s limit %d: the same both ways", c.state, limit)
				require.Equal(t, (len(order)+limit-1)/limit, pages, "%s limit %d: full pages", c.state, limit)
			}
			page, err := a.Jobs(ctx, JobsQuery{State: c.state, Limit: 1000})
			require.NoError(t, err)
			if c.state == JobRunning || !isMini(client) {
				require.EqualValues(t, len(c.want), page.Total, "%s: Total counts every level", c.state)
			}
			levels := map[PriorityLevel]int{}
			for _, j := range page.Jobs {
				e := byID[j.ID]
				require.Equal(t, e.level, j.Priority, j.ID)
				require.Equal(t, e.src%2, j.Shard, j.ID)
				require.Equal(t, fmt.Sprintf("%d-%d", e.ms, e.seq), j.EntryID, j.ID)
				levels[j.Priority]++
			}
			require.Equal(t, map[PriorityLevel]int{PriorityHigh: 12, PriorityNormal: 12, PriorityLow: 12}, levels)
		}

		// The cursor holds its place: after the first 10 queued jobs, the
		// deletion of the cursor's own entry and of one before it, and an
		// entry appended to the low level of shard 1, shift nothing.
		order := inEntryOrder(queued)
		first, err := a.Jobs(ctx, JobsQuery{State: JobQueued, Limit: 10})
		require.NoError(t, err)
		require.Equal(t, order[:10], summaryIDs(first.Jobs))
		ks, err := keys.Shards(q, 2)
		require.NoError(t, err)
		for _, id := range []string{order[9], order[3]} {
			e := byID[id]
			k := ks[e.src%2].AtLevel(levelNames[e.src/2])
			require.NoError(t, client.XDel(ctx, k.Stream, fmt.Sprintf("%d-%d", e.ms, e.seq)).Err())
		}
		require.NoError(t, client.XAdd(ctx, &redis.XAddArgs{Stream: ks[1].LevelStream("low"), Values: []any{"id", "late", "p", "x", keys.FieldPriority, "low"}}).Err())
		next, err := a.Jobs(ctx, JobsQuery{State: JobQueued, Limit: 10, Cursor: first.Next})
		require.NoError(t, err)
		require.Equal(t, order[10:20], summaryIDs(next.Jobs))
		back, err := a.Jobs(ctx, JobsQuery{State: JobQueued, Limit: 10, Cursor: next.Prev})
		require.NoError(t, err)
		require.Equal(t, append(append([]string{}, order[:3]...), order[4:9]...), summaryIDs(back.Jobs), "back: without the deleted entries")
		require.Empty(t, back.Prev)
		rest := jobsOf(t, a, JobsQuery{State: JobQueued, Cursor: next.Next})
		require.Equal(t, "late", rest[len(rest)-1].ID, "the appended entry comes last")

		// A cursor naming a stream beyond the queue's is rejected.
		bad := jobsCursor{state: JobQueued, hasKey: true, num: 6, str: "1-0"}.encode()
		_, err = a.Jobs(ctx, JobsQuery{State: JobQueued, Cursor: bad})
		require.ErrorIs(t, err, ErrInvalidCursor)
	})
}

// TestAdminJobsPriorityFromProducer: jobs produced with Priority are listed
// with their level: queued on their level's stream, a delayed one (in the
// schedule) and a failed one waiting for its retry from their stored
// fields; the default level is omitted in JSON and a non-default one named.
func TestAdminJobsPriorityFromProducer(t *testing.T) {
	backends(t, func(t *testing.T, client *redis.Client) {
		q := queueName(t)
		p := newStringProducer(t, client, q)
		mustProduce(t, p, "n", "x")
		mustProduce(t, p, "h", "x", Priority(PriorityHigh))
		mustProduce(t, p, "l", "x", Priority(PriorityLow))
		mustProduce(t, p, "l-later", "x", Priority(PriorityLow), After(time.Hour))
		mustProduce(t, p, "n-later", "x", After(time.Hour))
		a, err := NewAdmin(client, q, nil)
		require.NoError(t, err)
		got := map[string]PriorityLevel{}
		for _, st := range []JobState{JobQueued, JobScheduled} {
			for _, j := range jobsOf(t, a, JobsQuery{State: st}) {
				got[j.ID] = j.Priority
			}
		}
		require.Equal(t, map[string]PriorityLevel{"n": PriorityNormal, "h": PriorityHigh, "l": PriorityLow, "l-later": PriorityLow, "n-later": PriorityNormal}, got)
		js := jobsOf(t, a, JobsQuery{State: JobQueued})

		// Every queued job fails once and waits an hour for its retry.
		opts := fastOpts(t, "flaky", 5*time.Second)
		opts.RetryBackoff, opts.RetryBackoffMax = time.Hour, time.Hour
		c, err := NewConsumer(client, q, func(ctx context.Context, m *Message[string]) (string, error) {
			return "", errors.New("not yet")
		}, opts)
		require.NoError(t, err)
		stop := runConsumer(t, c)
		require.Eventually(t, func() bool {
			return len(jobsOf(t, a, JobsQuery{State: JobRetrying})) == 3
		}, 20*time.Second, 10*time.Millisecond)
		stop()
		retrying := map[string]PriorityLevel{}
		for _, j := range jobsOf(t, a, JobsQuery{State: JobRetrying}) {
			retrying[j.ID] = j.Priority
		}
		require.Equal(t, map[string]PriorityLevel{"n": PriorityNormal, "h": PriorityHigh, "l": PriorityLow}, retrying)
		for _, j := range js {
			b, err := json.Marshal(j)
			require.NoError(t, err)
			var m map[string]any
			require.NoError(t, json.Unmarshal(b, &m))
			if j.Priority == PriorityNormal {
				require.NotContains(t, m, "priority", j.ID)
			} else {
				require.Equal(t, j.Priority.String(), m["priority"], j.ID)
			}
		}
	})
}
