package streamq

// The per-shard committer.
//
// Goroutines: maxTicks tick workers per shard (committer.work), one per lane.
// They own every write the consumer makes to that shard on the hot path:
// start charges, outcomes (results, dead letters, skips) and retries. Workers
// never call Redis themselves; they queue requests here and wait only for the
// answer to their own start. A free tick worker takes whatever is queued and
// sends it as one tick, so a poke wakes the goroutine that writes, with no
// dispatcher between them, and a tick worker's stack stays grown from one
// tick to the next. While the shard's start charges fail, a timer
// (time.AfterFunc: heldTimer) ends each back-off of its held slots (see
// holdBack).

import (
	"errors"
	"fmt"
	"runtime"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/streamq/streamq/internal/keys"
	"github.com/streamq/streamq/internal/scripts"
)

// maxTicks bounds the ticks of one shard in flight at once. Each tick is one
// pipelined round trip on a connection of its own; two or three hide the
// round trip under load, more only split the batches.
const maxTicks = 3

// startReq asks a shard's committer to count the start of a slot's handler.
// The worker that sent it waits on done; the committer sets n or err, then
// closes done, exactly once (answered). done may close before the reply
// (write-ahead, see tick); the count is confirmed later (slot.counted).
type startReq struct {
	s        *slot
	eid      string
	seen     int // the starts seen at admission (before this one)
	n        int // the starts including this one, or -1 / -2 (see charge.lua)
	err      error
	done     chan struct{}
	answered bool // done is closed; owned by the tick that carries the request
}

// rideReq is a feeder's read of new entries (XREADGROUP without BLOCK) that
// rides a tick of its shard's committer instead of a round trip of its own.
// A feeder asks for one after a short read while the shard was busy: the
// entries that read brought are starting, and their outcomes follow. The read
// waits for the tick after which nothing is queued or in flight (the one that
// records the last outcomes; a tick of its own when the committer is already
// quiet), or for shortReadPause, so that what arrived meanwhile comes in one
// read and the read costs no round trip: a trickle of
// requests takes two round trips per read (the starts' tick, then the
// outcomes' tick with the next read) instead of three. The tick worker that
// carries it sets res, err and busy, then closes done.
type rideReq struct {
	count int
	at    int64 // mono time before the tick was sent (admit's read time)
	res   []redis.XStream
	err   error
	busy  bool // the tick carried starts or outcomes, or more was queued or in flight
	done  chan struct{}
}

// historyCount is what a committer adds to one minute's field of an hour's
// history hash (Admin.History): processed + failed<<32, as retry.lua adds.
type historyCount struct {
	key    string
	minute int64
	inc    int64
}

// historyEvery is how often a committer adds its recorded completions to the
// history hashes: one HINCRBY (and a PEXPIRE) riding a tick, instead of one
// per complete.lua call. Admin.History lags by about this much; a process
// that dies loses the counts it holds (its last historyEvery of them, or
// more while flushes fail: a failed flush is retried with the next one).
const historyEvery = time.Second

// historyTTL is how long an hour's history hash lives after its last
// addition: the 24 hours History reads, and the hour itself.
const historyTTL = 25 * time.Hour

// Results of charge.
const (
	chargeRun     = iota // counted (or written): the handler may run
	chargeSkip           // another consumer owns the entry now, or it is gone
	chargeStopped        // shutdown began before the start could be counted
	chargeHeld           // the charge failed: the slot waits for its shard (committer.holdBack)
)

// committer owns one shard's writes. Its queue (starts, outcomes) and the
// counters below are guarded by mu; a tick's work belongs to the tick worker
// that took it.
type committer[Req, Resp any] struct {
	r     *run[Req, Resp]
	shard int
	fixed completeFixed
	lanes []*lane // the run's lanes (one per tick worker), or nil

	// expired is when this committer last sent the start-count hash's
	// PEXPIRE (mono, 0: never); see startsExpireEvery.
	expired atomic.Int64

	mu       sync.Mutex
	starts   []*startReq
	outcomes []*completion
	closing  bool
	fails    backoff // the back-off of failing ticks; reset by a success
	// busy counts the ticks taken and not settled: in flight, or running
	// what follows them (which may queue their work again after a failure).
	busy  int
	alive int // tick workers that have not returned
	// ride is the feeder's read waiting to ride a tick (see rideReq), or
	// nil; hurried: its wait is over, it goes with the next tick.
	ride    *rideReq
	hurried bool
	// history holds the completions recorded since the last flush to the
	// history hashes (see historyEvery); historyAt is when that flush was
	// taken (mono), historyDue that historyEvery passed since the first
	// count waiting (a timer sets it: the next take sends them, alone if
	// need be), historyArmed that the timer runs.
	history      []historyCount
	historyAt    int64
	historyDue   bool
	historyArmed bool

	// stalled is closed while the shard's outcomes fail to record (a tick's
	// complete.lua or retry.lua failed, and no tick recorded outcomes since),
	// and replaced by an open one when a tick records outcomes again; see
	// failing. Guarded by mu.
	stalled   chan struct{}
	isStalled bool

	// held holds the slots whose start charge failed, and those of the
	// shard taken while its charges are held, in the order they were taken:
	// they wait here, unstarted and leased, not in a worker (see holdBack).
	// heldTimer ends a back-off (unhold); probeDue: the back-off ended, and
	// the next slot of the shard a worker takes is charged (the probe);
	// heldDone is set once shutdown took the slots left (drainHeld).
	// Guarded by mu. holding is set while the shard's charges are held: from
	// a failed charge until one succeeds.
	held      []*slot
	heldTimer *time.Timer
	probeDue  bool
	heldDone  bool
	holding   atomic.Bool

	wake chan struct{} // capacity 1: "the queue grew, a count was confirmed, a tick settled, or closing"
	quit chan struct{} // closed once the committer is done: the tick workers return
	done chan struct{} // closed when the last tick worker has returned
}

func newCommitter[Req, Resp any](r *run[Req, Resp], shard int, lanes []*lane) *committer[Req, Resp] {
	return &committer[Req, Resp]{r: r, shard: shard, fixed: r.completeFixedArgs(shard), lanes: lanes,
		stalled: make(chan struct{}), wake: make(chan struct{}, 1), quit: make(chan struct{}), done: make(chan struct{})}
}

// failing returns a channel closed while the shard's outcomes fail to
// record. A worker that waits for its last outcome of the shard before a
// redelivered entry stops waiting then: the outcome may not be recorded for
// as long as the shard fails, and the wait would hold the worker from every
// other shard's and queue's work (with Workers 1, all of it). A crash
// meanwhile loses that outcome whether or not the entry starts.
func (c *committer[Req, Resp]) failing() <-chan struct{} {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.stalled
}

// setStalled records whether the last tick that carried outcomes failed to
// record them (see failing). mu is held.
func (c *committer[Req, Resp]) setStalled(stalled bool) {
	switch {
	case stalled && !c.isStalled:
		close(c.stalled)
	case !stalled && c.isStalled:
		c.stalled = make(chan struct{})
	}
	c.isStalled = stalled
}

// holdBack sets aside slot s, which a worker took and will not start now:
// its start charge failed (failed), or the shard's charges are held
// (holding) after a failure. The shard's slots then wait here, not in a
// worker, while a back-off runs (the committer's, fails: reset by a tick
// without failure); when it ends, unhold puts them back at the heads of
// their classes in the ring, in the order they came, and the first of them
// that a worker takes is charged (the probe; the back-off starts again as
// it is handed out), the others set aside again. The probe's failure holds
// it too; a charge of the shard that succeeds ends the hold (recovered) and
// requeues them all. So a shard whose starts cannot be counted (its
// start-count key of another type, its node unreachable) keeps no worker
// from the other shards' and queues' work: one worker at a time waits for
// one charge of it per back-off. The slot stays leased and keeps its place
// in the budgets; its charge state is the worker's (charging, the count
// seen, scriptCharge), so its next charge is the same idempotent one, and a
// release at shutdown takes back a count that Redis may have kept. It
// reports false when s is not held: the worker charges it (not failed: the
// shard's charges are not held, or s is the probe), or shutdown took the
// held slots already (the worker drains it).
func (c *committer[Req, Resp]) holdBack(s *slot, failed bool) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.heldDone {
		return false
	}
	if !failed {
		if !c.holding.Load() {
			return false
		}
		if c.probeDue {
			c.probeDue = false
			c.armHold()
			return false
		}
	}
	c.held = append(c.held, s)
	c.r.ring.setAside(classOf(s.queue, s.level))
	c.holding.Store(true)
	c.armHold()
	return true
}

// armHold starts the back-off after which the held slots go back into the
// ring, unless it runs. mu is held.
func (c *committer[Req, Resp]) armHold() {
	if c.heldTimer == nil {
		c.heldTimer = time.AfterFunc(c.fails.next(), c.unhold)
	}
}

// unhold ends a back-off of the held shard (see holdBack): the slots set
// aside go back into the ring, and the next one taken is charged. When the
// ring is closed (shutdown) they stay for drainHeld.
func (c *committer[Req, Resp]) unhold() {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.heldTimer = nil
	if c.heldDone || !c.holding.Load() {
		return
	}
	c.probeDue = true
	c.requeueHeld()
}

// recovered ends the hold of the shard's charges after one succeeded: the
// slots set aside go back into the ring at once. Called by a worker whose
// charge Redis answered while holding was set.
func (c *committer[Req, Resp]) recovered() {
	c.mu.Lock()
	defer c.mu.Unlock()
	if !c.holding.Load() {
		return
	}
	c.holding.Store(false)
	c.probeDue = false
	if c.heldTimer != nil {
		c.heldTimer.Stop()
		c.heldTimer = nil
	}
	if !c.heldDone {
		c.requeueHeld()
	}
}

// requeueHeld returns the held slots to the ring, unless it is closed. mu
// is held.
func (c *committer[Req, Resp]) requeueHeld() {
	if len(c.held) > 0 && c.r.ring.requeue(c.held) {
		clear(c.held)
		c.held = c.held[:0]
	}
}

// drainHeld returns the slots set aside (holdBack) that did not go back into
// the ring before it closed, counted as read-ahead again, for release at
// shutdown; no slot is set aside after. Called once the workers have ended.
func (c *committer[Req, Resp]) drainHeld() []*slot {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.heldDone = true
	if c.heldTimer != nil {
		c.heldTimer.Stop()
		c.heldTimer = nil
	}
	held := c.held
	c.held = nil
	for _, s := range held {
		c.r.ring.unsetAside(classOf(s.queue, s.level))
	}
	return held
}

// poke wakes the loop. Workers queue outcomes without poking and poke before
// anything that waits, so a finished job's outcome and the worker's next
// start share a tick.
func (c *committer[Req, Resp]) poke() {
	select {
	case c.wake <- struct{}{}:
	default:
	}
}

// add queues an outcome. It never blocks: the outcome's slot holds a place
// of the shard until it is recorded, so the queue is bounded by Prefetch.
func (c *committer[Req, Resp]) add(cp *completion) {
	c.mu.Lock()
	c.outcomes = append(c.outcomes, cp)
	c.mu.Unlock()
}

// start queues start charges and wakes the loop.
func (c *committer[Req, Resp]) start(qs ...*startReq) {
	c.mu.Lock()
	c.starts = append(c.starts, qs...)
	c.mu.Unlock()
	c.poke()
}

// close makes the tick workers send what is queued and return once nothing
// is left and no tick is in flight (or shutdown gave up: see abandon).
func (c *committer[Req, Resp]) close() {
	c.mu.Lock()
	c.closing = true
	c.mu.Unlock()
	c.poke()
	<-c.done
}

// take removes what the next tick carries: every queued start, and up to
// MaxCompleteBatch outcomes whose start count Redis has confirmed (an
// outcome sent before that could overtake its start on another connection:
// the start count's HDEL would run before its HSET and leave it behind).
// A take that returns work counts it busy until settle.
func (c *committer[Req, Resp]) take() (tickWork, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	starts := c.starts
	c.starts = nil
	var outcomes []*completion
	keep := c.outcomes[:0]
	for _, cp := range c.outcomes {
		if len(outcomes) < c.r.c.opts.MaxCompleteBatch && cp.s.isCounted() {
			outcomes = append(outcomes, cp)
		} else {
			keep = append(keep, cp)
		}
	}
	clear(c.outcomes[len(keep):])
	c.outcomes = keep
	// A waiting read rides the tick after which nothing is queued or in
	// flight (no start taken, no outcome left, no other tick): the one that
	// records the last outcomes, or a tick of its own when there are none.
	// Earlier, when its wait is over, or at shutdown.
	var ride *rideReq
	if c.ride != nil && (c.hurried || c.closing || (len(starts) == 0 && len(c.outcomes) == 0 && c.busy == 0)) {
		ride, c.ride = c.ride, nil
	}
	// The history rides a tick at most once per historyEvery; alone once the
	// timer said it is due, or at shutdown.
	var history []historyCount
	if len(c.history) > 0 && (c.historyDue || c.closing ||
		((len(starts) > 0 || len(outcomes) > 0 || ride != nil) && mono()-c.historyAt >= int64(historyEvery))) {
		history, c.history = c.history, nil
		c.historyAt, c.historyDue = mono(), false
	}
	if len(c.history) == 0 {
		c.historyDue = false
	}
	if len(starts) > 0 || len(outcomes) > 0 || ride != nil || history != nil {
		c.busy++
	}
	return tickWork{starts, outcomes, ride, history}, c.closing
}

// tickWork is what one tick carries.
type tickWork struct {
	starts   []*startReq
	outcomes []*completion
	ride     *rideReq
	history  []historyCount
}

func (w *tickWork) empty() bool {
	return len(w.starts) == 0 && len(w.outcomes) == 0 && w.ride == nil && w.history == nil
}

// countHistory adds a recorded batch to the history counts waiting for the
// next flush (the minute of now, Unix ms): every outcome but a skip counts as
// processed, a failure or dead letter also as failed, as retry.lua counts a
// retry.
func (c *committer[Req, Resp]) countHistory(batch []*completion, now int64) {
	var processed, failed int64
	for _, cp := range batch {
		switch cp.code {
		case recordSkip:
			continue
		case keys.RecordDead, keys.RecordFailed:
			failed++
		}
		processed++
	}
	if processed == 0 {
		return
	}
	c.pendHistory(historyCount{key: historyKey(c.r.c.shards[c.shard], &c.r.c.opts, now), minute: now / 60_000 % 60,
		inc: processed + failed<<32})
}

// pendHistory adds h to the counts waiting for the next flush; the first
// count waiting arms the timer that makes the flush due.
func (c *committer[Req, Resp]) pendHistory(h historyCount) {
	c.mu.Lock()
	c.addHistory(h)
	arm := !c.historyArmed
	c.historyArmed = true
	c.mu.Unlock()
	if arm {
		time.AfterFunc(historyEvery, func() {
			c.mu.Lock()
			c.historyArmed = false
			c.historyDue = len(c.history) > 0
			due := c.historyDue
			c.mu.Unlock()
			if due {
				c.poke()
			}
		})
	}
}

// addHistory adds h to the waiting counts. mu is held.
func (c *committer[Req, Resp]) addHistory(h historyCount) {
	for i := range c.history {
		if c.history[i].key == h.key && c.history[i].minute == h.minute {
			c.history[i].inc += h.inc
			return
		}
	}
	c.history = append(c.history, h)
}

// rideAlong queues a feeder's read to ride the next tick that takes it (see
// rideReq), waking a tick worker when nothing else would.
func (c *committer[Req, Resp]) rideAlong(q *rideReq) {
	c.mu.Lock()
	c.ride, c.hurried = q, false
	quiet := c.isQuiet()
	c.mu.Unlock()
	if quiet {
		c.poke()
	}
}

// hurry sends the waiting read with the next tick, at once.
func (c *committer[Req, Resp]) hurry() {
	c.mu.Lock()
	c.hurried = true
	c.mu.Unlock()
	c.poke()
}

// settle ends a tick taken by take, once what follows it is done, and wakes
// a tick worker: outcomes may wait for the counts it confirmed, and a
// closing committer looks again whether it is done.
func (c *committer[Req, Resp]) settle() {
	c.mu.Lock()
	c.busy--
	c.mu.Unlock()
	c.poke()
}

// isQuiet reports whether nothing is queued or in flight. mu is held.
func (c *committer[Req, Resp]) isQuiet() bool {
	return c.busy == 0 && len(c.starts) == 0 && len(c.outcomes) == 0
}

// quietNow reports whether nothing is queued or in flight now.
func (c *committer[Req, Resp]) quietNow() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.isQuiet()
}

// finished reports, while closing, whether the committer is done: nothing
// queued and no tick unsettled, or shutdown's hard bound passed with no
// tick unsettled (what is queued is then given up: abandon).
func (c *committer[Req, Resp]) finished() bool {
	c.mu.Lock()
	if c.busy > 0 {
		c.mu.Unlock()
		return false // the tick's worker looks again when it settles
	}
	if len(c.starts) == 0 && len(c.outcomes) == 0 && c.ride == nil && len(c.history) == 0 {
		c.mu.Unlock()
		return true
	}
	c.mu.Unlock()
	if c.r.bg.Err() != nil {
		c.abandon()
		return true
	}
	return false
}

// abandon gives up on what is queued at shutdown's hard bound: the entries
// stay pending and are claimed by another consumer after MinIdle.
func (c *committer[Req, Resp]) abandon() {
	c.mu.Lock()
	starts, outcomes, ride := c.starts, c.outcomes, c.ride
	c.starts, c.outcomes, c.ride, c.history = nil, nil, nil, nil // the history counts are lost
	c.mu.Unlock()
	if ride != nil {
		ride.err = errGaveUp
		close(ride.done)
	}
	for _, q := range starts {
		if !q.answered {
			q.answer(0, errGaveUp)
		}
	}
	if len(outcomes) > 0 {
		c.r.c.log.ErrorContext(c.r.runCtx, "streamq: gave up recording outcomes at shutdown; the entries stay pending and will be reclaimed",
			"entries", len(outcomes))
		c.r.forgetCompletions(outcomes)
	}
}

// errGaveUp answers a start charge still queued when shutdown gave up.
var errGaveUp = errors.New("streamq: shutdown gave up recording")

// begin starts the tick workers, one per lane.
func (c *committer[Req, Resp]) begin() {
	c.alive = maxTicks
	for lane := range maxTicks {
		go c.work(lane)
	}
}

// work is one tick worker: it sends a tick whenever something can be sent
// and it is free: at once when the shard is idle (no added latency), and
// gathering what arrived meanwhile when every worker was busy (a group
// commit). What follows a tick runs in the worker when it is quick (forget
// the recorded slots), else in a goroutine of its own, so that the lane is
// free again: the fetcher's completion hook, or a back-off after a failure.
func (c *committer[Req, Resp]) work(lane int) {
	defer c.exit()
	for {
		w, closing := c.take()
		if !w.empty() {
			after, slow := c.tick(lane, w)
			if slow {
				go func() {
					after()
					c.settle()
				}()
			} else {
				after()
				c.settle()
			}
			// Yield before taking again, as after a poke: the workers this
			// tick released (write-ahead) or confirmed queue their starts
			// and outcomes first, and the next tick carries them together.
			c.gather()
			continue
		}
		if closing && c.finished() {
			c.quitOnce()
			return
		}
		if closing && c.r.bg.Err() == nil {
			// Closing, with outcomes that may wait for a count: the hard
			// bound must wake the worker to give up on them.
			select {
			case <-c.wake:
			case <-c.quit:
				return
			case <-c.r.bg.Done():
			}
			continue
		}
		select { // after shutdown's hard bound too: no spinning on bg
		case <-c.wake:
			// Yield once before taking the queue: the workers woken with the
			// one that poked (by a read that brought several entries, or by
			// outcomes confirmed together) queue their starts first, and
			// one tick carries them all instead of one tick each.
			c.gather()
		case <-c.quit:
			return
		}
	}
}

// gather yields before a tick worker takes the queue, again and again while
// the queue grows (at most gatherYields times): the workers woken by one read
// (or by one tick's write-ahead or confirmed counts) run one after another
// on a loaded machine, and a single yield let only the first of them queue
// its start before the tick left. It stops at the first yield after which
// nothing was queued, so an idle shard pays one yield, as before.
func (c *committer[Req, Resp]) gather() {
	n := c.queued()
	for range gatherYields {
		runtime.Gosched()
		m := c.queued()
		if m == n {
			return
		}
		n = m
	}
}

// gatherYields bounds gather's yields.
const gatherYields = 4

// queued returns how many starts and outcomes are queued.
func (c *committer[Req, Resp]) queued() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.starts) + len(c.outcomes)
}

// quitOnce tells every tick worker to return.
func (c *committer[Req, Resp]) quitOnce() {
	c.mu.Lock()
	defer c.mu.Unlock()
	select {
	case <-c.quit:
	default:
		close(c.quit)
	}
}

// exit counts a tick worker out; the last one closes done.
func (c *committer[Req, Resp]) exit() {
	c.mu.Lock()
	c.alive--
	last := c.alive == 0
	c.mu.Unlock()
	if last {
		close(c.done)
	}
}

// tick writes one pipelined round trip: the outcomes (one complete.lua call
// for all of them, one retry.lua call for the retries), then the start
// charges (one HSET of every fresh start, one charge.lua call for the
// others), the history counts when due, and last a feeder's read riding
// it. Outcomes go first: complete.lua's XACK frees memory under maxmemory
// before the HSET, which Redis would refuse then. Every part but the read is
// harmless when go-redis resends the pipeline after a lost reply (the
// history may count twice); the entries a lost read delivered stay pending
// for this consumer until the feeder's adoption pass admits them.
//
// Fresh starts are answered as soon as the tick is written (write-ahead:
// the bytes are in the kernel's hands and reach Redis even if this process
// dies now) when the committer has lanes; their count is confirmed by the
// reply (slot.counted), and sent again until it is. Starts with an owner
// check wait for the reply. tick answers every start it carries and
// returns what is left to do, and whether that may take long (a fetcher's
// completion hook, or a failure's back-off).
func (c *committer[Req, Resp]) tick(li int, w tickWork) (after func(), slow bool) {
	starts, outcomes, ride := w.starts, w.outcomes, w.ride
	r := c.r
	o := &r.c.opts
	k := r.c.shards[c.shard]
	var results, retries []*completion
	for _, cp := range outcomes {
		if cp.code == recordRetry {
			retries = append(retries, cp)
		} else {
			results = append(results, cp)
		}
	}
	// An entry read, claimed or renewed less than MinIdle/2 ago cannot have
	// been claimed by anyone since: its owner check is implied, and its start
	// is the count seen at admission plus one, which an HSET writes
	// idempotently.
	now := mono()
	var fresh, checked []*startReq
	for _, q := range starts {
		if q.s.ownedSince(now) < o.MinIdle/2 && !q.s.scriptCharge && !o.checkOwner {
			fresh = append(fresh, q)
		} else {
			checked = append(checked, q)
		}
	}
	client := r.c.client
	var ln *lane
	if c.lanes != nil {
		ln = c.lanes[li]
		client = ln.client
	}
	starter := c.fixed.starts
	pipe := client.Pipeline()
	var completeCmd, retryCmd, chargeCmd *redis.Cmd
	var retryKeys, chargeKeys []string
	var completeCall, retryArgs, chargeArgs []any
	if len(results) > 0 {
		completeCall = scripts.CompleteHead.Command(r.completeArgs(c.shard, &c.fixed, results))
		completeCmd = scripts.CompleteHead.Queue(r.bg, pipe, completeCall)
	}
	if len(retries) > 0 {
		retryKeys, retryArgs = r.retryArgs(c.shard, retries)
		retryCmd = scripts.Retry.EvalSha(r.bg, pipe, retryKeys, retryArgs...)
	}
	var hsetCmd *redis.IntCmd
	if len(fresh) > 0 {
		// The command's list built in place: HSet would copy it and box
		// the key.
		hset := make([]any, 2, 2+2*len(fresh))
		hset[0], hset[1] = "hset", c.fixed.startsKey
		for _, q := range fresh {
			hset = append(hset, q.eid, q.seen+1)
		}
		hsetCmd = redis.NewIntCmd(r.bg, hset...)
		_ = pipe.Process(r.bg, hsetCmd)
		if last := c.expired.Load(); last == 0 || now-last >= int64(startsExpireEvery) {
			if c.expired.CompareAndSwap(last, now) {
				pipe.PExpire(r.bg, starter, startsTTL)
			}
		}
	}
	if len(checked) > 0 {
		chargeKeys = []string{k.Stream, starter}
		chargeArgs = make([]any, 3, 3+2*len(checked))
		chargeArgs[0], chargeArgs[1], chargeArgs[2] = o.Group, o.Name, startsTTL.Milliseconds()
		for _, q := range checked {
			chargeArgs = append(chargeArgs, q.eid, q.seen)
		}
		chargeCmd = scripts.Charge.EvalSha(r.bg, pipe, chargeKeys, chargeArgs...)
	}
	var historyCmds []*redis.IntCmd
	for _, h := range w.history {
		historyCmds = append(historyCmds, pipe.HIncrBy(r.bg, h.key, strconv.FormatInt(h.minute, 10), h.inc))
		pipe.PExpire(r.bg, h.key, historyTTL)
	}
	var readCmd *redis.XStreamSliceCmd
	if ride != nil {
		// Last: the read sees this tick's outcomes done (their entries
		// acknowledged), as a read after them would.
		ride.at = now
		readCmd = pipe.XReadGroup(r.bg, &redis.XReadGroupArgs{Group: o.Group, Consumer: o.Name,
			Streams: []string{k.Stream, ">"}, Count: int64(ride.count), Block: -1})
	}
	if ln != nil && len(fresh) > 0 {
		ln.arm(func() {
			for _, q := range fresh {
				if !q.answered {
					q.answer(q.seen+1, nil)
				}
			}
		})
	}
	_, _ = pipe.Exec(r.bg) // each command's error is read below
	if ln != nil {
		ln.disarm()
	}

	// A server that lost its scripts (restarted, SCRIPT FLUSH) answers
	// NOSCRIPT: that part is sent again with its source, which loads it.
	if isNoScript(completeCmd) {
		completeCmd = scripts.CompleteHead.Eval(r.bg, client, completeCall)
	}
	if isNoScript(retryCmd) {
		retryCmd = scripts.Retry.Eval(r.bg, client, retryKeys, retryArgs...)
	}
	if isNoScript(chargeCmd) {
		chargeCmd = scripts.Charge.Eval(r.bg, client, chargeKeys, chargeArgs...)
	}

	// Starts first: their workers are waiting.
	var recount []*startReq // written ahead, not confirmed: sent again
	var failure error
	if hsetCmd != nil {
		err := hsetCmd.Err()
		for _, q := range fresh {
			switch {
			case err == nil:
				if !q.answered {
					q.answer(q.seen+1, nil)
				}
				q.s.markCounted()
			case q.answered:
				// Under maxmemory Redis refuses HSET; charge.lua's first
				// write is one it takes.
				q.s.scriptCharge = true
				recount = append(recount, q)
			default:
				q.s.scriptCharge = true
				q.answer(0, err) // the worker sends its charge again
			}
		}
		if err != nil {
			failure = err
		}
	}
	if chargeCmd != nil {
		res, err := chargeCmd.Int64Slice()
		if err == nil && len(res) != len(checked) {
			err = fmt.Errorf("streamq: charge: %d results for %d entries", len(res), len(checked))
		}
		for i, q := range checked {
			switch {
			case err != nil && q.answered:
				recount = append(recount, q)
			case err != nil:
				q.answer(0, err)
			case q.answered && res[i] < 0:
				// Written ahead and running, but the entry is no longer
				// this consumer's: its outcome is dropped.
				q.s.markLost()
				q.s.markCounted()
			case q.answered:
				q.s.markCounted()
			default:
				q.answer(int(res[i]), nil)
				if res[i] > 0 {
					q.s.markCounted()
				}
			}
		}
		if err != nil {
			failure = err
		}
	}

	if ride != nil {
		ride.res, ride.err = readCmd.Result()
		if errors.Is(ride.err, redis.Nil) {
			ride.res, ride.err = nil, nil
		}
		c.mu.Lock()
		ride.busy = len(starts) > 0 || len(outcomes) > 0 || c.busy > 1 || len(c.starts) > 0 || len(c.outcomes) > 0
		c.mu.Unlock()
		close(ride.done)
	}

	for i, cmd := range historyCmds {
		if err := cmd.Err(); err != nil {
			c.mu.Lock()
			closing := c.closing
			c.mu.Unlock()
			if closing {
				// Shutdown does not wait for the history (refused under
				// maxmemory, say): its counts are lost, as a crash's are.
				r.c.log.WarnContext(r.runCtx, "streamq: adding completions to the history failed at shutdown; they are not counted",
					"completions", w.history[i].inc&(1<<32-1), "err", err)
				continue
			}
			// Again with the next flush, at most once per historyEvery (a
			// lost reply may count twice).
			r.c.log.WarnContext(r.runCtx, "streamq: adding completions to the history failed; retrying",
				"key", w.history[i].key, "err", err)
			c.pendHistory(w.history[i])
		}
	}

	var failed []*completion
	if retryCmd != nil {
		res, err := retryCmd.Int64Slice()
		if err == nil && len(res) != len(retries) {
			err = fmt.Errorf("streamq: retry: %d results for %d entries", len(res), len(retries))
		}
		if err != nil {
			failed, failure = append(failed, retries...), err
		} else {
			for i, v := range res {
				if v < 0 {
					r.c.log.InfoContext(r.runCtx, "streamq: a failed entry was taken by another consumer before its retry was scheduled",
						"id", retries[i].s.entry.ID, "entry", retries[i].s.entry.EntryID)
				}
			}
			r.forgetCompletions(retries)
		}
	}
	var recorded []*completion
	if completeCmd != nil {
		if err := completeCmd.Err(); err != nil {
			failed, failure = append(failed, results...), err
		} else {
			recorded = results
			if _, plain := completeCmd.Val().(int64); !plain {
				recorded = r.txCompleted(results, completeCmd.Val())
			}
			r.c.outcomes.countRecorded(recorded)
			c.countHistory(recorded, time.Now().UnixMilli())
		}
	}
	if failure == nil || len(outcomes) > 0 {
		c.mu.Lock()
		if failure == nil {
			c.fails = backoff{}
		}
		if len(outcomes) > 0 {
			c.setStalled(len(failed) > 0)
		}
		c.mu.Unlock()
	}
	_, completer := o.Fetcher.(FetchCompleter)
	slow = len(failed) > 0 || len(recount) > 0 || (len(recorded) > 0 && completer)
	return func() {
		if len(recorded) > 0 {
			r.completed(recorded)
		}
		if len(failed) > 0 || len(recount) > 0 {
			c.retry(failed, recount, failure)
		}
	}, slow
}

// retry queues outcomes and written-ahead starts again after a failed tick,
// once a back-off has passed; at shutdown's hard bound it gives up on them:
// their entries stay pending and are claimed by another consumer after
// MinIdle (a start written ahead whose count was never confirmed may then
// go uncounted).
func (c *committer[Req, Resp]) retry(failed []*completion, recount []*startReq, err error) {
	r := c.r
	if r.bg.Err() != nil {
		if len(failed) > 0 {
			r.c.log.ErrorContext(r.runCtx, "streamq: gave up recording outcomes at shutdown; the entries stay pending and will be reclaimed",
				"entries", len(failed), "err", err)
			r.forgetCompletions(failed)
		}
		return
	}
	r.c.log.WarnContext(r.runCtx, "streamq: recording outcomes or starts failed; retrying", "outcomes", len(failed),
		"starts", len(recount), "stream", r.c.shards[c.shard].Stream, "err", err)
	r.c.slots.onError(err)
	c.mu.Lock()
	d := c.fails.next()
	c.mu.Unlock()
	_ = sleepCtx(r.bg, d)
	c.mu.Lock()
	c.outcomes = append(failed, c.outcomes...) // in the order they came
	c.starts = append(recount, c.starts...)
	c.mu.Unlock()
	c.poke()
}

// answer gives the worker its start count or error.
func (q *startReq) answer(n int, err error) {
	q.n, q.err, q.answered = n, err, true
	close(q.done)
}

func isNoScript(cmd *redis.Cmd) bool {
	return cmd != nil && cmd.Err() != nil && redis.HasErrorPrefix(cmd.Err(), "NOSCRIPT")
}

// completed runs after outcomes were recorded: the fetcher's completion hook
// for the successful ones, then the slots are forgotten (their places go back
// to the ring only now, so handled entries whose outcome waits for Redis
// count against Prefetch).
func (r *run[Req, Resp]) completed(batch []*completion) {
	if fc, ok := r.c.opts.Fetcher.(FetchCompleter); ok {
		var done []Entry
		for _, cp := range batch {
			if cp.code == keys.RecordResult {
				done = append(done, cp.s.entry)
			}
		}
		if len(done) > 0 {
			if err := fc.Completed(r.bg, done); err != nil {
				r.c.log.WarnContext(r.runCtx, "streamq: fetcher completion hook failed", "err", err)
			}
		}
	}
	r.forgetCompletions(batch)
}

// charge records, durably and before the handler runs, that s's handler
// starts, and sets s.entry.Deliveries to the starts including this one.
// Every start is counted, however the entry arrived; a start that is not
// recorded first would never be counted if the handler crashed the process.
// The shard's committer carries it in its next tick with whatever else is
// queued. A failed charge is not retried by the worker, which would wait as
// long as the shard fails: the slot is set aside, with the shard's others,
// until the shard's back-off has passed (committer.holdBack, chargeHeld),
// and charged again by the worker that takes it then (every charge is
// idempotent); a charge that Redis answers ends the hold. When the consumer
// shuts down first, the entry is released unstarted, and the release takes
// back a charge that Redis may have counted.
func (r *run[Req, Resp]) charge(s *slot) int {
	q := &startReq{s: s, eid: s.entry.EntryID, seen: s.entry.Deliveries - 1, done: make(chan struct{})}
	s.charging = true
	s.expectCount()
	c := r.committers[s.shard]
	c.start(q)
	<-q.done
	if q.err == nil && c.holding.Load() {
		c.recovered() // the shard's charges work again
	}
	switch {
	case q.err == nil && q.n == -1:
		s.charging = false
		r.c.log.InfoContext(r.runCtx, "streamq: an entry was taken by another consumer before it started",
			"id", s.entry.ID, "entry", s.entry.EntryID)
		return chargeSkip
	case q.err == nil && q.n < 0:
		s.charging = false
		return chargeSkip
	case q.err == nil:
		s.charging = false
		s.entry.Deliveries = q.n
		return chargeRun
	}
	r.c.slots.onError(q.err)
	if r.runCtx.Err() != nil {
		return chargeStopped
	}
	r.c.log.WarnContext(r.runCtx, "streamq: recording a handler start failed; the entry waits for its shard and is charged again",
		"id", s.entry.ID, "entry", s.entry.EntryID, "stream", r.c.shards[s.shard].Stream, "err", q.err)
	if !c.holdBack(s, true) {
		return chargeStopped
	}
	return chargeHeld
}

// startsTTL is how long a group's start counts live after the last start of
// any of its entries (on that shard). Counts of completed entries are deleted
// at completion; this bounds what is left by entries removed otherwise (a
// deleted group, a stream deleted by hand).
const startsTTL = 7 * 24 * time.Hour

// startsExpireEvery is how often a committer renews the start-count hash's
// TTL with a tick's HSET: at its first tick, then at most once per interval
// (a PEXPIRE per tick was about a third of a command per job). A hash that
// emptied and was created again by an HSET meanwhile has no TTL for at most
// this long; its fields are removed at completion all the same.
const startsExpireEvery = time.Minute

// completeFixed holds what stays the same in every complete.lua call of a
// shard in one run, built (and boxed) once: the dead-letter, fan-out marker
// and start-count keys, and the fixed arguments with a placeholder for the
// time (6).
type completeFixed struct {
	dead, fanout, starts string
	// stream, deadKey, fanoutKey and startsKey are the keys as argument
	// list values (boxing a string allocates).
	stream, deadKey, fanoutKey, startsKey any
	args                                  []any
	keep                                  string // ConsumerOptions.Retention's mark of ARGV[9], "" without
}

func (r *run[Req, Resp]) completeFixedArgs(shard int) completeFixed {
	o := &r.c.opts
	k := r.c.shards[shard]
	f := completeFixed{dead: k.DeadLetter, fanout: k.Fanout, starts: k.Starts(o.Group), keep: o.Retention.flag()}
	if o.Fanout {
		f.dead = k.GroupDeadLetter(o.Group)
	}
	store, fanout := "1", "0"
	if o.DiscardResults {
		store = "0"
	}
	if o.Fanout {
		fanout = "1"
	}
	f.args = []any{o.Group, k.Channel, o.ResultTTL.Milliseconds(), store,
		o.DeadLetterMaxLen, o.Name, nil, publishCommand(r.c.sharded), fanout}
	f.stream, f.deadKey, f.fanoutKey, f.startsKey = k.Stream, f.dead, f.fanout, f.starts
	return f
}

// completeArgs builds the keys and arguments of a complete.lua call for a
// shard's outcomes.
func (r *run[Req, Resp]) completeArgs(shard int, fixed *completeFixed, batch []*completion) ([]any, []any) {
	o := &r.c.opts
	k := r.c.shards[shard]
	keyList := make([]any, 3, 5+len(batch))
	keyList[0], keyList[1], keyList[2] = fixed.stream, fixed.deadKey, fixed.fanoutKey
	args := make([]any, len(fixed.args), len(fixed.args)+6*len(batch))
	copy(args, fixed.args)
	now := time.Now().UnixMilli()
	args[6] = now
	var txArgs []any // the staged writes' section, when some item has one
	var txKeys []string
	var flowKeys []string // the children of flows: three keys each, after the records
	var children []byte   // ":<item>,<item>...": the children among the items
	var progKeys []string // progress keys to expire with their records, after the start counts
	var progressed []byte // "~<item>,<item>...": the items of progKeys
	var extra []any       // pairs of an item and its flow fields, which its dead letter keeps
	keyed := false        // an item is keyed (Key): "%" in ARGV[9]
	for i, cp := range batch {
		e := cp.s.entry
		if e.ID != "" && !o.Fanout && cp.code != recordSkip && (cp.s.reported || e.Deliveries > 1) {
			// A delivery that reported progress, or a redelivery (an earlier
			// one may have): the stored value expires with the record.
			progKeys = append(progKeys, k.Progress(e.ID))
			progressed = appendItem(progressed, '~', i+1)
		}
		if m := &cp.s.meta; (m.parent != "" || m.flow || m.flowFailed != "") &&
			(cp.code == keys.RecordDead || (cp.s.tx != nil && cp.code == keys.RecordResult)) {
			extra = append(extra, i+1, flowFields(m))
		}
		if e.ID != "" && !o.Fanout {
			keyList = append(keyList, k.Record(e.ID))
			if cp.s.meta.parent != "" && cp.code != recordSkip {
				if rec, stream, ok := keys.FlowParent(cp.s.meta.parent); ok {
					flowKeys = append(flowKeys, cp.s.meta.parent, rec, stream)
					children = appendItem(children, ':', i+1)
				}
			}
		} else {
			keyList = append(keyList, fixed.deadKey)
		}
		var payload []byte
		value := cp.value
		if cp.code == keys.RecordDead {
			payload = e.Data
		} else if o.Fanout {
			value = nil // a fan-out group records no result
		}
		if cp.s.tx != nil && cp.code == keys.RecordResult {
			payload = e.Data // a refused staged write makes it a dead letter
			txArgs, txKeys = cp.s.tx.appendArgs(txArgs, txKeys, i+1)
		}
		args = append(args, e.EntryID, e.ID, codeArg[cp.code], value, payload, e.Deliveries)
		keyed = keyed || cp.s.meta.key != ""
	}
	if children != nil || progressed != nil || extra != nil || txArgs != nil || fixed.keep != "" || keyed {
		flag := []byte(args[8].(string))
		flag = append(append(append(flag, children...), progressed...), fixed.keep...)
		if keyed {
			flag = append(flag, '%') // keyed entries give back their slots (fair.lua)
		}
		if extra != nil {
			flag = strconv.AppendInt(append(flag, '+'), int64(len(extra)), 10)
		}
		if txArgs != nil {
			flag = strconv.AppendInt(append(flag, '/'), int64(len(txArgs)), 10)
		}
		args[8] = string(flag)
	}
	keyList = appendStrings(keyList, flowKeys)
	keyList = append(keyList, fixed.startsKey) // complete.lua drops start counts there
	keyList = appendStrings(keyList, progKeys)
	// The flow fields after the items, then the staged writes (their keys
	// last, declared for a cluster).
	args = append(args, extra...)
	keyList = appendStrings(keyList, txKeys)
	args = append(args, txArgs...)
	if fixed.keep != "" {
		keyList = append(keyList, k.Completed) // the completed list, last (complete.lua)
	}
	return keyList, args
}

// appendStrings appends each of ss to list.
func appendStrings(list []any, ss []string) []any {
	for _, s := range ss {
		list = append(list, s)
	}
	return list
}

// appendItem appends item i to a list of items that starts with mark
// (complete.lua's ARGV[9] parts ":", "~"; lease.lua's ARGV[5] "~"): mark
// before the first, a comma before the others.
func appendItem(list []byte, mark byte, i int) []byte {
	if list == nil {
		list = []byte{mark}
	} else {
		list = append(list, ',')
	}
	return strconv.AppendInt(list, int64(i), 10)
}

// flowFields returns an entry's flow fields ("pa", "fp", "ff"),
// length-prefixed: its dead letter keeps them (complete.lua), and Requeue
// puts them back into the new entry.
func flowFields(m *messageMeta) string {
	var f []string
	if m.parent != "" {
		f = append(f, keys.FieldParent, m.parent)
	}
	if m.flow {
		f = append(f, keys.FieldFlow, "1")
	}
	if m.flowFailed != "" {
		f = append(f, keys.FieldFlowFailed, m.flowFailed)
	}
	return lengthPrefixed(f)
}

// codeArg holds the outcome codes of complete.lua boxed once.
var codeArg = [256]any{keys.RecordResult: "R", keys.RecordFailed: "E", keys.RecordDead: "L", recordSkip: "S", recordRetry: "T"}

// forgetCompletions forgets the slots of recorded (or abandoned) outcomes.
func (r *run[Req, Resp]) forgetCompletions(batch []*completion) {
	slots := make([]*slot, len(batch))
	for i, cp := range batch {
		slots[i] = cp.s
		close(cp.done)
	}
	r.forget(slots...)
}

// historyKey returns the history hash of the hour of now (Unix ms) that the
// completions of o.Group count in: the answering group's, or a fan-out
// group's own, so that a job counts once per group.
func historyKey(k keys.Keys, o *ConsumerOptions, now int64) string {
	if o.Fanout {
		return k.GroupHistory(o.Group, now/msPerHour)
	}
	return k.History(now / msPerHour)
}
