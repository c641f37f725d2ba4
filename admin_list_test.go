package streamq

import (
	"context"
	"errors"
	"fmt"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/streamq/streamq/internal/keys"
)

// encParts length-prefixes strings as the schedule's data does.
func encParts(parts ...string) string {
	var b strings.Builder
	for _, p := range parts {
		b.WriteString(strconv.Itoa(len(p)))
		b.WriteByte(':')
		b.WriteString(p)
	}
	return b.String()
}

// seededJobs holds what seedJobs wrote, per state, by request id.
type seededJobs struct {
	due     map[string]int64 // scheduled and retrying: due time (ms)
	errs    map[string]string
	queued  []string
	running []string
	dead    []string
}

// seedJobs writes perState jobs in each listable state straight into the
// queue's keys, in the formats the scripts write, with pipelined commands
// (fast enough for 100,000 per state): scheduled and retrying jobs in the
// schedule and the retry set (due times spread over a few values, so many
// share one), queued and running entries in the stream (the group read the
// first perState entries), and dead letters. Due times and errors are
// deterministic so tests can check them.
func seedJobs(t testing.TB, client *redis.Client, q string, shards, perState int) seededJobs {
	t.Helper()
	ctx := context.Background()
	ks, err := keys.Shards(q, shards)
	require.NoError(t, err)
	require.NoError(t, client.Set(ctx, keys.Meta(q), shards, 0).Err())
	require.NoError(t, client.Set(ctx, keys.AnsweringGroup(q), DefaultGroup, 0).Err())
	for _, k := range ks {
		require.NoError(t, client.XGroupCreateMkStream(ctx, k.Stream, DefaultGroup, "0").Err())
	}
	s := seededJobs{due: map[string]int64{}, errs: map[string]string{}}
	base := time.Now().Add(time.Hour).UnixMilli()
	pipe := client.Pipeline()
	flush := func(force bool) {
		if pipe.Len() >= 2000 || (force && pipe.Len() > 0) {
			_, err := pipe.Exec(ctx)
			require.NoError(t, err)
		}
	}
	for i := range perState {
		id := fmt.Sprintf("sch-%d", i)
		k := ks[keys.ShardOf(id, shards)]
		due := base + int64(i%97)*1000
		s.due[id] = due
		pipe.ZAdd(ctx, k.Schedule, redis.Z{Score: float64(due), Member: "r" + id})
		pipe.HSet(ctx, k.ScheduleData, "r"+id, encParts(k.Record(id), "", "0", encParts("id", id, "p", "x"), "", strconv.FormatInt(base-3600_000, 10)))
		id = fmt.Sprintf("rty-%d", i)
		k = ks[keys.ShardOf(id, shards)]
		due = base + int64(i%89)*1000
		s.due[id] = due
		s.errs[id] = fmt.Sprintf("boom-%d", i%3)
		pipe.ZAdd(ctx, k.Retry, redis.Z{Score: float64(due), Member: "r" + id})
		pipe.HSet(ctx, k.ScheduleData, "r"+id, encParts(k.Record(id), k.Starts(DefaultGroup), strconv.Itoa(1+i%4), encParts("id", id, "p", "x", "g", DefaultGroup), s.errs[id]))
		id = fmt.Sprintf("run-%d", i)
		pipe.XAdd(ctx, &redis.XAddArgs{Stream: ks[keys.ShardOf(id, shards)].Stream, Values: []any{"id", id, "p", "x"}})
		s.running = append(s.running, id)
		id = fmt.Sprintf("ded-%d", i)
		k = ks[keys.ShardOf(id, shards)]
		pipe.XAdd(ctx, &redis.XAddArgs{Stream: k.DeadLetter, Values: []any{"id", id, "entry", "1-1", "p", "x",
			"error", fmt.Sprintf("fatal-%d", i%5), "deliveries", "3", "consumer", "w", "at", strconv.FormatInt(base, 10)}})
		s.dead = append(s.dead, id)
		flush(false)
	}
	flush(true)
	for _, k := range ks {
		// Everything in the stream so far is read: running.
		for {
			res, err := client.XReadGroup(ctx, &redis.XReadGroupArgs{Group: DefaultGroup, Consumer: "w1", Streams: []string{k.Stream, ">"}, Count: 10000, Block: -1}).Result()
			if errors.Is(err, redis.Nil) || (err == nil && len(res[0].Messages) == 0) {
				break
			}
			require.NoError(t, err)
		}
	}
	for i := range perState {
		id := fmt.Sprintf("que-%d", i)
		pipe.XAdd(ctx, &redis.XAddArgs{Stream: ks[keys.ShardOf(id, shards)].Stream, Values: []any{"id", id, "p", "x"}})
		s.queued = append(s.queued, id)
		flush(false)
	}
	flush(true)
	return s
}

// walk pages through one state with Next to the end, then back with Prev to
// the start, and returns the ids seen each way, in page order.
func walk(t *testing.T, a *Admin, q JobsQuery) (forward, backward []string, pages int) {
	t.Helper()
	ctx := context.Background()
	var first []JobSummary
	var last JobsPage
	cursor := ""
	for {
		q.Cursor = cursor
		page, err := a.Jobs(ctx, q)
		require.NoError(t, err)
		if cursor == "" {
			first = page.Jobs
			require.Empty(t, page.Prev, "the first page has no Prev")
		}
		require.LessOrEqual(t, len(page.Jobs), q.Limit)
		for _, j := range page.Jobs {
			require.Equal(t, q.State, j.State)
			forward = append(forward, j.ID)
		}
		pages++
		require.Less(t, pages, 10000, "paging does not end")
		if cursor != "" {
			require.NotEmpty(t, page.Prev, "a later page has a Prev")
		}
		if page.Next == "" {
			last = page
			break
		}
		cursor = page.Next
	}
	// Back from the last page: its own jobs, then every page before it.
	var back [][]string
	ids := func(js []JobSummary) []string {
		out := []string{}
		for _, j := range js {
			out = append(out, j.ID)
		}
		return out
	}
	back = append(back, ids(last.Jobs))
	cursor = last.Prev
	var page JobsPage
	for cursor != "" {
		q.Cursor = cursor
		var err error
		page, err = a.Jobs(ctx, q)
		require.NoError(t, err)
		if q.ErrorContains == "" && q.ID == "" {
			require.NotEmpty(t, page.Next, "a page reached by Prev has a Next")
		}
		back = append(back, ids(page.Jobs))
		cursor = page.Prev
		require.Less(t, len(back), 10000, "paging back does not end")
	}
	if len(back) > 1 && q.ErrorContains == "" && q.ID == "" {
		// (A filtered scan may end on an empty page: the window found
		// nothing before the start.)
		require.Equal(t, ids(first), ids(page.Jobs), "paging back ends on the first page")
	}
	for i := len(back) - 1; i >= 0; i-- {
		backward = append(backward, back[i]...)
	}
	return forward, backward, pages
}

func requireEachOnce(t *testing.T, want, got []string, what string) {
	t.Helper()
	seen := map[string]int{}
	for _, id := range got {
		seen[id]++
	}
	for id, n := range seen {
		require.Equal(t, 1, n, "%s: %s seen %d times", what, id, n)
	}
	require.ElementsMatch(t, want, got, what)
}

// TestAdminJobsPagingBothWays: in every state, on three shards, paging
// forward with Next to the end and back with Prev to the start sees every
// job exactly once each way, in the state's order (the same order both
// ways), and the first page again at the end.
func TestAdminJobsPagingBothWays(t *testing.T) {
	backends(t, func(t *testing.T, client *redis.Client) {
		q := queueName(t)
		s := seedJobs(t, client, q, 3, 150)
		a, err := NewAdmin(client, q, nil)
		require.NoError(t, err)
		var scheduled, retrying []string
		for id := range s.due {
			if strings.HasPrefix(id, "sch-") {
				scheduled = append(scheduled, id)
			} else {
				retrying = append(retrying, id)
			}
		}
		for _, c := range []struct {
			state JobState
			want  []string
		}{
			{JobScheduled, scheduled}, {JobRetrying, retrying}, {JobQueued, s.queued},
			{JobRunning, s.running}, {JobDeadLettered, s.dead},
		} {
			fwd, back, pages := walk(t, a, JobsQuery{State: c.state, Limit: 7})
			requireEachOnce(t, c.want, fwd, string(c.state)+" forward")
			require.Equal(t, fwd, back, "%s: the same order both ways", c.state)
			require.Equal(t, (len(c.want)+6)/7, pages, "%s: full pages", c.state)
			// From the far end (the cursor of an empty last page): the last 7.
			end, err := a.Jobs(context.Background(), JobsQuery{State: c.state, Limit: 7, Cursor: jobsCursor{state: c.state, back: true}.encode()})
			require.NoError(t, err)
			require.Equal(t, fwd[len(fwd)-7:], summaryIDs(end.Jobs), "%s: the last page", c.state)
			require.Empty(t, end.Next)
			require.NotEmpty(t, end.Prev)
			switch c.state {
			case JobScheduled, JobRetrying:
				for i := 1; i < len(fwd); i++ {
					require.LessOrEqual(t, s.due[fwd[i-1]], s.due[fwd[i]], "%s: soonest first", c.state)
				}
			case JobQueued, JobRunning:
				require.Equal(t, sortedByEntry(t, client, q, fwd), fwd, "%s: oldest first", c.state)
			}
			page, err := a.Jobs(context.Background(), JobsQuery{State: c.state})
			require.NoError(t, err)
			require.Len(t, page.Jobs, min(50, len(c.want)), "default limit")
			if c.state != JobQueued || !isMini(client) {
				require.EqualValues(t, len(c.want), page.Total, "%s total", c.state)
			}
		}
		// Dead letters: newest first.
		fwd, _, _ := walk(t, a, JobsQuery{State: JobDeadLettered, Limit: 11})
		page, err := a.Jobs(context.Background(), JobsQuery{State: JobDeadLettered, Limit: 1000})
		require.NoError(t, err)
		for i := 1; i < len(page.Jobs); i++ {
			prev, cur := page.Jobs[i-1], page.Jobs[i]
			pm, ps := parseStreamID(strings.SplitN(prev.DeadLetterID, "/", 2)[1])
			cm, cs := parseStreamID(strings.SplitN(cur.DeadLetterID, "/", 2)[1])
			require.True(t, pm > cm || (pm == cm && (ps > cs || ps == cs && prev.Shard > cur.Shard)), "newest first: %v then %v", prev, cur)
		}
		require.Equal(t, fwd, summaryIDs(page.Jobs))
	})
}

func summaryIDs(js []JobSummary) []string {
	out := make([]string, len(js))
	for i, j := range js {
		out[i] = j.ID
	}
	return out
}

// isMini reports whether client talks to miniredis (whose XINFO GROUPS lag
// is not Redis's).
func isMini(client *redis.Client) bool {
	return client.Info(context.Background(), "server").Err() != nil
}

// sortedByEntry returns ids sorted by their stream entry (then shard), as
// Admin.Jobs orders queued and running jobs.
func sortedByEntry(t *testing.T, client *redis.Client, q string, ids []string) []string {
	t.Helper()
	ctx := context.Background()
	n, err := queueShards(ctx, client, q)
	require.NoError(t, err)
	ks, err := keys.Shards(q, n)
	require.NoError(t, err)
	type e struct {
		id      string
		ms, seq uint64
		shard   int
	}
	var es []e
	for i, k := range ks {
		msgs, err := client.XRange(ctx, k.Stream, "-", "+").Result()
		require.NoError(t, err)
		for _, m := range msgs {
			ms, seq := parseStreamID(m.ID)
			es = append(es, e{m.Values["id"].(string), ms, seq, i})
		}
	}
	sort.Slice(es, func(i, j int) bool {
		a, b := es[i], es[j]
		if a.ms != b.ms {
			return a.ms < b.ms
		}
		if a.seq != b.seq {
			return a.seq < b.seq
		}
		return a.shard < b.shard
	})
	want := map[string]bool{}
	for _, id := range ids {
		want[id] = true
	}
	out := []string{}
	for _, x := range es {
		if want[x.id] {
			out = append(out, x.id)
		}
	}
	return out
}

// jobsOf returns the first page of a state (up to 1000 jobs).
func jobsOf(t *testing.T, a *Admin, q JobsQuery) []JobSummary {
	t.Helper()
	if q.Limit == 0 {
		q.Limit = 1000
	}
	page, err := a.Jobs(context.Background(), q)
	require.NoError(t, err)
	return page.Jobs
}

// TestAdminJobsStates: jobs produced and run by a real producer and
// consumer are listed in the right state with the right fields: a delayed
// job (due time, production time), a retry (attempt, next run, last error),
// a running job (consumer, deliveries, entry), a dead letter (error,
// consumer, dead-letter id) and, once the consumer stopped, a queued job.
// The ID search and the error filter find exactly the matching job.
func TestAdminJobsStates(t *testing.T) {
	backends(t, func(t *testing.T, client *redis.Client) {
		ctx := context.Background()
		q := queueName(t)
		p, err := NewProducer[string, string](client, q, &ProducerOptions{Shards: 2, Logger: testLogger(t)})
		require.NoError(t, err)
		t.Cleanup(func() { _ = p.Close() })
		release := make(chan struct{})
		c, err := NewConsumer(client, q, func(ctx context.Context, m *Message[string]) (string, error) {
			switch {
			case strings.HasPrefix(m.ID, "r-"):
				return "", RetryAfter(errors.New("db down"), time.Hour)
			case strings.HasPrefix(m.ID, "d-"):
				return "", Permanent(errors.New("bad input"))
			case strings.HasPrefix(m.ID, "b-"):
				<-release
			}
			return "ok", nil
		}, &ConsumerOptions{Name: "w", Shards: 2, ReadBlock: 50 * time.Millisecond, Logger: testLogger(t)})
		require.NoError(t, err)
		stop := runConsumer(t, c)
		before := time.Now()
		_, err = p.Produce(ctx, "later", "x", After(time.Hour))
		require.NoError(t, err)
		for _, id := range []string{"r-1", "d-1", "b-1"} {
			require.NoError(t, p.Enqueue(ctx, id, "x"))
		}
		a, err := NewAdmin(client, q, nil)
		require.NoError(t, err)
		eventually(t, 10*time.Second, func() bool {
			return len(jobsOf(t, a, JobsQuery{State: JobRetrying})) == 1 &&
				len(jobsOf(t, a, JobsQuery{State: JobDeadLettered})) == 1 &&
				len(jobsOf(t, a, JobsQuery{State: JobRunning})) == 1
		}, "a retry, a dead letter and a running job")

		sch := jobsOf(t, a, JobsQuery{State: JobScheduled})
		require.Len(t, sch, 1)
		require.Equal(t, "later", sch[0].ID)
		require.Equal(t, keys.ShardOf("later", 2), sch[0].Shard)
		require.WithinDuration(t, before.Add(time.Hour), sch[0].Due, 5*time.Second)
		require.WithinDuration(t, before, sch[0].ProducedAt, 5*time.Second)

		rty := jobsOf(t, a, JobsQuery{State: JobRetrying})[0]
		require.Equal(t, "r-1", rty.ID)
		require.Equal(t, JobRetrying, rty.State)
		require.Equal(t, 1, rty.Deliveries, "one attempt so far")
		require.Contains(t, rty.LastError, "db down")
		require.WithinDuration(t, time.Now().Add(time.Hour), rty.Due, 10*time.Second)
		require.Empty(t, rty.Group)

		run := jobsOf(t, a, JobsQuery{State: JobRunning})[0]
		require.Equal(t, "b-1", run.ID)
		require.Equal(t, "w", run.Consumer)
		require.Equal(t, 1, run.Deliveries)
		require.NotEmpty(t, run.EntryID)
		info, err := a.Job(ctx, "b-1")
		require.NoError(t, err)
		require.Equal(t, info.EntryID, run.EntryID)

		require.Equal(t, `"x"`, string(sch[0].Payload))
		require.Equal(t, `"x"`, string(rty.Payload))
		require.Equal(t, `"x"`, string(run.Payload))
		dead := jobsOf(t, a, JobsQuery{State: JobDeadLettered})[0]
		require.Equal(t, `"x"`, string(dead.Payload))
		require.Equal(t, "d-1", dead.ID)
		require.Contains(t, dead.LastError, "bad input")
		require.Equal(t, "w", dead.Consumer)
		require.WithinDuration(t, time.Now(), dead.At, 10*time.Second)
		dl, err := a.DeadLetter(ctx, dead.DeadLetterID)
		require.NoError(t, err)
		require.Equal(t, "d-1", dl.ID)

		// Searches.
		require.Len(t, jobsOf(t, a, JobsQuery{State: JobRunning, ID: "b-1"}), 1)
		require.Empty(t, jobsOf(t, a, JobsQuery{State: JobRunning, ID: "r-1"}))
		require.Len(t, jobsOf(t, a, JobsQuery{State: JobRetrying, ID: "r-1"}), 1)
		require.Empty(t, jobsOf(t, a, JobsQuery{State: JobRetrying, ID: "later"}))
		require.Len(t, jobsOf(t, a, JobsQuery{State: JobScheduled, ID: "later"}), 1)
		require.Len(t, jobsOf(t, a, JobsQuery{State: JobDeadLettered, ID: "d-1"}), 1)
		require.Empty(t, jobsOf(t, a, JobsQuery{State: JobDeadLettered, ID: "r-1"}))
		require.Len(t, jobsOf(t, a, JobsQuery{State: JobRetrying, ErrorContains: "db do"}), 1)
		require.Empty(t, jobsOf(t, a, JobsQuery{State: JobRetrying, ErrorContains: "bad input"}))
		require.Len(t, jobsOf(t, a, JobsQuery{State: JobDeadLettered, ErrorContains: "bad in"}), 1)
		require.Empty(t, jobsOf(t, a, JobsQuery{State: JobDeadLettered, ErrorContains: "db down"}))

		close(release)
		eventually(t, 10*time.Second, func() bool { return len(jobsOf(t, a, JobsQuery{State: JobRunning})) == 0 }, "b-1 finished")
		stop()
		require.NoError(t, p.Enqueue(ctx, "q-1", "x"))
		que := jobsOf(t, a, JobsQuery{State: JobQueued})
		require.Len(t, que, 1)
		require.Equal(t, "q-1", que[0].ID)
		require.Equal(t, `"x"`, string(que[0].Payload))
		require.NotEmpty(t, que[0].EntryID)
		require.Len(t, jobsOf(t, a, JobsQuery{State: JobQueued, ID: "q-1"}), 1)

		// Bad queries.
		_, err = a.Jobs(ctx, JobsQuery{State: "nope"})
		require.ErrorIs(t, err, ErrInvalidOptions)
		_, err = a.Jobs(ctx, JobsQuery{State: JobQueued, Limit: 1001})
		require.ErrorIs(t, err, ErrInvalidOptions)
		_, err = a.Jobs(ctx, JobsQuery{State: JobQueued, ErrorContains: "x"})
		require.ErrorIs(t, err, ErrInvalidOptions)
		_, err = a.Jobs(ctx, JobsQuery{State: JobQueued, Cursor: "garbage!"})
		require.ErrorIs(t, err, ErrInvalidCursor)
		_, err = a.Jobs(ctx, JobsQuery{State: JobScheduled, Cursor: (jobsCursor{state: JobQueued, hasKey: true, str: "1-1"}).encode()})
		require.ErrorIs(t, err, ErrInvalidCursor, "a cursor of another state")
	})
}

// TestAdminJobsErrorFilterWindow: with a scan window smaller than the jobs
// before the first match, a filtered page comes back short (or empty) with
// a Next that continues the scan, and paging on finds every match once.
func TestAdminJobsErrorFilterWindow(t *testing.T) {
	old := jobsScanWindow
	jobsScanWindow = 10
	t.Cleanup(func() { jobsScanWindow = old })
	backends(t, func(t *testing.T, client *redis.Client) {
		q := queueName(t)
		s := seedJobs(t, client, q, 2, 120)
		a, err := NewAdmin(client, q, nil)
		require.NoError(t, err)
		var want []string
		for id, e := range s.errs {
			if e == "boom-1" {
				want = append(want, id)
			}
		}
		fwd, back, pages := walk(t, a, JobsQuery{State: JobRetrying, Limit: 10, ErrorContains: "boom-1"})
		requireEachOnce(t, want, fwd, "retries matching")
		requireEachOnce(t, want, back, "retries matching, backwards")
		require.Greater(t, pages, len(want)/10+1, "the window split the scan")
		var dead []string
		for i, id := range s.dead {
			if i%5 == 2 {
				dead = append(dead, id)
			}
		}
		fwd, back, _ = walk(t, a, JobsQuery{State: JobDeadLettered, Limit: 4, ErrorContains: "fatal-2"})
		requireEachOnce(t, dead, fwd, "dead letters matching")
		requireEachOnce(t, dead, back, "dead letters matching, backwards")
		fwd, _, _ = walk(t, a, JobsQuery{State: JobDeadLettered, Limit: 4, ID: s.dead[77]})
		require.Equal(t, []string{s.dead[77]}, fwd, "the id search goes through the window")
	})
}

// TestAdminRunNow: RunNow appends a delayed job at once and the caller
// waiting on its id gets the result; a waiting retry runs again at once with
// its start count (the handler sees its second delivery); asking again
// runs nothing twice (it succeeds while the entry is in the stream); an unknown id is ErrNotFound, a completed
// one ErrNotScheduled. Cancel removes a waiting retry from the retry set.
func TestAdminRunNow(t *testing.T) {
	backends(t, func(t *testing.T, client *redis.Client) {
		ctx := context.Background()
		q := queueName(t)
		p := newStringProducer(t, client, q)
		var mu sync.Mutex
		deliveries := map[string][]int{}
		c, err := NewConsumer(client, q, func(ctx context.Context, m *Message[string]) (string, error) {
			mu.Lock()
			deliveries[m.ID] = append(deliveries[m.ID], m.Deliveries)
			mu.Unlock()
			if strings.HasPrefix(m.ID, "r-") && m.Deliveries == 1 {
				return "", RetryAfter(errors.New("later"), time.Hour)
			}
			return "done:" + m.Payload, nil
		}, &ConsumerOptions{Name: "w", ReadBlock: 50 * time.Millisecond, Logger: testLogger(t)})
		require.NoError(t, err)
		runConsumer(t, c)
		a, err := NewAdmin(client, q, nil)
		require.NoError(t, err)

		pr, err := p.Produce(ctx, "later", "x", After(time.Hour))
		require.NoError(t, err)
		require.NoError(t, a.RunNow(ctx, "later"))
		// Asked again: while the promoted entry is still in the stream the
		// call succeeds (a resend after a lost reply); once the consumer
		// completed it, which a fast consumer may do between the two calls,
		// the truthful answer is that it is no longer scheduled. Either way
		// it runs once.
		if err := a.RunNow(ctx, "later"); err != nil {
			require.ErrorIs(t, err, ErrNotScheduled, "asked again")
		}
		wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		defer cancel()
		got, err := pr.Wait(wctx)
		require.NoError(t, err)
		require.Equal(t, "done:x", got)
		require.Empty(t, jobsOf(t, a, JobsQuery{State: JobScheduled}))

		for _, id := range []string{"r-1", "r-2"} {
			require.NoError(t, p.Enqueue(ctx, id, "y"))
		}
		eventually(t, 10*time.Second, func() bool { return len(jobsOf(t, a, JobsQuery{State: JobRetrying})) == 2 }, "two retries wait")
		pr2, err := p.Produce(ctx, "r-1", "y")
		require.NoError(t, err, "the waiting retry's id attaches")
		require.NoError(t, a.RunNow(ctx, "r-1"))
		got, err = pr2.Wait(wctx)
		require.NoError(t, err)
		require.Equal(t, "done:y", got)
		mu.Lock()
		require.Equal(t, []int{1, 2}, deliveries["r-1"], "the start count went on")
		require.Equal(t, []int{1}, deliveries["later"])
		mu.Unlock()

		require.NoError(t, a.Cancel(ctx, "r-2"))
		require.Empty(t, jobsOf(t, a, JobsQuery{State: JobRetrying}))
		info, err := a.Job(ctx, "r-2")
		require.NoError(t, err)
		require.Equal(t, JobCanceled, info.State)
		require.ErrorIs(t, a.RunNow(ctx, "r-2"), ErrNotScheduled)
		require.ErrorIs(t, a.RunNow(ctx, "nobody"), ErrNotFound)
		require.ErrorIs(t, a.RunNow(ctx, "later"), ErrNotScheduled, "completed: the marker answers only while its entry is in the stream")
		_, err = p.Produce(ctx, "now", "z")
		require.NoError(t, err)
		eventually(t, 10*time.Second, func() bool {
			info, err := a.Job(ctx, "now")
			return err == nil && info.State == JobSucceeded
		}, "now ran")
		require.ErrorIs(t, a.RunNow(ctx, "now"), ErrNotScheduled)
	})
}

// TestAdminHistory: after a run with a known number of successes, dead
// letters and retries, the history (read by a new Admin, so from Redis)
// counts exactly those: processed = all three, failed = dead letters and
// retries; every minute is there, oldest first.
func TestAdminHistory(t *testing.T) {
	backends(t, func(t *testing.T, client *redis.Client) {
		ctx := context.Background()
		q := queueName(t)
		p, err := NewProducer[string, string](client, q, &ProducerOptions{Shards: 2, Logger: testLogger(t)})
		require.NoError(t, err)
		t.Cleanup(func() { _ = p.Close() })
		c, err := NewConsumer(client, q, func(ctx context.Context, m *Message[string]) (string, error) {
			switch {
			case strings.HasPrefix(m.ID, "r-"):
				return "", RetryAfter(errors.New("later"), time.Hour)
			case strings.HasPrefix(m.ID, "d-"):
				return "", Permanent(errors.New("bad"))
			}
			return "ok", nil
		}, &ConsumerOptions{Shards: 2, ReadBlock: 50 * time.Millisecond, Logger: testLogger(t)})
		require.NoError(t, err)
		runConsumer(t, c)
		const ok, dead, retries = 17, 5, 4
		var promises []*Promise[string]
		for i := range ok + dead {
			id := fmt.Sprintf("ok-%d", i)
			if i >= ok {
				id = fmt.Sprintf("d-%d", i)
			}
			pr, err := p.Produce(ctx, id, "x")
			require.NoError(t, err)
			promises = append(promises, pr)
		}
		for i := range retries {
			require.NoError(t, p.Enqueue(ctx, fmt.Sprintf("r-%d", i), "x"))
		}
		wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		defer cancel()
		for _, pr := range promises {
			_, _ = pr.Wait(wctx)
		}
		a, err := NewAdmin(client, q, nil)
		require.NoError(t, err)
		eventually(t, 10*time.Second, func() bool { return len(jobsOf(t, a, JobsQuery{State: JobRetrying})) == retries }, "retries wait")

		fresh, err := NewAdmin(client, q, nil)
		require.NoError(t, err)
		var hist []HistoryPoint
		var processed, failed int64
		// The committers add their counts once per second (historyEvery).
		eventually(t, 10*time.Second, func() bool {
			hist, err = fresh.History(ctx, 10*time.Minute)
			require.NoError(t, err)
			require.Len(t, hist, 10)
			processed, failed = 0, 0
			for i, h := range hist {
				processed += h.Processed
				failed += h.Failed
				if i > 0 {
					require.Equal(t, time.Minute, h.Minute.Sub(hist[i-1].Minute))
				}
			}
			return processed == ok+dead+retries && failed == dead+retries
		}, "the history counts every outcome and retry")
		require.WithinDuration(t, time.Now().Truncate(time.Minute), hist[len(hist)-1].Minute, time.Minute)
		require.EqualValues(t, ok+dead+retries, processed)
		require.EqualValues(t, dead+retries, failed)
		day, err := fresh.History(ctx, 0)
		require.NoError(t, err)
		require.Len(t, day, 24*60)
		// The hour hashes expire.
		n, err := queueShards(ctx, client, q)
		require.NoError(t, err)
		ks, err := keys.Shards(q, n)
		require.NoError(t, err)
		for _, k := range ks {
			ttl, err := client.PTTL(ctx, k.History(time.Now().UnixMilli()/msPerHour)).Result()
			require.NoError(t, err)
			require.Greater(t, ttl, 24*time.Hour, "every shard completed something this hour")
		}
	})
}

// TestAdminStatsFanoutDeadLetters: each group's dead letters count in its
// GroupStats: the fan-out group's own stream, the answering group's stream.
func TestAdminStatsFanoutDeadLetters(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	client := realRedis(t)
	q := queueName(t)
	b, err := NewConsumer(client, q, func(ctx context.Context, m *Message[string]) (string, error) {
		return "", Permanent(errors.New("audit refused it"))
	}, &ConsumerOptions{Group: "audit", Fanout: true, Shards: 2, ReadBlock: 50 * time.Millisecond, Logger: testLogger(t)})
	require.NoError(t, err)
	runConsumer(t, b)
	a, err := NewConsumer(client, q, func(ctx context.Context, m *Message[string]) (string, error) {
		if m.ID == "bad" {
			return "", Permanent(errors.New("no"))
		}
		return "ok", nil
	}, &ConsumerOptions{Shards: 2, ReadBlock: 50 * time.Millisecond, Logger: testLogger(t)})
	require.NoError(t, err)
	eventually(t, 10*time.Second, func() bool {
		ks, _ := keys.Shards(q, 2)
		n, err := client.Exists(ctx, ks[0].Stream, ks[1].Stream).Result()
		return err == nil && n == 2
	}, "fan-out group created")
	runConsumer(t, a)
	p, err := NewProducer[string, string](client, q, &ProducerOptions{Shards: 2, Logger: testLogger(t)})
	require.NoError(t, err)
	t.Cleanup(func() { _ = p.Close() })
	for i := range 6 {
		require.NoError(t, p.Enqueue(ctx, fmt.Sprintf("j%d", i), "x"))
	}
	require.NoError(t, p.Enqueue(ctx, "bad", "x"))
	admin, err := NewAdmin(client, q, nil)
	require.NoError(t, err)
	var st Stats
	eventually(t, 10*time.Second, func() bool {
		st, err = admin.Stats(ctx)
		if err != nil {
			return false
		}
		found := 0
		for _, g := range st.Groups {
			if (g.Name == "audit" && g.DeadLetters == 7) || (g.Name == DefaultGroup && g.DeadLetters == 1) {
				found++
			}
		}
		return found == 2
	}, "7 dead letters of audit, 1 of the answering group: %+v", st)
	require.EqualValues(t, 1, st.DeadLetters, "Stats.DeadLetters stays the answering group's")
}

// TestLegacyRetryInTheScheduleStillPromotes: a retry scheduled by an older
// version (in the schedule, its data without an error) is still appended at
// its due time with its start count, listed with the scheduled jobs (the
// list reads one set), and reported retrying by Admin.Job.
func TestLegacyRetryInTheScheduleStillPromotes(t *testing.T) {
	backends(t, func(t *testing.T, client *redis.Client) {
		ctx := context.Background()
		q := queueName(t)
		k, err := keys.New(q)
		require.NoError(t, err)
		require.NoError(t, client.Set(ctx, k.Record("old"), "P@1", time.Hour).Err())
		require.NoError(t, client.ZAdd(ctx, k.Schedule, redis.Z{Score: 1, Member: "rold"}).Err())
		require.NoError(t, client.HSet(ctx, k.ScheduleData, "rold",
			encParts(k.Record("old"), k.Starts(DefaultGroup), "2", encParts("id", "old", "p", `"x"`, "g", DefaultGroup))).Err())
		a, err := NewAdmin(client, q, nil)
		require.NoError(t, err)
		sch := jobsOf(t, a, JobsQuery{State: JobScheduled})
		require.Len(t, sch, 1)
		require.Equal(t, "old", sch[0].ID)
		require.Equal(t, 2, sch[0].Deliveries)
		info, err := a.Job(ctx, "old")
		require.NoError(t, err)
		require.Equal(t, JobRetrying, info.State, "a retry, whichever set it waits in")
		require.Equal(t, 2, info.Deliveries)
		got := make(chan int, 1)
		c, err := NewConsumer(client, q, func(ctx context.Context, m *Message[string]) (string, error) {
			got <- m.Deliveries
			return "ok", nil
		}, &ConsumerOptions{ReadBlock: 50 * time.Millisecond, Logger: testLogger(t)})
		require.NoError(t, err)
		runConsumer(t, c)
		select {
		case n := <-got:
			require.Equal(t, 3, n, "the third start")
		case <-time.After(10 * time.Second):
			t.Fatal("the old retry was not promoted")
		}
	})
}

// TestAdminJobsAfterScriptFlush: a server that lost its scripts (a restart,
// SCRIPT FLUSH) is sent the script's source: the page still comes back.
func TestAdminJobsAfterScriptFlush(t *testing.T) {
	t.Parallel()
	client := realRedis(t)
	q := queueName(t)
	seedJobs(t, client, q, 2, 20)
	a, err := NewAdmin(client, q, nil)
	require.NoError(t, err)
	ctx := context.Background()
	require.NoError(t, client.ScriptFlush(ctx).Err())
	page, err := a.Jobs(ctx, JobsQuery{State: JobScheduled})
	require.NoError(t, err)
	require.Len(t, page.Jobs, 20)
}

// TestAdminJobsFanoutRetry: a fan-out group's retry is listed with its
// group, found by id through an Admin of that group, and run at once by it
// (with its start count); the answering group's Admin does not find it.
func TestAdminJobsFanoutRetry(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	client := realRedis(t)
	q := queueName(t)
	starts := make(chan int, 4)
	b, err := NewConsumer(client, q, func(ctx context.Context, m *Message[string]) (string, error) {
		starts <- m.Deliveries
		if m.Deliveries == 1 {
			return "", RetryAfter(errors.New("audit busy"), time.Hour)
		}
		return "", nil
	}, &ConsumerOptions{Group: "audit", Fanout: true, ReadBlock: 50 * time.Millisecond, Logger: testLogger(t)})
	require.NoError(t, err)
	runConsumer(t, b)
	a, err := NewConsumer(client, q, func(ctx context.Context, m *Message[string]) (string, error) {
		return "ok", nil
	}, &ConsumerOptions{ReadBlock: 50 * time.Millisecond, Logger: testLogger(t)})
	require.NoError(t, err)
	eventually(t, 10*time.Second, func() bool {
		n, err := client.Exists(ctx, "streamq:{"+q+"}:stream").Result()
		return err == nil && n == 1
	}, "fan-out group created")
	runConsumer(t, a)
	p := newStringProducer(t, client, q)
	require.NoError(t, p.Enqueue(ctx, "f-1", "x"))
	require.Equal(t, 1, <-starts)
	answering, err := NewAdmin(client, q, nil)
	require.NoError(t, err)
	audit, err := NewAdmin(client, q, &AdminOptions{Group: "audit"})
	require.NoError(t, err)
	var rty []JobSummary
	eventually(t, 10*time.Second, func() bool {
		rty = jobsOf(t, answering, JobsQuery{State: JobRetrying})
		return len(rty) == 1
	}, "the audit retry waits")
	require.Equal(t, "f-1", rty[0].ID)
	require.Equal(t, "audit", rty[0].Group)
	require.Contains(t, rty[0].LastError, "audit busy")
	require.Len(t, jobsOf(t, audit, JobsQuery{State: JobRetrying, ID: "f-1"}), 1)
	require.Empty(t, jobsOf(t, answering, JobsQuery{State: JobRetrying, ID: "f-1"}))
	require.NoError(t, audit.RunNow(ctx, "f-1"))
	select {
	case n := <-starts:
		require.Equal(t, 2, n)
	case <-time.After(10 * time.Second):
		t.Fatal("the audit retry did not run")
	}
	require.Empty(t, jobsOf(t, answering, JobsQuery{State: JobRetrying}))
	require.ErrorIs(t, audit.RunNow(ctx, "nobody"), ErrNotScheduled, "a fan-out group has no records to tell")
}

// TestAdminJobsPayloadCut: a page carries at most 4096 bytes of a job's
// payload, so a page of big jobs stays bounded.
func TestAdminJobsPayloadCut(t *testing.T) {
	client, _ := miniRedis(t)
	ctx := context.Background()
	q := queueName(t)
	p := newStringProducer(t, client, q)
	big := strings.Repeat("b", 5000)
	_, err := p.Produce(ctx, "big", big, After(time.Hour))
	require.NoError(t, err)
	require.NoError(t, p.Enqueue(ctx, "queued", big))
	a, err := NewAdmin(client, q, nil)
	require.NoError(t, err)
	for _, st := range []JobState{JobScheduled, JobQueued} {
		js := jobsOf(t, a, JobsQuery{State: st})
		require.Len(t, js, 1)
		require.Len(t, js[0].Payload, 4096, "%s", st)
		require.Equal(t, `"`+big[:4095], string(js[0].Payload), "the payload's start, as encoded")
	}
}

// TestAdminJobsCursorHoldsItsPlace: jobs added before a cursor, and jobs of
// the page before it removed, neither shift nor repeat the next page (the
// cursor holds the sort key, not an offset).
func TestAdminJobsCursorHoldsItsPlace(t *testing.T) {
	backends(t, func(t *testing.T, client *redis.Client) {
		ctx := context.Background()
		q := queueName(t)
		seedJobs(t, client, q, 3, 60)
		a, err := NewAdmin(client, q, nil)
		require.NoError(t, err)
		all := jobsOf(t, a, JobsQuery{State: JobScheduled})
		first, err := a.Jobs(ctx, JobsQuery{State: JobScheduled, Limit: 10})
		require.NoError(t, err)
		require.Equal(t, summaryIDs(all[:10]), summaryIDs(first.Jobs))
		p, err := NewProducer[string, string](client, q, &ProducerOptions{Shards: 3, Logger: testLogger(t)})
		require.NoError(t, err)
		t.Cleanup(func() { _ = p.Close() })
		for i := range 5 {
			_, err := p.Produce(ctx, fmt.Sprintf("early-%d", i), "x", After(time.Minute))
			require.NoError(t, err)
		}
		// (The seeded jobs have no record: remove them by hand.)
		n, err := queueShards(ctx, client, q)
		require.NoError(t, err)
		ks, err := keys.Shards(q, n)
		require.NoError(t, err)
		for _, j := range first.Jobs[:3] {
			require.NoError(t, client.ZRem(ctx, ks[j.Shard].Schedule, "r"+j.ID).Err())
		}
		second, err := a.Jobs(ctx, JobsQuery{State: JobScheduled, Limit: 10, Cursor: first.Next})
		require.NoError(t, err)
		require.Equal(t, summaryIDs(all[10:20]), summaryIDs(second.Jobs))
		back, err := a.Jobs(ctx, JobsQuery{State: JobScheduled, Limit: 10, Cursor: second.Prev})
		require.NoError(t, err)
		got := summaryIDs(back.Jobs)
		require.Equal(t, summaryIDs(all[3:10]), got[len(got)-7:], "back: the page before, without the removed jobs")
		require.Equal(t, []string{"early-2", "early-3", "early-4"}, got[:3], "and the latest of the jobs added before it")
	})
}

// FuzzJobsCursor: any string given as a cursor (a dashboard passes them
// through URLs) decodes to a cursor or ErrInvalidCursor, never a panic, and
// every cursor Jobs issues decodes to itself.
func FuzzJobsCursor(f *testing.F) {
	f.Add(string(JobQueued), false, true, int64(2), "1796186471324-0", "")
	f.Add(string(JobScheduled), true, true, int64(1796186471324), "rorder|17", "cmV0cnlpbmd8bmt8MHx4")
	f.Add(string(JobDeadLettered), false, false, int64(0), "", "!!")
	f.Fuzz(func(t *testing.T, state string, back, hasKey bool, num int64, str, raw string) {
		for _, st := range []JobState{JobScheduled, JobRetrying, JobQueued, JobRunning, JobDeadLettered} {
			if c, err := decodeJobsCursor(raw, st); err != nil {
				require.ErrorIs(t, err, ErrInvalidCursor)
			} else {
				require.Equal(t, st, c.state)
			}
		}
		c := jobsCursor{state: JobState(state), back: back, hasKey: hasKey, num: num, str: str}
		if !zsetState(c.state) && hasKey && (!fullStreamID(str) || num < 0) {
			return // never issued
		}
		got, err := decodeJobsCursor(c.encode(), c.state)
		if strings.Contains(state, "|") {
			return // a state name never holds the separator
		}
		require.NoError(t, err)
		require.Equal(t, c, got)
	})
}
