package streamq

// Direct sends: a Produce or Enqueue call that finds its producer idle (no
// request waiting, no round trip in flight) sends its own request, from its
// own goroutine, instead of handing it to a coalescer sender and waiting to
// be woken with the reply. That is the one-job-per-call path of a service
// that enqueues one job per request: two goroutine hand-offs fewer per call.
// Calls that arrive meanwhile gather behind it as behind any send, and a
// sender takes them when it returns, so batching under load is unchanged.
//
// The call still returns when its ctx ends, whatever the connection does:
// it runs on a connection of the producer's own (one, cloned from the
// user's *redis.Client options), which the end of ctx, or of Close's bound,
// interrupts by moving its deadline into the past. go-redis then drops the
// connection and the next direct call dials again. A failure that is not
// the caller's (a broken connection, an error reply) sends the request
// again the usual way, on the user's client with its retries: the request
// id makes a resend harmless.
//
// Goroutines: none of its own; the calling goroutine does the I/O.

import (
	"context"
	"net"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"
)

// directConn is a producer's connection for direct sends.
type directConn struct {
	client *redis.Client

	mu     sync.Mutex
	conn   net.Conn // the connection dialed last
	active bool     // a call is using it: interrupt may cut it
	cut    bool     // interrupt cut it during the current call
}

// newDirectConn returns the producer's direct connection, or nil when the
// client is not a *redis.Client (a cluster or a ring: calls always go
// through the coalescer then).
func newDirectConn(client redis.UniversalClient) *directConn {
	c, ok := client.(*redis.Client)
	if !ok {
		return nil
	}
	d := &directConn{}
	d.client = oneConnection(c, func(o *redis.Options) {
		dial := o.Dialer
		if dial == nil {
			dial = (&net.Dialer{}).DialContext
		}
		o.Dialer = func(ctx context.Context, network, addr string) (net.Conn, error) {
			conn, err := dial(ctx, network, addr)
			if err != nil {
				return nil, err
			}
			d.mu.Lock()
			d.conn = conn
			d.mu.Unlock()
			return uncheckedConn{conn}, nil
		}
		// A retry would dial again after an interrupt and outlive the
		// call's ctx: a failed direct send goes the usual way instead.
		o.MaxRetries = -1
	})
	return d
}

// uncheckedConn hides a direct connection's socket (it is not a
// syscall.Conn), so go-redis does not check it before each call: that check
// is a non-blocking peek system call (and three allocations) per command,
// one of the seven system calls of an Enqueue. A connection the server closed is found by the call
// instead, which then fails and goes the usual way (see sendDirect): the
// request id makes the resend harmless, and a write into a closed socket
// never reached Redis.
type uncheckedConn struct{ net.Conn }

// interrupt cuts the connection if a call is using it: its blocked write or
// read returns at once with a timeout.
func (d *directConn) interrupt() {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.active && d.conn != nil {
		_ = d.conn.SetDeadline(time.Unix(1, 0))
		d.cut = true
	}
}

// begin marks the connection in use; end marks it free again, clearing a
// deadline that an interrupt may have set after the reply arrived.
func (d *directConn) begin() {
	d.mu.Lock()
	d.active, d.cut = true, false
	d.mu.Unlock()
}

func (d *directConn) end() {
	d.mu.Lock()
	if d.cut && d.conn != nil {
		_ = d.conn.SetDeadline(time.Time{})
	}
	d.active = false
	d.mu.Unlock()
}

// noStopFunc stands for context.AfterFunc's stop when ctx never ends.
func noStopFunc() bool { return true }

// sendDirect sends it from the caller's goroutine when the producer is idle,
// and reports sent = false when it did not (the caller hands it to the
// coalescer), or when the send failed for a reason that is not the caller's.
func (p *Producer[Req, Resp]) sendDirect(ctx context.Context, it *produceItem) (out produceOutcome, sent bool, err error) {
	d := p.direct
	if d == nil {
		return produceOutcome{}, false, nil
	}
	p.mu.RLock()
	if p.closed || !p.batcher.direct() {
		p.mu.RUnlock()
		return produceOutcome{}, false, nil
	}
	p.batches.Add(1) // Close waits for it like a batch's round trip
	p.mu.RUnlock()
	defer p.batches.Done()
	defer p.batcher.directDone()
	if err := ctx.Err(); err != nil {
		return produceOutcome{}, true, err
	}
	stop := noStopFunc
	if ctx.Done() != nil {
		stop = context.AfterFunc(ctx, d.interrupt)
	}
	d.begin()
	outs, err := p.runProduce(ctx, d.client, it.shard, []*produceItem{it}, false)
	d.end()
	stop()
	switch {
	case err == nil:
		return outs[0], true, nil
	case ctx.Err() != nil:
		return produceOutcome{}, true, ctx.Err() // the outcome is unknown, as when a wait ends
	case p.lifetime.Err() != nil:
		return produceOutcome{}, true, errClosedUnknown
	}
	return produceOutcome{}, false, nil
}
