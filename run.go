package streamq

// One queue's part of a Run: its state, its start and shutdown, and the
// admission of read entries into slots (admit, track, untrack, forget). The
// goroutines it starts are listed on the run type.

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/streamq/streamq/internal/keys"
)

// run is one queue's state in one Run call (of its Consumer, or of a
// MultiConsumer): everything but what the pool shares (the ring, its
// read-ahead and the workers; see pool).
//
// Goroutines and what they own (each file says the same at its top):
//   - feeders (run.feed, one per stream; feeder.go): resume, claim and read
//     entries, create slots, push them into places they reserved in the ring.
//   - fetch goroutines (run.startFetch; slot.go): one per slot with a remote
//     payload, until the slot is ready.
//   - workers (pool.work, shared by the pool's queues; worker.go): take slots
//     in ring order, ask the stream's committer to charge the start, run the
//     handler, queue the outcome.
//   - committers (committer.go, one loop per stream and its ticks in flight
//     on lanes.go's connections): every write of the hot path, in one
//     pipelined round trip per tick: outcomes, retries and start charges;
//     then forget the slots (their places go back to the ring).
//   - leaser (run.leaseLoop; lease.go): starts a lease renewal round every
//     MinIdle/3; renewals (run.renewShard, one per shard while its
//     lease.lua calls are in flight) renew the leases of the shard's owned
//     slots and mark lost ones.
//   - promoters (run.promoteLoop, one per shard; promoter.go): move due
//     delayed requests and retries into the stream.
//   - pause watcher (run.watchPause; pause.go): follows the queue's pause
//     key and holds or releases the queue's slots in the ring.
//   - rate limiter (limiter.loop; ratelimit.go), with RateLimit only.
//   - trimmer (run.trimLoop; trim.go): trims the stream and prunes idle
//     consumers.
//   - heartbeat (run.heartbeatLoop; heartbeat.go): records that this consumer
//     is alive.
//
// owned is shared by all of them and guarded by mu.
type run[Req, Resp any] struct {
	c     *Consumer[Req, Resp]
	ring  *ring // the pool's
	queue int   // the queue's index in the pool and its ring
	multi bool  // the pool has other queues

	runCtx         context.Context // Run's ctx: ends reading and fetching
	bg             context.Context // outlives runCtx: completions, leases, releases
	cancelBg       context.CancelFunc
	handlerCtx     context.Context // parent of handler contexts
	cancelHandlers context.CancelCauseFunc

	mu    sync.Mutex
	owned map[ownedKey]*slot // from push until forgotten

	releaseMu sync.Mutex
	unstarted []*slot // slots drained at shutdown, to release
	// leaseMu guards leasing and leaseAgain, and is held while a renewal
	// snapshots owned; releaseUnstarted untracks under it, then waits for
	// the renewals in flight then (their done channels), so a renewal that
	// saw released entries never reaches Redis after their release.
	leaseMu sync.Mutex
	// leasing has, per index of Consumer.shards, the done channel of the
	// shard's renewal in flight (closed when it is answered), or nil.
	leasing []chan struct{}
	// leaseAgain marks, per index of Consumer.shards, a shard whose renewal
	// was in flight when a round began: it renews again once answered.
	leaseAgain []bool

	committers []*committer[Req, Resp] // one per stream: shards fail independently
	lanes      [][]*lane               // per stream, the committer's connections (nil entries: none)
	places     *shardPlaces
	prefetch   int        // the places of the queue's shards together (its share of the pool's Prefetch)
	workers    int        // the pool's workers
	pause      *pauseGate // open while the queue is not paused (watchPause)
	limiter    *limiter   // nil without RateLimit
	// levelWake has one channel (capacity 1) per index of Consumer.shards:
	// the shard's promoter signals a level's channel when a producer created
	// the level's stream, or when its wake subscription (re)started, and the
	// level's feeder, waiting for the stream (awaitLevel), looks again.
	levelWake []chan struct{}
	// presumed tells, per index of Consumer.shards, whether the feeder
	// starts counted as backlogged (see startLevels); startHeld, whether
	// these feeders hold the queue's takes until their first reads.
	presumed  []bool
	startHeld bool

	fetches   sync.WaitGroup
	loops     sync.WaitGroup // leaser and its renewals, heartbeat, pause watcher, limiter, trimmer, promoters
	feeder    sync.WaitGroup
	stopLoops chan struct{}
	// leaseNow asks the leaser for a renewal at once (capacity 1): a
	// promoter resubscribed, so a cancel notice may have been missed.
	leaseNow chan struct{}
}

// newRun returns queue index queue's run in a pool whose ring is ring,
// holding up to prefetch entries (its shards' places together).
func newRun[Req, Resp any](c *Consumer[Req, Resp], ring *ring, queue, prefetch int) *run[Req, Resp] {
	q := &ring.qs[queue]
	q.strict = c.opts.StrictPriority
	if len(ring.qs) > 1 {
		// The queue's feeders start as backlogged (see feed).
		ring.presumeBacklogged(classOf(queue, levelNormal), c.nShards)
	}
	for l := range numLevels {
		q.weights[l] = c.opts.PriorityWeights[weightIndex[l]]
	}
	r := &run[Req, Resp]{
		c:         c,
		ring:      ring,
		queue:     queue,
		multi:     len(ring.qs) > 1,
		places:    newShardPlaces(prefetch, c.nShards),
		prefetch:  prefetch,
		workers:   c.opts.Workers,
		owned:     make(map[ownedKey]*slot),
		pause:     newPauseGate(),
		stopLoops: make(chan struct{}),
		leaseNow:  make(chan struct{}, 1),
		levelWake: make([]chan struct{}, len(c.shards)),
		presumed:  make([]bool, len(c.shards)),
	}
	r.leasing, r.leaseAgain = make([]chan struct{}, len(c.shards)), make([]bool, len(c.shards))
	for v := range r.levelWake {
		r.levelWake[v] = make(chan struct{}, 1)
	}
	r.startLevels()
	return r
}

// startLevels joins the feeders of the priority levels whose streams existed
// at Run's start (Consumer.findLevels) to the ring and the shards' places
// before any feeder runs, and presumes them and the default level
// backlogged until their first reads, holding the queue's takes until then
// (ring.holdStart): a backlog on several levels starts in level order from
// the first take. A queue without such a level is unchanged.
func (r *run[Req, Resp]) startLevels() {
	c := r.c
	if r.multi {
		for v := range c.nShards {
			r.presumed[v] = true // see newRun
		}
	}
	var classes []int
	for v, live := range c.levelsAtStart {
		if !live {
			continue
		}
		r.ring.addFeeder()
		r.places.addFeeder(c.realShard(v))
		r.presumed[v] = true
		classes = append(classes, r.class(v))
	}
	if len(classes) == 0 {
		return
	}
	if !r.multi {
		for v := range c.nShards {
			r.presumed[v] = true
			classes = append(classes, r.class(v))
		}
	}
	hold := 0
	if !c.opts.StrictPriority {
		for _, p := range r.presumed {
			if p {
				hold++
			}
		}
		r.startHeld = true
	}
	r.ring.holdStart(r.queue, classes, hold)
}

// newSoloPool returns the pool of a Consumer's own Run: one queue, with
// the consumer's Workers and Prefetch.
func newSoloPool[Req, Resp any](c *Consumer[Req, Resp]) (*pool, *run[Req, Resp]) {
	ring := newRing(c.opts.Prefetch, c.nShards)
	if c.opts.holdPrefetch {
		ring.groupReads = false // tests of a full ring read whatever room there is
	}
	p := newPool(ring, newReadAhead(c.opts.Workers, c.opts.Prefetch, c.opts.holdPrefetch), c.opts.Workers)
	r := newRun(c, ring, 0, c.opts.Prefetch)
	p.add(r)
	return p, r
}

// begin starts the queue's goroutines; the pool starts the workers.
func (r *run[Req, Resp]) begin(ctx context.Context) {
	o := &r.c.opts
	r.runCtx = ctx
	r.bg, r.cancelBg = context.WithCancel(context.WithoutCancel(ctx))
	r.handlerCtx, r.cancelHandlers = context.WithCancelCause(context.WithoutCancel(ctx))
	r.ring.assumePaused(r.queue) // until watchPause's first read says otherwise
	r.committers = make([]*committer[Req, Resp], len(r.c.shards))
	for shard := range r.committers {
		if !o.replyWait {
			r.lanes = append(r.lanes, newLanes(r.c.client, maxTicks))
		}
		var lanes []*lane
		if len(r.lanes) > shard {
			lanes = r.lanes[shard]
		}
		r.committers[shard] = newCommitter(r, shard, lanes)
		r.committers[shard].begin()
	}
	r.loops.Add(3)
	go r.leaseLoop()
	go r.heartbeatLoop()
	go r.watchPause()
	if o.RateLimit != nil {
		r.limiter = newLimiter(r)
		r.loops.Add(1)
		go r.limiter.loop()
	}
	if o.TrimInterval > 0 {
		r.loops.Add(1)
		go r.trimLoop()
	}
	r.loops.Add(r.c.nShards)
	for shard := range r.c.nShards {
		go r.promoteLoop(shard) // one per shard: its levels share the schedule
	}
	r.feeder.Add(len(r.c.shards))
	for shard := range r.c.shards {
		go r.feed(ctx, shard)
	}
}

func (r *run[Req, Resp]) committerOf(shard int) poker { return r.committers[shard] }

func (r *run[Req, Resp]) streams() int { return len(r.c.shards) }

func (r *run[Req, Resp]) feedersDone() { r.feeder.Wait() }

func (r *run[Req, Resp]) giveUp() { r.cancelBg() }

func (r *run[Req, Resp]) shutdownTimeout() time.Duration { return r.c.opts.ShutdownTimeout }

func (r *run[Req, Resp]) cancelHandlersCause(err error) { r.cancelHandlers(err) }

func (r *run[Req, Resp]) backgroundAdd() func() {
	r.c.background.Add(1)
	return r.c.background.Done
}

func (r *run[Req, Resp]) warn(ctx context.Context, msg string, args ...any) {
	r.c.log.WarnContext(ctx, msg, args...)
}

// finish runs the queue's shutdown steps once the workers ended: the
// drained slots are released, then outcomes are flushed, and only then do
// leases stop, because entries must stay leased until they are completed.
func (r *run[Req, Resp]) finish() {
	r.fetches.Wait()
	for _, c := range r.committers {
		for _, s := range c.drainHeld() {
			r.drain(s) // set aside while its shard's charges failed
		}
	}
	r.releaseUnstarted()
	for _, c := range r.committers {
		c.close() // sends every queued outcome, or gives up at the hard bound
	}
	for _, l := range r.lanes {
		closeLanes(l)
	}
	close(r.stopLoops)
	r.loops.Wait()
	r.cancelBg()
	r.cancelHandlers(nil)
}

// track records that this consumer owns s's entry, unless it holds that entry
// already, and reports whether it did.
func (r *run[Req, Resp]) track(s *slot) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	if _, held := r.owned[s.key()]; held {
		return false
	}
	r.owned[s.key()] = s
	return true
}

// forget drops slots whose entries are completed, released or left to a retry,
// and gives their places back to the ring and to their shards.
func (r *run[Req, Resp]) forget(slots ...*slot) {
	r.untrack(slots...)
	for _, s := range slots {
		if s.handedOff.Load() {
			r.ring.giveSettled(1)
			r.places.give(r.c.realShard(s.shard), 1)
		} else {
			r.givePlaces(s.shard, 1)
		}
	}
}

// reservePlaces blocks until the shard may hold at least one more entry and
// takes up to limit places, from the shard's share and from the ring. The
// feeder pushes at most that many slots and gives back the rest. onWait,
// when set, runs before the reservation first waits for places (see feed).
//
// It never waits for one budget while holding places of the other: when
// the ring has no room for the shard's class (its level's share is out),
// the shard's places go back before it waits, so the shard's other levels,
// whose classes may have room, read meanwhile. (Holding them, a level
// waiting for its share starved the shard's other levels until workers
// freed room; with every worker busy, a level could never be read.)
func (r *run[Req, Resp]) reservePlaces(ctx context.Context, shard, limit int, onWait func()) (int, error) {
	rs, class := r.c.realShard(shard), r.class(shard)
	var w ringWait
	for {
		n, err := r.places.reserve(ctx, rs, limit, onWait)
		if err != nil {
			r.ring.endWait(&w)
			return 0, err
		}
		got, wake := r.ring.tryReserveClass(class, n, &w)
		r.places.give(rs, n-got)
		if got > 0 {
			return got, nil
		}
		if onWait != nil && !w.paused {
			onWait()
			onWait = nil
		}
		if err := r.ring.awaitRoom(ctx, wake, &w); err != nil {
			return 0, err
		}
	}
}

// stepAside runs after a feeder's read of new entries came back empty (its
// stream is drained; an empty claim pass says nothing of that) and it gave its
// places back: while other feeders wait for places (of its shard, or of the
// ring), it waits until one of them got some, or for at most ReadBlock. A
// drained stream's feeder would otherwise take the places again at once
// (it is running; they wait to be woken), and with fewer places than
// feeders (Prefetch below the levels or queues read) a backlogged stream
// would never be read.
func (r *run[Req, Resp]) stepAside(ctx context.Context, shard int) {
	shardTurn, ringTurn := r.places.contended(r.c.realShard(shard)), r.ring.contended()
	if shardTurn == nil && ringTurn == nil {
		return
	}
	t := time.NewTimer(r.c.opts.ReadBlock)
	defer t.Stop()
	select {
	case <-shardTurn:
	case <-ringTurn:
	case <-t.C:
	case <-ctx.Done():
	}
}

// givePlaces returns n places of a shard (a stream: see Consumer.shards).
func (r *run[Req, Resp]) givePlaces(shard, n int) {
	r.ring.giveClass(r.class(shard), n)
	r.places.give(r.c.realShard(shard), n)
}

// class returns the ring class of stream index v (see ring).
func (r *run[Req, Resp]) class(v int) int { return classOf(r.queue, r.c.levelIndex(v)) }

// untrack stops renewing the leases of slots' entries.
func (r *run[Req, Resp]) untrack(slots ...*slot) {
	r.mu.Lock()
	for _, s := range slots {
		if r.owned[s.key()] == s {
			delete(r.owned, s.key())
		}
	}
	r.mu.Unlock()
}

// admit turns read, claimed or resumed entries of a shard into slots, pushes
// them into the places the feeder reserved, and returns how many it pushed.
// starts(i) is the number of handler starts of msgs[i] so far (0 for entries
// read as new); the slot's Deliveries is that plus one, the count its handler
// will see once charge.lua has recorded the start. An entry that already
// started MaxDeliveries times, or whose fields or request id are invalid, is
// dead-lettered without running. An entry this consumer already holds is
// skipped: a claim pass can return its own entries (resumed ones not yet
// leased, or after a lease outage), and a second slot would run the request
// twice. at is the mono time taken before the call that returned msgs: the
// entries' idle time was reset after it.
func (r *run[Req, Resp]) admit(shard int, msgs []redis.XMessage, at int64, starts func(i int) int) int {
	o := &r.c.opts
	admitted := 0
	now := time.Now()
	level := r.c.levelIndex(shard)
	for i, m := range msgs {
		n := starts(i)
		s := &slot{shard: shard, queue: r.queue, level: level, meta: parseMeta(m.Values, now)}
		s.entry = Entry{EntryID: m.ID, Deliveries: n + 1}
		id, idOK := m.Values[keys.FieldID].(string)
		data, dataOK := m.Values[keys.FieldPayload].(string)
		switch {
		case !idOK || !dataOK:
			s.entry.ID = id
			if validateID(id) != nil {
				s.entry.ID = "" // no record for an id Produce would refuse
			}
			s.entry.Deliveries = n
			s.dead = fmt.Sprintf("undecodable entry: fields %q and %q are required, got %s (was it written by another program?)",
				keys.FieldID, keys.FieldPayload, fieldNames(m.Values))
		case validateID(id) != nil:
			// Written by another program: the same rules as Produce, and no
			// record (the id cannot name one).
			s.entry.Data, s.entry.Deliveries = []byte(data), n
			s.dead = fmt.Sprintf("%v (id %s; Produce refuses it: was the entry written by another program?)",
				strings.TrimPrefix(validateID(id).Error(), "streamq: "), describeID(id))
		case n >= o.MaxDeliveries:
			s.entry.ID, s.entry.Data, s.entry.Deliveries = id, []byte(data), n
			s.dead = fmt.Sprintf("started %d times (MaxDeliveries=%d) without completing: its consumers crashed or lost it",
				n, o.MaxDeliveries)
		default:
			s.entry.ID, s.entry.Data = id, []byte(data)
		}
		s.entry.Headers = s.meta.headers
		if f, ok := m.Values[keys.FieldFetchFailures].(string); ok {
			s.fetchFailures, _ = strconv.Atoi(f)
		}
		if g, ok := m.Values[keys.FieldGroup].(string); ok && g != o.Group {
			s.skip, s.dead = true, "" // requeued for another group: acknowledge only
		}
		s.ownedAt.Store(at)
		s.earlier = n > 0
		if !r.track(s) {
			continue
		}
		admitted++
		r.startFetch(r.runCtx, s)
		r.ring.push(s)
	}
	return admitted
}

// describeID names a request id in a message: quoted, and cut when long.
func describeID(id string) string {
	const limit = 64
	if len(id) <= limit {
		return fmt.Sprintf("%q", id)
	}
	return fmt.Sprintf("%q... (%d bytes)", id[:limit], len(id))
}

func fieldNames(v map[string]any) string {
	names := make([]string, 0, len(v))
	for k := range v {
		names = append(names, fmt.Sprintf("%q", k))
	}
	if len(names) == 0 {
		return "no fields"
	}
	return strings.Join(names, ", ")
}

// recordFloor is how far ahead the in-flight record of an entry this consumer
// holds is kept alive: three lease periods past MinIdle, so a record outlives
// every lease renewal and the claim that follows a crash.
func (r *run[Req, Resp]) recordFloor() time.Duration { return 3 * r.c.opts.MinIdle }

// recordKey returns the key of s's record, or the stream's key when the
// entry has no record (the scripts skip it).
func (r *run[Req, Resp]) recordKey(shard int, s *slot) string {
	k := r.c.shards[shard]
	if s.entry.ID == "" {
		return k.Stream
	}
	return k.Record(s.entry.ID)
}
