package streamq

import (
	"context"
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/streamq/streamq/internal/redistest"
)

// soakJobs is how many jobs the soak test runs: 100,000 by default, so that it
// is part of every `go test`, and 1,000,000 with STREAMQ_SOAK=1.
func soakJobs() int {
	if os.Getenv("STREAMQ_SOAK") == "1" {
		return 1_000_000
	}
	return 100_000
}

// usedMemory returns INFO memory's used_memory.
func usedMemory(t testing.TB, c *redis.Client) int64 {
	t.Helper()
	n, err := readUsedMemory(c)
	require.NoError(t, err)
	return n
}

func readUsedMemory(c *redis.Client) (int64, error) {
	info, err := c.Info(context.Background(), "memory").Result()
	if err != nil {
		return 0, err
	}
	for _, line := range strings.Split(info, "\n") {
		if v, ok := strings.CutPrefix(strings.TrimSpace(line), "used_memory:"); ok {
			return strconv.ParseInt(v, 10, 64)
		}
	}
	return 0, fmt.Errorf("INFO memory has no used_memory:\n%s", info)
}

// memoryBreakdown returns the parts of MEMORY STATS that explain used_memory.
func memoryBreakdown(t testing.TB, c *redis.Client) string {
	t.Helper()
	res, err := c.Do(context.Background(), "MEMORY", "STATS").Result()
	require.NoError(t, err)
	stats := map[string]any{}
	switch r := res.(type) {
	case map[any]any: // RESP3
		for k, v := range r {
			stats[fmt.Sprint(k)] = v
		}
	case []any: // RESP2
		for i := 0; i+1 < len(r); i += 2 {
			stats[fmt.Sprint(r[i])] = r[i+1]
		}
	}
	var parts []string
	for _, k := range []string{"startup.allocated", "clients.normal", "lua.caches", "functions.caches",
		"overhead.total", "db.0", "keys.count", "dataset.bytes"} {
		if v, ok := stats[k]; ok {
			parts = append(parts, fmt.Sprintf("%s=%v", k, v))
		}
	}
	return strings.Join(parts, " ")
}

// soakRun is one pass of producers and consumers over a queue.
type soakRun struct {
	t        *testing.T
	addr     string
	queue    string
	jobs     int
	window   int64 // producers stay at most this many jobs ahead of the handlers
	ttl      time.Duration
	handled  atomic.Int64
	mu       sync.Mutex
	progress *sync.Cond // signalled as handled grows
}

// run enqueues jobs ids prefix0..prefix(jobs-1) from 2 producers, with many
// goroutines each, and handles them with 2 consumers; it returns when every
// job has been handled, with the producers closed and the consumers stopped,
// and the elapsed time.
func (s *soakRun) run(prefix string) time.Duration {
	t := s.t
	ctx := context.Background()
	s.progress = sync.NewCond(&s.mu)
	s.handled.Store(0)
	newClient := func() *redis.Client {
		return redis.NewClient(&redis.Options{Addr: s.addr, PoolSize: 32})
	}
	var clients []*redis.Client
	defer func() {
		for _, c := range clients {
			_ = c.Close()
		}
	}()

	var stops []func()
	for i := range 2 {
		cl := newClient()
		clients = append(clients, cl)
		c, err := NewConsumer(cl, s.queue, func(ctx context.Context, m *Message[int]) (int, error) {
			if n := s.handled.Add(1); n%256 == 0 || n == int64(s.jobs) {
				s.mu.Lock()
				s.progress.Broadcast()
				s.mu.Unlock()
			}
			return m.Payload, nil
		}, &ConsumerOptions{
			Name: fmt.Sprintf("soak-consumer-%d", i), Workers: 4, Prefetch: 512,
			DiscardResults: true, ResultTTL: s.ttl, TrimInterval: 200 * time.Millisecond,
			Logger: testLogger(t),
		})
		require.NoError(t, err)
		stops = append(stops, runConsumer(t, c))
	}

	start := time.Now()
	var next atomic.Int64
	var wg sync.WaitGroup
	for range 2 {
		cl := newClient()
		clients = append(clients, cl)
		p, err := NewProducer[int, int](cl, s.queue, &ProducerOptions{Logger: testLogger(t)})
		require.NoError(t, err)
		var pw sync.WaitGroup
		for range 32 {
			pw.Add(1)
			go func() {
				defer pw.Done()
				for {
					i := next.Add(1) - 1
					if i >= int64(s.jobs) {
						return
					}
					s.mu.Lock()
					for i-s.handled.Load() > s.window {
						s.progress.Wait()
					}
					s.mu.Unlock()
					if err := p.Enqueue(ctx, prefix+strconv.FormatInt(i, 10), int(i)); err != nil {
						t.Errorf("enqueue %d: %v", i, err)
						return
					}
				}
			}()
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			pw.Wait()
			_ = p.Close()
		}()
	}
	wg.Wait()
	eventually(t, 10*time.Minute, func() bool { return s.handled.Load() >= int64(s.jobs) },
		"handled %d of %d jobs", s.handled.Load(), s.jobs)
	elapsed := time.Since(start)
	for _, stop := range stops {
		stop()
	}
	return elapsed
}

// TestSoakMemoryIsFlat pushes many small fire-and-forget jobs through two
// producers and two consumers on a dedicated redis-server and checks the
// guarantee that Redis memory stays bounded: the stream never holds more than
// the backlog, every record key has a TTL and is gone once it passed, and
// used_memory comes back to where it was.
func TestSoakMemoryIsFlat(t *testing.T) {
	jobs := soakJobs()
	srv := redistest.Start(t)
	ctx := context.Background()
	// The measuring client: one connection, open for the whole test, so the
	// client buffers it costs are in both the before and the after figures.
	mc := redis.NewClient(&redis.Options{Addr: srv.Addr(), PoolSize: 1})
	t.Cleanup(func() { _ = mc.Close() })
	const q, ttl = "soak", 2 * time.Second
	admin, err := NewAdmin(mc, q, nil)
	require.NoError(t, err)
	stream, _, _, pattern := firstShardKeys(t, admin)

	recordCount := func() int {
		var n int
		iter := mc.Scan(ctx, 0, pattern, 1000).Iterator()
		for iter.Next(ctx) {
			n++
		}
		require.NoError(t, iter.Err())
		return n
	}
	// measure returns used_memory without two bounded server-side records
	// that are not the queue's and would dwarf a difference on a server this
	// small: the per-command latency histograms of Redis 7's latency
	// tracking (about 20 KB for each command name ever run, over 500 KB here,
	// freed by CONFIG RESETSTAT) and the slow log (up to 128 entries holding
	// copies of the arguments of slow calls, such as big completion scripts).
	measure := func() int64 {
		require.NoError(t, mc.ConfigResetStat(ctx).Err())
		require.NoError(t, mc.Do(ctx, "SLOWLOG", "RESET").Err())
		return usedMemory(t, mc)
	}
	// settle waits until every record has expired and been reclaimed (DBSIZE
	// counts keys that expired but are not reclaimed yet).
	settle := func(what string) {
		eventually(t, ttl+time.Minute, func() bool { return recordCount() == 0 }, "%s: record keys outlived their TTL", what)
		eventually(t, time.Minute, func() bool {
			live, err := mc.Keys(ctx, "*").Result() // a handful of keys by now
			require.NoError(t, err)
			return mc.DBSize(ctx).Val() == int64(len(live))
		}, "%s: expired records not reclaimed: DBSIZE %d, keys %q", what, mc.DBSize(ctx).Val(), mc.Keys(ctx, "*").Val())
	}

	cold := measure()
	s := &soakRun{t: t, addr: srv.Addr(), queue: q, jobs: jobs, window: 20_000, ttl: ttl}

	// Warm-up: a small run creates the stream, its group and consumers, and
	// loads the Lua scripts, which stay for the server's lifetime. The baseline
	// is taken after it, once its records expired.
	s.jobs = 2_000
	s.run("warm-")
	settle("warm-up")
	before := measure()
	t.Logf("used_memory: cold %d B, after warm-up %d B (%s)", cold, before, memoryBreakdown(t, mc))

	// The run, sampled every 20ms.
	s.jobs = jobs
	var peakLen, peakNodes, peakMem atomic.Int64
	var badTTL atomic.Int64
	sampleCtx, stopSampling := context.WithCancel(ctx)
	sampled := make(chan struct{})
	go func() {
		defer close(sampled)
		sc := redis.NewClient(&redis.Options{Addr: srv.Addr(), PoolSize: 2})
		defer sc.Close()
		var cursor uint64
		for tick := 0; sampleCtx.Err() == nil; tick++ {
			if n, err := sc.XLen(sampleCtx, stream).Result(); err == nil {
				peakLen.Store(max(peakLen.Load(), n))
			}
			if tick%10 == 0 {
				if n, err := readUsedMemory(sc); err == nil {
					peakMem.Store(max(peakMem.Load(), n))
				}
				if info, err := sc.XInfoStream(sampleCtx, stream).Result(); err == nil {
					peakNodes.Store(max(peakNodes.Load(), info.RadixTreeKeys))
				}
				// A page of record keys: each must have a TTL within its bound.
				keys, next, err := sc.Scan(sampleCtx, cursor, pattern, 200).Result()
				if err == nil {
					cursor = next
					for _, k := range keys {
						pttl, err := sc.PTTL(sampleCtx, k).Result()
						if err == nil && pttl == -1 {
							badTTL.Add(1)
							t.Errorf("record %s has no TTL during the run", k)
						}
					}
				}
			}
			time.Sleep(20 * time.Millisecond)
		}
	}()
	elapsed := s.run("job-")
	// Drained: the stream is empty and nothing is pending.
	eventually(t, time.Minute, func() bool {
		st, err := admin.Stats(ctx)
		require.NoError(t, err)
		return st.Length == 0 && len(st.Groups) == 1 && st.Groups[0].Pending == 0
	}, "stream not drained")
	stopSampling()
	<-sampled
	info, err := mc.XInfoStream(ctx, stream).Result()
	require.NoError(t, err)
	drained := measure()
	settle("run")
	// The key space's hash tables, sized for the records that were live at
	// once, shrink in the server's cron, a step at a time: wait for memory to
	// come within 5% (what it reaches once they have shrunk), for up to 30s,
	// then require the 10% the guarantee allows.
	after := measure()
	for deadline := time.Now().Add(30 * time.Second); after > before+before/20 && time.Now().Before(deadline); {
		time.Sleep(100 * time.Millisecond)
		after = measure()
	}
	limit := before + before/10

	t.Logf("jobs %d in %v: %.0f jobs/s (2 producers x 32 goroutines, 2 consumers x 4 workers)",
		jobs, elapsed.Round(time.Millisecond), float64(jobs)/elapsed.Seconds())
	t.Logf("stream: peak length %d (producer window %d), peak macro-nodes %d, entries-added %d, final length %d, final macro-nodes %d",
		peakLen.Load(), s.window, peakNodes.Load(), info.EntriesAdded, info.Length, info.RadixTreeKeys)
	t.Logf("used_memory: before %d B, peak %d B, drained (records still live) %d B, after TTLs %d B (%+.1f%%): %s",
		before, peakMem.Load(), drained, after, 100*float64(after-before)/float64(before), memoryBreakdown(t, mc))

	require.LessOrEqual(t, after, limit, "used_memory did not come back within 10%%: before %d B, after %d B", before, after)
	require.Zero(t, badTTL.Load(), "records without a TTL")
	// The stream holds at most the backlog the producers may build, plus what
	// is in flight: Enqueue calls past the window check and entries handled
	// but whose completion is on its way.
	require.LessOrEqual(t, peakLen.Load(), s.window+5_000, "the stream grew beyond the backlog")
	require.EqualValues(t, 0, info.Length)
	require.EqualValues(t, 0, info.RadixTreeKeys, "macro-nodes of deleted entries were not freed")
	require.EqualValues(t, 2_000+jobs, info.EntriesAdded)
	require.Zero(t, recordCount())
}
