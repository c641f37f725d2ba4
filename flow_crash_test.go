package streamq

// The flow crash test: consumer processes of a parent queue and a second
// child queue are SIGKILLed and restarted at random while 1,000 flows of ten
// children each run. Every id is accounted for afterwards.

import (
	"context"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"os"
	"os/signal"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/streamq/streamq/internal/crashtest"
)

// flowCrashConfig is what a flow consumer process is told.
type flowCrashConfig struct {
	Addr           string
	QueueA, QueueB string
	Name           string
}

// Bookkeeping keys of the flow crash test (a single redis-server: no slot
// rules for them).
func flowChildDoneKey(q string) string   { return "crashtest:{" + q + "}:childdone" }   // child id -> handler runs
func flowParentRunsKey(q string) string  { return "crashtest:{" + q + "}:parentruns" }  // parent id -> handler runs
func flowParentEntryKey(q string) string { return "crashtest:{" + q + "}:parententry" } // parent id -> its entry ids
func flowEarlyKey(q string) string       { return "crashtest:{" + q + "}:early" }       // parents that ran too early

// TestFlowCrashHelperProcess runs one consumer of each queue until killed.
func TestFlowCrashHelperProcess(t *testing.T) {
	var cfg flowCrashConfig
	if !crashtest.Config(&cfg) {
		return
	}
	client := redis.NewClient(&redis.Options{Addr: cfg.Addr, PoolSize: 32})
	defer client.Close()
	bg := context.Background()
	child := func(ctx context.Context, m *Message[string]) (string, error) {
		if err := client.HIncrBy(bg, flowChildDoneKey(cfg.QueueA), m.ID, 1).Err(); err != nil {
			return "", err
		}
		return "c:" + m.Payload, nil
	}
	handler := func(ctx context.Context, m *Message[string]) (string, error) {
		if !strings.HasPrefix(m.ID, "parent-") {
			return child(ctx, m)
		}
		kids, err := m.Children(ctx)
		if err != nil {
			return "", err
		}
		ids := make([]string, len(kids))
		for i, k := range kids {
			ids[i] = k.ID
		}
		// Every child's handler finished before the parent runs.
		done, err := client.HMGet(bg, flowChildDoneKey(cfg.QueueA), ids...).Result()
		if err != nil {
			return "", err
		}
		var out []string
		for i, k := range kids {
			if done[i] == nil || k.Err != nil {
				client.SAdd(bg, flowEarlyKey(cfg.QueueA), m.ID+"/"+k.ID)
			}
			r, _ := ChildResultOf(NewQueue[string, string](cfg.QueueB), k)
			out = append(out, r)
		}
		pipe := client.Pipeline()
		pipe.HIncrBy(bg, flowParentRunsKey(cfg.QueueA), m.ID, 1)
		pipe.SAdd(bg, flowParentEntryKey(cfg.QueueA)+":"+m.ID, m.EntryID)
		if _, err := pipe.Exec(bg); err != nil {
			return "", err
		}
		return strings.Join(out, ","), nil
	}
	opts := func() *ConsumerOptions {
		return &ConsumerOptions{
			Name:          cfg.Name,
			Workers:       8,
			MinIdle:       time.Second,
			ClaimInterval: 100 * time.Millisecond,
			ReadBlock:     100 * time.Millisecond,
			MaxDeliveries: 100,
			TrimInterval:  -1,
			Logger:        slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn})),
		}
	}
	ca, err := NewConsumer(client, cfg.QueueA, handler, opts())
	if err != nil {
		t.Fatal(err)
	}
	cb, err := NewConsumer(client, cfg.QueueB, child, opts())
	if err != nil {
		t.Fatal(err)
	}
	ctx, stop := signal.NotifyContext(bg, syscall.SIGTERM)
	defer stop()
	var wg sync.WaitGroup
	wg.Go(func() { _ = ca.Run(ctx) })
	wg.Go(func() { _ = cb.Run(ctx) })
	wg.Wait()
}

func TestFlowCrashEveryParentAfterItsChildren(t *testing.T) {
	if testing.Short() {
		t.Skip("crash test")
	}
	const parents, perParent = 1000, 10
	client := realRedis(t)
	addr := sharedAddr(t)
	qa, qb := queueName(t), queueName(t)
	A, B := NewQueue[string, string](qa), NewQueue[string, string](qb)
	ctx := context.Background()

	start := func(i int) *crashtest.Proc {
		return crashtest.Start(t, "TestFlowCrashHelperProcess", flowCrashConfig{Addr: addr, QueueA: qa, QueueB: qb, Name: fmt.Sprintf("c%d", i)})
	}
	procs := []*crashtest.Proc{start(0), start(1)}

	p, err := A.NewProducer(client, &ProducerOptions{Logger: testLogger(t), BackstopInterval: time.Second})
	require.NoError(t, err)
	defer p.Close()
	began := time.Now()
	prs := make([]*Promise[string], parents)
	var wg sync.WaitGroup
	sem := make(chan struct{}, 16)
	for i := range parents {
		sem <- struct{}{}
		wg.Go(func() {
			defer func() { <-sem }()
			kids := make([]Child, perParent)
			for j := range kids {
				q := A
				if j%2 == 1 {
					q = B
				}
				id := fmt.Sprintf("child-%04d-%02d", i, j)
				kids[j] = ChildOf(q, id, id)
			}
			pr, err := p.ProduceFlow(ctx, fmt.Sprintf("parent-%04d", i), "p", kids, nil)
			if err != nil {
				t.Errorf("flow %d: %v", i, err)
				return
			}
			prs[i] = pr
		})
	}

	// Kill and restart consumers at random while the flows run.
	stopKilling := make(chan struct{})
	killed := 0
	killerDone := make(chan struct{})
	go func() {
		defer close(killerDone)
		for {
			select {
			case <-stopKilling:
				return
			case <-time.After(time.Duration(100+rand.IntN(200)) * time.Millisecond):
			}
			i := rand.IntN(len(procs))
			procs[i].Kill()
			killed++
			procs[i] = start(len(procs) + killed)
		}
	}()
	wg.Wait()
	results := make([]string, parents)
	for i, pr := range prs {
		require.NotNil(t, pr, "flow %d was not produced", i)
		wctx, cancel := context.WithTimeout(ctx, 60*time.Second)
		results[i], err = pr.Wait(wctx)
		cancel()
		require.NoError(t, err, "parent %d", i)
	}
	close(stopKilling)
	<-killerDone
	t.Logf("%d flows of %d children in %v with %d consumer kills", parents, perParent, time.Since(began).Round(time.Millisecond), killed)
	require.Positive(t, killed)

	// Every child ran (at least once) and every parent saw its ten outcomes.
	childRuns := client.HGetAll(ctx, flowChildDoneKey(qa)).Val()
	require.Len(t, childRuns, parents*perParent)
	parentRuns := client.HGetAll(ctx, flowParentRunsKey(qa)).Val()
	require.Len(t, parentRuns, parents)
	reruns := 0
	for _, m := range []map[string]string{childRuns, parentRuns} {
		for _, v := range m {
			if v != "1" {
				reruns++
			}
		}
	}
	t.Logf("%d ids ran more than once (a consumer killed after the handler, before the outcome was recorded)", reruns)
	require.Empty(t, client.SMembers(ctx, flowEarlyKey(qa)).Val(), "parents that ran before a child had its outcome")
	for i := range parents {
		var want []string
		for j := range perParent {
			want = append(want, fmt.Sprintf("c:child-%04d-%02d", i, j))
		}
		require.Equal(t, strings.Join(want, ","), results[i], "parent %d", i)
		// Released exactly once: every run of the parent had the same entry.
		entries := client.SMembers(ctx, fmt.Sprintf("%s:parent-%04d", flowParentEntryKey(qa), i)).Val()
		require.Len(t, entries, 1, "parent %d was appended more than once: %v", i, entries)
	}
	for _, q := range []string{qa, qb} {
		requireDrained(t, client, q)
	}
}
