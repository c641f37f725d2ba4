package streamq

// The pool: what the queues of one Run share. A Consumer's Run is a pool of
// one queue; a MultiConsumer's, a pool of several. The pool owns the
// prefetch ring, its read-ahead and the workers; each queue keeps its own
// run (feeders, committers, leases, pause, rate limit, trimming: see run).
//
// Goroutines: Workers worker goroutines (work), each taking slots in ring
// order and running the handler of each through the slot's queue; the
// caller of Run waits in pool.run; one goroutine runs the shutdown steps.

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"time"
)

// queueRun is one queue's part of a pool: a *run of any request and result
// types.
type queueRun interface {
	// begin starts the queue's goroutines (not the workers).
	begin(ctx context.Context)
	// process handles a ready slot of the queue (see run.process).
	process(s *slot, flush func()) (owed bool)
	// drain sets aside a slot that will not start, for release.
	drain(s *slot)
	// committerOf returns the committer of a stream index, for pokes and
	// for whether its outcomes fail to record.
	committerOf(shard int) poker
	// streams returns how many streams the queue reads (levels × shards).
	streams() int
	// feedersDone waits for the queue's feeders to end.
	feedersDone()
	// finish runs the queue's shutdown steps after the workers ended.
	finish()
	// cancelHandlers cancels the queue's running handlers' contexts.
	cancelHandlersCause(cause error)
	// giveUp cancels the queue's background context (shutdown's hard bound).
	giveUp()
	// shutdownTimeout is the queue's ShutdownTimeout.
	shutdownTimeout() time.Duration
	// backgroundAdd counts work that may outlive Run, as the consumer's
	// background WaitGroup does: Add(1) returns its Done.
	backgroundAdd() (done func())
	// warn logs a warning with the queue's logger.
	warn(ctx context.Context, msg string, args ...any)
}

// poker is a committer as a worker sees it: poke sends what it holds;
// failing returns a channel closed while its outcomes fail to record.
type poker interface {
	poke()
	failing() <-chan struct{}
}

// pool is the shared state of one Run.
type pool struct {
	queues  []queueRun
	base    []int // per queue, the index of its first stream in a worker's last
	streams int
	ring    *ring
	ahead   *readAhead // moves the ring's target with what the workers see
	workers int
	runCtx  context.Context
	wg      sync.WaitGroup
}

func newPool(r *ring, ahead *readAhead, workers int) *pool {
	return &pool{ring: r, ahead: ahead, workers: workers}
}

// add makes q the pool's next queue and returns its index in the ring.
func (p *pool) add(q queueRun) int {
	p.queues = append(p.queues, q)
	p.base = append(p.base, p.streams)
	p.streams += q.streams()
	return len(p.queues) - 1
}

// run starts every queue and the workers, waits until ctx ends, then shuts
// down (see shutdown).
func (p *pool) run(ctx context.Context) {
	p.runCtx = ctx
	p.ring.setTarget(p.ahead.current())
	for _, q := range p.queues {
		q.begin(ctx)
	}
	p.wg.Add(p.workers)
	for range p.workers {
		go p.work()
	}
	<-ctx.Done()
	p.shutdown()
}

// shutdown runs after Run's ctx ended and returns within about
// 2×ShutdownTimeout (the largest of its queues'), whatever Redis does. The
// steps (see stop) run in their own goroutine: handlers get their queue's
// ShutdownTimeout; Redis work (the feeders' last reads, outcomes, releases,
// leases) gets as long again. Then the background contexts are cancelled,
// which ends every retry loop, and shutdown returns even if a call is still
// stalled on the connection: go-redis does not interrupt it when its context
// ends (unless the client has ContextTimeoutEnabled), so it ends on the
// client's own timeouts, and the remaining steps then finish in the
// background, each failing fast. Entries whose outcome or release was not
// recorded stay pending and are claimed after MinIdle.
func (p *pool) shutdown() {
	var timers []*time.Timer
	longest := time.Duration(0)
	for _, q := range p.queues {
		d := q.shutdownTimeout()
		longest = max(longest, d)
		timers = append(timers, time.AfterFunc(d, func() {
			q.cancelHandlersCause(fmt.Errorf("streamq: ShutdownTimeout (%v) elapsed", d))
		}))
	}
	gaveUp := make(chan struct{})
	hard := time.AfterFunc(2*longest, func() {
		for _, q := range p.queues {
			q.giveUp()
		}
		close(gaveUp)
	})
	done := make(chan struct{})
	var dones []func()
	for _, q := range p.queues {
		dones = append(dones, q.backgroundAdd())
	}
	go func() {
		defer func() {
			for _, d := range dones {
				d()
			}
		}()
		defer close(done)
		p.stop(timers)
	}()
	select {
	case <-done:
		hard.Stop()
	case <-gaveUp:
		for _, q := range p.queues {
			q.warn(p.runCtx, "streamq: shutdown stopped waiting for Redis after 2×ShutdownTimeout; "+
				"calls still in flight end on the client's timeouts, and unrecorded entries stay pending until claimed",
				"shutdown_timeout", q.shutdownTimeout())
		}
	}
}

// stop runs the shutdown steps in order: the feeders stop first (so no new
// slots appear), then workers finish or drain the ring, then each queue
// finishes on its own (releases, outcomes, and only then leases, because
// entries must stay leased until they are completed), so a queue whose
// Redis calls stall there does not hold up the others' releases. The first
// step is shared: a queue whose last read stalls delays every queue's
// releases, up to the hard bound (entries not released then are claimed
// after MinIdle); outcomes recorded by then are not affected.
func (p *pool) stop(handlerTimeouts []*time.Timer) {
	for _, q := range p.queues {
		q.feedersDone()
	}
	p.ring.close()
	p.wg.Wait()
	for _, t := range handlerTimeouts {
		t.Stop()
	}
	var wg sync.WaitGroup
	for _, q := range p.queues {
		wg.Add(1)
		go func() {
			defer wg.Done()
			q.finish()
		}()
	}
	wg.Wait()
}

// work takes slots in ring order until the ring is closed and empty.
func (p *pool) work() {
	defer p.wg.Done()
	// last[stream] is closed when this worker's last outcome of that stream
	// (p.base[queue]+shard) is recorded. Per stream: a shard that cannot
	// complete must not hold up the others' redelivered entries.
	last := make([]<-chan struct{}, p.streams)
	// owe is the committer holding this worker's last outcome, queued but not
	// poked: when the next slot starts at once, the outcome rides the same
	// tick as its start charge. Anything that waits pokes it first.
	var owe poker
	flush := func() {
		if owe != nil {
			owe.poke()
			owe = nil
		}
	}
	defer flush()
	for {
		s, ok := p.ring.tryTake()
		waited := false
		if !ok {
			flush()
			if s, waited, ok = p.ring.take(); !ok {
				return
			}
		}
		q := p.queues[s.queue]
		if p.runCtx.Err() != nil {
			flush()
			q.drain(s)
			continue
		}
		select {
		case <-s.ready:
		default:
			flush()
			waited = true
			if !p.awaitReady(s) {
				continue // its queue was paused: the slot waits in the ring
			}
		}
		if t, changed := p.ahead.took(waited && p.ring.binding()); changed {
			p.ring.setTarget(t)
		}
		if p.runCtx.Err() != nil { // also when the fetch ended with the shutdown
			flush()
			q.drain(s)
			continue
		}
		li := p.base[s.queue] + s.shard
		if s.entry.Deliveries > 1 && last[li] != nil {
			// A redelivered message may be the one that crashed an earlier
			// process: record this worker's last outcome before starting it, so
			// a crash cannot undo work that already succeeded. Not while the
			// shard's outcomes fail to record: the wait would hold this
			// worker from the other shards' and queues' work for as long.
			flush()
			select {
			case <-last[li]:
			case <-q.committerOf(s.shard).failing():
			case <-p.runCtx.Done():
				q.drain(s)
				continue
			}
		}
		next := q.committerOf(s.shard)
		if owe != nil && owe != next {
			flush() // the start goes to another committer
		}
		if q.process(s, flush) {
			owe = next
			last[li] = s.outcome
		}
	}
}

// awaitReady waits for slot s's fetch, or for Run's ctx to end, and reports
// true; it reports false when the slot's queue was paused first and the slot
// went back into the ring, so that a paused queue's slow fetch does not hold
// the worker (the fetch goes on; the slot is ready when taken again).
func (p *pool) awaitReady(s *slot) bool {
	for {
		select {
		case <-s.ready:
			return true
		case <-p.runCtx.Done():
			return true
		case <-p.ring.pausing(s.queue):
			if p.ring.putBack(s) {
				return false
			}
			if p.runCtx.Err() != nil {
				return true
			}
			// Resumed meanwhile: pausing is a new channel.
		}
	}
}

// queueOrder returns the queue indexes by weight, highest first (ties: the
// order given).
func queueOrder(weights []int) []int {
	order := make([]int, len(weights))
	for i := range order {
		order[i] = i
	}
	slices.SortStableFunc(order, func(a, b int) int { return weights[b] - weights[a] })
	return order
}
