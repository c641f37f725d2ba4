package streamq

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/streamq/streamq/internal/keys"
)

// TestAdminRunNowAgainAfterTheRetryCameBack: RunNow promotes a waiting
// retry, the job fails again and waits once more; a second RunNow must run
// it again. Before, a 10-minute marker keyed by the member answered "done"
// before the sets were read: the call succeeded and the retry kept waiting.
func TestAdminRunNowAgainAfterTheRetryCameBack(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	client := realRedis(t)
	q := queueName(t)
	starts := make(chan int, 8)
	c, err := NewConsumer(client, q, func(ctx context.Context, m *Message[string]) (string, error) {
		starts <- m.Deliveries
		return "", RetryAfter(errors.New("later"), time.Hour)
	}, &ConsumerOptions{Name: "w", MaxDeliveries: 10, ReadBlock: 50 * time.Millisecond, Logger: testLogger(t)})
	require.NoError(t, err)
	runConsumer(t, c)
	a, err := NewAdmin(client, q, nil)
	require.NoError(t, err)
	p := newStringProducer(t, client, q)
	require.NoError(t, p.Enqueue(ctx, "again", "x"))
	waitStart := func(want int) {
		t.Helper()
		select {
		case n := <-starts:
			require.Equal(t, want, n)
		case <-time.After(10 * time.Second):
			t.Fatalf("start %d did not come", want)
		}
	}
	waitRetrying := func() {
		t.Helper()
		eventually(t, 10*time.Second, func() bool { return len(jobsOf(t, a, JobsQuery{State: JobRetrying})) == 1 }, "the retry waits")
	}
	waitStart(1)
	waitRetrying()
	require.NoError(t, a.RunNow(ctx, "again"))
	waitStart(2)
	waitRetrying()
	require.NoError(t, a.RunNow(ctx, "again"), "the retry waits again: run it again")
	waitStart(3)
	waitRetrying()
	require.NoError(t, a.Cancel(ctx, "again"))
	require.ErrorIs(t, a.RunNow(ctx, "again"), ErrNotScheduled, "cancelled: the marker must not answer")
}

// TestAdminRunNowResendStillSucceeds: a RunNow sent again while the job it
// promoted is still queued succeeds and appends nothing (the marker answers
// only while the entry it names is in the stream).
func TestAdminRunNowResendStillSucceeds(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	client := realRedis(t)
	q := queueName(t)
	p := newStringProducer(t, client, q)
	_, err := p.Produce(ctx, "later", "x", After(time.Hour), Priority(PriorityHigh))
	require.NoError(t, err)
	a, err := NewAdmin(client, q, nil)
	require.NoError(t, err)
	require.NoError(t, a.RunNow(ctx, "later"))
	require.NoError(t, a.RunNow(ctx, "later"), "a resend")
	require.EqualValues(t, 1, client.XLen(ctx, "streamq:{"+q+"}:stream:high").Val(), "one entry")
}

// TestAdminJobsDeadLetterFilterBoundedWork: a filtered page over dead
// letters with 64 KiB payloads reads a bounded number of bytes per shard
// (before, 5,000 whole entries: ~320 MiB in one script call), and paging on
// finds every match exactly once.
func TestAdminJobsDeadLetterFilterBoundedWork(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	client := realRedis(t)
	q := queueName(t)
	k, err := keys.New(q)
	require.NoError(t, err)
	const n, size = 200, 64 << 10
	big := strings.Repeat("x", size)
	want := map[string]bool{}
	pipe := client.Pipeline()
	for i := range n {
		msg := "boring failure"
		if i%37 == 5 {
			msg = "the needle failure"
			want[fmt.Sprintf("d-%d", i)] = true
		}
		pipe.XAdd(ctx, &redis.XAddArgs{Stream: k.DeadLetter, ID: fmt.Sprintf("%d-1", 1000+i), Values: []any{
			keys.FieldID, fmt.Sprintf("d-%d", i), keys.FieldPayload, big, keys.DeadError, msg,
			keys.DeadEntry, "1-1", keys.DeadConsumer, "w", keys.DeadDeliveries, "1", keys.DeadAt, "1000"}})
	}
	_, err = pipe.Exec(ctx)
	require.NoError(t, err)
	a, err := NewAdmin(client, q, nil)
	require.NoError(t, err)
	got := map[string]bool{}
	cursor := ""
	pages := 0
	for {
		page, err := a.Jobs(ctx, JobsQuery{State: JobDeadLettered, ErrorContains: "needle", Cursor: cursor, Limit: 50})
		require.NoError(t, err)
		pages++
		for _, j := range page.Jobs {
			require.False(t, got[j.ID], "%s listed twice", j.ID)
			got[j.ID] = true
			require.Contains(t, j.LastError, "needle")
			require.Len(t, j.Payload, 4096)
		}
		if pages == 1 {
			// Newest first: the scan passed every entry from the newest down
			// to the frontier (all of them when the page is the last).
			scanned := n
			if page.Next != "" {
				c, err := decodeJobsCursor(page.Next, JobDeadLettered)
				require.NoError(t, err)
				ms, _ := parseStreamID(c.str)
				scanned = 1000 + n - int(ms)
			}
			require.LessOrEqual(t, scanned*size, 4<<20+size, "one page read %d entries of %d bytes", scanned, size)
		}
		if page.Next == "" {
			break
		}
		cursor = page.Next
		require.Less(t, pages, 100)
	}
	require.Equal(t, want, got)
	require.Greater(t, pages, 1)
}

// TestAdminStatsLagCountsALevelWithoutGroup: a priority level's stream that
// no consumer has read yet (its group is created when a consumer first sees
// it) holds jobs that Jobs(queued) lists; Stats must count them in the
// group's lag, not 0.
func TestAdminStatsLagCountsALevelWithoutGroup(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	client := realRedis(t)
	q := queueName(t)
	c, err := NewConsumer(client, q, func(ctx context.Context, m *Message[string]) (string, error) {
		return "ok", nil
	}, &ConsumerOptions{Name: "w", ReadBlock: 50 * time.Millisecond, Logger: testLogger(t)})
	require.NoError(t, err)
	stop := runConsumer(t, c)
	a, err := NewAdmin(client, q, nil)
	require.NoError(t, err)
	eventually(t, 10*time.Second, func() bool {
		s, err := a.Stats(ctx)
		return err == nil && len(s.Groups) == 1
	}, "the group exists")
	stop()
	p := newStringProducer(t, client, q)
	require.NoError(t, p.Enqueue(ctx, "h-1", "x", Priority(PriorityHigh)))
	require.NoError(t, p.Enqueue(ctx, "n-1", "y"))
	queued := jobsOf(t, a, JobsQuery{State: JobQueued})
	require.Len(t, queued, 2)
	s, err := a.Stats(ctx)
	require.NoError(t, err)
	require.Len(t, s.Groups, 1)
	require.EqualValues(t, 2, s.Groups[0].Lag, "both jobs wait for the group")
	require.EqualValues(t, 2, s.Length)
}

// TestAdminJobsIDSearchKeepsPriorityAndPayload: an id search of a queued or
// running job gives the same summary as the list: its priority level and
// its payload.
func TestAdminJobsIDSearchKeepsPriorityAndPayload(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	client := realRedis(t)
	q := queueName(t)
	p := newStringProducer(t, client, q)
	require.NoError(t, p.Enqueue(ctx, "hi", "payload-hi", Priority(PriorityHigh)))
	a, err := NewAdmin(client, q, nil)
	require.NoError(t, err)
	check := func(state JobState) {
		t.Helper()
		js := jobsOf(t, a, JobsQuery{State: state, ID: "hi"})
		require.Len(t, js, 1, "%s", state)
		require.Equal(t, PriorityHigh, js[0].Priority, "%s", state)
		require.Equal(t, `"payload-hi"`, string(js[0].Payload), "%s", state)
		all := jobsOf(t, a, JobsQuery{State: state})
		require.Len(t, all, 1)
		require.Equal(t, all[0].Priority, js[0].Priority)
		require.Equal(t, all[0].Payload, js[0].Payload)
	}
	check(JobQueued)
	running := make(chan struct{})
	release := make(chan struct{})
	c, err := NewConsumer(client, q, func(ctx context.Context, m *Message[string]) (string, error) {
		close(running)
		<-release
		return "ok", nil
	}, &ConsumerOptions{Name: "w", ReadBlock: 50 * time.Millisecond, Logger: testLogger(t)})
	require.NoError(t, err)
	stop := runConsumer(t, c)
	defer stop()
	defer close(release)
	select {
	case <-running:
	case <-time.After(10 * time.Second):
		t.Fatal("the job did not start")
	}
	check(JobRunning)
}

// TestAdminPurgeAllCountsExactly: purging every dead letter while dead
// letters keep coming counts exactly the ones it deleted (before, XLEN then
// DEL missed those added in between).
func TestAdminPurgeAllCountsExactly(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	client := realRedis(t)
	q := queueName(t)
	k, err := keys.New(q)
	require.NoError(t, err)
	a, err := NewAdmin(client, q, nil)
	require.NoError(t, err)
	var added atomic.Int64
	done := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		writer := sameServer(client)
		defer writer.Close()
		for {
			select {
			case <-done:
				return
			default:
			}
			pipe := writer.Pipeline()
			for range 20 {
				pipe.XAdd(ctx, &redis.XAddArgs{Stream: k.DeadLetter, Values: []any{keys.FieldID, "x", keys.DeadError, "e"}})
			}
			if _, err := pipe.Exec(ctx); err != nil {
				return
			}
			added.Add(20)
		}
	}()
	var purged int64
	for range 200 {
		n, err := a.PurgeDeadLetters(ctx)
		require.NoError(t, err)
		purged += n
	}
	close(done)
	wg.Wait()
	left := client.XLen(ctx, k.DeadLetter).Val()
	require.Equal(t, added.Load(), purged+left, "purged %d, left %d", purged, left)
}

// TestAdminHistoryCountsAJobOncePerGroup: a job processed by the answering
// group and by a fan-out group counts once in the answering group's history,
// and once in the fan-out group's (AdminOptions.Group).
func TestAdminHistoryCountsAJobOncePerGroup(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	client := realRedis(t)
	q := queueName(t)
	var audited atomic.Int64
	b, err := NewConsumer(client, q, func(ctx context.Context, m *Message[string]) (string, error) {
		audited.Add(1)
		return "", nil
	}, &ConsumerOptions{Group: "audit", Fanout: true, ReadBlock: 50 * time.Millisecond, Logger: testLogger(t)})
	require.NoError(t, err)
	runConsumer(t, b)
	c, err := NewConsumer(client, q, func(ctx context.Context, m *Message[string]) (string, error) {
		return "ok", nil
	}, &ConsumerOptions{ReadBlock: 50 * time.Millisecond, Logger: testLogger(t)})
	require.NoError(t, err)
	eventually(t, 10*time.Second, func() bool {
		n, err := client.Exists(ctx, "streamq:{"+q+"}:stream").Result()
		return err == nil && n == 1
	}, "fan-out group created")
	runConsumer(t, c)
	p := newStringProducer(t, client, q)
	for i := range 3 {
		pr, err := p.Produce(ctx, fmt.Sprintf("j-%d", i), "x")
		require.NoError(t, err)
		_, err = pr.Wait(waitCtx(t, 10*time.Second))
		require.NoError(t, err)
	}
	eventually(t, 10*time.Second, func() bool { return audited.Load() == 3 }, "audit ran all")
	sum := func(a *Admin) int64 {
		pts, err := a.History(ctx, 10*time.Minute)
		require.NoError(t, err)
		var n int64
		for _, p := range pts {
			n += p.Processed
		}
		return n
	}
	answering, err := NewAdmin(client, q, nil)
	require.NoError(t, err)
	audit, err := NewAdmin(client, q, &AdminOptions{Group: "audit"})
	require.NoError(t, err)
	// The committers add to the history once per second (historyEvery).
	eventually(t, 10*time.Second, func() bool { return sum(answering) == 3 }, "the answering group's history counts its own")
	eventually(t, 10*time.Second, func() bool { return sum(audit) == 3 }, "the audit group's history counts its own")
	require.EqualValues(t, 3, sum(answering))
}

// TestAdminFanoutGroupActsOnItsOwnRetry: the answering group and a fan-out
// group both wait to retry one id. An Admin of the fan-out group cancels and
// runs that group's retry, and leaves the answering group's alone (before,
// Cancel acted on the answering group's retry and record whatever the
// Admin's group).
func TestAdminFanoutGroupActsOnItsOwnRetry(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	client := realRedis(t)
	q := queueName(t)
	auditStarts := make(chan int, 4)
	b, err := NewConsumer(client, q, func(ctx context.Context, m *Message[string]) (string, error) {
		auditStarts <- m.Deliveries
		return "", RetryAfter(errors.New("audit busy"), time.Hour)
	}, &ConsumerOptions{Group: "audit", Fanout: true, ReadBlock: 50 * time.Millisecond, Logger: testLogger(t)})
	require.NoError(t, err)
	runConsumer(t, b)
	c, err := NewConsumer(client, q, func(ctx context.Context, m *Message[string]) (string, error) {
		return "", RetryAfter(errors.New("main busy"), time.Hour)
	}, &ConsumerOptions{ReadBlock: 50 * time.Millisecond, Logger: testLogger(t)})
	require.NoError(t, err)
	eventually(t, 10*time.Second, func() bool {
		n, err := client.Exists(ctx, "streamq:{"+q+"}:stream").Result()
		return err == nil && n == 1
	}, "fan-out group created")
	runConsumer(t, c)
	p := newStringProducer(t, client, q)
	for _, id := range []string{"f-1", "f-2"} {
		require.NoError(t, p.Enqueue(ctx, id, "x"))
	}
	answering, err := NewAdmin(client, q, nil)
	require.NoError(t, err)
	audit, err := NewAdmin(client, q, &AdminOptions{Group: "audit"})
	require.NoError(t, err)
	eventually(t, 10*time.Second, func() bool { return len(jobsOf(t, answering, JobsQuery{State: JobRetrying})) == 4 }, "four retries wait")
	for range 2 {
		<-auditStarts
	}
	require.NoError(t, audit.Cancel(ctx, "f-1"))
	info, err := answering.Job(ctx, "f-1")
	require.NoError(t, err)
	require.Equal(t, JobRetrying, info.State, "the answering group's retry is untouched")
	require.Len(t, jobsOf(t, answering, JobsQuery{State: JobRetrying, ID: "f-1"}), 1)
	require.Empty(t, jobsOf(t, audit, JobsQuery{State: JobRetrying, ID: "f-1"}), "audit's retry is cancelled")
	require.ErrorIs(t, audit.Cancel(ctx, "f-1"), ErrNotScheduled, "cancelled already: a fan-out group keeps no record to tell")
	require.ErrorIs(t, audit.Cancel(ctx, "nobody"), ErrNotScheduled)
	require.EqualValues(t, 1, statsOf(t, answering).Canceled)

	require.NoError(t, audit.RunNow(ctx, "f-2"))
	select {
	case n := <-auditStarts:
		require.Equal(t, 2, n)
	case <-time.After(10 * time.Second):
		t.Fatal("audit's retry of f-2 did not run")
	}
	info, err = answering.Job(ctx, "f-2")
	require.NoError(t, err)
	require.Equal(t, JobRetrying, info.State, "the answering group's retry of f-2 still waits")
}

func statsOf(t *testing.T, a *Admin) Stats {
	t.Helper()
	s, err := a.Stats(context.Background())
	require.NoError(t, err)
	return s
}

// poisonQueue runs a live consumer on a new queue whose handler fails every
// request whose id starts with "poison" (MaxDeliveries 2, retried at once)
// and counts the starts per id; it produces the poison ids and waits until
// each is a dead letter.
func poisonQueue(t *testing.T, client *redis.Client, ids ...string) (q string, starts func(id string) int) {
	t.Helper()
	ctx := context.Background()
	q = queueName(t)
	var mu sync.Mutex
	n := map[string]int{}
	c, err := NewConsumer(client, q, func(ctx context.Context, m *Message[string]) (string, error) {
		mu.Lock()
		n[m.ID]++
		mu.Unlock()
		if strings.HasPrefix(m.ID, "poison") {
			return "", errors.New("poison: " + m.Payload)
		}
		return "ok", nil
	}, &ConsumerOptions{Name: "w", MaxDeliveries: 2, RetryBackoff: time.Millisecond, RetryBackoffMax: time.Millisecond,
		ReadBlock: 50 * time.Millisecond, Logger: testLogger(t)})
	require.NoError(t, err)
	runConsumer(t, c)
	p := newStringProducer(t, client, q)
	for _, id := range ids {
		pr, err := p.Produce(ctx, id, id)
		require.NoError(t, err)
		_, err = pr.Wait(waitCtx(t, 20*time.Second))
		require.ErrorIs(t, err, ErrDeadLettered)
	}
	return q, func(id string) int {
		mu.Lock()
		defer mu.Unlock()
		return n[id]
	}
}

// settledDeadLetters waits until the queue holds want dead letters and
// nothing queued, running or waiting to retry.
func settledDeadLetters(t *testing.T, a *Admin, want int64) {
	t.Helper()
	eventually(t, 20*time.Second, func() bool {
		s, err := a.Stats(context.Background())
		if err != nil || s.DeadLetters != want || s.Scheduled != 0 || s.Length != 0 {
			return false
		}
		for _, g := range s.Groups {
			if g.Pending != 0 {
				return false
			}
		}
		return true
	}, "the queue settles with %d dead letters", want)
}

// TestAdminRequeueAllRequeuesEachDeadLetterOnce: with a live consumer, a
// 2-delivery poison request requeued by RequeueAll fails again and is a
// dead letter again; RequeueAll must not requeue that new dead letter (it
// requeues what was dead when it began). The filter selects.
func TestAdminRequeueAllRequeuesEachDeadLetterOnce(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	client := realRedis(t)
	q, starts := poisonQueue(t, client, "poison-1", "poison-2", "poison-3")
	a, err := NewAdmin(client, q, nil)
	require.NoError(t, err)
	settledDeadLetters(t, a, 3)
	res, err := a.RequeueAll(ctx, DeadLetterFilter{})
	require.NoError(t, err)
	require.True(t, res.Done)
	require.EqualValues(t, 3, res.Requeued)
	settledDeadLetters(t, a, 3)
	for _, id := range []string{"poison-1", "poison-2", "poison-3"} {
		require.Equal(t, 4, starts(id), "%s: two starts, requeued once, two more", id)
	}

	res, err = a.RequeueAll(ctx, DeadLetterFilter{ErrorContains: "poison-2"})
	require.NoError(t, err)
	require.EqualValues(t, 1, res.Requeued)
	res, err = a.RequeueAll(ctx, DeadLetterFilter{ID: "poison-3"})
	require.NoError(t, err)
	require.EqualValues(t, 1, res.Requeued)
	settledDeadLetters(t, a, 3)
	require.Equal(t, 4, starts("poison-1"))
	require.Equal(t, 6, starts("poison-2"))
	require.Equal(t, 6, starts("poison-3"))

	n, err := a.PurgeMatching(ctx, DeadLetterFilter{ErrorContains: "poison-1"})
	require.NoError(t, err)
	require.EqualValues(t, 1, n)
	dls, err := a.DeadLetters(ctx, "", 10)
	require.NoError(t, err)
	require.Len(t, dls, 2)
	for _, d := range dls {
		require.NotEqual(t, "poison-1", d.ID)
	}
	cctx, cancel := context.WithCancel(ctx)
	cancel()
	res, err = a.RequeueAll(cctx, DeadLetterFilter{})
	require.ErrorIs(t, err, context.Canceled)
	require.False(t, res.Done, "ctx ended first")
}
