package streamq

import (
	"bytes"
	"context"
	"fmt"
	"net"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"
)

// wrappedClient returns a client of raw's server whose connections (and so
// its consumers' lanes, which copy its options) are wrapped by wrap.
func wrappedClient(t *testing.T, raw *redis.Client, wrap func(net.Conn) net.Conn) *redis.Client {
	t.Helper()
	client := redis.NewClient(&redis.Options{Addr: raw.Options().Addr, PoolSize: 16,
		Dialer: func(ctx context.Context, network, addr string) (net.Conn, error) {
			c, err := (&net.Dialer{}).DialContext(ctx, network, addr)
			if err != nil {
				return nil, err
			}
			return wrap(c), nil
		}})
	t.Cleanup(func() { _ = client.Close() })
	return client
}

// readCountingConn counts the writes that carry an XREADGROUP, apart from
// those that carry it with other commands (a read riding a tick).
type readCountingConn struct {
	net.Conn
	alone, riding *atomic.Int64
}

func (c readCountingConn) Write(b []byte) (int, error) {
	if n := bytes.Count(b, []byte("xreadgroup")); n > 0 {
		if bytes.Count(b, []byte("\r\n*")) > 0 { // more than one command in the write
			c.riding.Add(int64(n))
		} else {
			c.alone.Add(int64(n))
		}
	}
	return c.Conn.Write(b)
}

// A trickle of requests (a few callers, one request per call, a consumer
// faster than they are) is read by reads that ride the ticks recording the
// outcomes of the entries before them (rideReq): a short read while the
// shard is busy sends its next read with that tick instead of a round trip
// of its own. Every request is handled exactly once, and its start counted
// once, whichever way it was read.
func TestTrickleReadsRideTicks(t *testing.T) {
	raw := realRedis(t)
	ctx := context.Background()
	var alone, riding atomic.Int64
	client := wrappedClient(t, raw, func(c net.Conn) net.Conn {
		return readCountingConn{Conn: c, alone: &alone, riding: &riding}
	})
	q := queueName(t)
	var mu sync.Mutex
	handled := map[string]int{}
	deliveries := map[string]int{}
	c, err := NewConsumer(client, q, func(_ context.Context, m *Message[int]) (int, error) {
		mu.Lock()
		handled[m.ID]++
		deliveries[m.ID] = m.Deliveries
		mu.Unlock()
		return m.Payload, nil
	}, &ConsumerOptions{Logger: testLogger(t), Workers: 4, Name: "c1"})
	require.NoError(t, err)
	runConsumer(t, c)
	p, err := NewProducer[int, int](raw, q, &ProducerOptions{Logger: testLogger(t)})
	require.NoError(t, err)
	defer p.Close()

	const callers, each = 3, 300
	var wg sync.WaitGroup
	for w := range callers {
		wg.Go(func() {
			for i := range each {
				require.NoError(t, p.Enqueue(ctx, fmt.Sprintf("r-%d-%d", w, i), i))
			}
		})
	}
	wg.Wait()
	eventually(t, 30*time.Second, func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(handled) == callers*each
	}, "not every request was handled")
	mu.Lock()
	for id, n := range handled {
		require.Equal(t, 1, n, "request %s handled %d times", id, n)
		require.Equal(t, 1, deliveries[id], "request %s: start count", id)
	}
	mu.Unlock()
	t.Logf("reads of new entries: %d alone, %d riding a tick", alone.Load(), riding.Load())
	require.Positive(t, riding.Load(), "no read rode a tick")
}
