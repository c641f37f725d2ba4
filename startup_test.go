package streamq

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"
)

// Tests of how Run starts (issue 17): the readiness signal, FailFast, and
// clear errors for configuration that retrying does not fix.

func echoConsumer(t *testing.T, client redis.UniversalClient, q string, opts *ConsumerOptions) *Consumer[string, string] {
	t.Helper()
	if opts == nil {
		opts = &ConsumerOptions{}
	}
	opts.Logger = testLogger(t)
	if opts.ReadBlock == 0 {
		opts.ReadBlock = 50 * time.Millisecond
	}
	c, err := NewConsumer(client, q, func(ctx context.Context, m *Message[string]) (string, error) {
		return m.Payload, nil
	}, opts)
	require.NoError(t, err)
	return c
}

// runErr runs c until ctx ends (or Run returns) and returns Run's error.
func runErr(t *testing.T, c *Consumer[string, string], d time.Duration) error {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), d)
	defer cancel()
	return c.Run(ctx)
}

func TestStartReadyClosesOnceReading(t *testing.T) {
	backends(t, func(t *testing.T, client *redis.Client) {
		c := echoConsumer(t, client, queueName(t), nil)
		select {
		case <-c.Ready():
			t.Fatal("ready before Run")
		default:
		}
		runConsumer(t, c)
		select {
		case <-c.Ready():
		case <-time.After(10 * time.Second):
			t.Fatal("Ready not closed 10s after Run started")
		}
	})
}

// A consumer whose Redis is unreachable is not ready; with FailFast, Run
// returns the connection error at once instead of retrying until ctx ends.
func TestStartUnreachableRedis(t *testing.T) {
	t.Parallel()
	// A port nothing listens on: a server started and stopped at once.
	m := miniredis.RunT(t)
	addr := m.Addr()
	m.Close()
	client := redis.NewClient(&redis.Options{Addr: addr, MaxRetries: -1, DialTimeout: 200 * time.Millisecond})
	t.Cleanup(func() { _ = client.Close() })

	c := echoConsumer(t, client, queueName(t), nil)
	start := time.Now()
	require.NoError(t, runErr(t, c, 500*time.Millisecond), "without FailFast, Run retries until ctx ends")
	require.GreaterOrEqual(t, time.Since(start), 450*time.Millisecond)
	select {
	case <-c.Ready():
		t.Fatal("ready without Redis")
	default:
	}

	c = echoConsumer(t, client, queueName(t), &ConsumerOptions{FailFast: true})
	start = time.Now()
	err := runErr(t, c, 20*time.Second)
	require.Error(t, err)
	require.Less(t, time.Since(start), 10*time.Second, "FailFast: Run must not wait for ctx")
	require.Contains(t, err.Error(), "FailFast")
	require.Equal(t, 1, strings.Count(err.Error(), "streamq:"), "%v", err)
	select {
	case <-c.Ready():
		t.Fatal("ready without Redis")
	default:
	}
}

// A key of the queue that holds another type ends Run with ErrWrongType,
// retried it would fail forever.
func TestStartWrongTypeKey(t *testing.T) {
	backends(t, func(t *testing.T, client *redis.Client) {
		q := queueName(t)
		require.NoError(t, client.Set(context.Background(), streamKey(q), "not a stream", 0).Err())
		err := runErr(t, echoConsumer(t, client, q, nil), 20*time.Second)
		require.ErrorIs(t, err, ErrWrongType)
		require.Contains(t, err.Error(), streamKey(q))
	})
}

// Refused credentials or permissions end Run with ErrAccessDenied.
func TestStartAccessDenied(t *testing.T) {
	t.Parallel()
	root := realRedis(t)
	ctx := context.Background()
	name := "nothing-" + queueName(t)
	// Allowed to connect (HELLO, AUTH, PING), nothing else.
	limited := aclUser(t, root, name, "~*", "&*", "-@all", "+hello", "+auth", "+ping")
	err := runErr(t, echoConsumer(t, limited, queueName(t), nil), 20*time.Second)
	require.ErrorIs(t, err, ErrAccessDenied)
	require.Contains(t, err.Error(), "NOPERM")

	wrong := redis.NewClient(&redis.Options{Addr: root.Options().Addr, Username: name, Password: "wrong"})
	t.Cleanup(func() { _ = wrong.Close() })
	err = runErr(t, echoConsumer(t, wrong, queueName(t), nil), 20*time.Second)
	require.ErrorIs(t, err, ErrAccessDenied)
	require.True(t, strings.Contains(err.Error(), "WRONGPASS") || strings.Contains(err.Error(), "NOAUTH"), "%v", err)
	require.NoError(t, root.Do(ctx, "ACL", "DELUSER", name).Err())
}
