package streamq

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/streamq/streamq/internal/keys"
	"github.com/streamq/streamq/internal/redistest"
)

// aclCommands is every command streamq sends, for the least-privilege rule in
// docs/operating.md's Security section. Keep the two the same: TestSecurityLeastPrivilege
// runs the whole workload as a user allowed only these commands and fails on
// any refusal. On a cluster, sharded pub/sub adds ssubscribe and spublish;
// servers from Redis 7.2 on, and Valkey, add aclIdentityCommands.
var aclCommands = []string{
	"del", "eval", "evalsha", "exists", "get", "mget", "publish", "set", "subscribe", "type",
	"xack", "xadd", "xautoclaim", "xclaim", "xdel", "xgroup|create", "xgroup|delconsumer",
	"xinfo|consumers", "xinfo|groups", "xlen", "xpending", "xrange", "xreadgroup", "xtrim",
	"hincrby", "hsetnx", "hget", "hdel", "hmget", "pexpire", "pttl",
	"hset", "hgetall", // consumer heartbeats (Admin.Consumers, Stats); periodic.lua's last and next slot; the schedule
	"scan",                                             // Queues (SCAN MATCH on the queues' meta keys)
	"time",                                             // ratelimit.lua and the schedule read the server's clock
	"zadd", "zcard", "zrange", "zrangebyscore", "zrem", // the schedule (delayed jobs, retries)
	"zscore", "zcount", "xrevrange", // Admin.Jobs and Admin.RunNow
	"ping", // go-redis's pub/sub health checks
}

// aclIdentityCommands are what servers that have CLIENT SETINFO (Redis 7.2
// and newer, Valkey) add to aclCommands: go-redis names its library and
// version on every new connection, unless its DisableIdentity option is set.
// Redis 7.0 has no such command (its ACL SETUSER refuses the rule, and it
// answers go-redis "unknown subcommand", which its ACL LOG does not record).
var aclIdentityCommands = []string{"client|setinfo"}

// aclServerCommands returns aclCommands plus the aclIdentityCommands that the
// server behind c knows.
func aclServerCommands(t *testing.T, c *redis.Client) []string {
	t.Helper()
	cmds := slices.Clone(aclCommands)
	for _, name := range aclIdentityCommands {
		if serverHasCommand(t, c, name) {
			cmds = append(cmds, name)
		}
	}
	return cmds
}

// serverHasCommand reports whether the server behind c knows the command or
// subcommand name ("client|setinfo").
func serverHasCommand(t *testing.T, c *redis.Client, name string) bool {
	t.Helper()
	info, err := c.Do(context.Background(), "COMMAND", "INFO", name).Slice()
	require.NoError(t, err)
	return len(info) == 1 && info[0] != nil
}

// aclOptional are commands streamq tries and does without when refused:
// CONFIG GET maxmemory-policy, for the eviction warning. Redis's ACL LOG
// records each refusal.
var aclOptional = []string{"config|get"}

// aclQueueRules returns the key and channel patterns of one queue: the
// queue's names, or for a sharded queue its meta key and its shards' names.
func aclQueueRules(q string, shards int) []string {
	if shards == 1 {
		return []string{"~streamq:{" + q + "}:*", "&streamq:{" + q + "}:*"}
	}
	return []string{"~streamq:{" + q + "}:*",
		"~streamq:shard:{" + q + "/????.??????}:*", "&streamq:shard:{" + q + "/????.??????}:*"}
}

// aclUser creates a user with rules on srv and returns a client logged in as it.
func aclUser(t *testing.T, admin *redis.Client, name string, rules ...string) *redis.Client {
	t.Helper()
	args := []any{"ACL", "SETUSER", name, "reset", "on", ">secret-" + name}
	for _, r := range rules {
		args = append(args, r)
	}
	require.NoError(t, admin.Do(context.Background(), args...).Err())
	c := redis.NewClient(&redis.Options{Addr: admin.Options().Addr, Username: name, Password: "secret-" + name, PoolSize: 32})
	t.Cleanup(func() { _ = c.Close() })
	return c
}

// TestSecurityLeastPrivilege runs every feature as a user restricted to the
// commands of aclCommands (plus aclIdentityCommands on a server that has
// them) and to its queues' keys and channels: a single-shard queue and a
// 2-shard one. On a server that has CLIENT SETINFO it also runs the
// single-shard workload as a user without it, through a client with
// go-redis's DisableIdentity, the documented alternative. Redis's ACL LOG
// must stay empty.
func TestSecurityLeastPrivilege(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	root := srv.Client(t)
	ctx := context.Background()
	single, sharded, anonymous := queueName(t), queueName(t), queueName(t)
	commands := aclServerCommands(t, root)
	rules := []string{"-@all"}
	for _, c := range commands {
		rules = append(rules, "+"+c)
	}
	rules = append(rules, aclQueueRules(single, 1)...)
	rules = append(rules, aclQueueRules(sharded, 2)...)
	user := aclUser(t, root, "streamq-app", rules...)
	identity := len(commands) > len(aclCommands)
	var anon *redis.Client
	if identity {
		rules := []string{"-@all"}
		for _, c := range aclCommands {
			rules = append(rules, "+"+c)
		}
		anon = aclUser(t, root, "streamq-anon", append(rules, aclQueueRules(anonymous, 1)...)...)
		opts := anon.Options()
		opts.DisableIdentity = true
		anon = redis.NewClient(opts)
		t.Cleanup(func() { _ = anon.Close() })
	}
	t.Logf("server commands beyond aclCommands: %v", commands[len(aclCommands):])
	require.NoError(t, root.Do(ctx, "ACL", "LOG", "RESET").Err())

	t.Run("single", func(t *testing.T) { aclWorkload(t, user, single, 1) })
	t.Run("sharded", func(t *testing.T) { aclWorkload(t, user, sharded, 2) })
	if identity {
		t.Run("disableIdentity", func(t *testing.T) { aclWorkload(t, anon, anonymous, 1) })
	}

	entries, err := root.Do(ctx, "ACL", "LOG").Slice()
	require.NoError(t, err)
	for _, e := range entries {
		m, _ := e.(map[any]any)
		if obj, _ := m["object"].(string); m["reason"] == "command" && slices.Contains(aclOptional, obj) {
			t.Logf("refused, optional: %v", obj)
			continue
		}
		t.Errorf("refused: %v", e)
	}
}

// TestSecurityLeastPrivilegeCluster runs the workload on a Redis Cluster as a
// user with aclCommands (plus aclIdentityCommands on a server that has them)
// plus what a cluster needs: sharded pub/sub and the slot map.
func TestSecurityLeastPrivilegeCluster(t *testing.T) {
	t.Parallel()
	cluster := redistest.StartCluster(t, 3, 0)
	ctx := context.Background()
	single, sharded := queueName(t), queueName(t)
	first := redis.NewClient(&redis.Options{Addr: cluster.Addrs()[0]})
	commands := aclServerCommands(t, first)
	require.NoError(t, first.Close())
	args := []any{"ACL", "SETUSER", "streamq-app", "reset", "on", ">secret", "-@all"}
	for _, c := range append(commands, aclClusterCommands...) {
		args = append(args, "+"+c)
	}
	for _, r := range append(aclQueueRules(single, 1), aclQueueRules(sharded, 3)...) {
		args = append(args, r)
	}
	for _, addr := range cluster.Addrs() {
		node := redis.NewClient(&redis.Options{Addr: addr})
		require.NoError(t, node.Do(ctx, args...).Err())
		require.NoError(t, node.Do(ctx, "ACL", "LOG", "RESET").Err())
		require.NoError(t, node.Close())
	}
	opts := cluster.Options()
	opts.Username, opts.Password = "streamq-app", "secret"
	user := redis.NewClusterClient(opts)
	t.Cleanup(func() { _ = user.Close() })

	t.Run("single", func(t *testing.T) { aclWorkload(t, user, single, 1) })
	t.Run("sharded", func(t *testing.T) { aclWorkload(t, user, sharded, 3) })

	for _, addr := range cluster.Addrs() {
		node := redis.NewClient(&redis.Options{Addr: addr})
		entries, err := node.Do(ctx, "ACL", "LOG").Slice()
		require.NoError(t, err)
		require.NoError(t, node.Close())
		for _, e := range entries {
			m, _ := e.(map[any]any)
			if obj, _ := m["object"].(string); m["reason"] == "command" && slices.Contains(aclOptional, obj) {
				continue
			}
			t.Errorf("refused on %s: %v", addr, e)
		}
	}
}

// aclClusterCommands are the commands a Redis Cluster adds to aclCommands:
// sharded pub/sub, and go-redis's cluster client reads the slot map and the
// command table (to find each command's keys).
var aclClusterCommands = []string{"ssubscribe", "spublish", "cluster|slots", "command"}

// aclWorkload produces (one by one, in a batch, fire-and-forget, duplicates),
// consumes with retries and dead letters, claims entries a stopped consumer
// held, trims and prunes, and uses every Admin method, all as client's user.
func aclWorkload(t *testing.T, client redis.UniversalClient, q string, shards int) {
	ctx := context.Background()
	log := testLogger(t)
	admin, err := NewAdmin(client, q, &AdminOptions{InflightTTL: time.Hour})
	require.NoError(t, err)
	p, err := NewProducer[string, string](client, q, &ProducerOptions{Shards: shards, Logger: log})
	require.NoError(t, err)
	defer p.Close()

	// Entries held by a consumer that then vanished: read into its pending
	// list, never completed.
	require.NoError(t, p.Enqueue(ctx, "ghost-1", "g"))
	require.NoError(t, p.Enqueue(ctx, "ghost-2", "g"))
	names, err := admin.Keys(ctx)
	require.NoError(t, err)
	for _, k := range names {
		err := client.XGroupCreateMkStream(ctx, k.Stream, DefaultGroup, "0").Err()
		if err != nil && !strings.HasPrefix(err.Error(), "BUSYGROUP") {
			require.NoError(t, err)
		}
		err = client.XReadGroup(ctx, &redis.XReadGroupArgs{
			Group: DefaultGroup, Consumer: "ghost", Streams: []string{k.Stream, ">"}, Count: 10, Block: -1,
		}).Err()
		if !errors.Is(err, redis.Nil) { // nil: no ghost entry on this shard
			require.NoError(t, err)
		}
	}

	var mu sync.Mutex
	runs := map[string]int{}
	c, err := NewConsumer(client, q, func(ctx context.Context, m *Message[string]) (string, error) {
		mu.Lock()
		runs[m.ID]++
		mu.Unlock()
		switch {
		case strings.HasPrefix(m.ID, "poison"):
			return "", Permanent(errors.New("poison"))
		case strings.HasPrefix(m.ID, "flaky") && m.Deliveries < 3:
			return "", fmt.Errorf("flaky, delivery %d", m.Deliveries)
		case strings.HasPrefix(m.ID, "tired") && m.Deliveries < 9:
			return "", errors.New("always fails")
		}
		return "ok:" + m.Payload, nil
	}, &ConsumerOptions{
		Shards: shards, Workers: 4, MinIdle: 500 * time.Millisecond, ClaimInterval: 100 * time.Millisecond,
		ReadBlock: 100 * time.Millisecond, RetryBackoff: 20 * time.Millisecond, MaxDeliveries: 2,
		TrimInterval: 200 * time.Millisecond, ConsumerIdleTimeout: time.Second, Logger: log,
		RateLimit: &RateLimit{N: 10_000, Per: time.Second, Burst: 100},
	})
	require.NoError(t, err)
	runConsumer(t, c)

	wait := func(pr *Promise[string]) (string, error) {
		wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		defer cancel()
		return pr.Wait(wctx)
	}
	var prs []*Promise[string]
	for i := range 10 {
		pr, err := p.Produce(ctx, fmt.Sprintf("job-%d", i), fmt.Sprint(i))
		require.NoError(t, err)
		prs = append(prs, pr)
	}
	batch, err := p.ProduceBatch(ctx, []Job[string]{{ID: "batch-1", Request: "b1"}, {ID: "batch-2", Request: "b2"}, {ID: "job-1", Request: "dup"}})
	require.NoError(t, err)
	prs = append(prs, batch...)
	require.NoError(t, p.Enqueue(ctx, "fire", "f"))
	flaky, err := p.Produce(ctx, "flaky-1", "x")
	require.NoError(t, err)
	delayed, err := p.Produce(ctx, "delayed-1", "d", After(50*time.Millisecond))
	require.NoError(t, err)
	prs = append(prs, delayed)
	canceled, err := p.Produce(ctx, "canceled-1", "d", After(time.Hour))
	require.NoError(t, err)
	require.NoError(t, admin.Cancel(ctx, "canceled-1"))
	_, err = wait(canceled)
	require.ErrorIs(t, err, ErrCanceled)
	poison, err := p.Produce(ctx, "poison-1", "x")
	require.NoError(t, err)
	tired, err := p.Produce(ctx, "tired-1", "x")
	require.NoError(t, err)
	for _, pr := range prs {
		_, err := wait(pr)
		require.NoError(t, err)
	}
	got, err := wait(flaky)
	require.Error(t, err, "MaxDeliveries 2: flaky-1 needs 3")
	require.Empty(t, got)
	_, err = wait(poison)
	require.ErrorIs(t, err, ErrDeadLettered)
	_, err = wait(tired)
	require.ErrorIs(t, err, ErrDeadLettered)
	for _, id := range []string{"ghost-1", "ghost-2"} { // claimed from the vanished consumer
		pr, err := p.Produce(ctx, id, "g")
		require.NoError(t, err)
		got, err := wait(pr)
		require.NoError(t, err)
		require.Equal(t, "ok:g", got)
	}

	_, err = c.Trim(ctx)
	require.NoError(t, err)
	// XGROUP DELCONSUMER runs, here or in the periodic trim.
	eventually(t, 30*time.Second, func() bool {
		_, err := c.PruneConsumers(ctx)
		require.NoError(t, err)
		for _, k := range names {
			cs, err := client.XInfoConsumers(ctx, k.Stream, DefaultGroup).Result()
			require.NoError(t, err)
			if slices.ContainsFunc(cs, func(c redis.XInfoConsumer) bool { return c.Name == "ghost" }) {
				return false
			}
		}
		return true
	}, "the vanished consumer is pruned once idle with nothing pending")
	stats, err := admin.Stats(ctx)
	require.NoError(t, err)
	require.EqualValues(t, 3, stats.DeadLetters)
	require.EqualValues(t, 1, stats.Canceled)
	dls, err := admin.DeadLetters(ctx, "", 10)
	require.NoError(t, err)
	require.Len(t, dls, 3)
	_, err = admin.Requeue(ctx, dls[0].DeadLetterID)
	require.NoError(t, err)
	n, err := admin.PurgeDeadLetters(ctx, dls[1].DeadLetterID)
	require.NoError(t, err)
	require.EqualValues(t, 1, n)
	eventually(t, 30*time.Second, func() bool {
		s, err := admin.Stats(ctx)
		return err == nil && s.DeadLetters == 2 // the requeued one failed again
	}, "requeued request dead-lettered again")
	_, err = admin.PurgeDeadLetters(ctx)
	require.NoError(t, err)

	j, err := admin.Job(ctx, "job-0")
	require.NoError(t, err)
	require.Equal(t, JobSucceeded, j.State)
	require.NoError(t, admin.Forget(ctx, "job-0", false))
	// Inspecting jobs: every state's list, a second page, a search, a
	// filter, RunNow, the history.
	for _, id := range []string{"later-1", "later-2"} {
		_, err := p.Produce(ctx, id, "l", After(time.Hour))
		require.NoError(t, err)
	}
	for _, st := range []JobState{JobScheduled, JobRetrying, JobQueued, JobRunning, JobDeadLettered} {
		page, err := admin.Jobs(ctx, JobsQuery{State: st, Limit: 1})
		require.NoError(t, err)
		if page.Next != "" {
			next, err := admin.Jobs(ctx, JobsQuery{State: st, Limit: 1, Cursor: page.Next})
			require.NoError(t, err)
			_, err = admin.Jobs(ctx, JobsQuery{State: st, Limit: 1, Cursor: next.Prev})
			require.NoError(t, err)
		}
	}
	_, err = admin.Jobs(ctx, JobsQuery{State: JobDeadLettered, ErrorContains: "poison"})
	require.NoError(t, err)
	found, err := admin.Jobs(ctx, JobsQuery{State: JobScheduled, ID: "later-1"})
	require.NoError(t, err)
	require.Len(t, found.Jobs, 1)
	later, err := p.Produce(ctx, "later-1", "l")
	require.NoError(t, err)
	require.NoError(t, admin.RunNow(ctx, "later-1"))
	got, err = wait(later)
	require.NoError(t, err)
	require.Equal(t, "ok:l", got)
	require.NoError(t, admin.Cancel(ctx, "later-2"))
	// The committers add to the history once per second (historyEvery).
	eventually(t, 10*time.Second, func() bool {
		hist, err := admin.History(ctx, time.Hour)
		require.NoError(t, err)
		var processed int64
		for _, h := range hist {
			processed += h.Processed
		}
		return processed > 0
	}, "the history counts the outcomes")
	cs, err := admin.Consumers(ctx)
	require.NoError(t, err)
	require.True(t, slices.ContainsFunc(cs, func(c ConsumerInfo) bool { return c.Live }), "%+v", cs)
	qs, err := Queues(ctx, client)
	require.NoError(t, err)
	require.Contains(t, qs, q)
	require.NoError(t, admin.Pause(ctx))
	stats, err = admin.Stats(ctx)
	require.NoError(t, err)
	require.True(t, stats.Paused)
	require.NoError(t, admin.Resume(ctx))

	pd, err := NewPeriodic(p, &PeriodicOptions{Logger: log})
	require.NoError(t, err)
	require.NoError(t, pd.Register(PeriodicJob[string]{Name: "tick", Schedule: Every(50 * time.Millisecond),
		Request: func(time.Time) (string, error) { return "t", nil }}))
	pctx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = pd.Run(pctx)
	}()
	eventually(t, 10*time.Second, func() bool {
		return client.HGet(ctx, keys.Periodic(q), "tick:last").Err() == nil
	}, "a periodic slot is produced and recorded")
	cancel()
	<-done
}

// TestSecurityMissingChannelPermission: a user with the queue's keys but not
// its channel gets an error from Produce that names the missing permission.
func TestSecurityMissingChannelPermission(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	root := srv.Client(t)
	q := queueName(t)
	user := aclUser(t, root, "no-channels", "+@all", "~streamq:{"+q+"}:*", "resetchannels")
	p, err := NewProducer[string, string](user, q, &ProducerOptions{Logger: testLogger(t)})
	require.NoError(t, err)
	defer p.Close()
	_, err = p.Produce(context.Background(), "a", "x")
	require.Error(t, err)
	t.Log(err)
	require.Contains(t, err.Error(), "&streamq:{"+q+"}:*", "the error names the channel permission to grant")
	require.Contains(t, err.Error(), "NOPERM")
}
