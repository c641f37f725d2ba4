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
type coalescer[T any] struct {
	in          chan T
	maxItems    int
	maxBytes    int
	maxInflight int
	linger      time.Duration
	size        func(T) int
	send        func([]T)

	sent chan struct{} // one token per finished send
	done chan struct{} // closed when the loop has sent everything
}

func newCoalescer[T any](maxInflight, maxItems, maxBytes int, linger time.Duration, size func(T) int, send func([]T)) *coalescer[T] {
	c := &coalescer[T]{
		in:          make(chan T, maxItems*maxInflight),
		maxItems:    maxItems,
		maxBytes:    maxBytes,
		maxInflight: maxInflight,
		linger:      linger,
		size:        size,
		send:        send,
		sent:        make(chan struct{}, maxInflight),
		done:        make(chan struct{}),
	}
	go c.loop()
	return c
}

// close stops accepting items and returns once every accepted item was sent.
// The caller guarantees that nobody sends on in after close.
func (c *coalescer[T]) close() {
	close(c.in)
	<-c.done
}

// loop is the coalescer's only goroutine besides the sends it starts; it owns
// carry and inflight.
func (c *coalescer[T]) loop() {
	defer close(c.done)
	var (
		carry    T
		hasCarry bool
		inflight int
		closed   bool
	)
	defer func() {
		for ; inflight > 0; inflight-- {
			<-c.sent
		}
	}()
	for {
		var first T
		if hasCarry {
			first, hasCarry = carry, false
		} else {
			// Idle: wait for the first item, collecting finished sends meanwhile.
			for !closed {
				select {
				case v, ok := <-c.in:
					if !ok {
						closed = true
						continue
					}
					first = v
				case <-c.sent:
					inflight--
					continue
				}
				break
			}
			if closed {
				return
			}
		}
		batch := []T{first}
		bytes := c.size(first)
		// add takes v into the batch, or keeps it for the next one when it
		// would break the byte limit; it reports whether the batch is closed.
		add := func(v T) bool {
			if s := c.size(v); bytes+s > c.maxBytes {
				carry, hasCarry = v, true
				return true
			} else {
				bytes += s
			}
			batch = append(batch, v)
			return len(batch) >= c.maxItems
		}
		full := hasCarry
		// waiting takes what is already waiting.
		waiting := func() {
			for !full && !closed {
				select {
				case v, ok := <-c.in:
					if !ok {
						closed = true
						continue
					}
					full = add(v)
					continue
				default:
				}
				break
			}
		}
		waiting()
		// Optional linger, for callers that ask for it.
		if c.linger > 0 && !full && !closed {
			t := time.NewTimer(c.linger)
		linger:
			for !full && !closed {
				select {
				case v, ok := <-c.in:
					if !ok {
						closed = true
						break linger
					}
					full = add(v)
				case <-t.C:
					break linger
				}
			}
			t.Stop()
		}
		// Group commit: while a send is in flight, gather until it returns.
		for !full && !closed && inflight > 0 {
			select {
			case v, ok := <-c.in:
				if !ok {
					closed = true
					continue
				}
				full = add(v)
			case <-c.sent:
				inflight--
			}
		}
		// The send returned while items waited in the channel: they go too.
		waiting()
		for inflight >= c.maxInflight {
			<-c.sent
			inflight--
		}
		inflight++
		go func(b []T) {
			c.send(b)
			c.sent <- struct{}{}
		}(batch)
	}
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
