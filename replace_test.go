package streamq

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/streamq/streamq/internal/crashtest"
	"github.com/streamq/streamq/internal/keys"
	"github.com/streamq/streamq/internal/scripts"
)

// replaceRecorder is a handler that records each run's payload per id and
// can hold the runs of "v1" until released.
type replaceRecorder struct {
	mu      sync.Mutex
	runs    map[string][]string
	started chan string
	hold    chan struct{}
}

func newReplaceRecorder() *replaceRecorder {
	return &replaceRecorder{runs: map[string][]string{}, started: make(chan string, 1000), hold: make(chan struct{})}
}

func (r *replaceRecorder) handle(ctx context.Context, m *Message[string]) (string, error) {
	r.mu.Lock()
	r.runs[m.ID] = append(r.runs[m.ID], m.Payload)
	r.mu.Unlock()
	if m.Payload == "v1" {
		r.started <- m.ID
		select {
		case <-r.hold:
		case <-ctx.Done():
			return "", ctx.Err()
		}
	}
	return "ran:" + m.Payload, nil
}

func (r *replaceRecorder) of(id string) []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]string(nil), r.runs[id]...)
}

// TestReplaceWhileRunningOneMoreRun: while the id's run with "v1" is in its
// handler, 8 producers call Replace 25 times each, concurrently (200 calls):
// the id runs exactly once more after v1, with a payload of the burst; a
// last Replace after the burst replaces that follow-up's payload, so the
// second run carries it. Every caller (the first included, and a plain
// produce attached to the running entry) gets the follow-up's outcome, and
// Admin.Job shows the waiting follow-up while v1 runs.
func TestReplaceWhileRunningOneMoreRun(t *testing.T) {
	t.Parallel()
	client := realRedis(t)
	q := queueName(t)
	ctx := context.Background()
	rec := newReplaceRecorder()
	c, err := NewConsumer(client, q, rec.handle, fastOpts(t, "replace", time.Second))
	require.NoError(t, err)
	runConsumer(t, c)

	p := newStringProducer(t, client, q)
	first := mustProduce(t, p, "doc", "v1", Replace())
	require.Equal(t, DedupNone, first.Deduplicated())
	<-rec.started
	plain := mustProduce(t, p, "doc", "ignored") // a plain produce attaches
	require.Equal(t, DedupInflight, plain.Deduplicated())

	var prs []*Promise[string]
	var mu sync.Mutex
	var wg sync.WaitGroup
	for pi := range 8 {
		pp := newStringProducer(t, client, q)
		wg.Go(func() {
			for s := range 25 {
				pr, err := pp.Produce(ctx, "doc", fmt.Sprintf("b-p%d-s%d", pi, s), Replace())
				require.NoError(t, err)
				require.Equal(t, DedupInflight, pr.Deduplicated())
				require.Empty(t, pr.EntryID(), "a follow-up has no entry yet")
				mu.Lock()
				prs = append(prs, pr)
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	last := mustProduce(t, p, "doc", "final", Replace())
	require.Equal(t, DedupInflight, last.Deduplicated())

	admin, err := NewAdmin(client, q, nil)
	require.NoError(t, err)
	info, err := admin.Job(ctx, "doc")
	require.NoError(t, err)
	require.Equal(t, JobRunning, info.State)
	require.Equal(t, "replace", info.Mode)
	require.Equal(t, `"final"`, string(info.Replacement), "the waiting follow-up's payload, as the codec encoded it")
	require.NotContains(t, info.EntryID, "+")

	close(rec.hold)
	for _, pr := range append(append(prs, first, plain), last) {
		got, err := pr.Wait(waitCtx(t, 10*time.Second))
		require.NoError(t, err)
		require.Equal(t, "ran:final", got, "every caller gets the follow-up's outcome")
	}
	require.Equal(t, []string{"v1", "final"}, rec.of("doc"), "exactly one more run, with the latest payload")
	info, err = admin.Job(ctx, "doc")
	require.NoError(t, err)
	require.Equal(t, JobSucceeded, info.State)
	require.Empty(t, info.Mode)
	t.Logf("Replace while running: %d concurrent Replace calls from 8 producers + 1 after them: runs %v", len(prs), rec.of("doc"))
}

// TestReplaceWhileQueuedOrScheduled: Replace on an id queued and not yet
// read replaces its entry (one run, the last payload); on an id waiting in
// the schedule (After) it replaces the waiting payload and keeps the due
// time (one run, the last payload). Without a consumer, nothing is read.
func TestReplaceWhileQueuedOrScheduled(t *testing.T) {
	t.Parallel()
	client := realRedis(t)
	q := queueName(t)
	ctx := context.Background()
	p := newStringProducer(t, client, q)
	admin, err := NewAdmin(client, q, nil)
	require.NoError(t, err)

	var queued, scheduled []*Promise[string]
	var eids []string
	for _, v := range []string{"q1", "q2", "q3"} {
		pr := mustProduce(t, p, "queued", v, Replace(), Priority(PriorityHigh))
		queued = append(queued, pr)
		eids = append(eids, pr.EntryID())
	}
	require.Equal(t, []Dedup{DedupNone, DedupInflight, DedupInflight},
		[]Dedup{queued[0].Deduplicated(), queued[1].Deduplicated(), queued[2].Deduplicated()})
	require.NotEqual(t, eids[0], eids[2], "the queued entry was replaced by a new one")
	n, err := client.XLen(ctx, "streamq:{"+q+"}:stream:high").Result()
	require.NoError(t, err)
	require.EqualValues(t, 1, n, "one entry in the stream")

	for _, v := range []string{"s1", "s2"} {
		scheduled = append(scheduled, mustProduce(t, p, "sched", v, Replace(), After(400*time.Millisecond)))
	}
	before, err := admin.Job(ctx, "sched")
	require.NoError(t, err)
	scheduled = append(scheduled, mustProduce(t, p, "sched", "s3", Replace()))
	info, err := admin.Job(ctx, "sched")
	require.NoError(t, err)
	require.Equal(t, JobScheduled, info.State)
	require.Equal(t, before.Due, info.Due, "the due time stays")
	require.Equal(t, "replace", info.Mode)

	rec := newReplaceRecorder()
	c, err := NewConsumer(client, q, rec.handle, fastOpts(t, "replace-q", time.Second))
	require.NoError(t, err)
	runConsumer(t, c)
	for _, pr := range queued {
		got, err := pr.Wait(waitCtx(t, 10*time.Second))
		require.NoError(t, err)
		require.Equal(t, "ran:q3", got)
	}
	for _, pr := range scheduled {
		got, err := pr.Wait(waitCtx(t, 10*time.Second))
		require.NoError(t, err)
		require.Equal(t, "ran:s3", got)
	}
	require.Equal(t, []string{"q3"}, rec.of("queued"))
	require.Equal(t, []string{"s3"}, rec.of("sched"))

	// Completed: a Replace runs the id again, replacing the stored outcome.
	again := mustProduce(t, p, "queued", "q4", Replace())
	require.Equal(t, DedupNone, again.Deduplicated())
	got, err := again.Wait(waitCtx(t, 10*time.Second))
	require.NoError(t, err)
	require.Equal(t, "ran:q4", got)
	require.Equal(t, []string{"q3", "q4"}, rec.of("queued"))
}

// TestReplaceFollowUpReplacesRetry: a run that fails with retries left while
// a follow-up waits behind it is not retried: the follow-up runs instead.
func TestReplaceFollowUpReplacesRetry(t *testing.T) {
	t.Parallel()
	client := realRedis(t)
	q := queueName(t)
	var mu sync.Mutex
	var runs []string
	started, hold := make(chan struct{}, 1), make(chan struct{})
	opts := fastOpts(t, "replace-retry", time.Second)
	opts.MaxDeliveries = 5
	c, err := NewConsumer(client, q, func(ctx context.Context, m *Message[string]) (string, error) {
		mu.Lock()
		runs = append(runs, m.Payload)
		mu.Unlock()
		if m.Payload == "v1" {
			started <- struct{}{}
			<-hold
			return "", RetryAfter(fmt.Errorf("fails"), 10*time.Millisecond)
		}
		return "ran:" + m.Payload, nil
	}, opts)
	require.NoError(t, err)
	runConsumer(t, c)
	p := newStringProducer(t, client, q)
	first := mustProduce(t, p, "doc", "v1", Replace())
	<-started
	mustProduce(t, p, "doc", "v2", Replace()).Release()
	close(hold)
	got, err := first.Wait(waitCtx(t, 10*time.Second))
	require.NoError(t, err)
	require.Equal(t, "ran:v2", got)
	mu.Lock()
	defer mu.Unlock()
	require.Equal(t, []string{"v1", "v2"}, runs)
}

// TestReplaceRefusedInFlows: a Replace on a flow's parent or child is
// refused, and so is Replace as a flow's option.
func TestReplaceRefusedInFlows(t *testing.T) {
	t.Parallel()
	client := realRedis(t)
	q := queueName(t)
	ctx := context.Background()
	p := newStringProducer(t, client, q)
	q2 := NewQueue[string, string](q)
	_, err := p.ProduceFlow(ctx, "parent", "x", []Child{ChildOf(q2, "c1", "y", Replace())}, nil)
	require.ErrorIs(t, err, ErrInvalidOptions)
	_, err = p.ProduceBatch(ctx, []Job[string]{{ID: "a", Request: "1", Options: []ProduceOption{Replace()}}})
	require.ErrorIs(t, err, ErrInvalidOptions)
	fl, err := p.ProduceFlow(ctx, "parent", "x", []Child{ChildOf(q2, "c1", "y")}, nil)
	require.NoError(t, err)
	defer fl.Release()
	for _, id := range []string{"parent", "c1"} {
		_, err = p.Produce(ctx, id, "z", Replace())
		require.ErrorIs(t, err, ErrInvalidOptions, id)
		require.ErrorContains(t, err, "flow")
	}
}

// replaceProducerConfig configures TestReplaceProducerHelperProcess.
type replaceProducerConfig struct {
	Addr, Queue string
	IDs         []string
}

func replaceGoKey(q string) string { return "crashtest:{" + q + "}:go" }

// TestReplaceProducerHelperProcess is the producer process of
// TestReplaceSurvivesSIGKILL: it produces "v1" for each id with Replace,
// then, once the parent says go, "v2" and "v3", marks that it did, and
// waits to be killed.
func TestReplaceProducerHelperProcess(t *testing.T) {
	var cfg replaceProducerConfig
	if !crashtest.Config(&cfg) {
		return
	}
	client, p := helperProducer(t, cfg.Addr, cfg.Queue)
	ctx := context.Background()
	for _, id := range cfg.IDs {
		if _, err := p.Produce(ctx, id, "v1", Replace()); err != nil {
			t.Fatal(err)
		}
	}
	for client.Exists(ctx, replaceGoKey(cfg.Queue)).Val() == 0 {
		time.Sleep(10 * time.Millisecond)
	}
	for _, v := range []string{"v2", "v3"} {
		for _, id := range cfg.IDs {
			if _, err := p.Produce(ctx, id, v, Replace()); err != nil {
				t.Fatal(err)
			}
		}
	}
	producedThenHold(ctx, client, cfg.Queue)
}

// TestReplaceSurvivesSIGKILL: a producer process produces v1 for 20 ids
// with Replace; a consumer process starts every one and blocks; the
// producer then replaces each with v2 and v3 (a follow-up kept behind each
// running entry) and is SIGKILLed, then the consumer is SIGKILLed with
// every handler running. A new consumer claims the entries: counted per id,
// it runs v1 once (the at-least-once rerun of the crashed run) and then the
// follow-up once, with the latest payload v3; nothing is lost, v2 never
// runs, nothing runs a third time, and a caller attached after the crashes
// gets v3's outcome.
func TestReplaceSurvivesSIGKILL(t *testing.T) {
	t.Parallel()
	client := realRedis(t)
	ctx := context.Background()
	q := queueName(t)
	ids := seqIDs("rep", 20)
	cons := crashtest.Start(t, "TestCrashHelperProcess", crashConfig{
		Addr: sharedAddr(t), Queue: q, Mode: "block", Name: "doomed", Workers: len(ids), Prefetch: len(ids), MinIdle: 500 * time.Millisecond,
	})
	prod := crashtest.Start(t, "TestReplaceProducerHelperProcess", replaceProducerConfig{Addr: sharedAddr(t), Queue: q, IDs: ids})
	eventually(t, 20*time.Second, func() bool { return client.SCard(ctx, startedKey(q)).Val() == int64(len(ids)) }, "every id started")
	require.NoError(t, client.Set(ctx, replaceGoKey(q), "1", 0).Err())
	eventually(t, 20*time.Second, func() bool { return client.Exists(ctx, producedKey(q)).Val() == 1 }, "the producer's replaces")
	prod.Kill()
	require.True(t, prod.KilledBy(syscall.SIGKILL))
	cons.Kill()
	require.True(t, cons.KilledBy(syscall.SIGKILL))

	admin, err := NewAdmin(client, q, nil)
	require.NoError(t, err)
	info, err := admin.Job(ctx, ids[0])
	require.NoError(t, err)
	require.Equal(t, "replace", info.Mode)
	require.Equal(t, `"v3"`, string(info.Replacement))

	p := newStringProducer(t, client, q)
	var prs []*Promise[string]
	for _, id := range ids {
		prs = append(prs, mustProduce(t, p, id, "plain")) // attaches
	}
	var mu sync.Mutex
	runs := map[string][]string{}
	c, err := NewConsumer(client, q, func(ctx context.Context, m *Message[string]) (string, error) {
		mu.Lock()
		runs[m.ID] = append(runs[m.ID], m.Payload)
		mu.Unlock()
		return "ran:" + m.Payload, nil
	}, fastOpts(t, "rescuer", 500*time.Millisecond))
	require.NoError(t, err)
	runConsumer(t, c)
	for i, pr := range prs {
		got, err := pr.Wait(waitCtx(t, 30*time.Second))
		require.NoError(t, err)
		require.Equal(t, "ran:v3", got, ids[i])
	}
	mu.Lock()
	defer mu.Unlock()
	for _, id := range ids {
		require.Equal(t, []string{"v1", "v3"}, runs[id], "%s: the crashed run once more, then the follow-up once, with the latest payload", id)
	}
}

// TestAdminJobShowsModes: Admin.Job names the flow-control mode and its
// time: Throttle's window end, Debounce's due time and latest run (first
// produce + maxWait), a Replace's waiting request.
func TestAdminJobShowsModes(t *testing.T) {
	t.Parallel()
	client := realRedis(t)
	q := queueName(t)
	ctx := context.Background()
	p := newStringProducer(t, client, q)
	admin, err := NewAdmin(client, q, nil)
	require.NoError(t, err)
	now := time.Now()
	near := func(want, got time.Time, what string) {
		t.Helper()
		require.WithinDuration(t, want, got, 2*time.Second, what)
	}
	mustProduce(t, p, "thr", "x", Throttle(10*time.Second)).Release()
	info, err := admin.Job(ctx, "thr")
	require.NoError(t, err)
	require.Equal(t, JobQueued, info.State)
	require.Equal(t, "throttle", info.Mode)
	near(now.Add(10*time.Second), info.ModeUntil, "the window's end")

	mustProduce(t, p, "deb", "x", Debounce(time.Minute, time.Hour)).Release()
	info, err = admin.Job(ctx, "deb")
	require.NoError(t, err)
	require.Equal(t, JobScheduled, info.State)
	require.Equal(t, "debounce", info.Mode)
	near(now.Add(time.Minute), info.Due, "the quiet period's end")
	near(now.Add(time.Hour), info.ModeUntil, "maxWait's cap")

	mustProduce(t, p, "rep", "x", Replace(), After(time.Hour)).Release()
	info, err = admin.Job(ctx, "rep")
	require.NoError(t, err)
	require.Equal(t, JobScheduled, info.State)
	require.Equal(t, "replace", info.Mode)
	require.True(t, info.ModeUntil.IsZero())
	require.Nil(t, info.Replacement, "nothing waits behind a scheduled request")

	mustProduce(t, p, "plain", "x").Release()
	info, err = admin.Job(ctx, "plain")
	require.NoError(t, err)
	require.Empty(t, info.Mode)
}

// testClusterReplace: Replace on a sharded queue of a cluster, across
// priority levels: each id's run with "v1" (level high) holds; a Replace
// with "v2" at level low waits behind it; when v1 ends, complete.lua
// appends the follow-up to the low level's stream of the id's shard (a key
// of the shard's slot it derives from its own stream). Each id runs v1, then
// v2 once at level low; every caller gets v2's outcome.
func testClusterReplace(t *testing.T, client redis.UniversalClient) {
	ctx := context.Background()
	q := queueName(t)
	var mu sync.Mutex
	runs := map[string][]string{}
	started, hold := make(chan string, 100), make(chan struct{})
	c, err := NewConsumer(client, q, func(ctx context.Context, m *Message[string]) (string, error) {
		mu.Lock()
		runs[m.ID] = append(runs[m.ID], m.Payload+"@"+m.Priority.String())
		mu.Unlock()
		if m.Payload == "v1" {
			started <- m.ID
			<-hold
		}
		return "ran:" + m.Payload, nil
	}, &ConsumerOptions{Shards: clusterShards, Workers: 16, Logger: testLogger(t)})
	require.NoError(t, err)
	runConsumer(t, c)
	p, err := NewProducer[string, string](client, q, &ProducerOptions{Shards: clusterShards, Logger: testLogger(t)})
	require.NoError(t, err)
	defer p.Close()
	ids := seqIDs("crep", 12)
	var prs []*Promise[string]
	for _, id := range ids {
		pr, err := p.Produce(ctx, id, "v1", Replace(), Priority(PriorityHigh))
		require.NoError(t, err)
		prs = append(prs, pr)
	}
	for range ids {
		<-started
	}
	for _, id := range ids {
		pr, err := p.Produce(ctx, id, "v2", Replace(), Priority(PriorityLow))
		require.NoError(t, err)
		require.Equal(t, DedupInflight, pr.Deduplicated())
		prs = append(prs, pr)
	}
	close(hold)
	for _, pr := range prs {
		wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		got, err := pr.Wait(wctx)
		cancel()
		require.NoError(t, err)
		require.Equal(t, "ran:v2", got, pr.ID())
	}
	mu.Lock()
	defer mu.Unlock()
	for _, id := range ids {
		require.Equal(t, []string{"v1@high", "v2@low"}, runs[id], id)
	}
}

// TestReplaceCompletionCommands runs complete.lua on its own redis-server
// for one successful entry and counts what Redis ran (INFO commandstats
// counts the commands a script calls). A plain record ("P<entry id>"): the
// same commands as before Replace existed (EXISTS of the fan-out marker,
// XACK, HDEL, XDEL, SET GET, PUBLISH, HINCRBY, and PEXPIRE for a new minute
// of history): a record with nothing behind it costs nothing more. A record
// with a follow-up behind the entry: XADD and SET more, no PUBLISH; the
// follow-up is in the stream with its payload and the record points at it.
func TestReplaceCompletionCommands(t *testing.T) {
	t.Parallel()
	client := privateRedis(t)
	ctx := context.Background()
	k, err := keys.New("c")
	require.NoError(t, err)
	require.NoError(t, client.XGroupCreateMkStream(ctx, k.Stream, "g", "0").Err())
	complete := func(rid, eid string) {
		_, err := scripts.Complete.Run(ctx, client,
			[]string{k.Stream, k.DeadLetter, k.Fanout, k.Record(rid), k.Starts("g")},
			"g", k.Channel, 60000, "1", 100, "me", time.Now().UnixMilli(), "PUBLISH", "0",
			eid, rid, "R", "ok", "", 1).Result()
		require.NoError(t, err)
	}
	entry := func(rid string) string {
		eid, err := client.XAdd(ctx, &redis.XAddArgs{Stream: k.Stream, Values: []any{"id", rid, "p", "x"}}).Result()
		require.NoError(t, err)
		require.NoError(t, client.XReadGroup(ctx, &redis.XReadGroupArgs{Group: "g", Consumer: "me", Streams: []string{k.Stream, ">"}, Count: 1}).Err())
		return eid
	}
	complete("warm", entry("warm")) // loads the script, creates the minute's history field
	plain := entry("plain")
	require.NoError(t, client.Set(ctx, k.Record("plain"), "P"+plain, time.Minute).Err())
	d := commandDelta(t, client, func() { complete("plain", plain) })
	require.Equal(t, map[string]int64{"evalsha": 1, "exists": 1, "xack": 1, "hdel": 1, "xdel": 1, "set": 1, "publish": 1}, d,
		"a plain completion")

	rep := entry("rep")
	fields := "2:id3:rep1:p1:y" // length-prefixed: level "", TTL, fields
	follow := "P" + rep + "+" + "0:" + "5:60000" + strconv.Itoa(len(fields)) + ":" + fields
	require.NoError(t, client.Set(ctx, k.Record("rep"), follow, time.Minute).Err())
	d = commandDelta(t, client, func() { complete("rep", rep) })
	require.Equal(t, map[string]int64{"evalsha": 1, "exists": 1, "xack": 1, "hdel": 1, "xdel": 1, "set": 2, "xadd": 1}, d,
		"a completion with a follow-up behind it")
	rec, err := client.Get(ctx, k.Record("rep")).Result()
	require.NoError(t, err)
	msgs, err := client.XRange(ctx, k.Stream, "-", "+").Result()
	require.NoError(t, err)
	require.Len(t, msgs, 1)
	require.Equal(t, "P"+msgs[0].ID, rec)
	require.Equal(t, map[string]any{"id": "rep", "p": "y"}, msgs[0].Values)
	ttl, err := client.PTTL(ctx, k.Record("rep")).Result()
	require.NoError(t, err)
	require.Greater(t, ttl, 50*time.Second, "the follow-up's record TTL")
}

// commandDelta returns the commandstats calls that fn made Redis run.
func commandDelta(t *testing.T, client *redis.Client, fn func()) map[string]int64 {
	t.Helper()
	ctx := context.Background()
	stats := func() map[string]int64 {
		info, err := client.Info(ctx, "commandstats").Result()
		require.NoError(t, err)
		out := map[string]int64{}
		for _, line := range strings.Split(info, "\n") {
			name, rest, ok := strings.Cut(strings.TrimSpace(line), ":calls=")
			if !ok {
				continue
			}
			n, _, _ := strings.Cut(rest, ",")
			out[strings.TrimPrefix(name, "cmdstat_")], _ = strconv.ParseInt(n, 10, 64)
		}
		return out
	}
	before := stats()
	fn()
	after := stats()
	d := map[string]int64{}
	for k, v := range after {
		if v != before[k] && k != "info" {
			d[k] = v - before[k]
		}
	}
	return d
}
