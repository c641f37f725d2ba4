package streamq

import (
	"context"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/streamq/streamq/internal/redistest"
	"github.com/streamq/streamq/internal/scripts"
)

// ownRedis starts a redis-server for one test (its statistics and script
// cache are the test's own); it skips without redis-server.
func ownRedis(t *testing.T) *redistest.Process {
	t.Helper()
	realRedis(t) // skips without redis-server
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	proc, err := redistest.StartProcess(ctx)
	require.NoError(t, err)
	t.Cleanup(func() { _ = proc.Stop() })
	return proc
}

// commandCalls returns INFO commandstats as command -> calls (the
// commands scripts run are counted too).
func commandCalls(t *testing.T, client *redis.Client) map[string]int64 {
	t.Helper()
	info, err := client.Info(context.Background(), "commandstats").Result()
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

// TestCancelUnusedSendsNoCommand: a plain workload, never cancelled, makes
// Redis run the same commands as before cancellation existed. The consumer's
// part of cancellation is a notice on a channel it already listens to and
// a mark per slot, checked under a lock the worker already takes: no
// command. This checks the Redis side on a server of its own: cancel.lua
// never ran (it is not in the script cache), and it logs the commands of
// 200 sequential jobs (one producer, one consumer with its periodic work
// pushed out of the run), which can be compared with an older build.
func TestCancelUnusedSendsNoCommand(t *testing.T) {
	t.Parallel()
	proc := ownRedis(t)
	client := redis.NewClient(&redis.Options{Addr: proc.Addr()})
	defer client.Close()
	ctx := context.Background()
	q := queueName(t)
	p := newStringProducer(t, client, q)
	h := newCountingHandler()
	c, err := NewConsumer(client, q, h.handle, &ConsumerOptions{ReadBlock: time.Second, MinIdle: 10 * time.Minute,
		ClaimInterval: time.Minute, TrimInterval: -1, Logger: testLogger(t)})
	require.NoError(t, err)
	stop := runConsumer(t, c)
	requireResults(t, client, q, []string{"warm"}, []*Promise[string]{mustProduce(t, p, "warm", "p-warm")}, time.Now().Add(10*time.Second))
	before := commandCalls(t, client)
	ids := seqIDs("plain", 200)
	for _, id := range ids {
		requireResults(t, client, q, []string{id}, []*Promise[string]{mustProduce(t, p, id, "p-"+id)}, time.Now().Add(10*time.Second))
	}
	after := commandCalls(t, client)
	stop()
	h.requireOnceEach(t, append(ids, "warm"))
	var names []string
	for k := range after {
		if k != "info" && k != "get" && after[k] != before[k] {
			names = append(names, k)
		}
	}
	slices.Sort(names)
	var b strings.Builder
	for _, k := range names {
		b.WriteString(k + "=" + strconv.FormatInt(after[k]-before[k], 10) + " ")
	}
	t.Logf("commands of 200 sequential jobs: %s", b.String())
	exists, err := client.ScriptExists(ctx, scripts.Cancel.Hash()).Result()
	require.NoError(t, err)
	require.Equal(t, []bool{false}, exists, "cancel.lua never ran")
}
