package streamq

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/streamq/streamq/internal/faultproxy"
	"github.com/streamq/streamq/internal/redistest"
)

// Run keeps its documented bound, about 2×ShutdownTimeout after its context
// ends, whatever the connection does meanwhile. go-redis does not interrupt a
// stalled call when its context ends (ContextTimeoutEnabled is off by
// default): a stalled XREADGROUP waits for its BLOCK plus 10 s, a script for
// ReadTimeout, and each may be retried. Run used to return 10.4 s after
// cancellation with ShutdownTimeout 200 ms.
func TestShutdownBoundHeldDuringStall(t *testing.T) {
	const shutdownTimeout = 200 * time.Millisecond
	// The bound, plus scheduling slack on a loaded machine.
	const limit = 2*shutdownTimeout + 500*time.Millisecond

	for _, tc := range []struct {
		name string
		// fault is applied while Run is running, before its context ends;
		// handled is closed once a handler ran, gate lets handlers return.
		fault func(t *testing.T, px *faultproxy.Proxy, handled <-chan struct{}, gate chan struct{})
		// beforeRun stalls before Run starts (the group cannot be created).
		beforeRun bool
	}{
		{
			// The feeder is in a blocking read when the connection stalls.
			name: "idle-read",
			fault: func(t *testing.T, px *faultproxy.Proxy, handled <-chan struct{}, gate chan struct{}) {
				close(gate)
				<-handled
				px.Stall(time.Minute)
			},
		},
		{
			// A handler is running; its outcome, the release of the
			// prefetched entries and the leases all meet the stall.
			name: "outcomes-pending",
			fault: func(t *testing.T, px *faultproxy.Proxy, handled <-chan struct{}, gate chan struct{}) {
				<-handled
				px.Stall(time.Minute)
				close(gate)
			},
		},
		{
			// Every connection is cut, and the new ones stall.
			name: "cut-then-stall",
			fault: func(t *testing.T, px *faultproxy.Proxy, handled <-chan struct{}, gate chan struct{}) {
				close(gate)
				<-handled
				px.Stall(time.Minute)
				px.Cut()
			},
		},
		{
			// The connection stalls before the consumer group is created.
			name:      "before-start",
			beforeRun: true,
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			srv := redistest.Start(t)
			px, err := faultproxy.New(srv.Addr())
			require.NoError(t, err)
			defer px.Close()
			direct := redis.NewClient(&redis.Options{Addr: srv.Addr()})
			defer direct.Close()
			// The user's client, with go-redis defaults: no context timeouts,
			// retries on.
			client := redis.NewClient(&redis.Options{Addr: px.Addr()})
			defer client.Close()
			q := queueName(t)

			p, err := NewProducer[string, string](direct, q, &ProducerOptions{Logger: testLogger(t)})
			require.NoError(t, err)
			for i := range 20 {
				require.NoError(t, p.Enqueue(context.Background(), fmt.Sprint(i), "v"))
			}
			require.NoError(t, p.Close())

			handled := make(chan struct{})
			gate := make(chan struct{})
			var first bool
			c, err := NewConsumer(client, q, func(ctx context.Context, m *Message[string]) (string, error) {
				if !first {
					first = true
					close(handled)
				}
				select {
				case <-gate:
				case <-ctx.Done():
				}
				return "ok", nil
			}, &ConsumerOptions{Workers: 1, Prefetch: 8, ShutdownTimeout: shutdownTimeout,
				ReadBlock: 50 * time.Millisecond, MinIdle: time.Second, Logger: testLogger(t)})
			require.NoError(t, err)

			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			if tc.beforeRun {
				px.Stall(time.Minute)
			}
			done := make(chan error, 1)
			go func() { done <- c.Run(ctx) }()
			if tc.beforeRun {
				require.Eventually(t, func() bool { return px.Conns() > 0 }, 10*time.Second, time.Millisecond,
					"Run never connected")
			} else {
				tc.fault(t, px, handled, gate)
			}
			// Let the stall catch the consumer's calls in flight.
			time.Sleep(100 * time.Millisecond)
			cancel()
			cancelled := time.Now()
			select {
			case err := <-done:
				require.NoError(t, err)
			case <-time.After(30 * time.Second):
				t.Fatal("Run did not return within 30s of cancellation")
			}
			took := time.Since(cancelled)
			t.Logf("Run returned %v after cancellation (ShutdownTimeout %v)", took.Round(time.Millisecond), shutdownTimeout)
			require.Less(t, took, limit, "Run must return within about 2×ShutdownTimeout")

			// Redis calls still stalled end once the connection does; the
			// shutdown work left behind then finishes.
			px.Resume()
			require.NoError(t, px.Close())
			c.waitBackground()
		})
	}
}
