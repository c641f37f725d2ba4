package streamq

// Lanes: the committer's own connections, which tell when a tick has been
// written.
//
// Goroutines: none of its own. A lane is used by one tick at a time (the
// committer hands lanes out as it hands out its in-flight slots); its
// connection's Read runs in that tick's goroutine, inside go-redis.

import (
	"context"
	"net"
	"sync"
	"sync/atomic"

	"github.com/redis/go-redis/v9"
	"github.com/redis/go-redis/v9/maintnotifications"
)

// lane is one connection of a committer: a client cloned from the user's
// options with a pool of one connection, whose dialer wraps each connection
// so that the first read after a tick's request was written calls the tick's
// written callback. go-redis writes a whole pipeline (and flushes it) before
// it reads the first reply, so that read means every byte of the tick is in
// the kernel's hands: it reaches Redis even if this process dies right after.
type lane struct {
	client redis.UniversalClient
	// armed is the callback of the tick in flight, until it runs.
	armed atomic.Pointer[func()]

	mu  sync.Mutex
	cur *signalConn // the connection being dialed or in use
}

// newLanes returns n lanes cloned from client, or nil when the client is not
// a *redis.Client (a cluster, a ring): ticks then use the client itself and
// workers wait for the reply of their start. A cluster client's background
// slot reloads read on connections of their own, which a lane could not
// tell from its tick's.
func newLanes(client redis.UniversalClient, n int) []*lane {
	c, ok := client.(*redis.Client)
	if !ok {
		return nil
	}
	lanes := make([]*lane, n)
	for i := range lanes {
		l := &lane{}
		o := *c.Options()
		o.Dialer, o.OnConnect = l.dialer(o.Dialer), l.onConnect(o.OnConnect)
		o.PoolSize, o.MinIdleConns, o.MaxIdleConns, o.MaxActiveConns = 1, 0, 1, 1
		o.PipelinePoolSize = -1 // pipelines on the one connection
		// go-redis writes the shared config's Mode while it sets up the
		// user's connections: a copy of our own, off (lanes need no
		// maintenance notifications).
		o.MaintNotificationsConfig = &maintnotifications.Config{Mode: maintnotifications.ModeDisabled}
		l.client = redis.NewClient(&o)
		lanes[i] = l
	}
	return lanes
}

// closeLanes closes the clients of lanes and returns nil.
func closeLanes(lanes []*lane) []*lane {
	for _, l := range lanes {
		if l != nil {
			_ = l.client.Close()
		}
	}
	return nil
}

func (l *lane) dialer(dial func(ctx context.Context, network, addr string) (net.Conn, error)) func(ctx context.Context, network, addr string) (net.Conn, error) {
	if dial == nil {
		dial = (&net.Dialer{}).DialContext
	}
	return func(ctx context.Context, network, addr string) (net.Conn, error) {
		conn, err := dial(ctx, network, addr)
		if err != nil {
			return nil, err
		}
		sc := &signalConn{Conn: conn, lane: l}
		l.mu.Lock()
		l.cur = sc
		l.mu.Unlock()
		return sc, nil
	}
}

// onConnect marks the connection being set up as ready once go-redis's
// handshake and the user's own OnConnect are done.
func (l *lane) onConnect(user func(ctx context.Context, cn *redis.Conn) error) func(ctx context.Context, cn *redis.Conn) error {
	return func(ctx context.Context, cn *redis.Conn) error {
		if user != nil {
			if err := user(ctx, cn); err != nil {
				return err
			}
		}
		l.mu.Lock()
		if l.cur != nil {
			l.cur.ready.Store(true)
		}
		l.mu.Unlock()
		return nil
	}
}

// arm sets the callback of the tick about to be sent on l.
func (l *lane) arm(written func()) {
	l.mu.Lock()
	if l.cur != nil {
		l.cur.wrote.Store(false)
	}
	l.mu.Unlock()
	l.armed.Store(&written)
}

// disarm takes the callback back when it did not run, and reports whether
// it had run.
func (l *lane) disarm() (ran bool) {
	return l.armed.Swap(nil) == nil
}

// signalConn is a lane's connection.
type signalConn struct {
	net.Conn
	lane  *lane
	ready atomic.Bool // the handshake is over
	// wrote is set when the armed tick's bytes were written after the
	// handshake (HELLO, AUTH, SELECT and OnConnect read replies too; those
	// reads must not count).
	wrote atomic.Bool
}

func (c *signalConn) Write(b []byte) (int, error) {
	n, err := c.Conn.Write(b)
	if err == nil && c.ready.Load() && c.lane.armed.Load() != nil {
		c.wrote.Store(true)
	}
	return n, err
}

func (c *signalConn) Read(b []byte) (int, error) {
	if c.wrote.Load() {
		if f := c.lane.armed.Swap(nil); f != nil {
			(*f)()
		}
	}
	return c.Conn.Read(b)
}
