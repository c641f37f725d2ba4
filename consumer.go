package streamq

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"runtime/debug"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/streamq/streamq/internal/keys"
	"github.com/streamq/streamq/internal/scripts"
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
}

// Handler handles one request. Its context is cancelled when the consumer shuts
// down past its ShutdownTimeout, or when another consumer claimed the message
// (cause ErrLeaseLost). A returned error is retried (see MaxDeliveries) unless
// wrapped with Permanent; RetryAfter sets the delay. A panic is an error.
type Handler[Req, Resp any] func(ctx context.Context, m *Message[Req]) (Resp, error)

// Consumer handles the requests of one queue, as one member of a consumer group.
type Consumer[Req, Resp any] struct {
	client  redis.UniversalClient
	queue   string
	shards  []keys.Keys
	sharded bool // notices use sharded pub/sub (Redis Cluster)
	slots   *slotRefresher
	metaOK  atomic.Bool
	opts    ConsumerOptions
	handler Handler[Req, Resp]
	log     *slog.Logger
	running atomic.Bool
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
	return &Consumer[Req, Resp]{
		client:  client,
		queue:   queue,
		shards:  shards,
		sharded: isCluster(client),
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
	// go-redis does not interrupt a call when its context ends (unless the
	// client has ContextTimeoutEnabled): a call stalled on the connection
	// would hold Run for the client's timeouts. Run stops waiting for it.
	ready := make(chan error, 1)
	c.background.Add(1)
	go func() {
		defer c.background.Done()
		ready <- c.ensureGroupRetry(ctx)
	}()
	var err error
	select {
	case err = <-ready:
	case <-ctx.Done():
		select {
		case err = <-ready:
		default:
			err = ctx.Err()
		}
	}
	if err != nil {
		if fatalStartError(err) || (c.opts.FailFast && ctx.Err() == nil) {
			return err
		}
		return nil // ctx ended before Redis could be reached
	}
	r := newRun(c)
	r.start(ctx)
	<-ctx.Done()
	r.shutdown()
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
func (c *Consumer[Req, Resp]) ensureGroup(ctx context.Context, shard int) error {
	stream := c.shards[shard].Stream
	groups, err := c.client.XInfoGroups(ctx, stream).Result()
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
		err := checkShards(ctx, c.client, c.queue, len(c.shards), &c.metaOK, c.log)
		if err == nil {
			err = c.checkAnswering(ctx)
		}
		for shard := range c.shards {
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

// run is the state of one Run call.
//
// Goroutines and what they own:
//   - feeders (feed, one per shard): resume, claim and read entries, create
//     slots, push them into places they reserved in the ring.
//   - fetch goroutines: one per slot with a remote payload, until the slot is ready.
//   - workers (work): take slots in ring order, charge redelivered ones, run the
//     handler, hand outcomes on and give the ring place back.
//   - completer senders (one coalescer per shard): record outcomes in batches,
//     then forget the slots (their places go back to the ring).
//   - leaser (leaseLoop): renews the leases of owned slots, marks lost ones.
//   - trimmer (trimLoop): trims the stream and prunes idle consumers.
//   - heartbeat (heartbeatLoop): records that this consumer is alive.
//
// owned is shared by all of them and guarded by mu.
type run[Req, Resp any] struct {
	c     *Consumer[Req, Resp]
	ring  *ring
	ahead *readAhead // moves the ring's target with what the workers see

	runCtx         context.Context // Run's ctx: ends reading and fetching
	bg             context.Context // outlives runCtx: completions, leases, releases
	cancelBg       context.CancelFunc
	handlerCtx     context.Context // parent of handler contexts
	cancelHandlers context.CancelCauseFunc

	mu    sync.Mutex
	owned map[ownedKey]*slot // from push until forgotten

	releaseMu sync.Mutex
	unstarted []*slot // slots drained at shutdown, to release

	completers    []*coalescer[*completion] // one per shard: shards fail independently
	completeFixed []completeFixed           // per shard: complete.lua's fixed keys and arguments
	trouble       []*trouble                // per shard: set while its outcomes fail to record
	// holdResults: a worker's result may wait for its next start (not with
	// a FetchCompleter, whose hook would then delay that start).
	holdResults bool
	places      *shardPlaces
	charger     *coalescer[*chargeReq] // counts handler starts, many per round trip
	pause       *pauseGate             // open while the queue is not paused (watchPause)
	limiter     *limiter               // nil without RateLimit

	fetches   sync.WaitGroup
	handoffs  sync.WaitGroup // hand-offs waiting for a busy completer
	workers   sync.WaitGroup
	loops     sync.WaitGroup // leaser, trimmer and heartbeat
	feeder    sync.WaitGroup
	stopLoops chan struct{}
}

func newRun[Req, Resp any](c *Consumer[Req, Resp]) *run[Req, Resp] {
	ring := newRing(c.opts.Prefetch, len(c.shards))
	if c.opts.holdPrefetch {
		ring.groupReads = false // tests of a full ring read whatever room there is
	}
	return &run[Req, Resp]{
		c:         c,
		ring:      ring,
		ahead:     newReadAhead(c.opts.Workers, c.opts.Prefetch, c.opts.holdPrefetch),
		places:    newShardPlaces(c.opts.Prefetch, len(c.shards)),
		owned:     make(map[ownedKey]*slot),
		pause:     newPauseGate(),
		stopLoops: make(chan struct{}),
	}
}

func (r *run[Req, Resp]) start(ctx context.Context) {
	o := &r.c.opts
	r.runCtx = ctx
	r.ring.setTarget(r.ahead.current())
	r.bg, r.cancelBg = context.WithCancel(context.WithoutCancel(ctx))
	r.handlerCtx, r.cancelHandlers = context.WithCancelCause(context.WithoutCancel(ctx))
	r.completers = make([]*coalescer[*completion], len(r.c.shards))
	r.completeFixed = make([]completeFixed, len(r.c.shards))
	r.trouble = make([]*trouble, len(r.c.shards))
	for shard := range r.c.shards {
		r.completeFixed[shard] = r.completeFixedArgs(shard)
		r.trouble[shard] = newTrouble()
	}
	_, hooked := o.Fetcher.(FetchCompleter)
	r.holdResults = !hooked
	for shard := range r.completers {
		// Sends overlap (a batch holds at most half the shard's places); the
		// channel is small, sized by the batches, not by Prefetch, which can
		// be huge: handOff waits for a full channel in a goroutine of its own.
		share := r.places.share(shard)
		batch := min(o.MaxCompleteBatch, max(1, share/completeSplit))
		inflight := min(max(2, (share+batch-1)/batch), maxCompleteInflight)
		r.completers[shard] = newCoalescer(inflight, batch, 1<<62, 0,
			func(*completion) int { return 0 }, func(b []*completion) { r.completeShard(shard, b) })
	}
	r.charger = newCoalescer(2, maxChargeBatch, 1<<62, 0,
		func(*chargeReq) int { return 0 }, r.sendCharges)
	r.workers.Add(o.Workers)
	for range o.Workers {
		go r.work()
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
	r.loops.Add(len(r.c.shards))
	for shard := range r.c.shards {
		go r.promoteLoop(shard)
	}
	r.feeder.Add(len(r.c.shards))
	for shard := range r.c.shards {
		go r.feed(ctx, shard)
	}
}

// shutdown runs after Run's ctx ended and returns within about
// 2×ShutdownTimeout, whatever Redis does. The steps (see stop) run in their
// own goroutine: handlers get ShutdownTimeout; Redis work (the feeder's last
// read, outcomes, releases, leases) gets as long again. Then the background
// context is cancelled, which ends every retry loop, and shutdown returns even
// if a call is still stalled on the connection: go-redis does not interrupt
// it when its context ends (unless the client has ContextTimeoutEnabled), so
// it ends on the client's own timeouts, and the remaining steps then finish
// in the background, each failing fast. Entries whose outcome or release was
// not recorded stay pending and are claimed after MinIdle.
func (r *run[Req, Resp]) shutdown() {
	o := &r.c.opts
	timeout := time.AfterFunc(o.ShutdownTimeout, func() {
		r.cancelHandlers(fmt.Errorf("streamq: ShutdownTimeout (%v) elapsed", o.ShutdownTimeout))
	})
	gaveUp := make(chan struct{})
	hard := time.AfterFunc(2*o.ShutdownTimeout, func() {
		r.cancelBg()
		close(gaveUp)
	})
	done := make(chan struct{})
	r.c.background.Add(1)
	go func() {
		defer r.c.background.Done()
		defer close(done)
		r.stop(timeout)
	}()
	select {
	case <-done:
		hard.Stop()
	case <-gaveUp:
		r.c.log.WarnContext(r.runCtx, "streamq: shutdown stopped waiting for Redis after 2×ShutdownTimeout; "+
			"calls still in flight end on the client's timeouts, and unrecorded entries stay pending until claimed",
			"shutdown_timeout", o.ShutdownTimeout)
	}
}

// stop runs the shutdown steps in order: the feeders stop first (so no new
// slots appear), then workers finish or drain the ring, then the drained slots
// are released, then outcomes are flushed, and only then do leases stop,
// because entries must stay leased until they are completed.
func (r *run[Req, Resp]) stop(handlerTimeout *time.Timer) {
	r.feeder.Wait()
	r.ring.close()
	r.workers.Wait()
	r.charger.close()
	handlerTimeout.Stop()
	r.fetches.Wait()
	r.releaseUnstarted()
	r.handoffs.Wait() // before the completers close their channels
	for _, c := range r.completers {
		c.close()
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
		r.givePlaces(s.shard, 1)
	}
}

// reservePlaces blocks until the shard may hold at least one more entry and
// takes up to limit places, from the shard's share and from the ring. The
// feeder pushes at most that many slots and gives back the rest.
func (r *run[Req, Resp]) reservePlaces(ctx context.Context, shard, limit int) (int, error) {
	n, err := r.places.reserve(ctx, shard, limit)
	if err != nil {
		return 0, err
	}
	got, err := r.ring.reserve(ctx, n)
	r.places.give(shard, n-got)
	return got, err
}

// givePlaces returns n places of a shard.
func (r *run[Req, Resp]) givePlaces(shard, n int) {
	r.ring.give(n)
	r.places.give(shard, n)
}

// shardPlaces splits Prefetch between the shards: a shard holds at most its
// share of entries (read, running, or handled and not yet recorded), so a
// shard whose completions fail stalls only itself.
type shardPlaces struct {
	mu    sync.Mutex
	free  []int
	max   []int
	freed []chan struct{} // capacity 1 each: "the shard's free went up"
}

func newShardPlaces(prefetch, shards int) *shardPlaces {
	p := &shardPlaces{free: make([]int, shards), max: make([]int, shards), freed: make([]chan struct{}, shards)}
	for i := range shards {
		n := prefetch / shards
		if i < prefetch%shards {
			n++
		}
		p.free[i], p.max[i] = max(n, 1), max(n, 1)
		p.freed[i] = make(chan struct{}, 1)
	}
	return p
}

func (p *shardPlaces) share(shard int) int { return p.max[shard] }

func (p *shardPlaces) reserve(ctx context.Context, shard, limit int) (int, error) {
	for {
		p.mu.Lock()
		n := min(p.free[shard], limit)
		p.free[shard] -= n
		p.mu.Unlock()
		if n > 0 {
			return n, nil
		}
		select {
		case <-p.freed[shard]:
		case <-ctx.Done():
			return 0, ctx.Err()
		}
	}
}

func (p *shardPlaces) give(shard, n int) {
	if n == 0 {
		return
	}
	p.mu.Lock()
	p.free[shard] += n
	p.mu.Unlock()
	select {
	case p.freed[shard] <- struct{}{}:
	default:
	}
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
// twice.
func (r *run[Req, Resp]) admit(shard int, msgs []redis.XMessage, starts func(i int) int) int {
	o := &r.c.opts
	admitted := 0
	now := time.Now()
	for i, m := range msgs {
		n := starts(i)
		s := &slot{shard: shard, ready: make(chan struct{}), meta: parseMeta(m.Values, now)}
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

// work takes slots in ring order until the feeder closes the ring.
func (r *run[Req, Resp]) work() {
	defer r.workers.Done()
	// last[shard] is closed when this worker's last outcome of that shard is
	// recorded. Per shard: a shard that cannot complete must not hold up the
	// others' redelivered entries.
	last := make([]<-chan struct{}, len(r.c.shards))
	// held is this worker's last result, not handed off yet: it goes to
	// Redis with the next start charge when that slot is ready at once (one
	// round trip for both), and is handed off before anything that waits.
	var held *completion
	flush := func() {
		if held != nil {
			r.handOff(held)
			held = nil
		}
	}
	defer flush()
	for {
		var (
			s      *slot
			waited bool
			ok     bool
		)
		if held != nil {
			s, ok = r.ring.tryTake()
		}
		if !ok {
			flush()
			if s, waited, ok = r.ring.take(); !ok {
				return
			}
		}
		if r.runCtx.Err() != nil {
			flush()
			r.drain(s)
			continue
		}
		select {
		case <-s.ready:
		default:
			flush()
			waited = true
			select {
			case <-s.ready:
			case <-r.runCtx.Done():
			}
		}
		if t, changed := r.ahead.took(waited && r.ring.binding()); changed {
			r.ring.setTarget(t)
		}
		if r.runCtx.Err() != nil { // also when the fetch ended with the shutdown
			flush()
			r.drain(s)
			continue
		}
		if s.entry.Deliveries > 1 && last[s.shard] != nil {
			// A redelivered message may be the one that crashed an earlier
			// process: record this worker's last outcome before starting it, so
			// a crash cannot undo work that already succeeded.
			flush()
			select {
			case <-last[s.shard]:
			case <-r.runCtx.Done():
				r.drain(s)
				continue
			}
		}
		held = r.process(s, held)
		if s.outcome != nil {
			last[s.shard] = s.outcome
		}
	}
}

// drain sets aside a slot that will not start, for release at shutdown.
func (r *run[Req, Resp]) drain(s *slot) {
	r.releaseMu.Lock()
	r.unstarted = append(r.unstarted, s)
	r.releaseMu.Unlock()
}

// process handles one ready slot and hands its outcome on. held is the
// worker's previous result not yet handed off, or nil: it travels with this
// slot's start charge when both are of one shard, and is handed off first
// otherwise. process returns the slot's result when the handler succeeded,
// for the worker to hold the same way (nil when it was handed off).
func (r *run[Req, Resp]) process(s *slot, held *completion) *completion {
	// Every path that does not charge this slot's start hands held off
	// first, so outcomes reach the completer in the order they came.
	release := func() {
		if held != nil {
			r.handOff(held)
			held = nil
		}
	}
	if held != nil && (held.s.shard != s.shard || r.trouble[s.shard].isSet()) {
		release() // a shard whose outcomes fail takes no starts along
	}
	if s.isLost() {
		release()
		r.forget(s)
		return nil
	}
	if s.skip {
		release()
		r.handOff(&completion{s: s, code: recordSkip})
		return nil
	}
	if s.dead != "" {
		release()
		r.deadLetter(s, s.dead)
		return nil
	}
	// Wait while the queue is paused, then for a rate-limit token: neither
	// counts as a delivery, and the entry stays leased meanwhile. Nothing is
	// held while waiting.
	if !r.mayStart(release) {
		release()
		r.drain(s)
		return nil
	}
	if dl := s.meta.deadline; !dl.IsZero() && !time.Now().Before(dl) {
		// Not started, so not a delivery: the count stays what it was.
		release()
		s.entry.Deliveries--
		r.c.outcomes.failed.Add(1)
		r.deadLetter(s, fmt.Sprintf("%s: the deadline %s passed before a handler started it",
			ErrDeadlineExceeded.Error(), dl.UTC().Format(time.RFC3339Nano)))
		return nil
	}
	// A failed fetch is not a delivery: the handler does not start, so no
	// start is charged (see fetchFailed).
	if s.fetchErr != nil {
		release()
		r.fetchFailed(s, s.fetchErr)
		return nil
	}
	// The handler's start is charged here, before it runs (with the held
	// result, which is recorded first).
	charged := r.chargeDelivery(s, held)
	held = nil
	switch charged {
	case chargeSkip:
		r.forget(s)
		return nil
	case chargeStopped:
		r.drain(s)
		return nil
	}
	req, err := decode[Req](r.c.opts.Codec, s.data)
	if err != nil {
		r.deadLetter(s, "undecodable request: "+unprefixed(err))
		return nil
	}
	ctx, cancel := context.WithCancelCause(r.handlerCtx)
	if !s.setCancel(cancel) {
		cancel(nil)
		r.forget(s)
		return nil
	}
	hctx, stop := r.bound(ctx, s.meta.deadline)
	msg := &Message[Req]{ID: s.entry.ID, EntryID: s.entry.EntryID, Payload: req, Deliveries: s.entry.Deliveries,
		Headers: s.meta.headers, ProducedAt: entryTime(s.entry.EntryID), ReadAt: s.meta.readAt, StartedAt: time.Now(),
		Deadline: s.meta.deadline}
	resp, err := r.call(hctx, s, msg)
	stop()
	cancel(nil)
	if s.isLost() {
		r.c.log.WarnContext(s.logContext(r.runCtx), "streamq: message was claimed by another consumer while its handler ran; its outcome is dropped",
			"id", s.entry.ID, "entry", s.entry.EntryID, "deliveries", s.entry.Deliveries)
		r.forget(s)
		return nil
	}
	if err != nil {
		r.fail(s, err)
		return nil
	}
	payload, err := encode(r.c.opts.Codec, resp)
	if err != nil {
		r.fail(s, Permanent(err))
		return nil
	}
	cp := &completion{s: s, code: recordResult, value: payload}
	if !r.holdResults {
		r.handOff(cp)
		return nil
	}
	r.settle(cp)
	return cp
}

// handOff passes an outcome to its shard's completer. The slot keeps its
// place (the entry is held, and leased, until its outcome is recorded), so
// the entries a consumer holds never exceed Prefetch; the payload is dropped
// at once. The completer's channel has room for the shard's whole share, so
// handOff does not block on a shard whose completions fail.
func (r *run[Req, Resp]) handOff(cp *completion) {
	if cp.done == nil {
		r.settle(cp)
	}
	in := r.completers[cp.s.shard].in
	select {
	case in <- cp:
		return
	default:
	}
	// The shard's completer is behind (its Redis may be unreachable): wait in
	// a goroutine, so that this worker stays free for the other shards. At
	// most the shard's share of places can be waiting here.
	r.handoffs.Add(1)
	go func() {
		defer r.handoffs.Done()
		select {
		case in <- cp:
		case <-r.bg.Done():
			// Shutdown gave up on Redis: the entry stays pending and is
			// delivered again later.
			r.forget(cp.s)
			close(cp.done)
			cp.answerCharge(nil, errGaveUp)
		}
	}()
}

// settle marks the slot of an outcome as handed off (the lease loop no longer
// takes its leaving the pending list for a loss) and drops the payload. The
// outcome may still wait in its worker to travel with the next start.
func (r *run[Req, Resp]) settle(cp *completion) {
	cp.done = make(chan struct{})
	cp.s.outcome = cp.done
	cp.s.handedOff.Store(true)
	cp.s.data = nil // the fetched payload
	if _, inline := r.c.opts.Fetcher.(InlineFetcher); inline && cp.code != recordDead && cp.code != recordRetry {
		cp.s.entry.Data = nil // the payload itself; dead letters and retries keep it
	}
}

// errGaveUp answers a start charge that travelled with an outcome the
// completer gave up on at shutdown.
var errGaveUp = errors.New("streamq: shutdown gave up recording outcomes")

// maxCompleteInflight bounds the completion round trips of one shard in
// flight at once.
const maxCompleteInflight = 4

// maxChargeBatch bounds the entries of one charge.lua call.
const maxChargeBatch = 512

// chargeReq asks the charger to record the start of s's handler.
type chargeReq struct {
	shard int
	rec   string // the entry's record key (see recordKey)
	eid   string // the entry id
	seen  int    // the starts seen at admission
	n     int    // the starts including this one, or -1 / -2 (see charge.lua)
	err   error  // the script's error
	out   chan struct{}
}

// newChargeReq asks for the start of s's handler. It copies what the script
// needs: a worker that stops waiting for a charge (its shard's outcomes
// fail) goes on with the slot while the request may still be sent.
func (r *run[Req, Resp]) newChargeReq(s *slot) *chargeReq {
	return &chargeReq{shard: s.shard, rec: r.recordKey(s.shard, s), eid: s.entry.EntryID,
		seen: s.entry.Deliveries - 1, out: make(chan struct{})}
}

// Results of chargeDelivery.
const (
	chargeRun     = iota // counted: the handler may run
	chargeSkip           // another consumer owns the entry now, or it is gone
	chargeStopped        // shutdown began before the start could be counted
)

// chargeDelivery records, durably and before the handler runs, that s's
// handler starts, and sets s.entry.Deliveries to the starts including this
// one. Every start is counted, however the entry arrived; a start that is not
// recorded first would never be counted if the handler crashed the process.
// Concurrent workers' charges share round trips (the charger is a group
// commit). With held, the worker's previous result of the same shard, the
// charge goes with that outcome in one complete.lua call. A failed charge is
// retried (charge.lua is idempotent) until it succeeds or the consumer shuts
// down; the entry is then released unstarted.
func (r *run[Req, Resp]) chargeDelivery(s *slot, held *completion) int {
	var b backoff
	for {
		req := r.newChargeReq(s)
		if held != nil {
			held.charge = req
			r.handOff(held)
			held = nil
			// The completer answers, unless its shard's outcomes start
			// failing: then the charge goes on its own (it is idempotent,
			// so a late answer of this one counts nothing twice).
			select {
			case <-req.out:
			case <-r.trouble[s.shard].set():
				req = r.newChargeReq(s)
				r.charger.in <- req
				<-req.out
			}
		} else {
			r.charger.in <- req
			<-req.out
		}
		switch {
		case req.err == nil && req.n == -1:
			r.c.log.InfoContext(r.runCtx, "streamq: an entry was taken by another consumer before it started",
				"id", s.entry.ID, "entry", s.entry.EntryID)
			return chargeSkip
		case req.err == nil && req.n < 0:
			return chargeSkip
		case req.err == nil:
			s.entry.Deliveries = req.n
			return chargeRun
		}
		r.c.slots.onError(req.err)
		r.c.log.WarnContext(r.runCtx, "streamq: recording a handler start failed; retrying",
			"id", s.entry.ID, "entry", s.entry.EntryID, "err", req.err)
		if sleepCtx(r.runCtx, b.next()) != nil {
			return chargeStopped
		}
	}
}

// startsTTL is how long a group's start counts live after the last start of
// any of its entries (on that shard). Counts of completed entries are deleted
// at completion; this bounds what is left by entries removed otherwise (a
// deleted group, a stream deleted by hand).
const startsTTL = 7 * 24 * time.Hour

// sendCharges records a batch of handler starts: one charge.lua call per shard.
func (r *run[Req, Resp]) sendCharges(batch []*chargeReq) {
	byShard := make(map[int][]*chargeReq)
	for _, req := range batch {
		byShard[req.shard] = append(byShard[req.shard], req)
	}
	var wg sync.WaitGroup
	for shard, reqs := range byShard {
		wg.Go(func() { r.chargeShard(shard, reqs) })
	}
	wg.Wait()
}

func (r *run[Req, Resp]) chargeShard(shard int, reqs []*chargeReq) {
	o := &r.c.opts
	k := r.c.shards[shard]
	keyList := make([]string, 2, 2+len(reqs))
	keyList[0], keyList[1] = k.Stream, k.Starts(o.Group)
	args := make([]any, 4, 4+2*len(reqs))
	args[0], args[1], args[2], args[3] = o.Group, o.Name, r.recordFloor().Milliseconds(), startsTTL.Milliseconds()
	for _, req := range reqs {
		keyList = append(keyList, req.rec)
		args = append(args, req.eid, req.seen)
	}
	res, err := scripts.Charge.Run(r.bg, r.c.client, keyList, args...).Int64Slice()
	if err == nil && len(res) != len(reqs) {
		err = fmt.Errorf("streamq: charge: %d results for %d entries", len(res), len(reqs))
	}
	for i, req := range reqs {
		if err != nil {
			req.err = err
		} else {
			req.n = int(res[i])
		}
		close(req.out)
	}
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

// bound applies HandlerTimeout and the request's deadline to a handler's
// context; stop releases their timers.
// Without either it allocates nothing (the common case, once per job).
func (r *run[Req, Resp]) bound(ctx context.Context, deadline time.Time) (context.Context, func()) {
	t := r.c.opts.HandlerTimeout
	switch {
	case t <= 0 && deadline.IsZero():
		return ctx, noStop
	case deadline.IsZero():
		return context.WithTimeoutCause(ctx, t, ErrHandlerTimeout)
	case t <= 0:
		return context.WithDeadlineCause(ctx, deadline, ErrDeadlineExceeded)
	}
	ctx, stop0 := context.WithTimeoutCause(ctx, t, ErrHandlerTimeout)
	ctx, stop1 := context.WithDeadlineCause(ctx, deadline, ErrDeadlineExceeded)
	return ctx, func() { stop1(); stop0() }
}

// noStop is bound's stop when there is nothing to release.
func noStop() {}

// call runs the middleware and the handler, turning a panic into an error
// matching ErrPanic.
func (r *run[Req, Resp]) call(ctx context.Context, s *slot, msg *Message[Req]) (resp Resp, err error) {
	s.logCtx = ctx
	mws := r.c.opts.Middleware
	if len(mws) == 0 {
		defer r.recovered(ctx, "handler", msg, &err)
		return r.c.handler(ctx, msg)
	}
	defer r.recovered(ctx, "middleware", msg, &err)
	d := &Delivery{Queue: r.c.queue, Group: r.c.opts.Group, Consumer: r.c.opts.Name, Shard: s.shard,
		ID: msg.ID, EntryID: msg.EntryID, Deliveries: msg.Deliveries, MaxDeliveries: r.c.opts.MaxDeliveries,
		Headers: msg.Headers, ProducedAt: msg.ProducedAt, ReadAt: msg.ReadAt, StartedAt: msg.StartedAt,
		Deadline: msg.Deadline}
	err = chainMiddleware(ctx, mws, d, func(ctx context.Context) (err error) {
		s.logCtx = ctx // the middleware's context: log lines about the outcome join its trace
		defer r.recovered(ctx, "handler", msg, &err)
		resp, err = r.c.handler(ctx, msg)
		return err
	})
	if err != nil {
		var zero Resp
		resp = zero
	}
	return resp, err
}

// recovered, deferred, turns a panic of what into *err, matching ErrPanic.
func (r *run[Req, Resp]) recovered(ctx context.Context, what string, msg *Message[Req], err *error) {
	if v := recover(); v != nil {
		r.c.log.ErrorContext(ctx, "streamq: "+what+" panicked", "id", msg.ID, "entry", msg.EntryID,
			"deliveries", msg.Deliveries, "panic", v, "stack", string(debug.Stack()))
		*err = fmt.Errorf("%w: %v", ErrPanic, v)
	}
}

// fail handles a failed attempt: dead-letter when the error is permanent or the
// deliveries are used up, else hand the entry to its completer, which
// acknowledges it and schedules its retry in one step (retry.lua).
func (r *run[Req, Resp]) fail(s *slot, err error) {
	o := &r.c.opts
	r.c.outcomes.failed.Add(1)
	if IsPermanent(err) || s.entry.Deliveries >= o.MaxDeliveries {
		r.deadLetter(s, err.Error())
		return
	}
	delay := retryDelay(o.RetryBackoff, s.entry.Deliveries, o.RetryBackoffMax)
	var ra retryAfterError
	if errors.As(err, &ra) {
		delay = min(max(ra.delay, 0), maxDelay)
	}
	r.c.log.InfoContext(s.logContext(r.runCtx), "streamq: handler failed; will retry", "id", s.entry.ID, "entry", s.entry.EntryID,
		"deliveries", s.entry.Deliveries, "retry_in", delay, "err", err)
	// Round up: a retry never runs before its delay.
	ms := int64((delay + time.Millisecond - 1) / time.Millisecond)
	r.handOff(&completion{s: s, code: recordRetry, value: []byte(strconv.FormatInt(ms, 10))})
}

// fetchFailed handles a message whose payload could not be fetched (after
// FetchRetries): its handler did not start, so no start is charged and the
// failure is not a handler failure. The message is retried through the
// schedule like a failed handler, its fetch failures counted in the entry's
// field "f" (retry.lua), and dead-lettered when the error is permanent or
// after MaxDeliveries failed fetches in a row.
func (r *run[Req, Resp]) fetchFailed(s *slot, err error) {
	o := &r.c.opts
	s.entry.Deliveries-- // admit counted the start that did not happen
	failures := s.fetchFailures + 1
	if IsPermanent(err) || failures >= o.MaxDeliveries {
		r.c.outcomes.failed.Add(1)
		r.deadLetter(s, fmt.Sprintf("payload fetch failed %d times (the handler did not run): %s", failures, unprefixed(err)))
		return
	}
	delay := retryDelay(o.RetryBackoff, failures, o.RetryBackoffMax)
	r.c.log.WarnContext(s.logContext(r.runCtx), "streamq: fetch failed; will retry (the handler did not run)", "id", s.entry.ID, "entry", s.entry.EntryID,
		"fetch_failures", failures, "retry_in", delay, "err", err)
	ms := int64((delay + time.Millisecond - 1) / time.Millisecond)
	r.handOff(&completion{s: s, code: recordRetry, value: []byte(strconv.FormatInt(ms, 10) + retryFetchFailed)})
}

// retryFetchFailed ends the value of a recordRetry completion whose payload
// could not be fetched: retry.lua then counts the failure in field "f"
// instead of moving a start count that was not charged.
const retryFetchFailed = ":f"

// recordRetry is the completion of a failed attempt to retry after a delay
// (value: milliseconds): acknowledged and scheduled (retry.lua).
const recordRetry = 'T'

// retryDelay is the exponential back-off before delivery number deliveries+1:
// base * 2^(deliveries-1), with jitter, capped at limit.
func retryDelay(base time.Duration, deliveries int, limit time.Duration) time.Duration {
	d := base
	for i := 1; i < deliveries && d < limit; i++ {
		d *= 2
	}
	return min(jitter(d), limit)
}

// jitter returns a duration drawn uniformly from [d/2, d].
func jitter(d time.Duration) time.Duration {
	if d <= 1 {
		return d
	}
	return d/2 + rand.N(d/2+1)
}

func (r *run[Req, Resp]) deadLetter(s *slot, reason string) {
	// The caller's error reads "streamq: request dead-lettered: <reason>".
	reason = strings.TrimPrefix(reason, "streamq: ")
	r.c.log.WarnContext(s.logContext(r.runCtx), "streamq: dead-lettering message", "id", s.entry.ID, "entry", s.entry.EntryID,
		"deliveries", s.entry.Deliveries, "reason", reason)
	r.handOff(&completion{s: s, code: recordDead, value: []byte(reason)})
}

// completeSplit: a completion batch holds at most 1/completeSplit of a shard's
// places, so that a second send starts while one is in flight instead of
// the ring waiting for each round trip.
const completeSplit = 2

// recordSkip completes an entry requeued for another group: acknowledged,
// nothing recorded.
const recordSkip = 'S'

// completion is the outcome of one message on its way to Redis.
type completion struct {
	s     *slot
	code  byte
	value []byte
	done  chan struct{} // closed once the outcome is recorded, or given up on
	// charge is the start of the worker's next slot (same shard), counted in
	// the same complete.lua call, or nil.
	charge *chargeReq
}

// answerCharge wakes the worker waiting for the start charge that travelled
// with cp, if any, with the count or the error.
func (cp *completion) answerCharge(n *int64, err error) {
	req := cp.charge
	if req == nil {
		return
	}
	cp.charge = nil
	if err != nil {
		req.err = err
	} else {
		req.n = int(*n)
	}
	close(req.out)
}

// completeShard records the outcomes of one shard in one round trip: XACK,
// XDEL, results first-writer-wins, dead letters and the notice, atomically
// (a fan-out group only acknowledges and dead-letters to its own stream).
// It retries until Redis takes them or shutdown gives up; entries it gives up
// on stay pending and are reclaimed by another consumer later. Each shard has
// its own completer, so a shard that fails here stalls only itself.
func (r *run[Req, Resp]) completeShard(shard int, batch []*completion) {
	all := batch
	var retries []*completion
	rest := batch[:0:0]
	for _, cp := range batch {
		if cp.code == recordRetry {
			retries = append(retries, cp)
		} else {
			rest = append(rest, cp)
		}
	}
	if len(retries) > 0 && !r.retryShard(shard, retries) {
		r.forgetCompletions(all)
		return
	}
	if len(rest) == 0 {
		r.forgetCompletions(all)
		return
	}
	batch = rest
	var charged []*completion // outcomes with a start charge travelling along
	for _, cp := range batch {
		if cp.charge != nil {
			charged = append(charged, cp)
		}
	}
	keyList, args := r.completeArgs(shard, batch, charged)
	var b backoff
	for {
		res, err := scripts.Complete.Run(r.bg, r.c.client, keyList, args...).Int64Slice()
		if err == nil && len(res) != len(charged) {
			err = fmt.Errorf("streamq: complete: %d start counts for %d starts", len(res), len(charged))
		}
		if err == nil {
			r.trouble[shard].clear()
			// The workers start before anything slow (the fetcher's hook).
			for i, cp := range charged {
				cp.answerCharge(&res[i], nil)
			}
			break
		}
		r.trouble[shard].raise()
		if len(charged) > 0 {
			// The workers charge on their own (the charge is idempotent);
			// the outcomes are retried without the starts.
			for _, cp := range charged {
				cp.answerCharge(nil, err)
			}
			charged = nil
			keyList, args = r.completeArgs(shard, batch, nil)
		}
		if r.bg.Err() != nil {
			r.c.log.ErrorContext(r.runCtx, "streamq: gave up recording outcomes at shutdown; the entries stay pending and will be reclaimed",
				"entries", len(batch), "err", err)
			r.forgetCompletions(all)
			return
		}
		r.c.log.WarnContext(r.runCtx, "streamq: recording outcomes failed; retrying", "entries", len(batch), "stream", r.c.shards[shard].Stream, "err", err)
		r.c.slots.onError(err)
		_ = sleepCtx(r.bg, b.next())
	}
	o := &r.c.opts
	r.c.outcomes.countRecorded(batch)
	if fc, ok := o.Fetcher.(FetchCompleter); ok {
		var done []Entry
		for _, cp := range batch {
			if cp.code == recordResult {
				done = append(done, cp.s.entry)
			}
		}
		if len(done) > 0 {
			if err := fc.Completed(r.bg, done); err != nil {
				r.c.log.WarnContext(r.runCtx, "streamq: fetcher completion hook failed", "err", err)
			}
		}
	}
	r.forgetCompletions(all)
}

// completeFixed holds what stays the same in every complete.lua call of a
// shard in one run, built (and boxed) once: the dead-letter and start-count
// keys, and the fixed arguments with placeholders for the time (6) and the
// number of starts (9).
type completeFixed struct {
	dead, starts string
	args         []any
}

func (r *run[Req, Resp]) completeFixedArgs(shard int) completeFixed {
	o := &r.c.opts
	k := r.c.shards[shard]
	f := completeFixed{dead: k.DeadLetter, starts: k.Starts(o.Group)}
	if o.Fanout {
		f.dead = k.GroupDeadLetter(o.Group)
	}
	store, fanout, publish := "1", "0", "PUBLISH"
	if o.DiscardResults {
		store = "0"
	}
	if o.Fanout {
		fanout = "1"
	}
	if r.c.sharded {
		publish = "SPUBLISH"
	}
	f.args = []any{o.Group, k.Channel, o.ResultTTL.Milliseconds(), store,
		o.DeadLetterMaxLen, o.Name, nil, publish, fanout, nil, r.recordFloor().Milliseconds(), startsTTL.Milliseconds()}
	return f
}

// completeArgs builds the keys and arguments of a complete.lua call for a
// shard's outcomes and the start charges travelling with some of them.
func (r *run[Req, Resp]) completeArgs(shard int, batch, charged []*completion) ([]string, []any) {
	o := &r.c.opts
	k := r.c.shards[shard]
	fixed := &r.completeFixed[shard]
	dead := fixed.dead
	keyList := make([]string, 2, 3+len(batch)+len(charged))
	keyList[0], keyList[1] = k.Stream, dead
	args := make([]any, 12, 12+6*len(batch)+2*len(charged))
	copy(args, fixed.args)
	args[6], args[9] = time.Now().UnixMilli(), len(charged)
	for _, cp := range batch {
		e := cp.s.entry
		if e.ID != "" && !o.Fanout {
			keyList = append(keyList, k.Record(e.ID))
		} else {
			keyList = append(keyList, dead)
		}
		var payload []byte
		value := cp.value
		if cp.code == recordDead {
			payload = e.Data
		} else if o.Fanout {
			value = nil // a fan-out group records no result
		}
		args = append(args, e.EntryID, e.ID, codeArg[cp.code], value, payload, e.Deliveries)
	}
	for _, cp := range charged {
		keyList = append(keyList, cp.charge.rec)
		args = append(args, cp.charge.eid, cp.charge.seen)
	}
	keyList = append(keyList, fixed.starts) // last: complete.lua drops and counts starts there
	return keyList, args
}

// codeArg holds the outcome codes of complete.lua boxed once.
var codeArg = [256]any{recordResult: "R", recordFailed: "E", recordDead: "L", recordSkip: "S", recordRetry: "T"}

// forgetCompletions forgets the slots of recorded (or abandoned) outcomes:
// their places go back to the ring only now, so that handled entries whose
// outcome waits for Redis count against Prefetch.
func (r *run[Req, Resp]) forgetCompletions(batch []*completion) {
	slots := make([]*slot, len(batch))
	for i, cp := range batch {
		slots[i] = cp.s
		close(cp.done)
		cp.answerCharge(nil, errGaveUp) // a start that did not go (any longer)
	}
	r.forget(slots...)
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

// trouble signals that a shard's outcomes fail to record: set() is closed
// while they do. A worker waiting for a start charge that travels with an
// outcome of that shard stops waiting and charges on its own, so a shard
// that cannot record outcomes stalls only its outcomes, not the workers.
type trouble struct {
	mu sync.Mutex
	ch chan struct{} // closed while the shard's last send failed
}

func newTrouble() *trouble { return &trouble{ch: make(chan struct{})} }

func (t *trouble) set() <-chan struct{} {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.ch
}

func (t *trouble) isSet() bool {
	select {
	case <-t.set():
		return true
	default:
		return false
	}
}

// raise marks the shard failing and wakes those waiting on set.
func (t *trouble) raise() {
	t.mu.Lock()
	defer t.mu.Unlock()
	select {
	case <-t.ch:
	default:
		close(t.ch)
	}
}

// clear marks the shard recording again.
func (t *trouble) clear() {
	t.mu.Lock()
	defer t.mu.Unlock()
	select {
	case <-t.ch:
		t.ch = make(chan struct{})
	default:
	}
}
