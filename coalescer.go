package streamq

// The coalescer: concurrent Produce and Enqueue calls of one Producer are
// gathered into one produce.lua call per shard, bounded by items, bytes and
// calls in flight.
//
// Goroutines: one coalescer loop per Producer (coalescer.loop) owns the
// pending batch; it hands full batches to send goroutines, at most
// maxInflight at a time. byteBudget bounds the bytes waiting.

import (
	"context"
	"sync"
	"time"
)

// sendCoalesced is the coalescer's send function for single Produce calls.
func (p *Producer[Req, Resp]) sendCoalesced(batch []*produceItem) {
	live := batch[:0:0]
	for _, it := range batch {
		if err := it.ctx.Err(); err != nil {
			it.deliver(produceOutcome{err: err})
			continue
		}
		live = append(live, it)
	}
	if len(live) > 0 {
		outs, errs := p.runShards(p.lifetime, live, false)
		for i, it := range live {
			if errs[i] != nil {
				it.deliver(produceOutcome{err: errs[i]})
			} else {
				it.deliver(outs[i])
			}
		}
	}
	for _, it := range batch {
		p.budget.release(it.size())
	}
}

// coalescer sends items in batches with zero linger, as a group commit: when
// nothing is in flight, whatever is waiting goes at once (alone, at idle);
// while a send is in flight, items gather until it returns or the batch is
// full, and only full batches go in parallel, up to maxInflight. So a caller
// never waits for more items to arrive, only for a round trip already under
// way, and under load batches grow by themselves.
//
// Goroutines: maxInflight senders (coalescer.sender), started with the
// coalescer, each sending one batch at a time. A caller's add wakes an idle
// sender when its item can go, and a sender whose send returned takes what
// waits itself: one hand-off from the caller to the goroutine that writes,
// and a sender's stack stays grown from one send to the next. pending, busy
// and closed are guarded by mu.
type coalescer[T any] struct {
	maxItems    int
	maxBytes    int
	maxInflight int
	linger      time.Duration
	size        func(T) int
	send        func([]T)

	mu      sync.Mutex
	ready   sync.Cond // signalled when a batch can go, and on close; L is &mu
	pending []T       // accepted and not yet taken by a sender, in order
	bytes   int       // the size of pending
	busy    int       // senders sending
	closed  bool
	filled  chan struct{} // capacity 1: a lingering sender's batch is full

	senders sync.WaitGroup
}

func newCoalescer[T any](maxInflight, maxItems, maxBytes int, linger time.Duration, size func(T) int, send func([]T)) *coalescer[T] {
	c := &coalescer[T]{
		maxItems:    maxItems,
		maxBytes:    maxBytes,
		maxInflight: maxInflight,
		linger:      linger,
		size:        size,
		send:        send,
		filled:      make(chan struct{}, 1),
	}
	c.ready.L = &c.mu
	c.senders.Add(maxInflight)
	for range maxInflight {
		go c.sender()
	}
	return c
}

// add accepts v; it never blocks (the producer's byte budget bounds what
// waits). It reports false once close has begun: v was not accepted.
func (c *coalescer[T]) add(v T) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return false
	}
	c.pending = append(c.pending, v)
	c.bytes += c.size(v)
	if c.full() {
		select {
		case c.filled <- struct{}{}:
		default:
		}
	}
	if c.goes() {
		c.ready.Signal()
	}
	return true
}

// full reports whether pending fills a batch. mu is held.
func (c *coalescer[T]) full() bool {
	return len(c.pending) >= c.maxItems || c.bytes >= c.maxBytes
}

// goes reports whether a batch can be sent now: something waits, and
// nothing is in flight, or the batch is full and a sender is free; or the
// coalescer is closing. mu is held.
func (c *coalescer[T]) goes() bool {
	if len(c.pending) == 0 {
		return false
	}
	return c.busy == 0 || c.closed || (c.full() && c.busy < c.maxInflight)
}

// direct reports whether a caller may send its item itself (see
// sendDirect): nothing waits, nothing is in flight, and no linger is asked
// for. The caller's send then counts as one in flight, so items gather
// behind it, until directDone.
func (c *coalescer[T]) direct() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed || c.linger > 0 || c.busy > 0 || len(c.pending) > 0 {
		return false
	}
	c.busy++
	return true
}

// directDone ends a caller's own send: a sender takes what gathered.
func (c *coalescer[T]) directDone() {
	c.mu.Lock()
	c.busy--
	if c.goes() {
		c.ready.Signal()
	}
	c.mu.Unlock()
}

// close stops accepting items and returns once every accepted item was sent.
func (c *coalescer[T]) close() {
	c.mu.Lock()
	c.closed = true
	c.ready.Broadcast()
	c.mu.Unlock()
	select {
	case c.filled <- struct{}{}: // a lingering sender stops lingering
	default:
	}
	c.senders.Wait()
}

// sender sends batches until the coalescer is closed and nothing waits.
func (c *coalescer[T]) sender() {
	defer c.senders.Done()
	c.mu.Lock()
	defer c.mu.Unlock()
	for {
		for !c.goes() {
			if c.closed && len(c.pending) == 0 {
				return
			}
			c.ready.Wait()
		}
		if c.linger > 0 && !c.full() && !c.closed {
			// Optional linger, for callers that ask for it: the batch waits
			// for more items (or to be full) before it goes.
			c.busy++ // others gather meanwhile, as behind a send
			c.mu.Unlock()
			t := time.NewTimer(c.linger)
			select {
			case <-c.filled:
			case <-t.C:
			}
			t.Stop()
			c.mu.Lock()
			c.busy--
			if len(c.pending) == 0 {
				// Closing (or a full batch) let another sender take it
				// meanwhile.
				continue
			}
		}
		batch := c.take()
		c.busy++
		if c.goes() {
			c.ready.Signal() // what is left fills another batch
		}
		c.mu.Unlock()
		c.send(batch)
		c.mu.Lock()
		c.busy--
		// Items that gathered during the send go next, from this sender;
		// wake another only for what this one leaves.
	}
}

// take removes the next batch from pending: at least one item, then items
// while the batch stays within maxItems and maxBytes. mu is held.
func (c *coalescer[T]) take() []T {
	n, bytes := 1, c.size(c.pending[0])
	for n < len(c.pending) && n < c.maxItems {
		s := c.size(c.pending[n])
		if bytes+s > c.maxBytes {
			break
		}
		bytes += s
		n++
	}
	batch := make([]T, n)
	copy(batch, c.pending)
	clear(c.pending[:n])
	c.pending = c.pending[n:]
	if len(c.pending) == 0 {
		c.pending = nil // let the array go, or reuse it from the start
	}
	c.bytes -= bytes
	return batch
}

// byteBudget bounds the bytes accepted but not yet sent.
type byteBudget struct {
	mu      sync.Mutex
	free    int
	freed   chan struct{} // closed and replaced on a release when watched
	watched bool          // a caller waits on freed
}

func newByteBudget(n int) *byteBudget {
	return &byteBudget{free: n, freed: make(chan struct{})}
}

// acquire takes n bytes, waiting for them until ctx ends or closing is closed
// (ErrClosed).
func (b *byteBudget) acquire(ctx context.Context, closing <-chan struct{}, n int) error {
	for {
		b.mu.Lock()
		if b.free >= n {
			b.free -= n
			b.mu.Unlock()
			return nil
		}
		ch := b.freed
		b.watched = true
		b.mu.Unlock()
		select {
		case <-ch:
		case <-ctx.Done():
			return ctx.Err()
		case <-closing:
			return ErrClosed
		}
	}
}

func (b *byteBudget) release(n int) {
	b.mu.Lock()
	b.free += n
	if b.watched { // else nobody waits: no channel to replace
		close(b.freed)
		b.freed = make(chan struct{})
		b.watched = false
	}
	b.mu.Unlock()
}
