package streamq

import (
	"context"
	"fmt"
	"net"
	"sync"
	"sync/atomic"
	"syscall"
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

// opaqueConn hides every method of its connection but net.Conn's, as a
// user's dialer wrapping the socket might.
type opaqueConn struct{ net.Conn }

// tlsLikeConn hides syscall.Conn but hands out its transport through
// NetConn, as *tls.Conn does.
type tlsLikeConn struct{ net.Conn }

func (c tlsLikeConn) NetConn() net.Conn { return c.Conn }

// peerClosed reports whether the peer of a TCP connection closed it (its FIN
// is in the socket), without consuming anything.
func peerClosed(conn net.Conn) bool {
	return peekSocket(conn.(syscall.Conn)) == socketClosed
}

// TestLaneNeverSignalsAWriteIntoADeadConnection: a lane's callback (which
// lets a worker start its handler before the reply) runs only when the
// tick's bytes went to a live connection. The server closed the lane's idle
// connection (CLIENT KILL; a restart, the server's timeout or a load
// balancer do the same); new connections wait at a gate in the dialer, so
// nothing of the tick can reach Redis. The tick must not be signalled
// before its retry dials: a handler started then would run with its start
// count on no connection at all. Before, the lane's connection wrapper hid
// syscall.Conn, go-redis skipped its health check, and the tick was written
// into the dead socket and signalled.
//
// With a connection that does not expose its socket directly (TLS), the
// lane checks the transport itself; with one it cannot see into, the tick
// is answered by its reply only.
func TestLaneNeverSignalsAWriteIntoADeadConnection(t *testing.T) {
	t.Parallel()
	raw := realRedis(t)
	ctx := context.Background()
	for _, wrap := range []string{"plain", "tls-like", "opaque"} {
		t.Run(wrap, func(t *testing.T) {
			t.Parallel()
			var (
				mu      sync.Mutex
				sockets []net.Conn // every socket dialed, in order
				gated   atomic.Bool
				open    = make(chan struct{})
				dialing = make(chan struct{}, 16) // a dial reached the closed gate
			)
			dial := func(ctx context.Context, network, addr string) (net.Conn, error) {
				if gated.Load() {
					select {
					case dialing <- struct{}{}:
					default:
					}
					select {
					case <-open:
					case <-ctx.Done():
						return nil, ctx.Err()
					}
				}
				c, err := (&net.Dialer{}).DialContext(ctx, network, addr)
				if err != nil {
					return nil, err
				}
				mu.Lock()
				sockets = append(sockets, c)
				mu.Unlock()
				switch wrap {
				case "tls-like":
					return tlsLikeConn{c}, nil
				case "opaque":
					return opaqueConn{c}, nil
				}
				return c, nil
			}
			client := redis.NewClient(&redis.Options{Addr: raw.Options().Addr, Dialer: dial})
			t.Cleanup(func() { _ = client.Close() })
			lanes := newLanes(client, 1)
			require.Len(t, lanes, 1)
			defer closeLanes(lanes)
			l := lanes[0]
			id, err := l.client.ClientID(ctx).Result()
			require.NoError(t, err)
			mu.Lock()
			require.Len(t, sockets, 1)
			sock := sockets[0]
			mu.Unlock()

			require.NoError(t, raw.ClientKillByFilter(ctx, "ID", fmt.Sprint(id)).Err())
			eventually(t, 5*time.Second, func() bool { return peerClosed(sock) }, "the server's FIN never came")
			gated.Store(true)

			key := "streamq:{" + queueName(t) + "}:starts:g"
			fired := make(chan struct{})
			l.arm(func() { close(fired) })
			done := make(chan error, 1)
			go func() {
				pipe := l.client.Pipeline()
				pipe.HSet(ctx, key, "1-1", 1)
				_, err := pipe.Exec(ctx)
				done <- err
			}()
			select {
			case <-dialing:
			case err := <-done:
				t.Fatalf("the tick ended (%v) without dialing a new connection", err)
			case <-time.After(10 * time.Second):
				t.Fatal("the tick never dialed a new connection")
			}
			select {
			case <-fired:
				t.Fatal("a tick written into a connection the server had closed was signalled as written: " +
					"a handler would start though its start count cannot reach Redis")
			default:
			}
			require.Zero(t, raw.Exists(ctx, key).Val(), "nothing reached Redis while the gate was closed")

			close(open)
			require.NoError(t, <-done)
			require.Equal(t, "1", raw.HGet(ctx, key, "1-1").Val())
			if wrap == "opaque" {
				// No way to see the socket: the reply answers the tick.
				require.False(t, l.disarm(), "a tick on a connection the lane cannot check was signalled before its reply")
				return
			}
			select {
			case <-fired:
			default:
				t.Fatal("the tick written on the new connection was never signalled")
			}
			require.True(t, l.disarm())
		})
	}
}
