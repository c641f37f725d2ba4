package streamq

// The per-key limit across processes, with and without SIGKILLs: consumers
// run as child processes; their handlers count, in Redis, the handlers of
// each key running at once.

import (
	"context"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"os"
	"os/signal"
	"strconv"
	"syscall"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/streamq/streamq/internal/crashtest"
)

// fairCrashConfig is what a child consumer of the key-limit tests does.
type fairCrashConfig struct {
	Addr     string
	Queue    string
	Name     string
	Workers  int
	MinIdle  time.Duration
	KeyLimit int
}

// Bookkeeping of the key-limit tests, in the queue's hash slot.
func fairCurKey(q string) string   { return "fairtest:{" + q + "}:cur" } // hash key -> handlers running now
func fairMaxKey(q string) string   { return "fairtest:{" + q + "}:max" } // hash key -> most at once
func fairInKey(q string) string    { return "fairtest:{" + q + "}:in:" } // + consumer: hash id -> key, handlers running
func fairStartKey(q string) string { return "fairtest:{" + q + "}:st:" } // + id: list of the Deliveries seen

// fairEnter counts a handler in: its key's count now and at most, and the
// handler in its consumer's set (so a test that kills the consumer can
// count its handlers out, as they stopped with the process).
var fairEnter = redis.NewScript(`
local n = redis.call("HINCRBY", KEYS[1], ARGV[1], 1)
if n > (tonumber(redis.call("HGET", KEYS[2], ARGV[1])) or 0) then
  redis.call("HSET", KEYS[2], ARGV[1], n)
end
redis.call("HSET", KEYS[3], ARGV[2], ARGV[1])
redis.call("RPUSH", KEYS[4], ARGV[3])
return n`)

// fairLeave counts a handler out; fairKilled counts out every handler of a
// killed consumer.
var fairLeave = redis.NewScript(`
if redis.call("HDEL", KEYS[2], ARGV[2]) == 1 then
  redis.call("HINCRBY", KEYS[1], ARGV[1], -1)
end
return 1`)

var fairKilled = redis.NewScript(`
local in_ = redis.call("HGETALL", KEYS[2])
for i = 1, #in_, 2 do
  redis.call("HINCRBY", KEYS[1], in_[i + 1], -1)
end
redis.call("DEL", KEYS[2])
return #in_ / 2`)

// TestFairKeysHelperProcess is the consumer process of the key-limit
// tests. Run by go test it returns at once.
func TestFairKeysHelperProcess(t *testing.T) {
	var cfg fairCrashConfig
	if !crashtest.Config(&cfg) {
		return
	}
	client := redis.NewClient(&redis.Options{Addr: cfg.Addr, PoolSize: 32})
	defer client.Close()
	bg := context.Background()
	q := cfg.Queue
	in := fairInKey(q) + cfg.Name
	handler := func(ctx context.Context, m *Message[string]) (string, error) {
		if err := fairEnter.Run(bg, client, []string{fairCurKey(q), fairMaxKey(q), in, fairStartKey(q) + m.ID},
			m.Key, m.ID, m.Deliveries).Err(); err != nil {
			return "", err
		}
		time.Sleep(time.Duration(1+rand.IntN(4)) * time.Millisecond)
		if err := fairLeave.Run(bg, client, []string{fairCurKey(q), in}, m.Key, m.ID).Err(); err != nil {
			return "", err
		}
		return "r:" + m.Payload, nil
	}
	c, err := NewConsumer(client, q, handler, &ConsumerOptions{
		Name: cfg.Name, Workers: cfg.Workers, MinIdle: cfg.MinIdle, KeyLimit: cfg.KeyLimit,
		ClaimInterval: 100 * time.Millisecond, ReadBlock: 100 * time.Millisecond,
		MaxDeliveries: 100, RetryBackoff: 50 * time.Millisecond, TrimInterval: -1,
		Logger: slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn})),
	})
	if err != nil {
		t.Fatal(err)
	}
	ctx, stop := signal.NotifyContext(bg, syscall.SIGTERM)
	defer stop()
	_ = c.Run(ctx)
}

// TestFairKeysLimitAcrossProcesses: limit 2 per key, three consumer
// processes of 8 workers, 5,000 jobs over 20 keys; the handlers count the
// runs of each key at once in Redis. The most never exceeds 2, every job
// completes with its result, and each job's handler starts saw increasing
// Deliveries (every start counted once; 1 alone without kills). With kills, a consumer is
// SIGKILLed at random moments and replaced by one with a new name, whose
// entries (and their slots) are claimed after MinIdle.
func TestFairKeysLimitAcrossProcesses(t *testing.T) {
	for _, kills := range []int{0, 3} {
		t.Run(fmt.Sprintf("kills=%d", kills), func(t *testing.T) {
			t.Parallel()
			client := realRedis(t)
			ctx := context.Background()
			q := queueName(t)
			const jobs, nkeys, limit = 5000, 20, 2
			// The limit is stored before the jobs come (the consumers store
			// it too when they start).
			a, err := NewAdmin(client, q, nil)
			require.NoError(t, err)
			require.NoError(t, a.SetKeyDefaults(ctx, limit, 0))
			p := newStringProducer(t, client, q)
			ids := make([]string, jobs)
			var prs []*Promise[string]
			for start := 0; start < jobs; start += 500 {
				batch := make([]Job[string], 0, 500)
				for i := start; i < start+500; i++ {
					ids[i] = fmt.Sprintf("j%05d", i)
					batch = append(batch, Job[string]{ID: ids[i], Request: "p-" + ids[i], Options: []ProduceOption{Key(fmt.Sprint("k", i%nkeys))}})
				}
				got, err := p.ProduceBatch(ctx, batch)
				require.NoError(t, err)
				prs = append(prs, got...)
			}
			addr := sharedAddr(t)
			seq := 0
			start := func() (*crashtest.Proc, string) {
				seq++
				name := fmt.Sprintf("c%d", seq)
				return crashtest.Start(t, "TestFairKeysHelperProcess", fairCrashConfig{
					Addr: addr, Queue: q, Name: name, Workers: 8, MinIdle: time.Second, KeyLimit: limit}), name
			}
			procs := make([]*crashtest.Proc, 3)
			names := make([]string, 3)
			for i := range procs {
				procs[i], names[i] = start()
			}
			for k := range kills {
				// Kill at a random moment while work remains.
				time.Sleep(time.Duration(150+rand.IntN(300)) * time.Millisecond)
				i := rand.IntN(len(procs))
				procs[i].Kill()
				require.True(t, procs[i].KilledBy(syscall.SIGKILL))
				out, err := fairKilled.Run(ctx, client, []string{fairCurKey(q), fairInKey(q) + names[i]}).Int()
				require.NoError(t, err)
				t.Logf("kill %d: consumer %s killed with %d handlers running", k+1, names[i], out)
				procs[i], names[i] = start()
			}
			wctx, cancel := context.WithTimeout(ctx, 60*time.Second)
			defer cancel()
			for i, pr := range prs {
				got, err := pr.Wait(wctx)
				require.NoError(t, err, "id %s", ids[i])
				require.Equal(t, "r:p-"+ids[i], got)
			}
			most, err := client.HGetAll(ctx, fairMaxKey(q)).Result()
			require.NoError(t, err)
			require.Len(t, most, nkeys)
			worst := 0
			for key, v := range most {
				n, _ := strconv.Atoi(v)
				worst = max(worst, n)
				require.LessOrEqual(t, n, limit, "key %s ran %d handlers at once", key, n)
			}
			reruns := 0
			for _, id := range ids {
				seen, err := client.LRange(ctx, fairStartKey(q)+id, 0, -1).Result()
				require.NoError(t, err)
				require.NotEmpty(t, seen, "id %s never started", id)
				// Each start is counted once: the runs see distinct counts,
				// in order (a start killed before its handler recorded
				// itself counts too, so a count may be missing here).
				last := 0
				for _, d := range seen {
					n, _ := strconv.Atoi(d)
					require.Greater(t, n, last, "id %s: its starts saw Deliveries %v", id, seen)
					last = n
				}
				if kills == 0 {
					require.Equal(t, []string{"1"}, seen, "id %s", id)
				}
				reruns += len(seen) - 1
			}
			if kills == 0 {
				require.Zero(t, reruns, "no job runs twice without a crash")
			}
			t.Logf("%d jobs over %d keys, limit %d, 3 processes x 8 workers, %d kills: at most %d handlers of a key at once, %d reruns after kills",
				jobs, nkeys, limit, kills, worst, reruns)
			eventually(t, 10*time.Second, func() bool { return len(fairKeysLeft(t, client, q)) == 1 }, "keyed state left: %v", fairKeysLeft(t, client, q))
			requireDrained(t, client, q)
		})
	}
}
