package streamq

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/streamq/streamq/internal/redistest"
)

// shared is one real redis-server for the package's tests; each test uses its
// own queue names, so tests run in parallel against it.
var shared struct {
	once sync.Once
	proc *redistest.Process
	err  error
}

func TestMain(m *testing.M) {
	// go-redis logs to the running tests (t.Log), not to stderr.
	redistest.LogToTests()
	code := m.Run()
	if shared.proc != nil {
		_ = shared.proc.Stop()
	}
	if code != 0 {
		redistest.UncapturedLog(os.Stderr)
	}
	if code == 0 {
		if err := goleak.Find(goleak.IgnoreCurrent()); err != nil {
			fmt.Fprintln(os.Stderr, "goroutine leak:", err)
			code = 1
		}
	}
	os.Exit(code)
}

// realRedis returns a client of the shared real redis-server. Without
// redis-server the test is skipped, except under CI where it fails.
func realRedis(t testing.TB) *redis.Client {
	t.Helper()
	shared.once.Do(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		defer cancel()
		shared.proc, shared.err = redistest.StartProcess(ctx)
	})
	if shared.err != nil {
		if errors.Is(shared.err, exec.ErrNotFound) && os.Getenv("CI") == "" {
			t.Skipf("real Redis tests need redis-server (apt-get install redis-server, or make test): %v", shared.err)
		}
		t.Fatalf("cannot start redis-server: %v", shared.err)
	}
	redistest.CaptureLog(t, shared.proc.Addr())
	c := redis.NewClient(&redis.Options{Addr: shared.proc.Addr(), PoolSize: 64})
	t.Cleanup(func() { _ = c.Close() })
	return c
}

// privateRedis starts a redis-server of the test's (or benchmark's) own, so
// that INFO commandstats counts only what it does and no key left by
// another weighs on it, and returns a client of it; both end with the test.
// Without redis-server the test is skipped, except under CI.
func privateRedis(t testing.TB) *redis.Client {
	t.Helper()
	realRedis(t) // skips without redis-server
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	proc, err := redistest.StartProcess(ctx)
	require.NoError(t, err)
	t.Cleanup(func() { _ = proc.Stop() })
	client := redis.NewClient(&redis.Options{Addr: proc.Addr()})
	t.Cleanup(func() { _ = client.Close() })
	return client
}

// miniRedis returns a client of a fresh in-process miniredis.
func miniRedis(t testing.TB) (*redis.Client, *miniredis.Miniredis) {
	t.Helper()
	m := miniredis.RunT(t)
	redistest.CaptureLog(t, m.Addr())
	c := redis.NewClient(&redis.Options{Addr: m.Addr()})
	t.Cleanup(func() { _ = c.Close() })
	return c, m
}

// backends runs fn against miniredis and against a real redis-server.
func backends(t *testing.T, fn func(t *testing.T, client *redis.Client)) {
	t.Run("miniredis", func(t *testing.T) {
		t.Parallel()
		c, _ := miniRedis(t)
		fn(t, c)
	})
	t.Run("redis", func(t *testing.T) {
		t.Parallel()
		fn(t, realRedis(t))
	})
}

var queueSeq atomic.Int64

// queueName returns a queue name unique to this test run.
func queueName(t testing.TB) string {
	return fmt.Sprintf("t%d-%d", time.Now().UnixNano()%1e9, queueSeq.Add(1))
}

// runConsumer runs c until the test ends and checks that Run returned.
func runConsumer[Req, Resp any](t testing.TB, c *Consumer[Req, Resp]) (stop func()) {
	t.Helper()
	return runUntilStopped(t, "consumer", c.Run, c.waitBackground)
}

// runUntilStopped runs run (a consumer's Run) until the test ends or stop is
// called, checks that it returned nil within 30 s, then waits for
// background: Run may return while its start-up calls still run (it does
// not wait for a stalled call); they log to t.
func runUntilStopped(t testing.TB, what string, run func(context.Context) error, background func()) (stop func()) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- run(ctx) }()
	var once sync.Once
	stop = func() {
		once.Do(func() {
			cancel()
			select {
			case err := <-done:
				require.NoError(t, err)
			case <-time.After(30 * time.Second):
				t.Errorf("%s did not stop within 30s", what)
			}
			bg := make(chan struct{})
			go func() { background(); close(bg) }()
			select {
			case <-bg:
			case <-time.After(30 * time.Second):
				t.Errorf("the background calls of %s did not end within 30s", what)
			}
		})
	}
	t.Cleanup(stop)
	return stop
}

// eventually waits for cond, polling; it is for states held in Redis, which
// offer no signal to wait on.
func eventually(t testing.TB, timeout time.Duration, cond func() bool, msg string, args ...any) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %v: "+msg, append([]any{timeout}, args...)...)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// testLogger returns a logger that writes to the test log under -v.
func testLogger(t testing.TB) *slogLogger { return newTestLogger(t) }

// firstShardKeys returns the names of a queue's first (for an unsharded queue,
// only) shard.
func firstShardKeys(t testing.TB, a *Admin) (stream, deadLetter, channel, recordPattern string) {
	t.Helper()
	ks, err := a.Keys(context.Background())
	require.NoError(t, err)
	return ks[0].Stream, ks[0].DeadLetter, ks[0].Channel, ks[0].RecordPattern
}

// sameServer returns a new client of c's server. It copies only the address:
// go-redis writes to a client's Options as connections are set up, so
// sharing them between clients is a data race.
func sameServer(c *redis.Client) *redis.Client {
	return redis.NewClient(&redis.Options{Addr: c.Options().Addr, PoolSize: c.Options().PoolSize})
}
