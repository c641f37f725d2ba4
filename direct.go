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
// A ProduceBatch or EnqueueBatch call whose jobs all belong to one shard
// sends its batch the same way when no other call is using the connection
// (sendBatchDirect); otherwise its round trip runs in a goroutine of its own,
// on the user's client.
//
// Goroutines: none of its own; the calling goroutine does the I/O.

import (
	"context"
	"errors"
	"net"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"
)

// directConn is a producer's connection for direct sends.
type directConn struct {
	client *redis.Client

	// held is true while a call owns the connection, from claim to unclaim:
	// the one-job path (inside the coalescer's direct turn) or a batch.
	held atomic.Bool

	mu     sync.Mutex
	conn   net.Conn    // the connection dialed last
	active bool        // a call is using it: interrupt may cut it
	cut    atomic.Bool // interrupt cut it during the current call (written under mu)
	call   uint64      // counts the calls (begin): a late interrupt spares the next

	// testHook, when a test sets it (before any call), runs as an
	// interrupt starts, before it looks at the connection.
	testHook func()
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
			if d.cut.Load() {
				// The call was interrupted while it dialed: the cut
				// holds for the new connection.
				_ = conn.SetDeadline(time.Unix(1, 0))
			}
			d.mu.Unlock()
			return uncheckedConn{conn, d}, nil
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
//
// It also keeps a cut: go-redis sets a deadline before each write and read,
// which would undo an interrupt that came between them (after the request
// was written, before its reply's read), and the call would wait for the
// reply or ReadTimeout. While the current call is cut, those are ignored
// (one atomic load per deadline: a cut connection is the only one, since
// the dialer cuts a connection dialed after the cut too); end clears the
// deadline on the connection itself.
type uncheckedConn struct {
	net.Conn
	d *directConn
}

func (c uncheckedConn) SetDeadline(t time.Time) error {
	if c.d.cut.Load() {
		return nil
	}
	return c.Conn.SetDeadline(t)
}

func (c uncheckedConn) SetReadDeadline(t time.Time) error {
	if c.d.cut.Load() {
		return nil
	}
	return c.Conn.SetReadDeadline(t)
}

func (c uncheckedConn) SetWriteDeadline(t time.Time) error {
	if c.d.cut.Load() {
		return nil
	}
	return c.Conn.SetWriteDeadline(t)
}

// interrupt cuts the connection if a call is using it: its blocked write or
// read returns at once with a timeout. Close's bound (the producer's
// lifetime) calls it.
func (d *directConn) interrupt() {
	d.interruptCall(0)
}

// interruptCall cuts the connection if call n is using it (any call for n =
// 0). The end of a call's ctx calls it: context.AfterFunc runs it in a
// goroutine of its own, which may reach the lock only after the call ended
// and the next one began, and must then leave the next one alone.
func (d *directConn) interruptCall(n uint64) {
	if d.testHook != nil {
		d.testHook()
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.active && (n == 0 || n == d.call) && d.conn != nil {
		_ = d.conn.SetDeadline(time.Unix(1, 0))
		d.cut.Store(true)
	}
}

// claim takes the connection for one call, and reports false when another
// call has it. The owner calls unclaim once its ctx can no longer interrupt
// the connection (after stopping its context.AfterFunc).
func (d *directConn) claim() bool { return d.held.CompareAndSwap(false, true) }

func (d *directConn) unclaim() { d.held.Store(false) }

// begin marks the connection in use by a new call and returns its number;
// end marks it free again, clearing a deadline that an interrupt may have
// set after the reply arrived.
func (d *directConn) begin() uint64 {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.active = true
	d.cut.Store(false)
	d.call++
	return d.call
}

func (d *directConn) end() {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.cut.Load() && d.conn != nil {
		_ = d.conn.SetDeadline(time.Time{})
	}
	d.active = false
	d.cut.Store(false)
}

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
	if !d.claim() {
		return produceOutcome{}, false, nil // a batch is using the connection
	}
	defer d.unclaim()
	if err := ctx.Err(); err != nil {
		return produceOutcome{}, true, err
	}
	outs, err := p.runDirect(ctx, it.shard, []*produceItem{it}, false)
	if err != nil {
		sent, err = p.directFailed(ctx, err)
		return produceOutcome{}, sent, err
	}
	return outs[0], true, nil
}

// sendBatchDirect sends a batch (atomic) from the caller's goroutine when
// all its items belong to one shard and no other call is using the direct
// connection; it reports sent = false when it did not, or when the send
// failed for a reason that is not the caller's: the batch then goes the
// usual way (a round trip in a goroutine of its own, on the user's client),
// which is safe, since a batch sent again appends no id twice. The caller
// has registered the round trip in p.batches (startBatch).
func (p *Producer[Req, Resp]) sendBatchDirect(ctx context.Context, items []*produceItem) (r batchResult, sent bool, err error) {
	d := p.direct
	if d == nil || len(items) == 0 {
		return batchResult{}, false, nil
	}
	shard := items[0].shard
	for _, it := range items[1:] {
		if it.shard != shard {
			return batchResult{}, false, nil
		}
	}
	if !d.claim() {
		return batchResult{}, false, nil
	}
	defer d.unclaim()
	if err := ctx.Err(); err != nil {
		return batchResult{}, true, err
	}
	outs, err := p.runDirect(ctx, shard, items, true)
	if err != nil {
		sent, err = p.directFailed(ctx, err)
		return batchResult{}, sent, err
	}
	return batchResult{outs: outs, errs: make([]error, len(items))}, true, nil
}

// runDirect runs one produce.lua call on the direct connection, which the
// end of ctx cuts. The caller has claimed the connection.
func (p *Producer[Req, Resp]) runDirect(ctx context.Context, shard int, items []*produceItem, atomic bool) ([]produceOutcome, error) {
	d := p.direct
	n := d.begin()
	defer d.end() // after stop, a panic included
	if ctx.Done() != nil {
		stop := context.AfterFunc(ctx, func() { d.interruptCall(n) })
		defer stop()
	}
	if p.lifetime.Err() != nil {
		d.interrupt() // Close's bound passed before begin: its interrupt found no call
	}
	return p.runProduce(ctx, d.client, shard, items, atomic)
}

// directFailed says what a direct send that failed with err returns: an
// invalid batch's ErrWrongType; the end of ctx or of Close's bound, whose
// outcome is unknown (as when a wait ends); or, for any other failure, sent
// = false: the request goes the usual way.
func (p *Producer[Req, Resp]) directFailed(ctx context.Context, err error) (bool, error) {
	switch {
	case errors.Is(err, ErrWrongType):
		return true, err // the batch's answer: sent again, it would only fail again
	case ctx.Err() != nil:
		return true, ctx.Err()
	case p.lifetime.Err() != nil:
		return true, errClosedUnknown
	}
	return false, nil
}
