package streamq

import (
	"context"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/streamq/streamq/internal/faultproxy"
)

// TestLaneSignalsWrittenBeforeTheReply: a lane calls its tick's callback once
// the tick has been written, while the reply is still on its way (here held
// by a stalled proxy), and never for the connection's handshake: a fresh
// lane's HELLO is written and read before the tick, and must not count as
// the tick being written.
func TestLaneSignalsWrittenBeforeTheReply(t *testing.T) {
	t.Parallel()
	raw := realRedis(t)
	proxy, err := faultproxy.New(raw.Options().Addr)
	require.NoError(t, err)
	t.Cleanup(func() { _ = proxy.Close() })
	client := redis.NewClient(&redis.Options{Addr: proxy.Addr()})
	t.Cleanup(func() { _ = client.Close() })
	ctx := context.Background()
	key := "streamq:{" + queueName(t) + "}:starts:g"

	for _, warm := range []bool{true, false} {
		lanes := newLanes(client, 1)
		require.Len(t, lanes, 1)
		l := lanes[0]
		if warm {
			require.NoError(t, l.client.Ping(ctx).Err()) // handshake done before the tick
		}
		fired := make(chan struct{})
		l.arm(func() { close(fired) })
		proxy.Stall(time.Minute)
		done := make(chan error, 1)
		go func() {
			pipe := l.client.Pipeline()
			pipe.HSet(ctx, key, "1-1", 1)
			_, err := pipe.Exec(ctx)
			done <- err
		}()
		if warm {
			// The tick is written; its reply waits in the proxy.
			select {
			case <-fired:
			case <-time.After(10 * time.Second):
				t.Fatal("the written tick was not signalled while its reply was held")
			}
			select {
			case err := <-done:
				t.Fatalf("the tick returned (%v) while the proxy held its reply", err)
			default:
			}
		} else {
			// A fresh connection: the handshake's reply is held, so the tick
			// cannot have been written yet.
			select {
			case <-fired:
				t.Fatal("the handshake was taken for the tick")
			case <-time.After(300 * time.Millisecond):
			}
		}
		proxy.Resume()
		require.NoError(t, <-done)
		select {
		case <-fired:
		default:
			t.Fatal("the tick was written and its reply came, but it was never signalled")
		}
		require.True(t, l.disarm(), "the callback ran, so nothing was left armed")
		require.Equal(t, "1", raw.HGet(ctx, key, "1-1").Val())
		closeLanes(lanes)
	}
}
