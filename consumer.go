package streamq

// The consumer: the public type, Run, group creation, and the state of one
// Run (its start, its shutdown, admission of entries into slots).
//
// Goroutines: Run's caller waits in Run; one goroutine per Run creates the
// groups (ensureGroupRetry) and one runs the shutdown steps (run.stop). The
// rest are started by run.start and listed on the run type below.

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/streamq/streamq/internal/keys"
)

// Message is a request as a handler receives it.
type Message[Req any] struct {
	// ID is the request id given to Produce.
	ID string
	// EntryID is the stream entry id.
	EntryID string
	// Payload is the decoded request.
	Payload Req
	// Deliveries counts the handler starts of this request, this one included
	// (1 on the first). Each start is recorded in Redis before the handler
	// runs, so starts that crashed their process count too; entries that were
	// read, claimed or released without starting count nothing.
	Deliveries int
	// Headers are the request's headers (see Headers); nil when none.
	Headers map[string]string
	// ProducedAt, ReadAt and StartedAt time the message: see Delivery.
	ProducedAt, ReadAt, StartedAt time.Time
	// Deadline is the request's deadline (see Deadline); zero when none.
	Deadline time.Time
	// Priority is the request's priority level (see Priority).
	Priority PriorityLevel

	// tx is the shard's template (a Consumer's message that staged nothing)
	// or the Tx that Tx made.
	tx    *Tx
	link  messageLink // the run, for Progress and Children; nil when built by hand
	shard int
	flow  bool // a flow's parent (entry field "fp")
}

// Handler handles one request. Its context is cancelled when the consumer shuts
// down past its ShutdownTimeout, or when another consumer claimed the message
// (cause ErrLeaseLost). A returned error is retried (see MaxDeliveries) unless
// wrapped with Permanent; RetryAfter sets the delay. A panic is an error.
type Handler[Req, Resp any] func(ctx context.Context, m *Message[Req]) (Resp, error)

// Consumer handles the requests of one queue, as one member of a consumer group.
type Consumer[Req, Resp any] struct {
	client redis.UniversalClient
	queue  string
	// shards holds the consumer's streams: for level l (see levelNames) and
	// shard i, shards[l*nShards+i] names shard i's keys with the level's
	// stream. The first nShards are the shards' own streams (the default
	// level), so a slot's shard is an index into shards, one feeder and one
	// committer each; realShard maps it to its shard.
	shards  []keys.Keys
	nShards int
	sharded bool  // notices use sharded pub/sub (Redis Cluster)
	tx      []*Tx // per index of shards, the template Tx of its messages
	slots   *slotRefresher
	metaOK  atomic.Bool
	opts    ConsumerOptions
	handler Handler[Req, Resp]
	log     *slog.Logger
	running atomic.Bool
	// lastRun is the state of the latest Run, for tests to look into.
	lastRun atomic.Pointer[run[Req, Resp]]
	// onGrant, set by tests before Run, sees every rate-limit grant.
	onGrant func(now time.Time, first time.Duration, n int)
	// background counts goroutines that may outlive Run: shutdown work
	// still waiting on Redis when Run's bound passed.
	background sync.WaitGroup
	outcomes   outcomeCounts // reported by the heartbeat (heartbeat.go)
	ready      chan struct{} // closed once by markReady (see Ready)
	readyOnce  sync.Once
}

// Ready returns a channel that is closed once the consumer is working: a Run
// created (or found) its consumer groups and its first read of new entries
// succeeded. It stays closed after Run returns. Use it for a readiness
// probe, or in tests to produce only once the consumer reads; while Redis is
// unreachable at start (Run retries, unless FailFast), it stays open.
func (c *Consumer[Req, Resp]) Ready() <-chan struct{} { return c.ready }

func (c *Consumer[Req, Resp]) markReady() { c.readyOnce.Do(func() { close(c.ready) }) }

// NewConsumer returns a consumer of queue that calls handler for each request.
// opts may be nil for the defaults. It does not touch Redis; Run does.
func NewConsumer[Req, Resp any](client redis.UniversalClient, queue string, handler Handler[Req, Resp], opts *ConsumerOptions) (*Consumer[Req, Resp], error) {
	if client == nil {
		return nil, fmt.Errorf("%w: client is nil", ErrInvalidOptions)
	}
	if handler == nil {
		return nil, fmt.Errorf("%w: handler is nil", ErrInvalidOptions)
	}
	var o ConsumerOptions
	if opts != nil {
		o = *opts
	}
	if err := o.resolve(); err != nil {
		return nil, err
	}
	shards, err := keys.Shards(queue, o.Shards)
	if err != nil {
		return nil, fmt.Errorf("%w: %v", ErrInvalidOptions, err)
	}
	streams := make([]keys.Keys, 0, numLevels*len(shards))
	for _, name := range levelNames {
		for _, k := range shards {
			streams = append(streams, k.AtLevel(name))
		}
	}
	cluster := isCluster(client)
	return &Consumer[Req, Resp]{
		client:  client,
		queue:   queue,
		shards:  streams,
		nShards: len(shards),
		sharded: cluster,
		tx:      newTxShards(streams, cluster),
		slots:   newSlotRefresher(client),
		opts:    o,
		handler: handler,
		log:     o.Logger.With("queue", queue, "consumer", o.Name),
		ready:   make(chan struct{}),
	}, nil
}

// Name returns the consumer's name in its group.
func (c *Consumer[Req, Resp]) Name() string { return c.opts.Name }

// Run consumes until ctx ends, then shuts down gracefully and returns nil:
// it stops reading, lets running handlers finish (cancelling their contexts
// after ShutdownTimeout), records their outcomes, and releases the prefetched
// messages that had not started so other consumers take them at once. Run
// returns at most about 2×ShutdownTimeout after ctx ended, whatever Redis or
// the connection does (unreachable, stalled, cut): then it stops waiting, and
// Redis calls still in flight end in the background on the client's own
// timeouts. Entries whose outcome or release was not recorded by then stay
// pending and are delivered again later (after MinIdle); so is the entry of a
// handler that ignores its context's cancellation and is still running.
//
// On start it creates the consumer group if needed (from the start of the
// stream, so nothing produced earlier is missed), resumes its own pending
// entries, then reads new ones and claims idle entries of other consumers.
// Redis errors are logged and retried; they do not end Run (with FailFast,
// an error before the consumer is ready ends it). Run returns an error only
// when the consumer is already running, the queue has another shard count
// (ErrShardMismatch), another group answers the queue (ErrAnsweringGroup),
// the server is older than Redis 7.0 (ErrUnsupportedServer), a key of the
// queue holds another type (ErrWrongType), or the server refuses the client's
// credentials or permissions at start (ErrAccessDenied). Ready tells when the
// consumer is working.
func (c *Consumer[Req, Resp]) Run(ctx context.Context) error {
	mustContext(ctx, "Consumer.Run")
	if !c.running.CompareAndSwap(false, true) {
		return errors.New("streamq: Consumer.Run called while it is already running; use one Consumer per Run")
	}
	defer c.running.Store(false)
	if err := c.start(ctx); err != nil || ctx.Err() != nil {
		return err
	}
	p, r := newSoloPool(c)
	c.lastRun.Store(r)
	p.run(ctx)
	return nil
}

// fatalStartError reports whether Run must return err rather than retry:
// configuration that waiting does not fix.
func fatalStartError(err error) bool {
	return errors.Is(err, ErrShardMismatch) || errors.Is(err, ErrUnsupportedServer) ||
		errors.Is(err, ErrAnsweringGroup) || errors.Is(err, ErrWrongType) || errors.Is(err, ErrAccessDenied)
}

// ErrAnsweringGroup is returned by Run when the queue is answered by another
// consumer group: a queue has one answering group (the one whose outcomes
// callers receive), and every other group must be a fan-out group
// (ConsumerOptions.Fanout).
var ErrAnsweringGroup = errors.New("streamq: the queue has another answering consumer group")

// waitBackground waits until the work that earlier Runs left behind (Redis
// calls still in flight when Run gave up waiting) has ended.
func (c *Consumer[Req, Resp]) waitBackground() { c.background.Wait() }

// ensureGroup creates the consumer group (and the stream) of a shard unless
// it exists. It looks first: under maxmemory, Redis refuses XGROUP CREATE
// even when the group exists, and a consumer could not start.
//
// A fan-out consumer sets the shard's fan-out marker first (and a consumer
// that finds another group sets it too): completions delete entries only
// while it is absent, since another group may not have read them yet.
func (c *Consumer[Req, Resp]) ensureGroup(ctx context.Context, shard int) error {
	stream := c.shards[shard].Stream
	groups, err := c.client.XInfoGroups(ctx, stream).Result()
	others := false
	for _, g := range groups {
		others = others || g.Name != c.opts.Group
	}
	if c.opts.Fanout || others {
		if err := c.markFanout(ctx, shard); err != nil {
			return err
		}
	}
	if err == nil {
		for _, g := range groups {
			if g.Name == c.opts.Group {
				return nil
			}
		}
	}
	err = c.client.XGroupCreateMkStream(ctx, stream, c.opts.Group, "0").Err()
	if err != nil && !strings.HasPrefix(err.Error(), "BUSYGROUP") {
		if strings.HasPrefix(err.Error(), "WRONGTYPE") {
			return fmt.Errorf("%w: %s is not a stream: %v", ErrWrongType, stream, err)
		}
		return fmt.Errorf("streamq: create group %q on %s: %w", c.opts.Group, stream, err)
	}
	return nil
}

// markFanout sets the shard's fan-out marker unless it exists (reading
// first: under maxmemory Redis refuses the SET).
func (c *Consumer[Req, Resp]) markFanout(ctx context.Context, shard int) error {
	key := c.shards[shard].Fanout
	n, err := c.client.Exists(ctx, key).Result()
	if err == nil && n == 0 {
		err = c.client.Set(ctx, key, "1", 0).Err()
	}
	if err != nil {
		return fmt.Errorf("streamq: set the fan-out marker %s: %w", key, err)
	}
	return nil
}

// checkAnswering registers the group as the queue's answering group on first
// use, or checks that it is (a fan-out group checks that it is not). It reads
// before it writes, so that it works under maxmemory.
func (c *Consumer[Req, Resp]) checkAnswering(ctx context.Context) error {
	key := keys.AnsweringGroup(c.queue)
	got, err := c.client.Get(ctx, key).Result()
	if errors.Is(err, redis.Nil) && !c.opts.Fanout {
		if _, err = c.client.SetNX(ctx, key, c.opts.Group, 0).Result(); err == nil {
			got, err = c.client.Get(ctx, key).Result()
		}
	}
	switch {
	case errors.Is(err, redis.Nil): // a fan-out group before any answering one
		return nil
	case err != nil:
		return fmt.Errorf("streamq: read the answering group of %s: %w", c.queue, err)
	case c.opts.Fanout && got == c.opts.Group:
		return fmt.Errorf("%w: group %q answers queue %q, so its consumers cannot set Fanout", ErrAnsweringGroup, got, c.queue)
	case !c.opts.Fanout && got != c.opts.Group:
		return fmt.Errorf("%w: group %q answers queue %q; set ConsumerOptions.Fanout on group %q's consumers, or delete the key %s if the answering group was renamed",
			ErrAnsweringGroup, got, c.queue, c.opts.Group, key)
	}
	return nil
}

// ensureGroupRetry checks the shard count and creates every shard's group,
// retrying until it succeeds or ctx ends.
func (c *Consumer[Req, Resp]) ensureGroupRetry(ctx context.Context) error {
	var b backoff
	for {
		err := checkShards(ctx, c.client, c.queue, c.nShards, &c.metaOK, c.log)
		if err == nil {
			err = c.checkAnswering(ctx)
		}
		// The default level's streams; a level's feeder creates its group
		// once the level's stream exists (awaitLevel).
		for shard := range c.nShards {
			if err == nil {
				err = c.ensureGroup(ctx, shard)
			}
		}
		if err == nil {
			return nil
		}
		err = classifyRedisError(err)
		if fatalStartError(err) {
			return err
		}
		if ctx.Err() != nil {
			return ctx.Err() // Run's ctx ended while it started: no error to report
		}
		if c.opts.FailFast {
			return wrapf(err, "consumer start failed (FailFast)")
		}
		c.log.ErrorContext(ctx, "streamq: cannot create the consumer group; retrying", "err", err)
		if sleepCtx(ctx, b.next()) != nil {
			return ctx.Err()
		}
	}
}

// run is one queue's state in one Run call (of its Consumer, or of a
// MultiConsumer): everything but what the pool shares (the ring, its
// read-ahead and the workers; see pool).
//
// Goroutines and what they own (each file says the same at its top):
//   - feeders (feed, one per stream; autoclaim.go): resume, claim and read
//     entries, create slots, push them into places they reserved in the ring.
//   - fetch goroutines (prefetch.go): one per slot with a remote payload,
//     until the slot is ready.
//   - workers (pool.work, shared by the pool's queues): take slots in ring
//     order, ask the stream's committer to charge the start, run the
//     handler, queue the outcome.
//   - committers (committer.go, one loop per stream and its ticks in flight):
//     every write of the hot path, in one pipelined round trip per tick:
//     outcomes, retries and start charges; then forget the slots (their
//     places go back to the ring).
//   - leaser (leaseLoop): renews the leases of owned slots, marks lost ones.
//   - trimmer (trimLoop): trims the stream and prunes idle consumers.
//   - heartbeat (heartbeatLoop): records that this consumer is alive.
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

	committers []*committer[Req, Resp] // one per stream: shards fail independently
	lanes      [][]*lane               // per stream, the committer's connections (nil entries: none)
	places     *shardPlaces
	prefetch   int        // the places of the queue's shards together (its share of the pool's Prefetch)
	workers    int        // the pool's workers
	pause      *pauseGate // open while the queue is not paused (watchPause)
	limiter    *limiter   // nil without RateLimit

	fetches   sync.WaitGroup
	loops     sync.WaitGroup // leaser, trimmer and heartbeat
	feeder    sync.WaitGroup
	stopLoops chan struct{}
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
	return &run[Req, Resp]{
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
	}
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
		go r.committers[shard].loop()
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

func (r *run[Req, Resp]) committerOf(shard int) poker    { return r.committers[shard] }
func (r *run[Req, Resp]) streams() int                   { return len(r.c.shards) }
func (r *run[Req, Resp]) feedersDone()                   { r.feeder.Wait() }
func (r *run[Req, Resp]) giveUp()                        { r.cancelBg() }
func (r *run[Req, Resp]) shutdownTimeout() time.Duration { return r.c.opts.ShutdownTimeout }
func (r *run[Req, Resp]) cancelHandlersCause(err error)  { r.cancelHandlers(err) }

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
// feeder pushes at most that many slots and gives back the rest.
func (r *run[Req, Resp]) reservePlaces(ctx context.Context, shard, limit int) (int, error) {
	n, err := r.places.reserve(ctx, r.c.realShard(shard), limit)
	if err != nil {
		return 0, err
	}
	got, err := r.ring.reserveClass(ctx, r.class(shard), n)
	r.places.give(r.c.realShard(shard), n-got)
	return got, err
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

// realShard returns the shard of stream index v (see Consumer.shards): the
// levels of a shard share its places.
func (c *Consumer[Req, Resp]) realShard(v int) int { return v % c.nShards }

// levelIndex returns the level of stream index v (see levelNames).
func (c *Consumer[Req, Resp]) levelIndex(v int) int { return v / c.nShards }

// class returns the ring class of stream index v (see ring).
func (r *run[Req, Resp]) class(v int) int { return classOf(r.queue, r.c.levelIndex(v)) }

// shardPlaces splits Prefetch between the shards: a shard holds at most its
// share of entries (read, running, or handled and not yet recorded), so a
// shard whose completions fail stalls only itself.
type shardPlaces struct {
	mu   sync.Mutex
	free []int
	max  []int
	// wake[shard] is closed (and dropped) when the shard's free went up,
	// waking every feeder of the shard waiting in reserve; nil while none
	// waits.
	wake []chan struct{}
	// feeders counts the feeders sharing a shard's places (its default
	// level's, and one per priority level in use): one reservation takes
	// at most max/feeders, so a feeder that gives its places back and
	// takes them again at once cannot starve its shard's other levels.
	feeders []int
	turns   []turns // per shard: see stepAside
}

// turns lets a feeder whose read came back empty step aside for the feeders
// waiting for the places it gives back (see run.stepAside): without it, the
// drained feeder takes them again at once, before a waiting feeder wakes,
// and with fewer places than feeders a backlogged level (or queue) never
// reads. Guarded by its owner's mutex.
type turns struct {
	waiting int           // feeders blocked in a reservation
	taken   chan struct{} // closed when one of them got places; nil while none waits
}

// wait counts a feeder that starts waiting for places.
func (t *turns) wait() { t.waiting++ }

// done counts a waiting feeder that stopped waiting, with places (got) or
// without (its ctx ended, or its own limit stops it now).
func (t *turns) done(got bool) {
	t.waiting--
	if got && t.taken != nil {
		close(t.taken)
		t.taken = nil
	}
}

// contended returns a channel closed once a waiting feeder got places, or
// nil when none waits.
func (t *turns) contended() <-chan struct{} {
	if t.waiting == 0 {
		return nil
	}
	if t.taken == nil {
		t.taken = make(chan struct{})
	}
	return t.taken
}

func newShardPlaces(prefetch, shards int) *shardPlaces {
	p := &shardPlaces{free: make([]int, shards), max: make([]int, shards), wake: make([]chan struct{}, shards),
		feeders: make([]int, shards), turns: make([]turns, shards)}
	for i := range shards {
		n := prefetch / shards
		if i < prefetch%shards {
			n++
		}
		p.free[i], p.max[i] = max(n, 1), max(n, 1)
		p.feeders[i] = 1
	}
	return p
}

func (p *shardPlaces) share(shard int) int { return p.max[shard] }

func (p *shardPlaces) reserve(ctx context.Context, shard, limit int) (int, error) {
	waiting := false
	for {
		p.mu.Lock()
		n := min(p.free[shard], limit, max(1, p.max[shard]/p.feeders[shard]))
		p.free[shard] -= n
		left := p.free[shard]
		switch {
		case n > 0 && waiting:
			p.turns[shard].done(true)
		case n == 0 && !waiting:
			p.turns[shard].wait()
			waiting = true
		}
		if n > 0 {
			if left > 0 && p.feeders[shard] > 1 {
				p.signalLocked(shard) // another level's feeder may wait for the rest
			}
			p.mu.Unlock()
			return n, nil
		}
		if p.wake[shard] == nil {
			p.wake[shard] = make(chan struct{})
		}
		wake := p.wake[shard]
		p.mu.Unlock()
		select {
		case <-wake:
		case <-ctx.Done():
			p.mu.Lock()
			p.turns[shard].done(false)
			p.mu.Unlock()
			return 0, ctx.Err()
		}
	}
}

// contended returns a channel closed once a feeder waiting for the shard's
// places got some, or nil when none waits.
func (p *shardPlaces) contended(shard int) <-chan struct{} {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.turns[shard].contended()
}

func (p *shardPlaces) give(shard, n int) {
	if n == 0 {
		return
	}
	p.mu.Lock()
	p.free[shard] += n
	p.signalLocked(shard)
	p.mu.Unlock()
}

// signalLocked wakes the feeders waiting for the shard's places; mu is held.
func (p *shardPlaces) signalLocked(shard int) {
	if p.wake[shard] != nil {
		close(p.wake[shard])
		p.wake[shard] = nil
	}
}

// addFeeder counts one more feeder (a priority level's) sharing a shard's
// places.
func (p *shardPlaces) addFeeder(shard int) {
	p.mu.Lock()
	p.feeders[shard]++
	p.signalLocked(shard)
	p.mu.Unlock()
}

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
		s := &slot{shard: shard, queue: r.queue, level: level, ready: make(chan struct{}), meta: parseMeta(m.Values, now)}
		s.entry = Entry{EntryID: m.ID, Deliveries: n + 1}
		id, idOK := m.Values[fieldID].(string)
		data, dataOK := m.Values[fieldPayload].(string)
		switch {
		case !idOK || !dataOK:
			s.entry.ID = id
			if validateID(id) != nil {
				s.entry.ID = "" // no record for an id Produce would refuse
			}
			s.entry.Deliveries = n
			s.dead = fmt.Sprintf("undecodable entry: fields %q and %q are required, got %s (was it written by another program?)",
				fieldID, fieldPayload, fieldNames(m.Values))
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
		if f, ok := m.Values[fieldFetchFailures].(string); ok {
			s.fetchFailures, _ = strconv.Atoi(f)
		}
		if g, ok := m.Values[fieldGroup].(string); ok && g != o.Group {
			s.skip, s.dead = true, "" // requeued for another group: acknowledge only
		}
		s.ownedAt.Store(at)
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

// Entry field names.
const (
	fieldID      = "id"
	fieldPayload = "p"
	fieldGroup   = "g" // set by Requeue: only this group runs the entry
	// fieldFetchFailures counts the failed fetches in a row of a retried
	// entry (set by retry.lua); the handler did not start on any of them.
	fieldFetchFailures = "f"
)

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

// backoff is a capped exponential back-off for retrying Redis calls.
type backoff struct{ d time.Duration }

func (b *backoff) next() time.Duration {
	switch {
	case b.d == 0:
		b.d = 50 * time.Millisecond
	case b.d < 2*time.Second:
		b.d *= 2
	}
	return jitter(b.d)
}
