// Package streamqtest helps test code that produces and consumes streamq
// requests.
//
// [NewClient] gives a test a Redis of its own: a real redis-server on a free
// loopback port when one is installed, miniredis otherwise, both stopped when
// the test ends. streamq behaves the same on both for what it promises to
// callers: results, errors, delivery counts ([streamq.Message].Deliveries,
// [streamq.DeadLetter].Deliveries), retries, dead letters, deduplication and
// delayed jobs, because it counts handler starts itself rather than trusting
// the stream's delivery counter. Recovery from crashed consumers depends on
// stream idle times, which miniredis moves only with SetTime: test that on a
// real server ([NewRedisServer]).
//
// [Drain] runs a consumer until its queue has nothing left to do;
// [RequireProduced], [RequireNotProduced] and [RequireDeadLettered] assert
// what happened to a request id. The helpers take a [TB] (a *testing.T or
// *testing.B) and stop the test with Fatalf when an assertion fails; a nil
// context panics, as streamq's methods do.
//
// The package is part of the streamq module (no extra dependency):
//
//	client := streamqtest.NewClient(t)
//	c, _ := streamq.NewConsumer(client, "orders", handleOrder, nil)
//	p, _ := streamq.NewProducer[Order, Receipt](client, "orders", nil)
//	promise, _ := p.Produce(ctx, "order-1", Order{Item: "tea", Qty: 2})
//	streamqtest.Drain(ctx, t, client, "orders", c, nil)
//	receipt, err := promise.Wait(ctx)
//
// Its cost was not measured as such: NewClient starts one redis-server per
// test when it uses a real server, and Drain reads Admin.Stats every
// PollInterval (10ms). The package's README.md says more.
package streamqtest

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"sync"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"

	"github.com/streamq/streamq/internal/redistest"
)

// TB is the part of testing.TB the helpers use: *testing.T and *testing.B
// implement it.
type TB interface {
	Helper()
	Cleanup(func())
	Logf(format string, args ...any)
	Fatalf(format string, args ...any)
}

// Backend names the Redis a client of NewClient talks to.
type Backend string

// The backends NewClient chooses from.
const (
	// RedisServer is a redis-server process started for the test.
	RedisServer Backend = "redis-server"
	// Miniredis is an in-process miniredis.
	Miniredis Backend = "miniredis"
)

// BackendEnv is the environment variable that forces NewClient's choice:
// "redis-server" (fail when it is not installed) or "miniredis". Unset or
// empty: redis-server when it is on PATH, miniredis otherwise.
const BackendEnv = "STREAMQTEST_BACKEND"

// NewClient returns a client of a Redis started for this test: a real
// redis-server on a free loopback port (its files in a temporary directory,
// persisting nothing) when redis-server is on PATH (or when
// STREAMQ_REDIS_SERVER names another server binary, see [NewRedisServer]),
// an in-process miniredis otherwise. BackendEnv overrides the choice. The server and the client are
// closed when the test ends. Use [ClientBackend] to learn which one it is.
func NewClient(t TB) *redis.Client {
	t.Helper()
	switch Backend(os.Getenv(BackendEnv)) {
	case RedisServer:
		return NewRedisServer(t)
	case Miniredis:
		c, _ := NewMiniredis(t)
		return c
	case "":
		// A STREAMQ_REDIS_SERVER that names nothing fails in NewRedisServer:
		// the developer asked for that server.
		if _, err := redistest.ServerBinary(); !errors.Is(err, exec.ErrNotFound) {
			return NewRedisServer(t)
		}
		c, _ := NewMiniredis(t)
		return c
	default:
		t.Fatalf("streamqtest: %s=%q: want %q or %q", BackendEnv, os.Getenv(BackendEnv), RedisServer, Miniredis)
		return nil
	}
}

// backends records which backend each client's address belongs to.
var (
	backendsMu sync.Mutex
	backends   = map[string]Backend{}
)

func remember(addr string, b Backend) {
	backendsMu.Lock()
	defer backendsMu.Unlock()
	backends[addr] = b
}

// ClientBackend tells which backend a client returned by NewClient,
// NewRedisServer or NewMiniredis talks to ("" for any other client).
func ClientBackend(c *redis.Client) Backend {
	backendsMu.Lock()
	defer backendsMu.Unlock()
	return backends[c.Options().Addr]
}

// NewRedisServer returns a client of a real redis-server started for this
// test on a free loopback port; both are stopped when the test ends. It fails
// the test when redis-server is not installed. The environment variable
// STREAMQ_REDIS_SERVER, when set, names another server binary to start
// instead (a path, or a name on PATH), such as Valkey's valkey-server.
func NewRedisServer(t TB) *redis.Client {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	p, err := redistest.StartProcess(ctx)
	if err != nil {
		if errors.Is(err, exec.ErrNotFound) {
			t.Fatalf("streamqtest: redis-server is not installed (apt-get install redis-server), or use NewMiniredis: %v", err)
		} else {
			t.Fatalf("streamqtest: start redis-server: %v", err)
		}
		return nil
	}
	t.Cleanup(func() { _ = p.Stop() })
	c := redis.NewClient(&redis.Options{Addr: p.Addr()})
	t.Cleanup(func() { _ = c.Close() })
	remember(p.Addr(), RedisServer)
	return c
}

// NewMiniredis returns a client of an in-process miniredis started for this
// test, and the miniredis itself (to move its clock with SetTime, for
// example); both are closed when the test ends.
func NewMiniredis(t TB) (*redis.Client, *miniredis.Miniredis) {
	t.Helper()
	m := miniredis.NewMiniRedis()
	if err := m.Start(); err != nil {
		t.Fatalf("streamqtest: start miniredis: %v", err)
		return nil, nil
	}
	t.Cleanup(m.Close)
	c := redis.NewClient(&redis.Options{Addr: m.Addr()})
	t.Cleanup(func() { _ = c.Close() })
	remember(m.Addr(), Miniredis)
	return c, m
}

// mustContext panics when ctx is nil, as streamq's own methods do: a nil
// Context is a programming error. The check comes first, before the helper
// starts anything.
func mustContext(ctx context.Context, fn string) {
	if ctx == nil {
		panic("streamqtest: nil Context passed to " + fn + "; use context.Background()")
	}
}

// fatalf reports a failed assertion with the package's prefix.
func fatalf(t TB, format string, args ...any) {
	t.Helper()
	t.Fatalf("streamqtest: "+format, args...)
}

// quote shortens long values in failure messages.
func quote(b []byte) string {
	s := string(b)
	if len(s) > 200 {
		s = s[:200] + "..."
	}
	return fmt.Sprintf("%q", s)
}
