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
	"syscall"

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
		l.client = oneConnection(c, func(o *redis.Options) {
			o.Dialer, o.OnConnect = l.dialer(o.Dialer), l.onConnect(o.OnConnect)
		})
		lanes[i] = l
	}
	return lanes
}

// oneConnection returns a client with c's options and a pool of one
// connection (pipelines included), after edit changed what else it needs
// (its dialer, say).
func oneConnection(c *redis.Client, edit func(o *redis.Options)) *redis.Client {
	o := *c.Options()
	o.PoolSize, o.MinIdleConns, o.MaxIdleConns, o.MaxActiveConns = 1, 0, 1, 1
	o.PipelinePoolSize = -1 // pipelines on the one connection
	// go-redis writes the shared config's Mode while it sets up the user's
	// connections: a copy of our own, off (a connection of our own needs no
	// maintenance notifications).
	o.MaintNotificationsConfig = &maintnotifications.Config{Mode: maintnotifications.ModeDisabled}
	edit(&o)
	return redis.NewClient(&o)
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
		if sys, ok := conn.(syscall.Conn); ok {
			// go-redis checks a pooled connection before it reuses it
			// (a non-blocking peek of the socket, which finds the FIN of
			// a connection the server closed), but only one that is a
			// syscall.Conn: pass the socket through.
			return &checkedConn{signalConn: sc, sys: sys}, nil
		}
		// The socket is hidden (TLS) or out of reach: the lane checks it
		// itself before a tick's write counts (see live).
		sc.probe, _ = transport(conn)
		sc.ownCheck = true
		return sc, nil
	}
}

// transport returns the socket under conn, following NetConn (as *tls.Conn
// gives it) a few levels down.
func transport(conn net.Conn) (syscall.Conn, bool) {
	for range 8 {
		if sys, ok := conn.(syscall.Conn); ok {
			return sys, true
		}
		u, ok := conn.(interface{ NetConn() net.Conn })
		if !ok {
			return nil, false
		}
		if conn = u.NetConn(); conn == nil {
			return nil, false
		}
	}
	return nil, false
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
//
// A tick may be signalled as written only when its bytes went to a live
// connection: a socket whose peer closed it (CLIENT KILL, a restart, the
// server's timeout, a load balancer) still takes a write, and the start
// count it carries reaches nobody. For a plain socket go-redis's own check
// before reuse sees to it (checkedConn passes the socket through); for a
// socket under TLS the lane peeks at it before the tick's first write; a
// connection with no socket to see is never signalled early (its ticks are
// answered by their reply).
type signalConn struct {
	net.Conn
	lane  *lane
	ready atomic.Bool // the handshake is over
	// wrote is set when the armed tick's bytes were written after the
	// handshake (HELLO, AUTH, SELECT and OnConnect read replies too; those
	// reads must not count).
	wrote atomic.Bool
	// ownCheck is set when go-redis cannot check the connection: live
	// peeks at probe, the socket under it (nil: none found).
	ownCheck bool
	probe    syscall.Conn
}

func (c *signalConn) Write(b []byte) (int, error) {
	counts := c.ready.Load() && c.lane.armed.Load() != nil
	if counts && c.ownCheck && !c.wrote.Load() && !c.live() {
		counts = false // the reply will answer the tick
	}
	n, err := c.Conn.Write(b)
	if err == nil && counts {
		c.wrote.Store(true)
	}
	return n, err
}

// live reports whether the socket under a connection go-redis does not
// check is known to be open with nothing waiting in it (a TLS record there
// may be the server's close_notify).
func (c *signalConn) live() bool {
	return c.probe != nil && peekSocket(c.probe) == socketIdle
}

// checkedConn is a lane's connection over a socket go-redis can check
// before it reuses the connection.
type checkedConn struct {
	*signalConn
	sys syscall.Conn
}

// SyscallConn gives go-redis's pool the socket, for its health check.
func (c *checkedConn) SyscallConn() (syscall.RawConn, error) { return c.sys.SyscallConn() }

func (c *signalConn) Read(b []byte) (int, error) {
	if c.wrote.Load() {
		if f := c.lane.armed.Swap(nil); f != nil {
			(*f)()
		}
	}
	return c.Conn.Read(b)
}

// socketState is what a peek at a socket found (peekSocket).
type socketState uint8

const (
	socketUnknown socketState = iota // could not look
	socketIdle                       // open, nothing to read
	socketData                       // bytes wait to be read
	socketClosed                     // the peer closed it, or it broke
)
