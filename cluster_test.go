package streamq

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/streamq/streamq/internal/crashtest"
	"github.com/streamq/streamq/internal/keys"
	"github.com/streamq/streamq/internal/redistest"
)

// The tests in this file run against a real local Redis Cluster
// (redistest.StartCluster): hash tags, SPUBLISH/SSUBSCRIBE, MOVED and
// failover cannot be checked on miniredis or a single server.

// clusterShards is the shard count of the cluster tests' queues: two per
// master of a three-master cluster.
const clusterShards = 6

// TestCluster runs the queue's guarantees on a three-master cluster, once
// through a *redis.ClusterClient and once through redis.NewUniversalClient
// given every address (which returns a cluster client).
func TestCluster(t *testing.T) {
	t.Parallel()
	c := redistest.StartCluster(t, 3, 0)
	t.Run("ClusterClient", func(t *testing.T) {
		t.Parallel()
		clusterSuite(t, c, c.Client(t))
	})
	t.Run("UniversalClient", func(t *testing.T) {
		t.Parallel()
		u := redis.NewUniversalClient(&redis.UniversalOptions{Addrs: c.Addrs()})
		t.Cleanup(func() { _ = u.Close() })
		require.IsType(t, &redis.ClusterClient{}, u)
		clusterSuite(t, c, u)
	})
}

func clusterSuite(t *testing.T, c *redistest.Cluster, client redis.UniversalClient) {
	t.Run("DedupAcrossProducers", func(t *testing.T) {
		t.Parallel()
		testClusterDedup(t, c, client)
	})
	t.Run("KillAndReclaim", func(t *testing.T) {
		t.Parallel()
		testClusterKillAndReclaim(t, c, client)
	})
	t.Run("SafeTrim", func(t *testing.T) {
		t.Parallel()
		testClusterSafeTrim(t, client)
	})
	t.Run("Stats", func(t *testing.T) {
		t.Parallel()
		testClusterStats(t, client)
	})
	t.Run("Delayed", func(t *testing.T) {
		t.Parallel()
		testClusterDelayed(t, client)
	})
	t.Run("Flow", func(t *testing.T) {
		t.Parallel()
		testClusterFlow(t, client)
	})
	t.Run("MultiConsumer", func(t *testing.T) {
		t.Parallel()
		testClusterMulti(t, client)
	})
	t.Run("Replace", func(t *testing.T) {
		t.Parallel()
		testClusterReplace(t, client)
	})
	t.Run("Keyed", func(t *testing.T) {
		t.Parallel()
		testClusterKeyed(t, client)
	})
	t.Run("Retention", func(t *testing.T) {
		t.Parallel()
		testClusterRetention(t, client)
	})
}

// testClusterKeyed: keyed jobs on a queue sharded over every master take
// their keys' turns and limit on each shard (the scripts touch only keys of
// their shard's slot), every job runs once, and no keyed state is left.
func testClusterKeyed(t *testing.T, client redis.UniversalClient) {
	ctx := context.Background()
	q := queueName(t)
	p, err := NewProducer[string, string](client, q, &ProducerOptions{Shards: clusterShards, Logger: testLogger(t)})
	require.NoError(t, err)
	t.Cleanup(func() { _ = p.Close() })
	rc := newRunCounter()
	c, err := NewConsumer(client, q, func(ctx context.Context, m *Message[string]) (string, error) {
		rc.add(m.ID)
		return m.Key, nil
	}, &ConsumerOptions{Shards: clusterShards, Workers: 4, KeyLimit: 1, KeyWindow: 2, Logger: testLogger(t)})
	require.NoError(t, err)
	runConsumer(t, c)
	<-c.Ready()
	var prs []*Promise[string]
	for i := range 60 {
		pr, err := p.Produce(ctx, fmt.Sprint("j", i), "x", Key(fmt.Sprint("k", i%3)))
		require.NoError(t, err)
		prs = append(prs, pr)
	}
	for i, pr := range prs {
		v, err := pr.Wait(waitCtx(t, 30*time.Second))
		require.NoError(t, err)
		require.Equal(t, fmt.Sprint("k", i%3), v)
	}
	a, err := NewAdmin(client, q, &AdminOptions{})
	require.NoError(t, err)
	eventually(t, 10*time.Second, func() bool {
		top, err := a.TopKeys(ctx, 10)
		return err == nil && len(top) == 0
	}, "keys left with jobs")
	runs := rc.snapshot()
	for i := range 60 {
		require.Equal(t, 1, runs[fmt.Sprint("j", i)], "runs of j%d", i)
	}
}

// testClusterMulti: a MultiConsumer over three queues on a cluster, one of
// them sharded over every master and using priority levels, another with a
// request type of its own: each queue's requests run once and reach their
// callers, whatever node their shard is on.
func testClusterMulti(t *testing.T, client redis.UniversalClient) {
	ctx := context.Background()
	type job struct{ N int }
	names := []string{queueName(t) + "-a", queueName(t) + "-b", queueName(t) + "-c"}
	shards := []int{clusterShards, 1, 2}
	rc := newRunCounter()
	var queues []MultiQueue
	for i, q := range names {
		var c QueueConsumer
		var err error
		o := &ConsumerOptions{Shards: shards[i], Logger: testLogger(t)}
		if i == 1 {
			c, err = NewConsumer(client, q, func(ctx context.Context, m *Message[job]) (int, error) {
				rc.add(q + "/" + m.ID)
				return 2 * m.Payload.N, nil
			}, o)
		} else {
			c, err = NewConsumer(client, q, func(ctx context.Context, m *Message[string]) (string, error) {
				rc.add(q + "/" + m.ID)
				return m.Payload, nil
			}, o)
		}
		require.NoError(t, err)
		queues = append(queues, MultiQueue{Consumer: c, Weight: 3 - i})
	}
	mc, err := NewMultiConsumer(&MultiOptions{Workers: 6}, queues...)
	require.NoError(t, err)
	runMulti(t, mc)
	const n = 60
	pa, err := NewProducer[string, string](client, names[0], &ProducerOptions{Shards: shards[0], Logger: testLogger(t)})
	require.NoError(t, err)
	defer pa.Close()
	pb, err := NewProducer[job, int](client, names[1], &ProducerOptions{Logger: testLogger(t)})
	require.NoError(t, err)
	defer pb.Close()
	pc, err := NewProducer[string, string](client, names[2], &ProducerOptions{Shards: shards[2], Logger: testLogger(t)})
	require.NoError(t, err)
	defer pc.Close()
	var strs []*Promise[string]
	var ints []*Promise[int]
	for i := range n {
		id := fmt.Sprint("j", i)
		pr, err := pa.Produce(ctx, id, id, Priority(levelValue[i%numLevels]))
		require.NoError(t, err)
		strs = append(strs, pr)
		pi, err := pb.Produce(ctx, id, job{N: i})
		require.NoError(t, err)
		ints = append(ints, pi)
		pr, err = pc.Produce(ctx, id, id)
		require.NoError(t, err)
		strs = append(strs, pr)
	}
	wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	for _, pr := range strs {
		got, err := pr.Wait(wctx)
		require.NoError(t, err)
		require.Equal(t, pr.ID(), got)
	}
	for i, pi := range ints {
		got, err := pi.Wait(wctx)
		require.NoError(t, err)
		require.Equal(t, 2*i, got)
	}
	runs := rc.snapshot()
	require.Len(t, runs, 3*n)
	for id, k := range runs {
		require.Equal(t, 1, k, "runs of %s", id)
	}
}

// testClusterDelayed: delayed jobs on every shard of a sharded queue run once,
// not before their time, and well before the promoters' 10 s backstop: the
// wake notices (sharded pub/sub) reach the consumers' promoters.
func testClusterDelayed(t *testing.T, client redis.UniversalClient) {
	ctx := context.Background()
	q := queueName(t)
	rc := newRunCounter()
	var mu sync.Mutex
	late := map[string]time.Duration{}
	due := map[string]time.Time{}
	c, err := NewConsumer(client, q, func(ctx context.Context, m *Message[string]) (string, error) {
		now := time.Now()
		rc.add(m.ID)
		mu.Lock()
		late[m.ID] = now.Sub(due[m.ID])
		mu.Unlock()
		return m.Payload, nil
	}, &ConsumerOptions{Shards: clusterShards, Workers: 4, Logger: testLogger(t)})
	require.NoError(t, err)
	runConsumer(t, c)
	p, err := NewProducer[string, string](client, q, &ProducerOptions{Shards: clusterShards, Logger: testLogger(t)})
	require.NoError(t, err)
	defer p.Close()
	// Let the consumer subscribe and find an empty schedule first.
	time.Sleep(500 * time.Millisecond)
	var prs []*Promise[string]
	for i := range 30 {
		id := fmt.Sprintf("later-%d", i)
		at := time.Now().Add(300 * time.Millisecond)
		mu.Lock()
		due[id] = at
		mu.Unlock()
		pr, err := p.Produce(ctx, id, id, At(at))
		require.NoError(t, err)
		prs = append(prs, pr)
	}
	for _, pr := range prs {
		wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		got, err := pr.Wait(wctx)
		cancel()
		require.NoError(t, err)
		require.Equal(t, pr.ID(), got)
	}
	mu.Lock()
	defer mu.Unlock()
	for id, n := range rc.snapshot() {
		require.Equal(t, 1, n, "runs of %s", id)
		require.GreaterOrEqual(t, late[id], time.Duration(0), "%s ran early", id)
		require.Less(t, late[id], 5*time.Second, "%s ran %v late: a wake notice was missed", id, late[id])
	}
}

// runCounter counts handler runs per id.
type runCounter struct {
	mu   sync.Mutex
	runs map[string]int
}

func newRunCounter() *runCounter { return &runCounter{runs: map[string]int{}} }

func (rc *runCounter) add(id string) {
	rc.mu.Lock()
	rc.runs[id]++
	rc.mu.Unlock()
}

func (rc *runCounter) snapshot() map[string]int {
	rc.mu.Lock()
	defer rc.mu.Unlock()
	out := make(map[string]int, len(rc.runs))
	for k, v := range rc.runs {
		out[k] = v
	}
	return out
}

// requireShardsSpread checks that the queue's shard streams exist and are
// spread evenly over the cluster's masters.
func requireShardsSpread(t *testing.T, c *redistest.Cluster, client redis.UniversalClient, q string) {
	t.Helper()
	ctx := context.Background()
	shards, err := keys.Shards(q, clusterShards)
	require.NoError(t, err)
	cc := c.Client(t)
	perMaster := map[string]int{}
	for _, k := range shards {
		require.EqualValues(t, 1, client.Exists(ctx, k.Stream).Val(), "shard stream %s exists", k.Stream)
		m, err := cc.MasterForKey(ctx, k.Stream)
		require.NoError(t, err)
		perMaster[m.Options().Addr]++
	}
	require.Len(t, perMaster, 3, "shards on every master: %v", perMaster)
	for addr, n := range perMaster {
		require.Equal(t, clusterShards/3, n, "shards on %s", addr)
	}
}

// testClusterDedup: three producers submit the same ids concurrently; each
// handler runs once per id and every caller gets the result. The backstop is
// far off, so results must come through the sharded completion notices.
func testClusterDedup(t *testing.T, c *redistest.Cluster, client redis.UniversalClient) {
	ctx := context.Background()
	q := queueName(t)
	const ids, producers = 300, 3
	rc := newRunCounter()
	for i := range 2 {
		cons, err := NewConsumer(client, q, func(ctx context.Context, m *Message[int]) (int, error) {
			rc.add(m.ID)
			return m.Payload * 2, nil
		}, &ConsumerOptions{Shards: clusterShards, Workers: 4, Name: fmt.Sprintf("c%d", i),
			ReadBlock: 100 * time.Millisecond, Logger: testLogger(t)})
		require.NoError(t, err)
		runConsumer(t, cons)
	}
	var wg sync.WaitGroup
	errs := make(chan error, producers*ids)
	for range producers {
		p, err := NewProducer[int, int](client, q, &ProducerOptions{Shards: clusterShards,
			BackstopInterval: time.Hour, Logger: testLogger(t)})
		require.NoError(t, err)
		defer p.Close()
		for _, i := range rand.Perm(ids) {
			wg.Go(func() {
				pr, err := p.Produce(ctx, "id-"+strconv.Itoa(i), i)
				if err == nil {
					wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
					var got int
					got, err = pr.Wait(wctx)
					cancel()
					if err == nil && got != 2*i {
						err = fmt.Errorf("id-%d: got %d, want %d", i, got, 2*i)
					}
				}
				if err != nil {
					errs <- fmt.Errorf("id-%d: %w", i, err)
				}
			})
		}
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}
	runs := rc.snapshot()
	require.Len(t, runs, ids)
	for id, n := range runs {
		require.Equal(t, 1, n, "handler runs of %s", id)
	}
	requireShardsSpread(t, c, client, q)
}

// clusterCrashConfig is what the child consumer of KillAndReclaim is told.
type clusterCrashConfig struct {
	Addrs   []string
	Queue   string
	Name    string
	MinIdle time.Duration
}

// clusterStartedKey counts the handler starts of the child consumer.
func clusterStartedKey(q string) string { return "clustertest:{" + q + "}:started" }

// TestClusterCrashHelper is the child consumer of KillAndReclaim: its handler
// counts its start and blocks until the process is killed. Run by go test it
// returns at once; it works only when crashtest.Start ran it.
func TestClusterCrashHelper(t *testing.T) {
	var cfg clusterCrashConfig
	if !crashtest.Config(&cfg) {
		return
	}
	client := redis.NewClusterClient(&redis.ClusterOptions{Addrs: cfg.Addrs})
	defer client.Close()
	bg := context.Background()
	c, err := NewConsumer(client, cfg.Queue, func(ctx context.Context, m *Message[int]) (int, error) {
		if err := client.Incr(bg, clusterStartedKey(cfg.Queue)).Err(); err != nil {
			return 0, err
		}
		<-ctx.Done()
		return 0, context.Cause(ctx)
	}, &ConsumerOptions{
		Shards: clusterShards, Name: cfg.Name, Workers: 4, Prefetch: 12, MinIdle: cfg.MinIdle,
		ReadBlock: 100 * time.Millisecond, TrimInterval: -1,
		Logger: slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelInfo})),
	})
	if err != nil {
		t.Fatal(err)
	}
	ctx, stop := signal.NotifyContext(bg, syscall.SIGTERM)
	defer stop()
	_ = c.Run(ctx)
}

// testClusterKillAndReclaim: a consumer process is SIGKILLed while its
// handlers run; a second consumer reclaims its entries after MinIdle and
// completes every request, counting the crashed deliveries.
func testClusterKillAndReclaim(t *testing.T, c *redistest.Cluster, client redis.UniversalClient) {
	ctx := context.Background()
	q := queueName(t)
	const n = 60
	const minIdle = 2 * time.Second
	p, err := NewProducer[int, int](client, q, &ProducerOptions{Shards: clusterShards, Logger: testLogger(t)})
	require.NoError(t, err)
	defer p.Close()
	prs := make([]*Promise[int], n)
	for i := range n {
		prs[i], err = p.Produce(ctx, "k"+strconv.Itoa(i), i)
		require.NoError(t, err)
	}

	child := crashtest.Start(t, "TestClusterCrashHelper", clusterCrashConfig{
		Addrs: c.Addrs(), Queue: q, Name: "doomed", MinIdle: minIdle})
	// Wait until all four workers are inside handlers and the ring holds more.
	eventually(t, 60*time.Second, func() bool {
		v, _ := client.Get(ctx, clusterStartedKey(q)).Int()
		return v >= 4
	}, "child consumer started its handlers")
	child.Kill()

	shards, err := keys.Shards(q, clusterShards)
	require.NoError(t, err)
	var held int64
	for _, k := range shards {
		pend, err := client.XPendingExt(ctx, &redis.XPendingExtArgs{
			Stream: k.Stream, Group: DefaultGroup, Consumer: "doomed", Start: "-", End: "+", Count: 1000,
		}).Result()
		require.NoError(t, err)
		held += int64(len(pend))
	}
	require.GreaterOrEqual(t, held, int64(4), "the killed consumer held entries")

	var mu sync.Mutex
	runs := map[string]int{}
	redelivered := 0
	cons, err := NewConsumer(client, q, func(ctx context.Context, m *Message[int]) (int, error) {
		mu.Lock()
		runs[m.ID]++
		if m.Deliveries > 1 {
			redelivered++
		}
		mu.Unlock()
		return m.Payload + 1000, nil
	}, &ConsumerOptions{Shards: clusterShards, Name: "survivor", Workers: 4, MinIdle: minIdle,
		ClaimInterval: 100 * time.Millisecond, ReadBlock: 100 * time.Millisecond, Logger: testLogger(t)})
	require.NoError(t, err)
	runConsumer(t, cons)

	for i, pr := range prs {
		wctx, cancel := context.WithTimeout(ctx, 60*time.Second)
		got, err := pr.Wait(wctx)
		cancel()
		require.NoError(t, err, "k%d", i)
		require.Equal(t, i+1000, got)
	}
	mu.Lock()
	defer mu.Unlock()
	require.Len(t, runs, n)
	for id, r := range runs {
		require.Equal(t, 1, r, "survivor runs of %s", id)
	}
	// A delivery is a handler start: only the entries whose handlers the
	// killed consumer started run as a second delivery; those it had merely
	// prefetched run as a first.
	started, err := client.Get(ctx, clusterStartedKey(q)).Int64()
	require.NoError(t, err)
	require.EqualValues(t, started, redelivered, "every entry whose handler the killed consumer started was redelivered, and no other")
	t.Logf("killed consumer held %d entries; the survivor reclaimed and completed them", held)
}

// testClusterSafeTrim: a second group lags (its only consumer is stuck in a
// handler) while the first completes everything; trimming then removes
// nothing the lagging group has not acknowledged. Once it catches up, trim
// removes entries again.
func testClusterSafeTrim(t *testing.T, client redis.UniversalClient) {
	ctx := context.Background()
	q := queueName(t)
	const n = 1200 // ~200 per shard: whole macro-nodes that MINID ~ can free
	release := make(chan struct{})
	var lagDone atomic.Int64
	lag, err := NewConsumer(client, q, func(ctx context.Context, m *Message[int]) (int, error) {
		select {
		case <-release:
		case <-ctx.Done():
			return 0, ctx.Err()
		}
		lagDone.Add(1)
		return m.Payload, nil
	}, &ConsumerOptions{Shards: clusterShards, Group: "lagging", Fanout: true, Workers: 8, Prefetch: 64,
		ReadBlock: 100 * time.Millisecond, TrimInterval: -1, Logger: testLogger(t)})
	require.NoError(t, err)
	stopLag := runConsumer(t, lag)
	defer stopLag()
	defer func() {
		select {
		case <-release:
		default:
			close(release)
		}
	}()

	fast, err := NewConsumer(client, q, func(ctx context.Context, m *Message[int]) (int, error) {
		return m.Payload, nil
	}, &ConsumerOptions{Shards: clusterShards, Group: "fast", Workers: 4,
		ReadBlock: 100 * time.Millisecond, TrimInterval: -1, Logger: testLogger(t)})
	require.NoError(t, err)
	runConsumer(t, fast)
	admin, err := NewAdmin(client, q, nil)
	require.NoError(t, err)
	eventually(t, 30*time.Second, func() bool {
		s, err := admin.Stats(ctx)
		return err == nil && len(s.Groups) == 2
	}, "both groups exist on every shard")

	p, err := NewProducer[int, int](client, q, &ProducerOptions{Shards: clusterShards, Logger: testLogger(t)})
	require.NoError(t, err)
	defer p.Close()
	jobs := make([]Job[int], n)
	for i := range jobs {
		jobs[i] = Job[int]{ID: "t" + strconv.Itoa(i), Request: i}
	}
	var prs []*Promise[int]
	for i := 0; i < n; i += 200 {
		part, err := p.ProduceBatch(ctx, jobs[i:min(i+200, n)])
		require.NoError(t, err)
		prs = append(prs, part...)
	}
	for _, pr := range prs {
		_, err := pr.Wait(ctx) // the fast group's result
		require.NoError(t, err)
	}
	groupOf := func(s Stats, name string) GroupStats {
		for _, g := range s.Groups {
			if g.Name == name {
				return g
			}
		}
		t.Fatalf("no group %q in %+v", name, s)
		return GroupStats{}
	}
	eventually(t, 30*time.Second, func() bool {
		s, err := admin.Stats(ctx)
		return err == nil && groupOf(s, "fast").Pending == 0 && groupOf(s, "fast").Lag == 0
	}, "the fast group acknowledged everything")

	for _, c := range []*Consumer[int, int]{fast, lag} {
		removed, err := c.Trim(ctx)
		require.NoError(t, err)
		require.Zero(t, removed, "trim removed entries the lagging group has not acknowledged")
	}
	s, err := admin.Stats(ctx)
	require.NoError(t, err)
	require.EqualValues(t, n, s.Length, "every entry is still in the streams")
	lg := groupOf(s, "lagging")
	require.Positive(t, lg.Pending, "the lagging group holds entries")
	require.EqualValues(t, n, lg.Pending+lg.Lag, "the lagging group has not acknowledged anything")

	close(release)
	eventually(t, 60*time.Second, func() bool {
		s, err := admin.Stats(ctx)
		return err == nil && groupOf(s, "lagging").Pending == 0 && groupOf(s, "lagging").Lag == 0
	}, "the lagging group caught up")
	require.EqualValues(t, n, lagDone.Load())
	removed, err := fast.Trim(ctx)
	require.NoError(t, err)
	require.Positive(t, removed, "once both groups are done, trim frees whole macro-nodes")
	s, err = admin.Stats(ctx)
	require.NoError(t, err)
	require.EqualValues(t, n-removed, s.Length)
	t.Logf("trim removed %d of %d entries once both groups were done", removed, n)
}

// testClusterStats: Admin.Stats sums every shard of the cluster: a backlog
// before any consumer, then dead letters and an empty queue after.
func testClusterStats(t *testing.T, client redis.UniversalClient) {
	ctx := context.Background()
	q := queueName(t)
	const n, bad = 90, 12
	p, err := NewProducer[int, int](client, q, &ProducerOptions{Shards: clusterShards, Logger: testLogger(t)})
	require.NoError(t, err)
	defer p.Close()
	for i := range n {
		require.NoError(t, p.Enqueue(ctx, "s"+strconv.Itoa(i), i))
	}
	qs, err := Queues(ctx, client)
	require.NoError(t, err)
	require.Contains(t, qs, q, "Queues scans every master")
	admin, err := NewAdmin(client, q, nil)
	require.NoError(t, err)
	s, err := admin.Stats(ctx)
	require.NoError(t, err)
	require.EqualValues(t, n, s.Length, "backlog summed over shards")
	require.Empty(t, s.Groups)
	ks, err := admin.Keys(ctx)
	require.NoError(t, err)
	require.Len(t, ks, clusterShards)

	cons, err := NewConsumer(client, q, func(ctx context.Context, m *Message[int]) (int, error) {
		if m.Payload < bad {
			return 0, Permanent(errors.New("bad request"))
		}
		return m.Payload, nil
	}, &ConsumerOptions{Shards: clusterShards, Workers: 4, ReadBlock: 100 * time.Millisecond, Logger: testLogger(t)})
	require.NoError(t, err)
	runConsumer(t, cons)
	eventually(t, 30*time.Second, func() bool {
		s, err = admin.Stats(ctx)
		return err == nil && s.Length == 0 && s.DeadLetters == bad &&
			len(s.Groups) == 1 && s.Groups[0].Pending == 0 && s.Groups[0].Lag == 0
	}, "queue drained with %d dead letters", bad)
	require.Equal(t, DefaultGroup, s.Groups[0].Name)
	require.EqualValues(t, 1, s.Groups[0].Consumers)
	dl, err := admin.DeadLetters(ctx, "", 100)
	require.NoError(t, err)
	require.Len(t, dl, bad)
}

// TestClusterFailover runs producers and consumers on a cluster of three
// masters with a replica each and SIGKILLs a master mid-run. Its replica takes
// over; no request is lost: every caller gets its result, retrying Produce on
// errors during the failover (producing an id again is safe) and producing
// again when the request's record was lost with the master (asynchronous
// replication can lose the last writes a master acknowledged). Completion
// notices must work again afterwards: a producer with no backstop gets the
// results of new requests.
func TestClusterFailover(t *testing.T) {
	t.Parallel()
	c := redistest.StartCluster(t, 3, 1)
	ctx := context.Background()
	q := queueName(t)
	const n = 3000
	const minIdle = 3 * time.Second

	var (
		mu      sync.Mutex
		entries = map[string][]string{} // request id -> entry id of each handler run
		handled atomic.Int64
	)
	for i := range 2 {
		cons, err := NewConsumer(c.Client(t), q, func(ctx context.Context, m *Message[int]) (int, error) {
			mu.Lock()
			entries[m.ID] = append(entries[m.ID], m.EntryID)
			mu.Unlock()
			handled.Add(1)
			return 3 * m.Payload, nil
		}, &ConsumerOptions{Shards: clusterShards, Name: fmt.Sprintf("c%d", i), Workers: 4, MinIdle: minIdle,
			ClaimInterval: 200 * time.Millisecond, ReadBlock: 200 * time.Millisecond, Logger: testLogger(t)})
		require.NoError(t, err)
		runConsumer(t, cons)
	}

	// watcher's results can only come through the notices.
	watcher, err := NewProducer[int, int](c.Client(t), q, &ProducerOptions{Shards: clusterShards,
		BackstopInterval: time.Hour, Logger: testLogger(t)})
	require.NoError(t, err)
	defer watcher.Close()
	pr, err := watcher.Produce(ctx, "warm-up", 1)
	require.NoError(t, err)
	got, err := pr.Wait(ctx)
	require.NoError(t, err)
	require.Equal(t, 3, got)

	var produceRetries, lostRecords atomic.Int64
	deadline := time.Now().Add(3 * time.Minute)
	// produce submits id until its caller has the result.
	produce := func(p *Producer[int, int], i int) error {
		id := "f" + strconv.Itoa(i)
		for {
			if time.Now().After(deadline) {
				return fmt.Errorf("%s: no result before the deadline", id)
			}
			pctx, cancel := context.WithTimeout(ctx, 5*time.Second)
			pr, err := p.Produce(pctx, id, i)
			cancel()
			if err != nil {
				produceRetries.Add(1)
				time.Sleep(50 * time.Millisecond)
				continue
			}
			wctx, cancel := context.WithTimeout(ctx, time.Minute)
			got, err := pr.Wait(wctx)
			cancel()
			if errors.Is(err, ErrRecordLost) {
				lostRecords.Add(1)
				continue
			}
			if err != nil {
				return fmt.Errorf("%s: %w", id, err)
			}
			if got != 3*i {
				return fmt.Errorf("%s: got %d, want %d", id, got, 3*i)
			}
			return nil
		}
	}

	var wg sync.WaitGroup
	errs := make(chan error, 2*n)
	for range 2 { // two producers, each submitting every id: dedup holds during failover too
		p, err := NewProducer[int, int](c.Client(t), q, &ProducerOptions{Shards: clusterShards,
			BackstopInterval: 2 * time.Second, Logger: testLogger(t)})
		require.NoError(t, err)
		defer p.Close()
		sem := make(chan struct{}, 64)
		wg.Go(func() {
			var inner sync.WaitGroup
			for _, i := range rand.Perm(n) {
				sem <- struct{}{}
				inner.Go(func() {
					defer func() { <-sem }()
					if err := produce(p, i); err != nil {
						errs <- err
					}
				})
			}
			inner.Wait()
		})
	}

	eventually(t, 2*time.Minute, func() bool { return handled.Load() >= n/3 }, "a third of the run handled")
	killedAt := handled.Load()
	killed := c.KillMaster(1)
	start := time.Now()
	c.WaitHealthy(t)
	failover := time.Since(start)
	wg.Wait()
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}
	// A request can run twice: redelivered (same entry) when its completion
	// was lost with the master or its lease lapsed during the outage (longer
	// than MinIdle) and the other consumer claimed it, or appended again (a new entry) when its
	// record was lost and the other producer submitted the id afterwards.
	var redelivered, reappended int
	mu.Lock()
	for i := range n {
		runs := entries["f"+strconv.Itoa(i)]
		require.NotEmpty(t, runs, "f%d was handled", i)
		distinct := map[string]bool{}
		for _, e := range runs {
			distinct[e] = true
		}
		if len(distinct) > 1 {
			reappended++
		} else if len(runs) > 1 {
			redelivered++
		}
	}
	mu.Unlock()

	// New requests after the failover resolve through re-established
	// sharded subscriptions (watcher has no backstop to fall back on).
	for i := range 60 {
		id := "after-" + strconv.Itoa(i)
		var pr *Promise[int]
		require.Eventually(t, func() bool {
			pctx, cancel := context.WithTimeout(ctx, 5*time.Second)
			defer cancel()
			pr, err = watcher.Produce(pctx, id, i)
			return err == nil
		}, 30*time.Second, 50*time.Millisecond, "produce %s after failover", id)
		wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		got, err := pr.Wait(wctx)
		cancel()
		require.NoError(t, err, "%s: no notice after failover", id)
		require.Equal(t, 3*i, got)
	}

	admin, err := NewAdmin(c.Client(t), q, nil)
	require.NoError(t, err)
	drained := func() (bool, string) {
		s, err := admin.Stats(ctx)
		if err != nil {
			return false, err.Error()
		}
		return s.Length == 0 && len(s.Groups) == 1 && s.Groups[0].Pending == 0,
			fmt.Sprintf("length %d, groups %+v", s.Length, s.Groups)
	}
	var last string
	if !assert.Eventually(t, func() bool {
		var ok bool
		ok, last = drained()
		return ok
	}, time.Minute, 50*time.Millisecond) {
		t.Fatalf("the queue did not drain within a minute of the failover: %s", last)
	}
	t.Logf("failover: killed master %s after %d of %d requests were handled; cluster healthy %v later", killed, killedAt, n, failover.Round(time.Millisecond))
	t.Logf("failover: %d Produce calls retried, %d waits ended with ErrRecordLost and were produced again",
		produceRetries.Load(), lostRecords.Load())
	t.Logf("failover: of %d ids, %d ran twice on one entry (completion or lease renewal lost in the outage), %d ran on two entries (record lost, id produced again)",
		n, redelivered, reappended)
}

// TestClusterThroughput measures fire-and-forget jobs per second on clusters
// of 1, 2 and 3 masters (Shards = 2 x masters), and on a plain server with
// 1 and 6 shards for reference. It is a measurement, not a check, and runs only
// with STREAMQ_CLUSTER_BENCH=1 (without -race for meaningful figures):
//
//	STREAMQ_CLUSTER_BENCH=1 go test -run TestClusterThroughput -v .
//
// STREAMQ_CLUSTER_BENCH_N sets the jobs per run (default 60000).
func TestClusterThroughput(t *testing.T) {
	if os.Getenv("STREAMQ_CLUSTER_BENCH") != "1" {
		t.Skip("set STREAMQ_CLUSTER_BENCH=1 to measure cluster throughput")
	}
	n := 60000
	if s := os.Getenv("STREAMQ_CLUSTER_BENCH_N"); s != "" {
		var err error
		n, err = strconv.Atoi(s)
		require.NoError(t, err, "STREAMQ_CLUSTER_BENCH_N")
	}
	for _, shards := range []int{1, 6} {
		t.Run(fmt.Sprintf("single-server/shards=%d", shards), func(t *testing.T) {
			s := redistest.Start(t)
			rate := clusterThroughput(t, func(testing.TB) redis.UniversalClient {
				return redis.NewClient(&redis.Options{Addr: s.Addr()})
			}, []int{s.PID()}, shards, n)
			t.Logf("BENCH single server, %d shards: %d jobs in %.0f jobs/s", shards, n, rate)
		})
	}
	for _, masters := range []int{1, 2, 3} {
		t.Run(fmt.Sprintf("masters=%d", masters), func(t *testing.T) {
			c := redistest.StartCluster(t, masters, 0)
			rate := clusterThroughput(t, func(testing.TB) redis.UniversalClient {
				return redis.NewClusterClient(c.Options())
			}, c.PIDs(), 2*masters, n)
			t.Logf("BENCH cluster of %d masters, %d shards: %d jobs in %.0f jobs/s", masters, 2*masters, n, rate)
		})
	}
}

// clusterThroughput runs n fire-and-forget jobs through two producers (each
// with 128 concurrent Enqueue callers, so calls coalesce) and two consumers
// (8 workers each, DiscardResults), each with its own client, and returns
// jobs per second from the first Enqueue to the last handler return. It logs
// the CPU time used by this process and by the servers (process ids servers).
func clusterThroughput(t *testing.T, newClient func(testing.TB) redis.UniversalClient, servers []int, shards, n int) float64 {
	t.Helper()
	ctx := context.Background()
	q := queueName(t)
	quiet := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	client := func() redis.UniversalClient {
		cl := newClient(t)
		t.Cleanup(func() { _ = cl.Close() })
		return cl
	}
	var done atomic.Int64
	finished := make(chan struct{})
	for i := range 2 {
		cons, err := NewConsumer(client(), q, func(ctx context.Context, m *Message[int]) (struct{}, error) {
			if done.Add(1) == int64(n) {
				close(finished)
			}
			return struct{}{}, nil
		}, &ConsumerOptions{Shards: shards, Name: fmt.Sprintf("b%d", i), Workers: 8, Prefetch: 256,
			DiscardResults: true, ReadBlock: 100 * time.Millisecond, Logger: quiet})
		require.NoError(t, err)
		runConsumer(t, cons)
	}
	// Let the consumers create their groups before the clock starts.
	admin, err := NewAdmin(client(), q, nil)
	require.NoError(t, err)
	eventually(t, 30*time.Second, func() bool {
		s, err := admin.Stats(ctx)
		return err == nil && len(s.Groups) == 1 && s.Groups[0].Consumers == 2
	}, "consumers ready")

	var next atomic.Int64
	var wg sync.WaitGroup
	errs := make(chan error, 256)
	cpu0, srv0 := processCPU(), serversCPU(servers)
	start := time.Now()
	for range 2 {
		p, err := NewProducer[int, struct{}](client(), q, &ProducerOptions{Shards: shards, Logger: quiet})
		require.NoError(t, err)
		defer p.Close()
		for range 128 {
			wg.Go(func() {
				for {
					i := int(next.Add(1) - 1)
					if i >= n {
						return
					}
					if err := p.Enqueue(ctx, "j"+strconv.Itoa(i), i); err != nil {
						errs <- err
						return
					}
				}
			})
		}
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}
	select {
	case <-finished:
	case <-time.After(5 * time.Minute):
		t.Fatalf("only %d of %d jobs handled after 5 minutes", done.Load(), n)
	}
	elapsed := time.Since(start)
	cpu, srv := processCPU()-cpu0, serversCPU(servers)-srv0
	require.EqualValues(t, n, done.Load())
	t.Logf("BENCH %d jobs, %d shards: %v wall; CPU: client %v (%.1f us/job), %d redis-server %v (%.1f us/job)",
		n, shards, elapsed.Round(time.Millisecond), cpu.Round(time.Millisecond), us(cpu, n),
		len(servers), srv.Round(time.Millisecond), us(srv, n))
	return float64(n) / elapsed.Seconds()
}

func us(d time.Duration, n int) float64 { return float64(d.Microseconds()) / float64(n) }

// serversCPU returns the CPU time (user + system) the processes pids have
// used, from /proc (clock ticks of 10 ms); 0 where /proc is missing.
func serversCPU(pids []int) time.Duration {
	var total time.Duration
	for _, pid := range pids {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
		if err != nil {
			continue
		}
		// Fields after the parenthesised command: state is field 3, utime 14, stime 15.
		rest := string(b[strings.LastIndexByte(string(b), ')')+2:])
		f := strings.Fields(rest)
		if len(f) < 13 {
			continue
		}
		ut, _ := strconv.ParseInt(f[11], 10, 64)
		st, _ := strconv.ParseInt(f[12], 10, 64)
		total += time.Duration(ut+st) * 10 * time.Millisecond
	}
	return total
}

// processCPU returns the CPU time (user + system) this process has used.
func processCPU() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// TestClusterManualFailover promotes replicas with CLUSTER FAILOVER, as an
// operator does before maintenance. The old masters keep running as replicas
// and end the sharded subscriptions they served (Redis sends SUNSUBSCRIBE);
// a producer must still get completion notices afterwards, without a backstop
// to fall back on.
func TestClusterManualFailover(t *testing.T) {
	t.Parallel()
	c := redistest.StartCluster(t, 3, 1)
	ctx := context.Background()
	q := queueName(t)
	client := c.Client(t)
	cons, err := NewConsumer(client, q, func(ctx context.Context, m *Message[int]) (int, error) {
		return m.Payload + 1, nil
	}, &ConsumerOptions{Shards: clusterShards, Workers: 4, ReadBlock: 100 * time.Millisecond, Logger: testLogger(t)})
	require.NoError(t, err)
	runConsumer(t, cons)
	p, err := NewProducer[int, int](client, q, &ProducerOptions{Shards: clusterShards,
		BackstopInterval: time.Hour, Logger: testLogger(t)})
	require.NoError(t, err)
	defer p.Close()
	shards, err := keys.Shards(q, clusterShards)
	require.NoError(t, err)

	round := func(prefix string) {
		t.Helper()
		for i := range 60 {
			id := prefix + strconv.Itoa(i)
			var pr *Promise[int]
			require.Eventually(t, func() bool {
				pctx, cancel := context.WithTimeout(ctx, 5*time.Second)
				defer cancel()
				pr, err = p.Produce(pctx, id, i)
				return err == nil
			}, 30*time.Second, 50*time.Millisecond, "produce %s", id)
			wctx, cancel := context.WithTimeout(ctx, 20*time.Second)
			got, err := pr.Wait(wctx)
			cancel()
			if err != nil {
				rec, rerr := client.Get(ctx, shards[keys.ShardOf(id, clusterShards)].Record(id)).Result()
				st := shards[keys.ShardOf(id, clusterShards)].Stream
				gi, gerr := client.XInfoGroups(ctx, st).Result()
				xl := client.XLen(ctx, st).Val()
				xr, _ := client.XRange(ctx, st, "-", "+").Result()
				t.Logf("shard %d (%s): length %d, groups %+v (%v), entries %+v", keys.ShardOf(id, clusterShards), st, xl, gi, gerr, xr)
				t.Fatalf("%s: %v; its record holds %q (%v): a result there means its notice was lost", id, err, rec, rerr)
			}
			require.Equal(t, i+1, got)
		}
	}
	round("before-")
	for i := range 3 {
		c.FailoverMaster(t, i)
	}
	round("after-")
}
