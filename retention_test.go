package streamq

import (
	"context"
	"errors"
	"fmt"
	"reflect"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/streamq/streamq/internal/keys"
	"github.com/streamq/streamq/internal/scripts"
)

// completeCalls records the keys and ARGV[9] of every complete.lua call the
// client sends (alone or in a pipeline).
type completeCalls struct {
	mu    sync.Mutex
	calls [][]any
}

func (h *completeCalls) DialHook(next redis.DialHook) redis.DialHook { return next }
func (h *completeCalls) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		h.see(cmd)
		return next(ctx, cmd)
	}
}
func (h *completeCalls) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		for _, c := range cmds {
			h.see(c)
		}
		return next(ctx, cmds)
	}
}
func (h *completeCalls) see(cmd redis.Cmder) {
	if args := cmd.Args(); isScript(args, scripts.Complete) {
		h.mu.Lock()
		h.calls = append(h.calls, slices.Clone(args))
		h.mu.Unlock()
	}
}

// runRetention produces n jobs to a fresh queue (ids job-0..), the ids in
// fail failing for good, and runs a consumer with keep until all completed.
func runRetention(t *testing.T, client *redis.Client, q string, shards, n int, keep *Retention, fail ...string) *Admin {
	t.Helper()
	ctx := context.Background()
	p, err := NewProducer[string, string](client, q, &ProducerOptions{Shards: shards, Logger: testLogger(t)})
	require.NoError(t, err)
	t.Cleanup(func() { _ = p.Close() })
	for i := range n {
		require.NoError(t, p.Enqueue(ctx, fmt.Sprintf("job-%d", i), fmt.Sprintf(`{"n":%d}`, i)))
	}
	c, err := NewConsumer(client, q, func(ctx context.Context, m *Message[string]) (string, error) {
		if slices.Contains(fail, m.ID) {
			return "", Permanent(errors.New("boom " + m.ID))
		}
		return "ok " + m.ID, nil
	}, &ConsumerOptions{Name: "w", Shards: shards, Workers: 4, ReadBlock: 20 * time.Millisecond, Retention: keep, Logger: testLogger(t),
		replyWait: true}) // ticks on the client itself: its hooks see them
	require.NoError(t, err)
	stop := runConsumer(t, c)
	admin, err := NewAdmin(client, q, nil)
	require.NoError(t, err)
	eventually(t, 10*time.Second, func() bool {
		s, err := admin.Stats(ctx)
		return err == nil && s.Length == 0 && len(s.Groups) == 1 && s.Groups[0].Pending == 0 && s.Scheduled == 0
	}, "the jobs did not complete")
	stop()
	return admin
}

// TestRetentionOffSendsNothingMore: without Retention, complete.lua gets no
// completed-list key and no "#" mark (so it runs exactly the commands it ran
// before the feature: the list's step is skipped whole), and no list key
// appears; with it, every call carries both.
func TestRetentionOffSendsNothingMore(t *testing.T) {
	t.Parallel()
	for _, keep := range []*Retention{nil, {MaxCount: 5}} {
		client := realRedis(t)
		hook := &completeCalls{}
		client.AddHook(hook)
		q := queueName(t)
		admin := runRetention(t, client, q, 1, 20, keep, "job-3")
		k, _ := keys.New(q)
		hook.mu.Lock()
		require.NotEmpty(t, hook.calls)
		for _, args := range hook.calls {
			nkeys := int(reflect.ValueOf(args[2]).Int())
			callKeys := args[3 : 3+nkeys]
			flag := args[3+nkeys+8].(string)
			if keep == nil {
				require.NotContains(t, callKeys, k.Completed, "a completed-list key without Retention")
				require.NotContains(t, flag, "#", "the retention mark without Retention")
			} else {
				require.Equal(t, k.Completed, callKeys[len(callKeys)-1])
				require.Contains(t, flag, "#5,0")
			}
		}
		hook.mu.Unlock()
		n, err := client.Exists(context.Background(), k.Completed).Result()
		require.NoError(t, err)
		page, err := admin.Completed(context.Background(), "", 0)
		require.NoError(t, err)
		if keep == nil {
			require.Zero(t, n)
			require.Empty(t, page.Jobs)
			require.Zero(t, page.Total)
		} else {
			require.Len(t, page.Jobs, 5)
		}
	}
}

// TestRetentionByCount: MaxCount 10 keeps the 10 newest of 30 completions
// per shard, newest first, outcomes included; Stats.Completed counts them;
// Admin.Job tells when each finished.
func TestRetentionByCount(t *testing.T) {
	t.Parallel()
	client := realRedis(t)
	ctx := context.Background()
	q := queueName(t)
	admin := runRetention(t, client, q, 1, 30, &Retention{MaxCount: 10}, "job-29")
	page, err := admin.Completed(ctx, "", 100)
	require.NoError(t, err)
	require.Len(t, page.Jobs, 10)
	require.EqualValues(t, 10, page.Total)
	require.Empty(t, page.Next)
	seen := map[string]bool{}
	for i, j := range page.Jobs {
		require.False(t, seen[j.ID], "listed twice: %s", j.ID)
		seen[j.ID] = true
		require.WithinDuration(t, time.Now(), j.At, time.Minute)
		if i > 0 {
			require.False(t, j.At.After(page.Jobs[i-1].At), "newest first")
		}
		want := JobSucceeded
		if j.ID == "job-29" {
			want = JobDeadLettered
		}
		require.Equal(t, want, j.State, j.ID)
	}
	s, err := admin.Stats(ctx)
	require.NoError(t, err)
	require.EqualValues(t, 10, s.Completed)
	info, err := admin.Job(ctx, page.Jobs[0].ID)
	require.NoError(t, err)
	require.Equal(t, page.Jobs[0].At, info.Finished)

	// Paged by 3: every entry once, in the same order.
	var all []CompletedJob
	cursor := ""
	for {
		p, err := admin.Completed(ctx, cursor, 3)
		require.NoError(t, err)
		all = append(all, p.Jobs...)
		if p.Next == "" {
			break
		}
		cursor = p.Next
	}
	require.Equal(t, page.Jobs, all)
	_, err = admin.Completed(ctx, "nonsense", 3)
	require.ErrorIs(t, err, ErrInvalidCursor)
}

// completeDirect runs complete.lua as a consumer with Retention would, for
// one item per id (code "R"), at the given time.
func completeDirect(t *testing.T, client *redis.Client, k keys.Keys, now int64, flag string, code string, eids, ids []string) {
	t.Helper()
	keyList := []string{k.Stream, k.DeadLetter, k.Fanout}
	for _, id := range ids {
		keyList = append(keyList, k.Record(id))
	}
	keyList = append(keyList, k.Starts(DefaultGroup), k.Completed)
	args := []any{DefaultGroup, k.Channel, 60000, "1", 1000, "c", now, "PUBLISH", "0" + flag}
	for i, id := range ids {
		args = append(args, eids[i], id, code, "v", "", 1)
	}
	require.NoError(t, scripts.Complete.Run(context.Background(), client, keyList, args...).Err())
}

// TestRetentionByAge: MaxAge drops the completions older than it at the
// next completion step, and the list expires with it (the step's own clock,
// ARGV[7], decides: no waiting).
func TestRetentionByAge(t *testing.T) {
	t.Parallel()
	client := realRedis(t)
	ctx := context.Background()
	q := queueName(t)
	k, _ := keys.New(q)
	require.NoError(t, client.Set(ctx, keys.Meta(q), 1, 0).Err())
	now := time.Now().UnixMilli()
	completeDirect(t, client, k, now-5000, "#0,2000", "R", []string{"1-1", "1-2"}, []string{"old-1", "old-2"})
	completeDirect(t, client, k, now-1000, "#0,2000", "R", []string{"1-3"}, []string{"mid"})
	completeDirect(t, client, k, now, "#0,2000", "R", []string{"1-4"}, []string{"new"})
	admin, err := NewAdmin(client, q, nil)
	require.NoError(t, err)
	page, err := admin.Completed(ctx, "", 0)
	require.NoError(t, err)
	var ids []string
	for _, j := range page.Jobs {
		ids = append(ids, j.ID)
	}
	require.Equal(t, []string{"new", "mid"}, ids, "the completions older than 2s are gone")
	require.Equal(t, time.UnixMilli(now), page.Jobs[0].At)
	ttl, err := client.PTTL(ctx, k.Completed).Result()
	require.NoError(t, err)
	require.Greater(t, ttl, time.Second)
	require.LessOrEqual(t, ttl, 2*time.Second)
}

// TestRetentionRaces: a whole call sent again (its reply lost), a duplicate
// copy of a request finishing second (another entry, another outcome), and
// two calls in the same millisecond: each request is listed once, with its
// first outcome, and every score is unique (so paging neither skips nor
// repeats).
func TestRetentionRaces(t *testing.T) {
	t.Parallel()
	client := realRedis(t)
	ctx := context.Background()
	q := queueName(t)
	k, _ := keys.New(q)
	require.NoError(t, client.Set(ctx, keys.Meta(q), 1, 0).Err())
	now := time.Now().UnixMilli()
	completeDirect(t, client, k, now, "#100,0", "R", []string{"1-1", "1-2"}, []string{"a", "b"})
	completeDirect(t, client, k, now, "#100,0", "R", []string{"1-1", "1-2"}, []string{"a", "b"}) // resent
	completeDirect(t, client, k, now, "#100,0", "E", []string{"2-1"}, []string{"a"})             // a's duplicate, failed
	completeDirect(t, client, k, now, "#100,0", "R", []string{"1-3"}, []string{"c"})             // same ms
	completeDirect(t, client, k, now-10, "#100,0", "R", []string{"1-4"}, []string{"d"})          // a clock behind
	zs, err := client.ZRangeWithScores(ctx, k.Completed, 0, -1).Result()
	require.NoError(t, err)
	var members []string
	scores := map[float64]bool{}
	for _, z := range zs {
		members = append(members, z.Member.(string))
		require.False(t, scores[z.Score], "score %v twice", z.Score)
		scores[z.Score] = true
	}
	require.Equal(t, []string{"Ria", "Rib", "Ric", "Rid"}, members, "listed once each, first outcome, in completion order")
	admin, err := NewAdmin(client, q, nil)
	require.NoError(t, err)
	var ids []string
	for cursor := ""; ; {
		p, err := admin.Completed(ctx, cursor, 1)
		require.NoError(t, err)
		for _, j := range p.Jobs {
			ids = append(ids, j.ID)
		}
		if cursor = p.Next; cursor == "" {
			break
		}
	}
	require.Equal(t, []string{"d", "c", "b", "a"}, ids)
}

// TestRetentionShardsAndConcurrentConsumers: two shards, two consumers
// completing at once (calls racing on each shard's list): every job listed
// once, the pages of 7 across the shards list each once.
func TestRetentionShardsAndConcurrentConsumers(t *testing.T) {
	t.Parallel()
	client := realRedis(t)
	ctx := context.Background()
	q := queueName(t)
	keep := &Retention{MaxCount: 1000, MaxAge: time.Hour}
	p, err := NewProducer[string, string](client, q, &ProducerOptions{Shards: 2, Logger: testLogger(t)})
	require.NoError(t, err)
	t.Cleanup(func() { _ = p.Close() })
	const n = 200
	for i := range n {
		require.NoError(t, p.Enqueue(ctx, fmt.Sprintf("job-%d", i), "x"))
	}
	for _, name := range []string{"w1", "w2"} {
		c, err := NewConsumer(client, q, func(ctx context.Context, m *Message[string]) (string, error) {
			return "ok", nil
		}, &ConsumerOptions{Name: name, Shards: 2, Workers: 4, ReadBlock: 20 * time.Millisecond, Retention: keep, Logger: testLogger(t)})
		require.NoError(t, err)
		runConsumer(t, c)
	}
	admin, err := NewAdmin(client, q, nil)
	require.NoError(t, err)
	eventually(t, 10*time.Second, func() bool {
		s, err := admin.Stats(ctx)
		return err == nil && s.Completed >= n
	}, "not every job listed")
	seen := map[string]bool{}
	for cursor := ""; ; {
		p, err := admin.Completed(ctx, cursor, 7)
		require.NoError(t, err)
		for _, j := range p.Jobs {
			require.False(t, seen[j.ID], "listed twice: %s", j.ID)
			seen[j.ID] = true
		}
		if cursor = p.Next; cursor == "" {
			break
		}
	}
	require.Len(t, seen, n)
}

func TestRetentionOptions(t *testing.T) {
	t.Parallel()
	client, _ := miniRedis(t)
	h := func(ctx context.Context, m *Message[string]) (string, error) { return "", nil }
	for _, tc := range []struct {
		r      Retention
		fanout bool
		want   string
	}{
		{Retention{}, false, "none of"},
		{Retention{Errors: -1}, false, "Errors"},
		{Retention{Errors: MaxRetentionErrors + 1}, false, "Errors"},
		{Retention{MaxCount: -1}, false, "MaxCount"},
		{Retention{MaxCount: MaxRetentionCount + 1}, false, "MaxCount"},
		{Retention{MaxAge: time.Millisecond}, false, "MaxAge"},
		{Retention{MaxCount: 5}, true, "fan-out"},
	} {
		_, err := NewConsumer(client, "q", h, &ConsumerOptions{Retention: &tc.r, Fanout: tc.fanout, Group: "g"})
		require.ErrorIs(t, err, ErrInvalidOptions)
		require.True(t, strings.Contains(err.Error(), tc.want), err.Error())
	}
	_, err := NewConsumer(client, "q", h, &ConsumerOptions{Retention: &Retention{MaxAge: time.Hour}})
	require.NoError(t, err)
	_, err = NewConsumer(client, "q", h, &ConsumerOptions{Retention: &Retention{Errors: 5}})
	require.NoError(t, err)
	require.Empty(t, (&Retention{Errors: 5}).flag(), "Errors alone keeps no completed list")
}

// TestAdminOldestQueuedAgeAndPayload: Stats tells the age of the oldest
// entry a group has not read (0 once it read them all), and Admin.Job the
// payload of a queued and of a scheduled request.
func TestAdminOldestQueuedAgeAndPayload(t *testing.T) {
	t.Parallel()
	client := realRedis(t)
	ctx := context.Background()
	q := queueName(t)
	k, _ := keys.New(q)
	require.NoError(t, client.XGroupCreateMkStream(ctx, k.Stream, DefaultGroup, "0").Err())
	p := newStringProducer(t, client, q)
	before := time.Now()
	require.NoError(t, p.Enqueue(ctx, "first", `{"a":1}`))
	require.NoError(t, p.Enqueue(ctx, "second", "x"))
	require.NoError(t, p.Enqueue(ctx, "later", "y", After(time.Hour)))
	admin, err := NewAdmin(client, q, nil)
	require.NoError(t, err)
	s, err := admin.Stats(ctx)
	require.NoError(t, err)
	require.Len(t, s.Groups, 1)
	age := s.Groups[0].OldestQueuedAge
	require.Positive(t, age)
	require.LessOrEqual(t, age, time.Since(before)+time.Second) // the server's clock may be a little ahead
	require.EqualValues(t, 1, s.Scheduled)
	require.Zero(t, s.Retrying)

	info, err := admin.Job(ctx, "first")
	require.NoError(t, err)
	require.Equal(t, JobQueued, info.State)
	require.Equal(t, `"{\"a\":1}"`, string(info.Payload)) // the JSON codec's encoding of the string
	info, err = admin.Job(ctx, "later")
	require.NoError(t, err)
	require.Equal(t, JobScheduled, info.State)
	require.Equal(t, `"y"`, string(info.Payload))

	// Once the group read both, nothing waits.
	_, err = client.XReadGroup(ctx, &redis.XReadGroupArgs{Group: DefaultGroup, Consumer: "c", Streams: []string{k.Stream, ">"}, Count: 2, Block: -1}).Result()
	require.NoError(t, err)
	s, err = admin.Stats(ctx)
	require.NoError(t, err)
	require.Zero(t, s.Groups[0].OldestQueuedAge)
}

// testClusterRetention: on a cluster, the completed list of a queue sharded
// over every master is kept per shard (each on its node) and Admin.Completed
// pages over all of them (one pipeline split by slot): every job once.
func testClusterRetention(t *testing.T, client redis.UniversalClient) {
	ctx := context.Background()
	q := queueName(t)
	p, err := NewProducer[string, string](client, q, &ProducerOptions{Shards: clusterShards, Logger: testLogger(t)})
	require.NoError(t, err)
	t.Cleanup(func() { _ = p.Close() })
	const n = 30
	for i := range n {
		require.NoError(t, p.Enqueue(ctx, fmt.Sprintf("job-%d", i), "x"))
	}
	c, err := NewConsumer(client, q, func(ctx context.Context, m *Message[string]) (string, error) {
		return "ok", nil
	}, &ConsumerOptions{Shards: clusterShards, ReadBlock: 20 * time.Millisecond, Retention: &Retention{MaxCount: 100}, Logger: testLogger(t)})
	require.NoError(t, err)
	runConsumer(t, c)
	admin, err := NewAdmin(client, q, nil)
	require.NoError(t, err)
	eventually(t, 20*time.Second, func() bool {
		s, err := admin.Stats(ctx)
		return err == nil && s.Completed == n
	}, "not every job listed")
	seen := map[string]bool{}
	for cursor := ""; ; {
		page, err := admin.Completed(ctx, cursor, 7)
		require.NoError(t, err)
		require.EqualValues(t, n, page.Total)
		for _, j := range page.Jobs {
			require.False(t, seen[j.ID], "listed twice: %s", j.ID)
			seen[j.ID] = true
			require.Equal(t, JobSucceeded, j.State)
		}
		if cursor = page.Next; cursor == "" {
			break
		}
	}
	require.Len(t, seen, n)
	info, err := admin.Job(ctx, "job-7")
	require.NoError(t, err)
	require.False(t, info.Finished.IsZero())
}

// TestRetentionErrors: with Retention.Errors 3, a request that fails 5
// times keeps the errors of its 3 newest retried attempts (newest first,
// with their start), its final error being the record's; Forget drops
// them. Without it, retry.lua gets its "0" flag and no error-list key, and no
// list appears.
func TestRetentionErrors(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	for _, keep := range []*Retention{nil, {Errors: 3}} {
		client := realRedis(t)
		retries := &retryCalls{}
		client.AddHook(retries)
		q := queueName(t)
		k, _ := keys.New(q)
		p := newStringProducer(t, client, q)
		require.NoError(t, p.Enqueue(ctx, "flaky", "x"))
		c, err := NewConsumer(client, q, func(ctx context.Context, m *Message[string]) (string, error) {
			return "", fmt.Errorf("attempt %d failed", m.Deliveries)
		}, &ConsumerOptions{Name: "w", ReadBlock: 20 * time.Millisecond, ClaimInterval: 20 * time.Millisecond, MaxDeliveries: 5,
			RetryBackoff: time.Millisecond, RetryBackoffMax: time.Millisecond, Retention: keep, Logger: testLogger(t), replyWait: true})
		require.NoError(t, err)
		stop := runConsumer(t, c)
		admin, err := NewAdmin(client, q, nil)
		require.NoError(t, err)
		var info JobInfo
		eventually(t, 10*time.Second, func() bool {
			info, err = admin.Job(ctx, "flaky")
			return err == nil && info.State == JobDeadLettered
		}, "never dead-lettered")
		stop()
		require.Equal(t, "attempt 5 failed", info.Error)
		retries.mu.Lock()
		require.GreaterOrEqual(t, len(retries.calls), 4, "four retries (an EVALSHA refused NOSCRIPT is sent again as EVAL)")
		for _, args := range retries.calls {
			nkeys := int(reflect.ValueOf(args[2]).Int())
			flag := args[3+nkeys+3].(string)
			if keep == nil {
				require.Equal(t, "0", flag)
				require.NotContains(t, args[3:3+nkeys], k.Errors("flaky"))
			} else {
				require.Equal(t, "0#3", flag)
				require.Equal(t, k.Errors("flaky"), args[3+nkeys-2], "the error list, before the fan-out marker")
				require.Equal(t, k.Fanout, args[3+nkeys-1], "the fan-out marker, last")
			}
		}
		retries.mu.Unlock()
		if keep == nil {
			require.Nil(t, info.Errors)
			n, err := client.Exists(ctx, k.Errors("flaky")).Result()
			require.NoError(t, err)
			require.Zero(t, n)
			continue
		}
		require.Len(t, info.Errors, 3)
		for i, e := range info.Errors {
			require.Equal(t, 4-i, e.Start)
			require.Equal(t, fmt.Sprintf("attempt %d failed", 4-i), e.Error)
			require.WithinDuration(t, time.Now(), e.At, time.Minute)
		}
		recTTL, err := client.PTTL(ctx, k.Record("flaky")).Result()
		require.NoError(t, err)
		listTTL, err := client.PTTL(ctx, k.Errors("flaky")).Result()
		require.NoError(t, err)
		require.Positive(t, listTTL, "the list expires")
		require.Positive(t, recTTL)
		require.NoError(t, admin.Forget(ctx, "flaky", false))
		n, err := client.Exists(ctx, k.Errors("flaky")).Result()
		require.NoError(t, err)
		require.Zero(t, n, "Forget drops the list")
	}
}

// retryCalls records every retry.lua call the client sends.
type retryCalls struct {
	mu    sync.Mutex
	calls [][]any
}

func (h *retryCalls) DialHook(next redis.DialHook) redis.DialHook { return next }
func (h *retryCalls) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		h.see(cmd)
		return next(ctx, cmd)
	}
}
func (h *retryCalls) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		for _, c := range cmds {
			h.see(c)
		}
		return next(ctx, cmds)
	}
}
func (h *retryCalls) see(cmd redis.Cmder) {
	if args := cmd.Args(); isScript(args, scripts.Retry) {
		h.mu.Lock()
		h.calls = append(h.calls, slices.Clone(args))
		h.mu.Unlock()
	}
}
