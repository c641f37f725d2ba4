package streamq

import (
	"bytes"
	"context"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/streamq/streamq/internal/redistest"
)

// replyError is an error reply from the server, as go-redis reports it.
type replyError string

func (e replyError) Error() string { return string(e) }
func (replyError) RedisError()     {}

// oldServer is a go-redis hook for a server that does not know HELLO and
// reports version in INFO server ("" passes INFO on).
type oldServer struct{ version string }

func (oldServer) DialHook(next redis.DialHook) redis.DialHook { return next }
func (o oldServer) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if c, ok := cmd.(*redis.Cmd); ok && cmd.Name() == "hello" {
			c.SetErr(replyError("ERR unknown command 'HELLO'"))
			return c.Err()
		}
		if c, ok := cmd.(*redis.StringCmd); ok && cmd.Name() == "info" && o.version != "" {
			c.SetVal("# Server\r\nredis_version:" + o.version + "\r\nredis_mode:standalone\r\n")
			return nil
		}
		return next(ctx, cmd)
	}
}
func (oldServer) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}

// TestServerVersionWithoutHello: where HELLO is unknown (Redis before 6.0,
// some proxies), the version comes from INFO server.
func TestServerVersionWithoutHello(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	for _, tc := range []struct{ version, found string }{{"", ""}, {"5.0.7", "5.0.7"}} {
		client := sameServer(realRedis(t))
		t.Cleanup(func() { _ = client.Close() })
		client.AddHook(oldServer{tc.version})
		admin, err := NewAdmin(client, queueName(t), nil)
		require.NoError(t, err)
		_, err = admin.Stats(ctx)
		if tc.found == "" {
			require.ErrorIs(t, err, ErrNotFound, "the real server's INFO says 7.x: the check passed, the queue is unknown")
			continue
		}
		require.ErrorIs(t, err, ErrUnsupportedServer)
		require.Contains(t, err.Error(), tc.found)
	}
}

// fakeVersion is a go-redis hook that answers streamq's HELLO (sent with Do,
// so a *redis.Cmd; the connection's own HELLO is another type) with another
// server version.
type fakeVersion struct{ version string }

func (fakeVersion) DialHook(next redis.DialHook) redis.DialHook { return next }
func (f fakeVersion) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if c, ok := cmd.(*redis.Cmd); ok && cmd.Name() == "hello" {
			c.SetVal(map[any]any{"server": "redis", "version": f.version, "proto": int64(3)})
			return nil
		}
		return next(ctx, cmd)
	}
}
func (fakeVersion) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}

// TestServerVersionCheck: on a server older than 7.0 every first use fails
// with ErrUnsupportedServer saying what was found, and Consumer.Run returns
// it instead of retrying forever.
func TestServerVersionCheck(t *testing.T) {
	t.Parallel()
	real := realRedis(t)
	client := sameServer(real)
	t.Cleanup(func() { _ = client.Close() })
	client.AddHook(fakeVersion{"6.2.14"})
	ctx := context.Background()
	q := queueName(t)
	check := func(err error) {
		t.Helper()
		require.ErrorIs(t, err, ErrUnsupportedServer)
		require.Contains(t, err.Error(), "6.2.14")
		require.Contains(t, err.Error(), "7.0")
	}

	p, err := NewProducer[string, string](client, q, &ProducerOptions{Logger: testLogger(t)})
	require.NoError(t, err)
	defer p.Close()
	_, err = p.Produce(ctx, "a", "x")
	check(err)
	check(p.Enqueue(ctx, "a", "x"))
	c, err := NewConsumer(client, q, func(context.Context, *Message[string]) (string, error) { return "", nil },
		&ConsumerOptions{ReadBlock: 50 * time.Millisecond, Logger: testLogger(t)})
	require.NoError(t, err)
	runCtx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	check(c.Run(runCtx))
	require.NoError(t, runCtx.Err(), "Run returned the error, not the end of its context")
	admin, err := NewAdmin(client, q, nil)
	require.NoError(t, err)
	_, err = admin.Stats(ctx)
	check(err)
	require.Zero(t, real.Exists(ctx, "streamq:{"+q+"}:meta", "streamq:{"+q+"}:stream").Val(), "nothing written")

	// The real servers pass.
	backends(t, func(t *testing.T, client *redis.Client) {
		q := queueName(t)
		admin, err := NewAdmin(client, q, nil)
		require.NoError(t, err)
		_, err = admin.Stats(ctx)
		require.ErrorIs(t, err, ErrNotFound, "the server check passed; the queue does not exist yet")
		p := newStringProducer(t, client, q)
		require.NoError(t, p.Enqueue(ctx, "a", "x"))
	})
}

// recordingHandler keeps the log records it receives.
type recordingHandler struct {
	mu      sync.Mutex
	records []string
}

func (h *recordingHandler) Enabled(context.Context, slog.Level) bool { return true }
func (h *recordingHandler) Handle(_ context.Context, r slog.Record) error {
	var b bytes.Buffer
	b.WriteString(r.Level.String() + " " + r.Message)
	r.Attrs(func(a slog.Attr) bool { b.WriteString(" " + a.String()); return true })
	h.mu.Lock()
	h.records = append(h.records, b.String())
	h.mu.Unlock()
	return nil
}
func (h *recordingHandler) WithAttrs([]slog.Attr) slog.Handler { return h }
func (h *recordingHandler) WithGroup(string) slog.Handler      { return h }

func (h *recordingHandler) matching(prefix, substr string) []string {
	h.mu.Lock()
	defer h.mu.Unlock()
	var out []string
	for _, r := range h.records {
		if strings.HasPrefix(r, prefix) && strings.Contains(r, substr) {
			out = append(out, r)
		}
	}
	return out
}

// TestServerWarnsOnUnsafeMaxmemoryPolicy: a policy that can evict streamq's
// keys is logged as a warning at the first use; noeviction is not.
func TestServerWarnsOnUnsafeMaxmemoryPolicy(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	client := srv.Client(t)
	ctx := context.Background()
	for _, tc := range []struct {
		policy string
		warned bool
	}{{"noeviction", false}, {"volatile-lru", true}, {"allkeys-lru", true}} {
		require.NoError(t, client.ConfigSet(ctx, "maxmemory-policy", tc.policy).Err())
		for _, kind := range []string{"producer", "consumer"} {
			h := &recordingHandler{}
			log := slog.New(h)
			q := queueName(t)
			if kind == "producer" {
				p, err := NewProducer[string, string](client, q, &ProducerOptions{Logger: log})
				require.NoError(t, err)
				require.NoError(t, p.Enqueue(ctx, "a", "x"))
				require.NoError(t, p.Enqueue(ctx, "b", "x"))
				require.NoError(t, p.Close())
			} else {
				started := make(chan struct{})
				var once sync.Once
				c, err := NewConsumer(client, q, func(context.Context, *Message[string]) (string, error) {
					once.Do(func() { close(started) })
					return "", nil
				}, &ConsumerOptions{ReadBlock: 50 * time.Millisecond, Logger: log})
				require.NoError(t, err)
				require.NoError(t, client.XAdd(ctx, &redis.XAddArgs{Stream: "streamq:{" + q + "}:stream", Values: []string{"id", "a", "p", `"x"`}}).Err())
				stop := runConsumer(t, c)
				<-started
				stop()
			}
			warnings := h.matching("WARN", "maxmemory-policy")
			if tc.warned {
				require.Len(t, warnings, 1, "%s with %s: one warning: %v", kind, tc.policy, h.records)
				require.Contains(t, warnings[0], tc.policy)
			} else {
				require.Empty(t, warnings, "%s with %s", kind, tc.policy)
			}
		}
	}
}
