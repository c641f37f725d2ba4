package streamq

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"runtime/debug"
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
	// Deliveries counts the deliveries of this request, this one included
	// (1 on the first). It is kept by Redis, so it counts crashed attempts too.
	Deliveries int
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
	// background counts goroutines that may outlive Run: shutdown work
	// still waiting on Redis when Run's bound passed.
	background sync.WaitGroup
}

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
// Redis errors are logged and retried; they do not end Run. Run returns an
// error only when the consumer is already running or the queue has another
// shard count (ErrShardMismatch).
func (c *Consumer[Req, Resp]) Run(ctx context.Context) error {
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
		if errors.Is(err, ErrShardMismatch) {
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

// waitBackground waits until the work that earlier Runs left behind (Redis
// calls still in flight when Run gave up waiting) has ended.
func (c *Consumer[Req, Resp]) waitBackground() { c.background.Wait() }

// ensureGroup creates the consumer group (and the stream) of a shard unless
// it exists.
func (c *Consumer[Req, Resp]) ensureGroup(ctx context.Context, shard int) error {
	stream := c.shards[shard].Stream
	err := c.client.XGroupCreateMkStream(ctx, stream, c.opts.Group, "0").Err()
	if err != nil && !strings.HasPrefix(err.Error(), "BUSYGROUP") {
		if strings.HasPrefix(err.Error(), "WRONGTYPE") {
			return fmt.Errorf("%w: %s is not a stream: %v", ErrWrongType, stream, err)
		}
		return fmt.Errorf("streamq: create group %q on %s: %w", c.opts.Group, stream, err)
	}
	return nil
}

// ensureGroupRetry checks the shard count and creates every shard's group,
// retrying until it succeeds or ctx ends.
func (c *Consumer[Req, Resp]) ensureGroupRetry(ctx context.Context) error {
	var b backoff
	for {
		err := checkShards(ctx, c.client, c.queue, len(c.shards), &c.metaOK)
		for shard := range c.shards {
			if err == nil {
				err = c.ensureGroup(ctx, shard)
			}
		}
		if err == nil {
			return nil
		}
		if errors.Is(err, ErrShardMismatch) {
			return err
		}
		c.log.Error("streamq: cannot create the consumer group; retrying", "err", err)
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
//   - completer senders (coalescer): record outcomes in batches, then untrack slots.
//   - leaser (leaseLoop): renews the leases of owned slots, marks lost ones.
//   - trimmer (trimLoop): trims the stream and prunes idle consumers.
//
// owned is shared by all of them and guarded by mu.
type run[Req, Resp any] struct {
	c    *Consumer[Req, Resp]
	ring *ring

	runCtx         context.Context // Run's ctx: ends reading and fetching
	bg             context.Context // outlives runCtx: completions, leases, releases
	cancelBg       context.CancelFunc
	handlerCtx     context.Context // parent of handler contexts
	cancelHandlers context.CancelCauseFunc

	mu    sync.Mutex
	owned map[ownedKey]*slot // from push until forgotten

	releaseMu sync.Mutex
	unstarted []*slot // slots drained at shutdown, to release

	completer *coalescer[*completion]
	fetches   sync.WaitGroup
	workers   sync.WaitGroup
	loops     sync.WaitGroup // leaser and trimmer
	feeder    sync.WaitGroup
	stopLoops chan struct{}
}

func newRun[Req, Resp any](c *Consumer[Req, Resp]) *run[Req, Resp] {
	return &run[Req, Resp]{
		c:         c,
		ring:      newRing(c.opts.Prefetch),
		owned:     make(map[ownedKey]*slot),
		stopLoops: make(chan struct{}),
	}
}

func (r *run[Req, Resp]) start(ctx context.Context) {
	o := &r.c.opts
	r.runCtx = ctx
	r.bg, r.cancelBg = context.WithCancel(context.WithoutCancel(ctx))
	r.handlerCtx, r.cancelHandlers = context.WithCancelCause(context.WithoutCancel(ctx))
	r.completer = newCoalescer(2, o.MaxCompleteBatch, 1<<62, 0,
		func(*completion) int { return 0 }, r.sendCompletions)
	r.workers.Add(o.Workers)
	for range o.Workers {
		go r.work()
	}
	r.loops.Add(1)
	go r.leaseLoop()
	if o.TrimInterval > 0 {
		r.loops.Add(1)
		go r.trimLoop()
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
		r.c.log.Warn("streamq: shutdown stopped waiting for Redis after 2×ShutdownTimeout; "+
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
	handlerTimeout.Stop()
	r.fetches.Wait()
	r.releaseUnstarted()
	r.completer.close()
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
// and gives their places back to the ring.
func (r *run[Req, Resp]) forget(slots ...*slot) {
	r.untrack(slots...)
	r.ring.give(len(slots))
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

// admit turns read or claimed entries of a shard into slots, pushes them into
// the places the feeder reserved, and returns how many it pushed. For claimed
// (or resumed) entries, deliveries are the deliveries so far and charge is
// set: the handler's start counts one more. Read entries were counted by the
// read. An entry this consumer already holds is skipped: a claim pass can
// return its own entries (resumed ones not yet leased, or after a lease
// outage), and a second slot would run the request twice.
func (r *run[Req, Resp]) admit(shard int, msgs []redis.XMessage, charge bool, deliveries func(i int) int) int {
	o := &r.c.opts
	admitted := 0
	for i, m := range msgs {
		s := &slot{shard: shard, charge: charge, ready: make(chan struct{})}
		s.entry = Entry{EntryID: m.ID, Deliveries: deliveries(i)}
		id, idOK := m.Values[fieldID].(string)
		data, dataOK := m.Values[fieldPayload].(string)
		switch {
		case !idOK || !dataOK:
			s.entry.ID = id
			s.dead = fmt.Sprintf("undecodable entry: fields %q and %q are required, got %s (was it written by another program?)",
				fieldID, fieldPayload, fieldNames(m.Values))
		case charge && s.entry.Deliveries >= o.MaxDeliveries, s.entry.Deliveries > o.MaxDeliveries:
			s.entry.ID, s.entry.Data = id, []byte(data)
			s.dead = fmt.Sprintf("delivered %d times (MaxDeliveries=%d) without completing: its consumers crashed or lost it",
				s.entry.Deliveries, o.MaxDeliveries)
		default:
			s.entry.ID, s.entry.Data = id, []byte(data)
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

// Entry field names.
const (
	fieldID      = "id"
	fieldPayload = "p"
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
	var last <-chan struct{} // closed when this worker's last outcome is recorded
	for s := range r.ring.slots {
		if r.runCtx.Err() != nil {
			r.drain(s)
			continue
		}
		select {
		case <-s.ready:
		case <-r.runCtx.Done():
		}
		if r.runCtx.Err() != nil { // also when the fetch ended with the shutdown
			r.drain(s)
			continue
		}
		if s.charge && last != nil {
			// A redelivered message may be the one that crashed an earlier
			// process: record this worker's last outcome before starting it, so
			// a crash cannot undo work that already succeeded.
			select {
			case <-last:
			case <-r.runCtx.Done():
				r.drain(s)
				continue
			}
		}
		r.process(s)
		if s.outcome != nil {
			last = s.outcome
		}
	}
}

// drain sets aside a slot that will not start, for release at shutdown.
func (r *run[Req, Resp]) drain(s *slot) {
	r.releaseMu.Lock()
	r.unstarted = append(r.unstarted, s)
	r.releaseMu.Unlock()
}

// process handles one ready slot and hands its outcome on.
func (r *run[Req, Resp]) process(s *slot) {
	if s.isLost() {
		r.forget(s)
		return
	}
	if s.dead != "" {
		r.deadLetter(s, s.dead)
		return
	}
	// The attempt starts here: a fetch failure counts like a handler failure.
	if s.charge && !r.chargeDelivery(s) {
		r.forget(s)
		return
	}
	if s.fetchErr != nil {
		r.fail(s, s.fetchErr)
		return
	}
	req, err := decode[Req](r.c.opts.Codec, s.data)
	if err != nil {
		r.deadLetter(s, "undecodable request: "+err.Error())
		return
	}
	ctx, cancel := context.WithCancelCause(r.handlerCtx)
	if !s.setCancel(cancel) {
		cancel(nil)
		r.forget(s)
		return
	}
	msg := &Message[Req]{ID: s.entry.ID, EntryID: s.entry.EntryID, Payload: req, Deliveries: s.entry.Deliveries}
	resp, err := r.call(ctx, msg)
	cancel(nil)
	if s.isLost() {
		r.c.log.Warn("streamq: message was claimed by another consumer while its handler ran; its outcome is dropped",
			"id", s.entry.ID, "entry", s.entry.EntryID)
		r.forget(s)
		return
	}
	if err != nil {
		r.fail(s, err)
		return
	}
	payload, err := encode(r.c.opts.Codec, resp)
	if err != nil {
		r.fail(s, Permanent(err))
		return
	}
	r.handOff(&completion{s: s, code: recordResult, value: payload})
}

// handOff passes an outcome to the completer and gives the slot's ring place
// back at once: the payload is no longer needed, and the ring refills while
// the outcome waits for its round trip. The entry stays tracked (leased) until
// its outcome is recorded. Outcomes in flight are bounded by the completer's
// channel, on which handOff blocks when Redis falls behind.
func (r *run[Req, Resp]) handOff(cp *completion) {
	cp.done = make(chan struct{})
	cp.s.outcome = cp.done
	cp.s.data = nil // the fetched payload
	if _, inline := r.c.opts.Fetcher.(InlineFetcher); inline && cp.code != recordDead {
		cp.s.entry.Data = nil // the payload itself; dead letters keep it
	}
	select {
	case r.completer.in <- cp:
	case <-r.bg.Done():
		// Shutdown gave up on Redis: the entry stays pending and is delivered
		// again later.
		r.untrack(cp.s)
		close(cp.done)
	}
	r.ring.give(1)
}

// chargeDelivery counts the delivery of a claimed or resumed entry as its
// handler starts, and reports whether the handler may run. It may not when
// another consumer owns the entry now, or the entry is gone. When Redis cannot
// be reached, the entry is left pending (it will be claimed again).
func (r *run[Req, Resp]) chargeDelivery(s *slot) bool {
	o := &r.c.opts
	n, err := scripts.Charge.Run(r.bg, r.c.client, []string{r.c.shards[s.shard].Stream},
		o.Group, o.Name, s.entry.EntryID).Int()
	switch {
	case err != nil:
		r.c.slots.onError(err)
		r.c.log.Warn("streamq: counting a delivery failed; leaving the entry to be claimed again",
			"id", s.entry.ID, "entry", s.entry.EntryID, "err", err)
		return false
	case n == -1:
		r.c.log.Info("streamq: a claimed entry was taken by another consumer before it started",
			"id", s.entry.ID, "entry", s.entry.EntryID)
		return false
	case n < 0:
		return false
	}
	s.entry.Deliveries = n
	s.charge = false
	return true
}

// call runs the handler, turning a panic into an error.
func (r *run[Req, Resp]) call(ctx context.Context, msg *Message[Req]) (resp Resp, err error) {
	defer func() {
		if v := recover(); v != nil {
			r.c.log.Error("streamq: handler panicked", "id", msg.ID, "entry", msg.EntryID, "panic", v, "stack", string(debug.Stack()))
			err = fmt.Errorf("handler panicked: %v", v)
		}
	}()
	return r.c.handler(ctx, msg)
}

// fail handles a failed attempt: dead-letter when the error is permanent or the
// deliveries are used up, else leave the entry pending and schedule its retry.
func (r *run[Req, Resp]) fail(s *slot, err error) {
	o := &r.c.opts
	if IsPermanent(err) || s.entry.Deliveries >= o.MaxDeliveries {
		r.deadLetter(s, err.Error())
		return
	}
	delay := retryDelay(o.RetryBackoff, s.entry.Deliveries, o.MinIdle)
	var ra retryAfterError
	if errors.As(err, &ra) {
		delay = min(max(ra.delay, 0), o.MinIdle)
	}
	r.c.log.Info("streamq: handler failed; will retry", "id", s.entry.ID, "entry", s.entry.EntryID,
		"deliveries", s.entry.Deliveries, "retry_in", delay, "err", err)
	r.retryAfter(s, delay)
}

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
	r.c.log.Warn("streamq: dead-lettering message", "id", s.entry.ID, "entry", s.entry.EntryID,
		"deliveries", s.entry.Deliveries, "reason", reason)
	r.handOff(&completion{s: s, code: recordDead, value: []byte(reason)})
}

// completion is the outcome of one message on its way to Redis.
type completion struct {
	s     *slot
	code  byte
	value []byte
	done  chan struct{} // closed once the outcome is recorded, or given up on
}

// sendCompletions records a batch of outcomes: one script call per shard.
func (r *run[Req, Resp]) sendCompletions(batch []*completion) {
	if len(r.c.shards) == 1 {
		r.completeShard(0, batch)
		return
	}
	groups := make(map[int][]*completion)
	for _, cp := range batch {
		groups[cp.s.shard] = append(groups[cp.s.shard], cp)
	}
	var wg sync.WaitGroup
	for shard, group := range groups {
		wg.Go(func() { r.completeShard(shard, group) })
	}
	wg.Wait()
}

// completeShard records the outcomes of one shard in one round trip: results
// first-writer-wins, XACK, XDEL, dead letters and the notice, atomically.
// It retries until Redis takes them or shutdown gives up; entries it gives up
// on stay pending and are reclaimed by another consumer later.
func (r *run[Req, Resp]) completeShard(shard int, batch []*completion) {
	o := &r.c.opts
	k := r.c.shards[shard]
	keyList := make([]string, 2, 2+len(batch))
	keyList[0], keyList[1] = k.Stream, k.DeadLetter
	store := "1"
	if o.DiscardResults {
		store = "0"
	}
	publish := "PUBLISH"
	if r.c.sharded {
		publish = "SPUBLISH"
	}
	args := make([]any, 8, 8+6*len(batch))
	args[0], args[1], args[2], args[3] = o.Group, k.Channel, o.ResultTTL.Milliseconds(), store
	args[4], args[5], args[6], args[7] = o.DeadLetterMaxLen, o.Name, time.Now().UnixMilli(), publish
	for _, cp := range batch {
		e := cp.s.entry
		if e.ID != "" {
			keyList = append(keyList, k.Record(e.ID))
		} else {
			keyList = append(keyList, k.DeadLetter)
		}
		var payload []byte
		if cp.code == recordDead {
			payload = e.Data
		}
		args = append(args, e.EntryID, e.ID, string(cp.code), cp.value, payload, e.Deliveries)
	}
	var b backoff
	for {
		err := scripts.Complete.Run(r.bg, r.c.client, keyList, args...).Err()
		if err == nil {
			break
		}
		if r.bg.Err() != nil {
			r.c.log.Error("streamq: gave up recording outcomes at shutdown; the entries stay pending and will be reclaimed",
				"entries", len(batch), "err", err)
			r.forgetCompletions(batch)
			return
		}
		r.c.log.Warn("streamq: recording outcomes failed; retrying", "entries", len(batch), "err", err)
		r.c.slots.onError(err)
		_ = sleepCtx(r.bg, b.next())
	}
	if fc, ok := o.Fetcher.(FetchCompleter); ok {
		var done []Entry
		for _, cp := range batch {
			if cp.code == recordResult {
				done = append(done, cp.s.entry)
			}
		}
		if len(done) > 0 {
			if err := fc.Completed(r.bg, done); err != nil {
				r.c.log.Warn("streamq: fetcher completion hook failed", "err", err)
			}
		}
	}
	r.forgetCompletions(batch)
}

func (r *run[Req, Resp]) forgetCompletions(batch []*completion) {
	slots := make([]*slot, len(batch))
	for i, cp := range batch {
		slots[i] = cp.s
		close(cp.done)
	}
	r.untrack(slots...) // their ring places were given back at hand-off
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
