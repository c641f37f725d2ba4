package streamq

// The prefetch ring: the bounded, ordered queue of slots between the
// feeders and the workers of one Run (one queue's Consumer, or every queue
// of a MultiConsumer).
//
// Goroutines: feeders reserve places and push slots; workers take them. The
// ring's counters are guarded by ring.mu, its queues by ring.qmu.

import (
	"context"
	"sync"
	"time"
)

// ring is the bounded, ordered prefetch ring. The feeders push slots in
// stream order and workers take them in that order within each class: a
// class is one priority level of one queue (class = queue×numLevels +
// level; a Consumer's ring has one queue, so its classes are its levels).
// pickQueue chooses the queue of the next take, pickLevel its level. A slot
// holds its place in the budget from reserve until its place is given back,
// so memory is bounded by the depth even when workers finish out of order.
// Waiting for room uses a signal, never a sleep.
//
// The places are a budget, not storage: the queue of waiting slots grows and
// shrinks with what it holds, so a deep ring costs nothing until it fills
// (a channel of Prefetch places cost 8 bytes a place at Run, 76 MiB for
// Prefetch 10,000,000, on an empty queue).
type ring struct {
	mu     sync.Mutex
	depth  int // Prefetch: the places in all
	free   int
	target int // how many places may be out at once (readAhead), <= depth
	// settled counts the places out whose slots were handed off (their
	// outcome waits to be recorded): they bound memory (depth) but are not
	// read-ahead, so the target does not count them.
	settled int
	shards  int  // feeders sharing the ring, one per stream read
	capped  bool // the last reservation was cut to its fair share of the target
	// groupReads makes a feeder wait, while entries are out, until half the
	// target is free (see minRead). Set for one shard only: with several, the
	// other feeders' blocked reads hold places that are not entries.
	groupReads bool
	// wake is closed (and dropped) when free, the target or a class's
	// room went up, waking every feeder waiting in reserveClass: each looks
	// again, and those that still cannot read wait on the next one. (A
	// signal handed to one waiter that could not use it was lost to the
	// others.) nil while no feeder waits.
	wake  chan struct{}
	turns turns // feeders waiting in reserveClass for room (see run.stepAside)
	// paused counts the paused queues (see setPausedState): their places out do not
	// count as read-ahead (ahead), and their feeders reserve nothing.
	paused int
	// With several classes in use (leveled: a priority level's feeder
	// joined, or the ring serves several queues), out counts each class's
	// places out and not settled, and backlog counts the class's feeders
	// whose last read filled its reservation (more is likely waiting). A
	// backlogged class holds at most its weighted share of the target among
	// the backlogged classes (classRoom), or, with strict, none while a
	// higher one is backlogged: so the ring holds the classes in about the
	// proportions workers take them.
	leveled bool
	out     []int // per class
	backlog []int // per class

	qmu    sync.Mutex
	queued sync.Cond // signalled on push, close and a queue's release; L is &qmu
	qs     []ringQueue
	n      int // slots queued, all classes
	closed bool
	// held counts the queues whose slots are not taken now (paused, or a
	// worker waits for the queue's rate-limit token; see setHeld). While it
	// is 0, a queued slot can be taken.
	held int
	// qstrict takes the queues in qorder (highest weight first), the first
	// with slots that can be taken; else queue weights share the takes by
	// smooth weighted round robin. Set before use.
	qstrict bool
	qorder  []int
}

// ringQueue is one queue's part of the ring: its levels' slots and the
// policies that choose among them.
type ringQueue struct {
	q [numLevels]slotQueue
	n int // slots queued, all levels
	// mixed is set once a slot of a level other than the default was
	// pushed: until then the queue's takes are plain FIFO.
	mixed bool
	// strict takes the highest level queued first (StrictPriority); else
	// weights (per level) share the takes while several levels are queued,
	// by smooth weighted round robin over credit. Set before use.
	strict  bool
	weights [numLevels]int
	credit  [numLevels]int
	// weight is the queue's share of the takes among the ring's queues
	// (MultiQueue.Weight); qcredit its round-robin credit.
	weight  int
	qcredit int
	// paused and waiting (workers waiting for the queue's rate-limit token)
	// hold the queue (see ring.setHeld). paused is written with both mu and
	// qmu held, so either lock reads it; waiting is guarded by qmu.
	paused  bool
	waiting int
	// starting counts the queue's feeders that Run's start presumed
	// backlogged on several priority levels and that have not read yet
	// (holdStart): the queue is held until each read, so that its first
	// take chooses among every level's requests. Guarded by qmu.
	starting int
	// pauseRead is set once the queue's pause watcher read its state
	// (written with mu and qmu held, like paused): until then paused is
	// assumed (Run's start), and the queue keeps its place among the
	// backlogged ones (classRoom).
	pauseRead bool
	// pausing is closed while paused is set (a new one is made when it is
	// cleared): a worker waiting for one of the queue's slots (its fetch,
	// its rate-limit token) gives the slot back when it closes. Guarded
	// by qmu.
	pausing chan struct{}
}

// slotQueue is one class's queue of slots, in push order.
type slotQueue struct {
	buf  []*slot // circular: n slots from head
	head int
	n    int
}

// ringMinCap is the smallest storage the ring allocates; ringKeepCap is the
// size below which it never shrinks (8 KiB), so a ring that fills and drains
// all the time does not reallocate all the time.
const (
	ringMinCap  = 16
	ringKeepCap = 1024
)

// newRing returns a ring of depth places for one queue read by shards
// feeders.
func newRing(depth, shards int) *ring { return newSharedRing(depth, shards, 1) }

// newSharedRing returns a ring of depth places for queues queues, read by
// shards feeders in all. Queue weights default to 1.
func newSharedRing(depth, shards, queues int) *ring {
	r := &ring{depth: depth, free: depth, target: depth, shards: max(shards, 1),
		groupReads: shards <= 1, qs: make([]ringQueue, queues),
		out: make([]int, queues*numLevels), backlog: make([]int, queues*numLevels), qorder: make([]int, queues)}
	for i := range r.qs {
		r.qs[i].weight = 1
		r.qs[i].pausing = make(chan struct{})
		r.qorder[i] = i
	}
	if queues > 1 {
		r.leveled, r.groupReads = true, false
	}
	r.queued.L = &r.qmu
	return r
}

// classOf returns the ring class of a queue's level.
func classOf(queue, level int) int { return queue*numLevels + level }

// reserve blocks until at least one place is free, and fewer places than the
// target are out, and takes up to limit places within both. The caller
// pushes at most that many slots and gives back the rest. Several feeders
// (one per shard) share the ring; one reservation takes at most a fair share
// of the target, target/shards (at least 1), so a feeder blocked on an empty
// shard holding its places, or one that gives them back and takes them again
// at once, never starves the other shards. A reservation cut to its share
// counts as the target binding (see binding): the target grows when workers
// wait for it.
func (r *ring) reserve(ctx context.Context, limit int) (int, error) {
	return r.reserveClass(ctx, levelNormal, limit)
}

// reserveClass is reserve for the feeder of a class (see classRoom).
func (r *ring) reserveClass(ctx context.Context, class, limit int) (int, error) {
	var w ringWait
	for {
		n, wake := r.tryReserveClass(class, limit, &w)
		if n > 0 {
			return n, nil
		}
		if err := r.awaitRoom(ctx, wake, &w); err != nil {
			return 0, err
		}
	}
}

// ringWait is one reservation's state across its attempts
// (tryReserveClass): whether it is counted in turns, and whether its queue
// was paused at the last attempt.
type ringWait struct {
	waiting bool
	paused  bool
}

// tryReserveClass is one attempt of reserveClass: it takes up to limit
// places for class, or returns 0 and the channel to wait on before the next
// attempt (awaitRoom). w carries the reservation's state between attempts.
func (r *ring) tryReserveClass(class, limit int, w *ringWait) (int, <-chan struct{}) {
	r.mu.Lock()
	defer r.mu.Unlock()
	room := max(0, min(r.free, r.target-r.ahead()))
	avail := min(room, limit)
	if r.ahead() > 0 && room < r.minRead() && r.queuedSlots() > 0 {
		avail = 0 // the workers have entries waiting: read more at once later
	}
	// forRoom: what stops the class is the ring's room, so that places
	// given back would be read (see turns); not its share, its queue's
	// pause or its batching.
	forRoom := true
	w.paused = r.qs[class/numLevels].paused
	if w.paused {
		avail, forRoom = 0, false // read nothing a paused queue cannot start
	}
	if r.leveled {
		room, share := r.classRoom(class)
		avail = min(avail, room)
		forRoom = forRoom && room > 0
		if room < share/2 && r.classQueued(class) > 0 {
			// Backlogged, with its slots waiting for the workers: read
			// half its share at once later, not one entry per place freed.
			avail, forRoom = 0, false
		}
	}
	fair := max(1, r.target/r.shards)
	n := min(avail, fair)
	if n > 0 {
		r.capped = avail > fair
	}
	r.free -= n
	r.out[class] += n
	switch {
	case n > 0 && w.waiting:
		r.turns.done(true)
		w.waiting = false
	case n == 0 && forRoom && !w.waiting:
		r.turns.wait()
		w.waiting = true
	case n == 0 && !forRoom && w.waiting:
		r.turns.done(false)
		w.waiting = false
	}
	if n > 0 {
		if min(r.free, r.target-r.ahead()) > 0 {
			r.signalLocked() // another feeder may be waiting for the rest
		}
		return n, nil
	}
	return 0, r.sleep()
}

// awaitRoom waits for the signal of wake (from tryReserveClass), or for
// ctx, which ends the reservation w.
func (r *ring) awaitRoom(ctx context.Context, wake <-chan struct{}, w *ringWait) error {
	select {
	case <-wake:
		return nil
	case <-ctx.Done():
		r.endWait(w)
		return ctx.Err()
	}
}

// endWait ends the reservation w without places.
func (r *ring) endWait(w *ringWait) {
	if w.waiting {
		r.mu.Lock()
		r.turns.done(false)
		r.mu.Unlock()
		w.waiting = false
	}
}

// sleep returns the channel a feeder waits on for the next signal; mu is
// held.
func (r *ring) sleep() <-chan struct{} {
	if r.wake == nil {
		r.wake = make(chan struct{})
	}
	return r.wake
}

// signalLocked wakes every waiting feeder; mu is held.
func (r *ring) signalLocked() {
	if r.wake != nil {
		close(r.wake)
		r.wake = nil
	}
}

// signal wakes every waiting feeder.
func (r *ring) signal() {
	r.mu.Lock()
	r.signalLocked()
	r.mu.Unlock()
}

// contended returns a channel closed once a feeder waiting for places got
// some, or nil when none waits.
func (r *ring) contended() <-chan struct{} {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.turns.contended()
}

// classRoom is how many more places a class may take while classes are
// backlogged, queue by queue and then level by level within its queue.
// With strict (queues, or a queue's levels), none while a higher one is
// backlogged. A queue or level whose streams are drained (its last reads
// came back short) takes one place at a time while another is backlogged:
// enough for a blocking read to take what arrives at once (after which its
// reads fill up and it counts as backlogged), and never the places the
// backlogged ones need (a drained feeder gives its places back after each
// empty read and would take them again first). A backlogged queue holds at
// most its weight's share of the target among the backlogged queues, and a
// backlogged level at most its weight's share of that among its queue's
// backlogged levels (at least 1). It returns the room and the class's share
// (0 when it has none: a drained class, or no class backlogged). mu is
// held.
func (r *ring) classRoom(class int) (room, share int) {
	const unlimited = 1 << 30
	qi, level := class/numLevels, class%numLevels
	qshare := r.target
	if len(r.qs) > 1 {
		sum := 0
		for j := range r.qs {
			if r.queueWaiting(j) {
				sum += r.qs[j].weight
			}
		}
		if sum == 0 {
			return unlimited, 0
		}
		if r.qstrict {
			for _, j := range r.qorder {
				if j == qi {
					break
				}
				if r.queueWaiting(j) {
					return 0, 0
				}
			}
		}
		if !r.queueBacklogged(qi) {
			return 1, 0
		}
		if !r.qstrict {
			qshare = max(1, r.target*r.qs[qi].weight/sum)
		}
	}
	q := &r.qs[qi]
	base := classOf(qi, 0)
	sum := 0
	for l := range numLevels {
		if r.backlog[base+l] > 0 {
			sum += q.weights[l]
		}
	}
	if sum == 0 {
		return unlimited, 0
	}
	if q.strict {
		for _, l := range levelOrder {
			if l == level {
				break
			}
			if r.backlog[base+l] > 0 {
				return 0, 0
			}
		}
	}
	if r.backlog[class] == 0 {
		return 1, 0
	}
	if q.strict {
		if len(r.qs) > 1 {
			return max(0, qshare-r.queueOut(qi)), qshare
		}
		return unlimited, 0
	}
	share = max(1, qshare*q.weights[level]/sum)
	return max(0, share-r.out[class]), share
}

// classQueued returns how many slots of class wait to be taken; mu may be
// held.
func (r *ring) classQueued(class int) int {
	r.qmu.Lock()
	defer r.qmu.Unlock()
	return r.qs[class/numLevels].q[class%numLevels].n
}

// queueWaiting reports whether queue qi has work waiting that its share of
// the ring must leave room for: it is backlogged, and not known to be
// paused (a paused queue's backlog would keep the others from reading, with
// Strict the lower ones entirely, while it starts nothing). mu is held.
func (r *ring) queueWaiting(qi int) bool {
	q := &r.qs[qi]
	return r.queueBacklogged(qi) && !(q.paused && q.pauseRead)
}

// presumeBacklogged counts feeders of class as backlogged before their
// first read (a queue of a ring of several: see feed).
func (r *ring) presumeBacklogged(class, feeders int) {
	r.mu.Lock()
	r.backlog[class] += feeders
	r.mu.Unlock()
}

// queueBacklogged reports whether a feeder of one of queue qi's classes is
// backlogged; mu is held.
func (r *ring) queueBacklogged(qi int) bool {
	for l := range numLevels {
		if r.backlog[classOf(qi, l)] > 0 {
			return true
		}
	}
	return false
}

// queueOut returns the places out of queue qi's classes; mu is held.
func (r *ring) queueOut(qi int) int {
	n := 0
	for l := range numLevels {
		n += r.out[classOf(qi, l)]
	}
	return n
}

// setBacklog records that a feeder of class found its stream backlogged (its
// read filled its reservation) or drained, where it was not before.
func (r *ring) setBacklog(class int, backlogged bool) {
	r.mu.Lock()
	if backlogged {
		r.backlog[class]++
	} else {
		r.backlog[class]--
		r.signalLocked() // a lower class may read more now
	}
	r.mu.Unlock()
}

// push appends a slot into a place taken with reserve. It never blocks: the
// reservation is the bound.
func (r *ring) push(s *slot) {
	r.qmu.Lock()
	rq := &r.qs[s.queue]
	q := &rq.q[s.level]
	if q.n == len(q.buf) {
		q.resize(max(ringMinCap, 2*len(q.buf)))
	}
	q.buf[(q.head+q.n)%len(q.buf)] = s
	q.n++
	rq.n++
	r.n++
	if s.level != levelNormal {
		rq.mixed = true
	}
	r.qmu.Unlock()
	r.queued.Signal()
}

// take removes the next slot, waiting for one that can be taken; it reports
// false once the ring is closed and empty, and whether it had to wait (for
// the ring to fill, or while only held queues had slots: when their places
// fill the target, the read-ahead starves the worker as an empty ring would).
func (r *ring) take() (s *slot, waited, ok bool) {
	r.qmu.Lock()
	for !r.takeable() && !r.closed {
		waited = true
		r.queued.Wait()
	}
	if r.n == 0 {
		r.qmu.Unlock()
		return nil, waited, false
	}
	s, wake := r.pop()
	r.qmu.Unlock()
	if wake {
		r.signal()
	}
	return s, waited, true
}

// takeable reports whether a queued slot can be taken now; qmu is held.
func (r *ring) takeable() bool {
	if r.n == 0 {
		return false
	}
	if r.held == 0 || r.closed {
		return true
	}
	for i := range r.qs {
		if q := &r.qs[i]; q.n > 0 && !q.isHeld() {
			return true
		}
	}
	return false
}

// queuedSlots returns how many slots wait to be taken.
func (r *ring) queuedSlots() int {
	r.qmu.Lock()
	defer r.qmu.Unlock()
	return r.n
}

// queuedOf returns how many slots of queue qi wait to be taken.
func (r *ring) queuedOf(qi int) int {
	r.qmu.Lock()
	defer r.qmu.Unlock()
	return r.qs[qi].n
}

// tryTake removes the next slot if one can be taken, without waiting.
func (r *ring) tryTake() (*slot, bool) {
	r.qmu.Lock()
	if !r.takeable() {
		r.qmu.Unlock()
		return nil, false
	}
	s, wake := r.pop()
	r.qmu.Unlock()
	if wake {
		r.signal()
	}
	return s, true
}

// pop removes the next slot, of a queue chosen by pickQueue and a level
// chosen by pickLevel: the oldest of its class, and reports whether the
// feeders must be woken (signal, once qmu is released: mu is taken before
// qmu). takeable() holds; qmu is held.
func (r *ring) pop() (*slot, bool) {
	qi := 0
	if len(r.qs) > 1 {
		qi = r.pickQueue()
	}
	rq := &r.qs[qi]
	l := levelNormal
	if rq.mixed {
		l = rq.pickLevel()
	}
	s := rq.q[l].pop()
	rq.n--
	r.n--
	// A feeder waiting for a fuller read reads what room there is.
	return s, (r.n == 0 && r.groupReads) || (rq.q[l].n == 0 && r.leveled)
}

// pickQueue chooses the queue of the next slot taken, among the queues with
// slots that can be taken: the first in qorder with qstrict, else by smooth
// weighted round robin (each such queue gains its weight in credit, the
// richest is taken and pays the sum), so that while queues stay queued
// their takes follow the weights, evenly spread, and a queue with nothing
// to take gives its turns away. qmu is held.
func (r *ring) pickQueue() int {
	best, total := -1, 0
	for _, i := range r.qorder {
		q := &r.qs[i]
		if q.n == 0 || (!r.closed && q.isHeld()) {
			continue
		}
		if r.qstrict {
			return i
		}
		q.qcredit += q.weight
		total += q.weight
		if best < 0 || q.qcredit > r.qs[best].qcredit {
			best = i
		}
	}
	r.qs[best].qcredit -= total
	return best
}

// pickLevel chooses the level of the next slot taken, among the levels with
// slots queued: the highest with strict, else by smooth weighted round robin
// as pickQueue does for queues. qmu is held.
func (q *ringQueue) pickLevel() int {
	best, total := -1, 0
	for _, l := range levelOrder {
		if q.q[l].n == 0 {
			continue
		}
		if q.strict {
			return l
		}
		q.credit[l] += q.weights[l]
		total += q.weights[l]
		if best < 0 || q.credit[l] > q.credit[best] {
			best = l
		}
	}
	q.credit[best] -= total
	return best
}

// setPaused holds (or releases) queue qi's slots while it is paused: take
// skips them (workers take the other queues' slots meanwhile, instead of
// waiting at its gate), its places out stop counting as read-ahead (they
// would hold the target that the other queues read by), and its feeders
// reserve nothing until it is resumed.
func (r *ring) setPaused(qi int, paused bool) { r.setPausedState(qi, paused, true) }

// assumePaused holds queue qi as paused until its pause watcher reads the
// state (Run's start): as setPaused, except that it keeps its place among
// the backlogged queues meanwhile (see pauseRead).
func (r *ring) assumePaused(qi int) { r.setPausedState(qi, true, false) }

// setPausedState is setPaused; read tells whether the state was read.
func (r *ring) setPausedState(qi int, paused, read bool) {
	r.mu.Lock()
	r.qmu.Lock()
	q := &r.qs[qi]
	if q.paused == paused && q.pauseRead == read {
		r.qmu.Unlock()
		r.mu.Unlock()
		return
	}
	q.pauseRead = q.pauseRead || read
	if q.paused == paused {
		r.qmu.Unlock()
		r.signalLocked() // the others' shares change (classRoom)
		r.mu.Unlock()
		return
	}
	was := q.isHeld()
	q.paused = paused
	if paused {
		r.paused++
		close(q.pausing)
	} else {
		r.paused--
		q.pausing = make(chan struct{})
	}
	r.setHeld(was, q.isHeld())
	r.qmu.Unlock()
	r.signalLocked()
	r.mu.Unlock()
}

// pausing returns a channel closed while queue qi is paused (see
// putBack).
func (r *ring) pausing(qi int) <-chan struct{} {
	r.qmu.Lock()
	defer r.qmu.Unlock()
	return r.qs[qi].pausing
}

// putBack returns a slot a worker took, and will not start now because its
// queue is paused, to the head of its class, and reports whether it did: a
// paused queue's slots wait in the ring, not in a worker. It does nothing
// (false) when the queue is not paused (resumed meanwhile: the worker goes
// on with the slot) or the ring is closed (the worker drains it). The slot
// keeps its place in the budget, as it did in the worker.
func (r *ring) putBack(s *slot) bool {
	r.qmu.Lock()
	defer r.qmu.Unlock()
	if !r.qs[s.queue].paused || r.closed {
		return false
	}
	r.pushFront(s)
	return true // held: no worker can take it until Resume
}

// pushFront puts s at the head of its class: the next of its class taken.
// qmu is held.
func (r *ring) pushFront(s *slot) {
	rq := &r.qs[s.queue]
	q := &rq.q[s.level]
	if q.n == len(q.buf) {
		q.resize(max(ringMinCap, 2*len(q.buf)))
	}
	q.head = (q.head - 1 + len(q.buf)) % len(q.buf)
	q.buf[q.head] = s
	q.n++
	rq.n++
	r.n++
	if s.level != levelNormal {
		rq.mixed = true
	}
}

// setAside marks the place of a slot that a worker took and set aside
// without starting it (its shard's start charges fail: see
// committer.holdBack) as not read-ahead while it waits, as a handed-off
// slot's is (settle): it would otherwise hold the target that the other
// shards and queues read by. requeue or unsetAside undoes it.
func (r *ring) setAside(class int) { r.settle(class) }

// unsetAside counts a slot set aside (setAside) as read-ahead again: it is
// drained at shutdown instead of requeued.
func (r *ring) unsetAside(class int) {
	r.mu.Lock()
	r.settled--
	r.out[class]++
	r.mu.Unlock()
}

// requeue returns slots set aside (setAside) to the heads of their classes,
// in their order, ahead of the slots read after them, and wakes the
// workers; they keep their places in the budget, as they did aside. It
// does nothing and reports false when the ring is closed: shutdown drains
// them then.
func (r *ring) requeue(slots []*slot) bool {
	r.mu.Lock()
	r.qmu.Lock()
	if r.closed {
		r.qmu.Unlock()
		r.mu.Unlock()
		return false
	}
	for i := len(slots) - 1; i >= 0; i-- {
		s := slots[i]
		r.settled--
		r.out[classOf(s.queue, s.level)]++
		r.pushFront(s)
	}
	r.qmu.Unlock()
	r.mu.Unlock()
	r.queued.Broadcast()
	return true
}

// addWaiting counts a worker that starts (delta 1) or stops (-1) waiting
// for queue qi's rate-limit token: while one waits, take skips the queue's
// slots, so that in a pool of several queues one worker at a time waits
// for it.
func (r *ring) addWaiting(qi, delta int) {
	r.qmu.Lock()
	q := &r.qs[qi]
	was := q.isHeld()
	q.waiting += delta
	r.setHeld(was, q.isHeld())
	r.qmu.Unlock()
}

// isHeld reports whether the queue's slots are not taken now: paused, a
// worker waits for its rate-limit token, or its first reads are still
// coming (holdStart). qmu (or, for paused alone, mu) is held.
func (q *ringQueue) isHeld() bool { return q.paused || q.waiting > 0 || q.starting > 0 }

// maxStartHold bounds holdStart's hold, should a feeder neither read nor
// wait for places (the hold also ends when one of its feeders must wait for
// places, which only the workers can free: with fewer places than feeders).
const maxStartHold = 500 * time.Millisecond

// holdStart counts backlogged the classes whose feeders Run's start
// presumes backlogged (one entry per feeder: the default level's and those
// of the levels whose streams exist at Run's start), and, when hold > 0,
// holds queue qi's slots until hold feeders called startRead (or for
// maxStartHold). Without it the level whose first read answers first
// starts first: with weights, normal requests before the high ones; with
// strict order, the normal level reads before the high level counts as
// backlogged. (Strict order needs no hold: a lower level reserves nothing
// while a higher one is backlogged, and holding it would wait for a read
// that cannot come.) Called before the feeders start.
func (r *ring) holdStart(qi int, classes []int, hold int) {
	r.mu.Lock()
	for _, c := range classes {
		r.backlog[c]++
	}
	r.mu.Unlock()
	if hold == 0 {
		return
	}
	r.qmu.Lock()
	q := &r.qs[qi]
	was := q.isHeld()
	q.starting += hold
	r.setHeld(was, q.isHeld())
	r.qmu.Unlock()
	time.AfterFunc(maxStartHold, func() { r.endStart(qi, -1) })
}

// startRead ends one feeder's part of queue qi's start hold (holdStart):
// its first read of new entries returned, a call of its admitted entries,
// or a call failed.
func (r *ring) startRead(qi int) { r.endStart(qi, 1) }

// endStart counts n of queue qi's start reads done (-1: all of them).
func (r *ring) endStart(qi, n int) {
	r.qmu.Lock()
	q := &r.qs[qi]
	was := q.isHeld()
	if n < 0 || n > q.starting {
		n = q.starting
	}
	q.starting -= n
	r.setHeld(was, q.isHeld())
	r.qmu.Unlock()
}

// setHeld counts a queue held or released (from was to now); on release it
// wakes the workers. qmu is held.
func (r *ring) setHeld(was, now bool) {
	switch {
	case now && !was:
		r.held++
	case !now && was:
		r.held--
		r.queued.Broadcast()
	}
}

// pop removes the oldest of q.n > 0 slots.
func (q *slotQueue) pop() *slot {
	s := q.buf[q.head]
	q.buf[q.head] = nil
	q.head = (q.head + 1) % len(q.buf)
	q.n--
	if len(q.buf) > ringKeepCap && q.n <= len(q.buf)/4 {
		q.resize(len(q.buf) / 2) // give memory back after a burst
	}
	return s
}

// resize moves the queued slots into new storage of size c (>= q.n).
func (q *slotQueue) resize(c int) {
	buf := make([]*slot, c)
	for i := range q.n {
		buf[i] = q.buf[(q.head+i)%len(q.buf)]
	}
	q.buf, q.head = buf, 0
}

// addFeeder counts one more feeder sharing the ring (a priority level's,
// started once its stream exists): reservations take a fair share of the
// target among them, and reads no longer wait for half the target.
func (r *ring) addFeeder() {
	r.mu.Lock()
	r.qmu.Lock()
	r.shards++
	r.leveled = true
	r.groupReads = false
	r.qmu.Unlock()
	r.signalLocked()
	r.mu.Unlock()
}

// slots yields queued slots in ring order, waiting for each, until the ring
// is closed and empty.
func (r *ring) slots(yield func(*slot) bool) {
	for {
		s, _, ok := r.take()
		if !ok || !yield(s) {
			return
		}
	}
}

// close ends slots once the queued slots are taken. Nothing is pushed after
// close; held queues' slots are taken too (to be released).
func (r *ring) close() {
	r.qmu.Lock()
	r.closed = true
	r.qmu.Unlock()
	r.queued.Broadcast()
}

// ahead is how many places are out for entries not handed off yet, of
// queues not paused; mu is held.
func (r *ring) ahead() int {
	n := r.depth - r.free - r.settled
	if r.paused > 0 {
		for qi := range r.qs {
			if r.qs[qi].paused {
				n -= r.queueOut(qi)
			}
		}
	}
	return n
}

// settle marks one place out (of a slot of class) as handed off: room for
// the read-ahead.
func (r *ring) settle(class int) {
	r.mu.Lock()
	r.settled++
	r.out[class]--
	r.signalLocked()
	r.mu.Unlock()
}

// giveSettled returns n places that were settled.
func (r *ring) giveSettled(n int) {
	if n == 0 {
		return
	}
	r.mu.Lock()
	r.free += n
	r.settled -= n
	r.signalLocked()
	r.mu.Unlock()
}

// give returns n places to the ring.
func (r *ring) give(n int) { r.giveClass(levelNormal, n) }

// giveClass returns n places of a class's feeder or slots to the ring.
func (r *ring) giveClass(class, n int) {
	if n == 0 {
		return
	}
	r.mu.Lock()
	r.free += n
	r.out[class] -= n
	r.signalLocked()
	r.mu.Unlock()
}

// setTarget sets how many places may be out at once (1..depth). Places out
// beyond a lowered target are not taken back: they come back as their
// entries complete.
func (r *ring) setTarget(n int) {
	n = min(max(n, 1), r.depth)
	r.mu.Lock()
	if n > r.target {
		r.signalLocked()
	}
	r.target = n
	r.mu.Unlock()
}

// binding reports whether the target is what stops the feeders: as many
// places are out as it allows while some are free, or the last reservation
// was cut to its fair share of the target.
func (r *ring) binding() bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.free > 0 && (r.ahead() >= r.target || r.capped)
}

// minRead is the room a feeder waits for while slots wait in the ring: half
// the target with groupReads, else 1. Under load, reads then take several
// entries each instead of the one or two each completion frees; once no slot
// waits (a worker may be idle) any room is read, so neither an idle consumer
// nor one whose places are held by long handlers waits for more. mu is held.
func (r *ring) minRead() int {
	if !r.groupReads {
		return 1
	}
	return max(1, r.target/2)
}
