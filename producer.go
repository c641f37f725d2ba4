package streamq

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/streamq/streamq/internal/keys"
)

// Producer submits requests to a queue and delivers their results.
//
// Requests are identified by an id: any number of producers, in any number of
// processes, submitting one id while its record lives cause one stream entry and
// one handler execution, and all of them get the same result. A Producer is safe
// for concurrent use; concurrent Produce calls are coalesced into shared round
// trips with no added wait.
type Producer[Req, Resp any] struct {
	client  redis.UniversalClient
	queue   string
	shards  []keys.Keys // one per shard; shard i holds the ids keys.ShardOf maps to i
	sharded bool        // notices use sharded pub/sub (Redis Cluster)
	slots   *slotRefresher
	opts    ProducerOptions
	log     *slog.Logger

	// lifetime is cancelled by Close once the accepted requests are sent (or
	// CloseTimeout ran out); sends, setup attempts and the loops use it.
	lifetime context.Context
	cancel   context.CancelFunc
	// closing is closed first thing by Close: callers blocked on the budget,
	// the coalescer channel or a setup attempt give up with ErrClosed.
	closing chan struct{}

	// mu guards closed, the sends on batcher.in and the Adds to batches. It is
	// never held across Redis I/O, and a holder blocked on a send also watches
	// closing, so Close takes it promptly.
	mu     sync.RWMutex
	closed bool

	batcher *coalescer[*produceItem]
	budget  *byteBudget
	waiters *waiters
	sends   sendTracker // requests Send accepted, for Flush
	// flowQueues caches, per queue name, the keys of a queue other than this
	// one that a flow's children went to (ProduceFlow): name -> []keys.Keys.
	flowQueues sync.Map

	metaOK     atomic.Bool // the queue's recorded shard count matches ours
	subscribed atomic.Bool // subs are confirmed and the loops run

	// setupMu guards the fields below. It is held only for bookkeeping, never
	// across Redis I/O: the shard-count check and the subscription each run in
	// a goroutine of their own (one attempt at a time), which callers wait for
	// with their own contexts.
	setupMu  sync.Mutex
	metaTry  *attempt        // shard-count check in progress
	subTry   *attempt        // subscription in progress
	subs     []*redis.PubSub // confirmed subscriptions, one per shard
	trying   []*redis.PubSub // subscriptions of the attempt in progress
	stopping bool            // Close is stopping the goroutines: start none

	kick    chan struct{}  // asks the backstop loop for a check now
	loops   sync.WaitGroup // listeners, backstop, setup attempts, subscription closers
	batches sync.WaitGroup // ProduceBatch round trips in flight
	stopped chan struct{}  // closed when every goroutine of the producer has ended (after Close)
	closeO  sync.Once
}

// setupTimeout bounds one attempt at recording the shard count or at
// subscribing to completion notices; a failed attempt is retried by the next call.
const setupTimeout = 10 * time.Second

// NewProducer returns a producer for queue. opts may be nil for the defaults.
// It does not touch Redis: the first Produce subscribes to completion notices.
func NewProducer[Req, Resp any](client redis.UniversalClient, queue string, opts *ProducerOptions) (*Producer[Req, Resp], error) {
	if client == nil {
		return nil, fmt.Errorf("%w: client is nil", ErrInvalidOptions)
	}
	var o ProducerOptions
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
	p := &Producer[Req, Resp]{
		client:  client,
		queue:   queue,
		shards:  shards,
		sharded: isCluster(client),
		slots:   newSlotRefresher(client),
		opts:    o,
		log:     o.Logger.With("queue", queue),
		budget:  newByteBudget(o.MaxPendingBytes),
		waiters: newWaiters(),
		kick:    make(chan struct{}, 1),
		closing: make(chan struct{}),
		stopped: make(chan struct{}),
	}
	p.lifetime, p.cancel = context.WithCancel(context.Background())
	p.batcher = newCoalescer(o.Concurrency, o.MaxBatchItems, o.MaxBatchBytes, o.Linger,
		(*produceItem).size, p.sendCoalesced)
	return p, nil
}

// Produce submits a request and returns a promise of its result.
//
// It returns once Redis has recorded the request: appended it to the stream,
// attached it to an earlier request with the same id that is still in flight, or
// found that id's stored result (the promise is then already resolved). A nil
// error means the request will be handled (at least once) unless it is
// dead-lettered. When ctx ends first, Produce returns ctx's error at once,
// whatever the connection does, and the outcome is unknown: producing the same
// id again is safe and attaches to the request if it was recorded.
//
// The first Produce (or ProduceBatch) subscribes to completion notices; callers
// wait for that with their own contexts, and an attempt that Redis does not
// confirm within 10s fails and is tried again by the next call.
//
// A promise costs a map entry, and a periodic record check, until its request
// completes or the promise is released: call Promise.Release when the result is
// no longer wanted, and use Enqueue for fire-and-forget. A nil ctx panics.
func (p *Producer[Req, Resp]) Produce(ctx context.Context, id string, req Req, opts ...ProduceOption) (*Promise[Resp], error) {
	mustContext(ctx, "Producer.Produce")
	if len(p.opts.Interceptors) == 0 {
		return p.produce(ctx, id, req, opts, nil, false)
	}
	var pr *Promise[Resp]
	err := p.intercept(ctx, []string{id}, [][]ProduceOption{opts}, func(ctx context.Context, outs []*Outgoing) error {
		h, set := headersOf(outs, 0)
		var err error
		pr, err = p.produce(ctx, id, req, opts, h, set)
		if err == nil && outs != nil {
			outs[0].EntryID = pr.EntryID()
		}
		return err
	})
	if err != nil {
		if pr != nil {
			pr.Release()
		}
		return nil, err
	}
	return pr, nil
}

// produce is Produce inside the interceptors.
func (p *Producer[Req, Resp]) produce(ctx context.Context, id string, req Req, opts []ProduceOption,
	headers map[string]string, headersSet bool) (*Promise[Resp], error) {
	it, err := p.newItem(ctx, id, req, opts, headers, headersSet)
	if err != nil {
		return nil, err
	}
	if err := p.ensureSubscribed(ctx); err != nil {
		return nil, err
	}
	c := p.waiters.acquire(id)
	out, err := p.submit(ctx, it)
	if err != nil {
		p.waiters.drop(id, c)
		return nil, err
	}
	return p.settle(id, c, out)
}

// Enqueue submits a request without waiting for its result: fire-and-forget.
// It has Produce's deduplication, its meaning of a nil error and its handling
// of ctx, but needs no subscription and keeps nothing in memory once it
// returns. A nil ctx panics.
func (p *Producer[Req, Resp]) Enqueue(ctx context.Context, id string, req Req, opts ...ProduceOption) error {
	mustContext(ctx, "Producer.Enqueue")
	if len(p.opts.Interceptors) == 0 {
		_, err := p.enqueue(ctx, id, req, opts, nil, false)
		return err
	}
	return p.intercept(ctx, []string{id}, [][]ProduceOption{opts}, func(ctx context.Context, outs []*Outgoing) error {
		h, set := headersOf(outs, 0)
		entryID, err := p.enqueue(ctx, id, req, opts, h, set)
		if err == nil && outs != nil {
			outs[0].EntryID = entryID
		}
		return err
	})
}

// enqueue is Enqueue inside the interceptors; it returns the entry id.
func (p *Producer[Req, Resp]) enqueue(ctx context.Context, id string, req Req, opts []ProduceOption,
	headers map[string]string, headersSet bool) (string, error) {
	it, err := p.newItem(ctx, id, req, opts, headers, headersSet)
	if err != nil {
		return "", err
	}
	if err := p.ensureMeta(ctx); err != nil {
		return "", err
	}
	out, err := p.submit(ctx, it)
	if err != nil {
		return "", err
	}
	switch out.code {
	case outcomeRejected:
		return "", fmt.Errorf("%w: request %q: %s", ErrWrongType, id, out.data)
	case outcomeAppended, outcomeInflight:
		return out.data, nil
	}
	return "", nil
}

// errClosedUnknown is returned to a caller whose request was still being sent
// when Close gave up waiting (CloseTimeout).
var errClosedUnknown = fmt.Errorf("%w before Redis answered: the request may or may not be recorded; producing its id again is safe", ErrClosed)

// Close flushes the requests already accepted, then stops the producer. Promises
// still waiting resolve with ErrClosed; their requests are still handled, and a
// new producer gets their results by producing the same ids. Close is idempotent.
//
// Close returns within CloseTimeout whatever the connection does: requests whose
// round trip has not ended by then get an ErrClosed whose outcome is unknown,
// and goroutines still blocked in a Redis call end when that call returns
// (after the client's ReadTimeout).
func (p *Producer[Req, Resp]) Close() error {
	p.closeO.Do(func() {
		bound, cancel := context.WithTimeout(context.Background(), p.opts.CloseTimeout)
		defer cancel()
		close(p.closing)
		p.mu.Lock()
		p.closed = true
		p.mu.Unlock()
		flushed := make(chan struct{})
		go func() {
			p.batcher.close()
			p.batches.Wait()
			close(flushed)
		}()
		select {
		case <-flushed:
		case <-bound.Done():
			p.log.WarnContext(bound, "streamq: Close gave up waiting for requests still being sent; their callers get ErrClosed",
				"close_timeout", p.opts.CloseTimeout)
		}
		p.cancel()
		p.setupMu.Lock()
		p.stopping = true
		subs := append(append([]*redis.PubSub(nil), p.subs...), p.trying...)
		p.setupMu.Unlock()
		// A PubSub's Close waits for a connection setup in progress: never
		// block Close itself on it.
		for _, ps := range subs {
			p.loops.Add(1)
			go func() {
				defer p.loops.Done()
				_ = ps.Close()
			}()
		}
		go func() {
			<-flushed
			p.loops.Wait()
			close(p.stopped)
		}()
		select {
		case <-p.stopped:
		case <-bound.Done():
			p.log.WarnContext(bound, "streamq: Close returns while a Redis call is still blocked; its goroutine ends when the call returns",
				"close_timeout", p.opts.CloseTimeout)
		}
		p.waiters.failAll(ErrClosed)
	})
	return nil
}

// newItem validates and encodes one request and applies its options.
// headers, when set, replace the options' headers (a ProduceInterceptor
// changed them).
func (p *Producer[Req, Resp]) newItem(ctx context.Context, id string, req Req, opts []ProduceOption,
	headers map[string]string, headersSet bool) (*produceItem, error) {
	if err := validateID(id); err != nil {
		return nil, err
	}
	payload, err := encode(p.opts.Codec, req)
	if err != nil {
		return nil, err
	}
	if len(payload) > p.opts.MaxPayloadBytes {
		return nil, fmt.Errorf("%w: request %q encodes to %d bytes, the limit is MaxPayloadBytes=%d",
			ErrPayloadTooLarge, id, len(payload), p.opts.MaxPayloadBytes)
	}
	it := &produceItem{ctx: ctx, id: id, shard: keys.ShardOf(id, len(p.shards)), payload: payload}
	settings := applyProduceOptions(opts)
	if headersSet {
		settings.headers = headers
	}
	if err := it.apply(settings); err != nil {
		return nil, fmt.Errorf("request %q: %w", id, err)
	}
	if n := len(payload) + it.headerBytes; n > p.opts.MaxPayloadBytes {
		return nil, fmt.Errorf("%w: request %q encodes to %d bytes with its headers, the limit is MaxPayloadBytes=%d",
			ErrPayloadTooLarge, id, n, p.opts.MaxPayloadBytes)
	}
	// An item is its id, payload and extra fields; it must fit one round trip
	// and the pending budget, or it could never be sent.
	if size, limit := it.size(), min(p.opts.MaxBatchBytes, p.opts.MaxPendingBytes); size > limit {
		return nil, fmt.Errorf("%w: request %q is %d bytes with its id and fields, the limit is min(MaxBatchBytes, MaxPendingBytes)=%d",
			ErrPayloadTooLarge, id, size, limit)
	}
	return it, nil
}

func validateID(id string) error {
	if id == "" {
		return fmt.Errorf("%w: the id is empty", ErrInvalidID)
	}
	if len(id) > MaxIDLen {
		return fmt.Errorf("%w: the id is %d bytes, the limit is %d", ErrInvalidID, len(id), MaxIDLen)
	}
	return nil
}

// submit hands an item to the coalescer and waits for its outcome. Every exit,
// a panic included, gives back the budget unless the coalescer took the item.
func (p *Producer[Req, Resp]) submit(ctx context.Context, it *produceItem) (produceOutcome, error) {
	if err := p.budget.acquire(ctx, p.closing, it.size()); err != nil {
		return produceOutcome{}, err
	}
	handed := false
	defer func() {
		if !handed {
			p.budget.release(it.size())
		}
	}()
	it.out = make(chan produceOutcome, 1) // only items handed to the coalescer need it
	if err := p.hand(ctx, it); err != nil {
		return produceOutcome{}, err
	}
	handed = true
	select {
	case out := <-it.out:
		return out, out.err
	case <-ctx.Done():
		select {
		case out := <-it.out:
			return out, out.err
		default:
			return produceOutcome{}, ctx.Err()
		}
	case <-p.lifetime.Done():
		select {
		case out := <-it.out:
			return out, out.err
		default:
			return produceOutcome{}, errClosedUnknown
		}
	}
}

// hand passes it to the coalescer, under the read lock that keeps Close from
// closing the channel meanwhile.
func (p *Producer[Req, Resp]) hand(ctx context.Context, it *produceItem) error {
	p.mu.RLock()
	defer p.mu.RUnlock()
	if p.closed {
		return ErrClosed
	}
	select {
	case p.batcher.in <- it:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	case <-p.closing:
		return ErrClosed
	}
}

// settle turns a produce outcome into a promise, which takes over the
// reference on c.
func (p *Producer[Req, Resp]) settle(id string, c *call, out produceOutcome) (*Promise[Resp], error) {
	pr := &Promise[Resp]{id: id, c: c, codec: p.opts.Codec, w: p.waiters, src: p, released: make(chan struct{})}
	switch out.code {
	case outcomeAppended, outcomeInflight:
		if out.code == outcomeInflight {
			pr.dedup = DedupInflight
		}
		pr.entryID = out.data
		p.waiters.markAppended(c)
		return pr, nil
	case outcomeDone:
		pr.dedup = DedupStored
		p.waiters.resolve(id, c, out.data, nil)
		return pr, nil
	default:
		p.waiters.drop(id, c)
		return nil, fmt.Errorf("%w: request %q: %s", ErrWrongType, id, out.data)
	}
}

// attempt is one try at a setup step, run by a goroutine of its own.
type attempt struct {
	done chan struct{}
	err  error // set before done is closed
}

// await waits with ctx for the setup step guarded by slot: it returns nil at
// once when ready reports it done, joins the attempt in progress, or starts
// one that runs run in its own goroutine, bounded by setupTimeout and stopped
// by Close. No caller ever waits on Redis without its own ctx.
func (p *Producer[Req, Resp]) await(ctx context.Context, slot **attempt, ready func() bool, run func(context.Context) error) error {
	if ready() {
		return nil
	}
	p.setupMu.Lock()
	if ready() {
		p.setupMu.Unlock()
		return nil
	}
	select {
	case <-p.closing:
		p.setupMu.Unlock()
		return ErrClosed
	default:
	}
	a := *slot
	if a == nil && !p.stopping {
		a = &attempt{done: make(chan struct{})}
		*slot = a
		p.loops.Add(1)
		go func() {
			defer p.loops.Done()
			actx, cancel := context.WithTimeout(p.lifetime, setupTimeout)
			err := run(actx)
			cancel()
			if err != nil && p.lifetime.Err() != nil {
				err = ErrClosed
			}
			p.setupMu.Lock()
			*slot = nil
			p.setupMu.Unlock()
			a.err = err
			close(a.done)
		}()
	}
	p.setupMu.Unlock()
	if a == nil {
		return ErrClosed
	}
	select {
	case <-a.done:
		return a.err
	case <-ctx.Done():
		return ctx.Err()
	case <-p.closing:
		return ErrClosed
	}
}

// ensureMeta records or checks the queue's shard count once.
func (p *Producer[Req, Resp]) ensureMeta(ctx context.Context) error {
	if p.metaOK.Load() {
		return nil // checked already; no closure to allocate
	}
	return p.await(ctx, &p.metaTry, p.metaOK.Load, func(actx context.Context) error {
		return checkShards(actx, p.client, p.queue, len(p.shards), &p.metaOK, p.log)
	})
}

// ensureSubscribed subscribes to the completion notices of every shard once,
// and starts the listener and backstop loops. It returns after Redis confirmed
// the subscriptions, so no notice of a request appended afterwards can be missed.
func (p *Producer[Req, Resp]) ensureSubscribed(ctx context.Context) error {
	if err := p.ensureMeta(ctx); err != nil {
		return err
	}
	if p.subscribed.Load() {
		return nil // no method values to allocate
	}
	return p.await(ctx, &p.subTry, p.subscribed.Load, p.subscribe)
}

// subscribe is one subscription attempt, run by await. Each PubSub is listed
// in trying while it waits for its confirmation, so that Close can close it
// (which ends a blocked read); the confirmation read is bounded by ctx's deadline.
func (p *Producer[Req, Resp]) subscribe(ctx context.Context) error {
	subs := make([]*redis.PubSub, 0, len(p.shards))
	fail := func(err error) error {
		p.setupMu.Lock()
		p.trying = nil
		p.setupMu.Unlock()
		for _, ps := range subs {
			_ = ps.Close()
		}
		return err
	}
	for _, k := range p.shards {
		// One subscription per shard: in a cluster each channel lives on its
		// shard's node (sharded pub/sub), and a subscription serves one node.
		var ps *redis.PubSub
		if p.sharded {
			ps = p.client.SSubscribe(ctx, k.Channel)
		} else {
			ps = p.client.Subscribe(ctx, k.Channel)
		}
		subs = append(subs, ps)
		p.setupMu.Lock()
		stopping := p.stopping
		p.trying = append(p.trying, ps)
		p.setupMu.Unlock()
		if stopping {
			return fail(ErrClosed)
		}
		if _, err := ps.Receive(ctx); err != nil {
			if errors.Is(err, context.DeadlineExceeded) && p.lifetime.Err() == nil {
				err = fmt.Errorf("not confirmed within %v: %w", setupTimeout, err)
			}
			return fail(fmt.Errorf("streamq: subscribe to %s: %w", k.Channel, channelPermission(err, p.queue, len(p.shards))))
		}
	}
	p.setupMu.Lock()
	defer p.setupMu.Unlock()
	p.trying = nil
	if p.stopping {
		for _, ps := range subs {
			_ = ps.Close()
		}
		return ErrClosed
	}
	p.subs = subs
	p.loops.Add(len(subs) + 1)
	for _, ps := range subs {
		go p.listen(ps, ps.ChannelWithSubscriptions())
	}
	go p.backstop()
	p.subscribed.Store(true)
	return nil
}

// listen resolves promises from completion notices. It runs until Close.
func (p *Producer[Req, Resp]) listen(ps *redis.PubSub, ch <-chan any) {
	defer p.loops.Done()
	for m := range ch {
		switch m := m.(type) {
		case *redis.Message:
			if len(m.Payload) > 0 && m.Payload[0] == '~' {
				// A progress notice (progress.lua); completion notices start
				// with a digit.
				id, seq, v, err := parseProgressNotice(m.Payload[1:])
				if err != nil {
					p.log.WarnContext(p.lifetime, "streamq: ignoring a malformed progress notice", "err", err)
				} else {
					p.waiters.progress(id, seq, v)
				}
				continue
			}
			if err := parseNotice(m.Payload, p.waiters.resolveID); err != nil {
				p.log.WarnContext(p.lifetime, "streamq: ignoring a malformed completion notice", "err", err)
			}
		case *redis.Subscription:
			if m.Kind == "sunsubscribe" && p.lifetime.Err() == nil {
				// The node ended the subscription: it became a replica in a
				// cluster failover. It still relays the shard's notices as a
				// replica, so subscribe again (go-redis does not).
				if err := ps.SSubscribe(p.lifetime, m.Channel); err != nil && p.lifetime.Err() == nil {
					p.log.WarnContext(p.lifetime, "streamq: resubscribing to completion notices failed", "channel", m.Channel, "err", err)
				}
			}
			if m.Kind != "subscribe" && m.Kind != "ssubscribe" {
				continue
			}
			// A resubscription after a reconnect: notices may have been lost.
			select {
			case p.kick <- struct{}{}:
			default:
			}
		}
	}
}

// backstop periodically reads the records of waiting requests, recovering
// results whose notice was lost. It runs until Close. A failed check is
// retried after a short back-off (from backstopRetry, doubling up to
// BackstopInterval), not a full interval later: the check after a
// resubscription often meets a connection that is not usable yet, and a
// missed result must be found while its record lives (ResultTTL).
func (p *Producer[Req, Resp]) backstop() {
	defer p.loops.Done()
	t := time.NewTimer(p.opts.BackstopInterval)
	defer t.Stop()
	retry := time.Duration(0)
	for {
		select {
		case <-p.lifetime.Done():
			return
		case <-t.C:
		case <-p.kick:
		}
		next := p.opts.BackstopInterval
		if err := p.checkWaiting(p.lifetime); err != nil && p.lifetime.Err() == nil {
			p.slots.onError(err)
			retry = min(max(2*retry, backstopRetry), p.opts.BackstopInterval)
			next = retry
			p.log.WarnContext(p.lifetime, "streamq: backstop check failed; will retry", "err", err, "retry_in", retry)
		} else {
			retry = 0
		}
		if !t.Stop() {
			select {
			case <-t.C:
			default:
			}
		}
		t.Reset(next)
	}
}

// backstopRetry is the first delay before a failed record check is tried again.
const backstopRetry = 100 * time.Millisecond

// checkWaiting reads the records of every waiting request and resolves those
// that completed or vanished.
func (p *Producer[Req, Resp]) checkWaiting(ctx context.Context) error {
	byShard := make([][]string, len(p.shards))
	for _, id := range p.waiters.appendedIDs() {
		i := keys.ShardOf(id, len(p.shards))
		byShard[i] = append(byShard[i], id)
	}
	for shard, ids := range byShard {
		if err := p.checkRecords(ctx, p.shards[shard], ids); err != nil {
			return err
		}
	}
	// Progress notices lost with the subscription: the stored latest value,
	// for the requests whose promises listen (none: nothing read).
	for id, st := range p.waiters.progressListeners() {
		if err := p.readProgress(ctx, id, st); err != nil && !errors.Is(err, redis.Nil) {
			return err
		}
	}
	return nil
}

// checkRecords resolves the waiters of ids (all of one shard) whose records
// show an outcome or vanished. MGET keeps to one slot: the keys share a tag.
func (p *Producer[Req, Resp]) checkRecords(ctx context.Context, k keys.Keys, ids []string) error {
	const chunk = 256
	for len(ids) > 0 {
		n := min(chunk, len(ids))
		part := ids[:n]
		ids = ids[n:]
		names := make([]string, len(part))
		for i, id := range part {
			names[i] = k.Record(id)
		}
		vals, err := p.client.MGet(ctx, names...).Result()
		if err != nil {
			return err
		}
		for i, v := range vals {
			s, ok := v.(string)
			switch {
			case !ok:
				p.waiters.resolveLost(part[i], p.opts.InflightTTL)
			case len(s) > 0 && s[0] != recordInflight:
				p.waiters.resolveID(part[i], s)
			}
		}
	}
	return nil
}

// Record values. The first byte says what the rest is.
const (
	recordInflight = 'P' // rest: the stream entry id
	recordResult   = 'R' // rest: the encoded response
	recordFailed   = 'E' // rest: the error message
	recordDead     = 'L' // rest: the error message; the request was dead-lettered
	recordNoResult = 'N' // completed; the result was not stored
	recordCanceled = 'C' // rest: a message; Admin.Cancel cancelled the scheduled request
)

// parseNotice splits a completion notice ("<len>:<id><len>:<record>"...) and
// calls fn for each request.
func parseNotice(s string, fn func(id, record string)) error {
	next := func() (string, error) {
		colon := -1
		for i := 0; i < len(s) && i < 12; i++ {
			if s[i] == ':' {
				colon = i
				break
			}
		}
		if colon <= 0 {
			return "", errors.New("missing length prefix")
		}
		n, err := strconv.Atoi(s[:colon])
		if err != nil || n < 0 || colon+1+n > len(s) {
			return "", fmt.Errorf("bad length %q", s[:colon])
		}
		v := s[colon+1 : colon+1+n]
		s = s[colon+1+n:]
		return v, nil
	}
	for len(s) > 0 {
		id, err := next()
		if err != nil {
			return err
		}
		rec, err := next()
		if err != nil {
			return err
		}
		fn(id, rec)
	}
	return nil
}

// Promise is the future result of a produced request.
type Promise[Resp any] struct {
	id       string
	entryID  string
	c        *call
	codec    Codec
	w        *waiters
	released chan struct{} // closed by Release
	relOnce  sync.Once

	src      progressSource // the producer, for a late Progress; nil when none
	progOnce sync.Once
	prog     *progressState // set by the first Progress
	progCh   chan []byte

	once sync.Once
	resp Resp
	err  error

	dedup Dedup // how Produce was answered
}

// Dedup says how Redis answered the Produce call of a promise.
type Dedup int

// The answers of a Produce call.
const (
	// DedupNone: the call recorded a new request (or, with RetryFailed,
	// replaced a stored failure).
	DedupNone Dedup = iota
	// DedupInflight: a request with the id was in flight (queued, running,
	// or waiting in the schedule): the promise waits for that request, and
	// this call's payload and options were not used.
	DedupInflight
	// DedupStored: the id's outcome was stored (ResultTTL): the promise is
	// resolved with it at once, and this call's payload was not used.
	DedupStored
)

// String names the answer.
func (d Dedup) String() string {
	switch d {
	case DedupNone:
		return "new"
	case DedupInflight:
		return "attached to the request in flight"
	case DedupStored:
		return "answered from the stored outcome"
	}
	return fmt.Sprintf("Dedup(%d)", int(d))
}

// Deduplicated tells whether the Produce call was deduplicated, and how:
// DedupNone when it recorded a new request, DedupInflight when it attached to
// the request in flight under the same id, DedupStored when it got the id's
// stored outcome. A deduplicated call's payload is not compared with the
// first one's: it is dropped, whatever it holds.
func (pr *Promise[Resp]) Deduplicated() Dedup { return pr.dedup }

// ID returns the request id.
func (pr *Promise[Resp]) ID() string { return pr.id }

// EntryID returns the stream entry id of the request, or "" when its result was
// already stored when it was produced, or when it was waiting in the schedule
// (At, After): its entry is appended at its due time.
func (pr *Promise[Resp]) EntryID() string { return pr.entryID }

// Done returns a channel closed when the result is available. Release does not
// close it: after Release, use Wait, not Done.
func (pr *Promise[Resp]) Done() <-chan struct{} { return pr.c.done }

// Release gives up interest in the result. Once every promise of the request
// id held in this producer is released, the producer forgets the id: no map
// entry, no record check. The request itself is unaffected: it stays queued
// and is handled. Wait on a released promise returns ErrReleased (a Wait
// already blocked returns it too). Release is idempotent and safe for
// concurrent use; a promise that is neither waited on to the end nor released
// costs its map entry until its request completes or its record expires.
func (pr *Promise[Resp]) Release() {
	pr.relOnce.Do(func() {
		close(pr.released)
		pr.w.drop(pr.id, pr.c)
		pr.progOnce.Do(func() { pr.progCh = closedProgress }) // no channel made after Release
		if pr.prog != nil {
			pr.prog.unsubscribe(pr.progCh)
		}
	})
}

// Wait blocks until the request completes or ctx ends, and returns the response
// or the error: a *RequestError (errors.Is ErrFailed, ErrDeadLettered) when the
// request failed, ErrNoResult, ErrRecordLost, ErrClosed, ErrReleased, an error
// saying the codec failed (or panicked) to decode the response, or ctx's error.
// Wait may be called any number of times, from any goroutine. A nil ctx panics.
func (pr *Promise[Resp]) Wait(ctx context.Context) (Resp, error) {
	mustContext(ctx, "Promise.Wait")
	var zero Resp
	select {
	case <-pr.released:
		return zero, ErrReleased
	default:
	}
	select {
	case <-pr.c.done:
	case <-pr.released:
		return zero, ErrReleased
	case <-ctx.Done():
		return zero, ctx.Err()
	}
	pr.once.Do(func() { pr.resp, pr.err = decodeRecord[Resp](pr.codec, pr.c.record, pr.c.err) })
	return pr.resp, pr.err
}

// decodeRecord turns a request's record into its response or error.
func decodeRecord[Resp any](codec Codec, record string, err error) (Resp, error) {
	var zero Resp
	if err != nil {
		return zero, err
	}
	if record == "" {
		return zero, fmt.Errorf("streamq: empty record")
	}
	body := record[1:]
	switch record[0] {
	case recordResult:
		return decode[Resp](codec, []byte(body))
	case recordFailed:
		return zero, &RequestError{Message: body}
	case recordDead:
		return zero, &RequestError{Message: body, DeadLettered: true}
	case recordNoResult:
		return zero, ErrNoResult
	case recordCanceled:
		return zero, fmt.Errorf("%w: %s", ErrCanceled, body)
	default:
		return zero, fmt.Errorf("%w: record starts with %q", ErrWrongType, record[0])
	}
}

// call is the shared state of every promise of one request id in one producer.
type call struct {
	done       chan struct{}
	record     string    // set before done is closed
	err        error     // set before done is closed
	refs       int       // guarded by waiters.mu: Produce calls in progress and unreleased promises
	appended   bool      // guarded by waiters.mu: the request is recorded in Redis
	appendedAt time.Time // guarded by waiters.mu: when appended was first set
	// prog is the request's progress, made by the first Promise.Progress
	// (nil until then: a request nobody asks about pays nothing). Guarded
	// by waiters.mu; its fields by its own mutex.
	prog *progressState
}

// waiters maps request ids to their calls. A call is registered before its
// request is appended, so a notice that races the append reply is not lost. A
// call leaves the map when it is resolved or when nobody holds a reference.
type waiters struct {
	mu     sync.Mutex
	m      map[string]*call
	closed error // set by failAll: calls acquired later are resolved with it at once
}

func newWaiters() *waiters { return &waiters{m: make(map[string]*call)} }

// acquire takes a reference on id's call, registering one when there is none.
// After failAll, it returns a call already resolved with failAll's error, so a
// promise settled after Close never waits.
func (w *waiters) acquire(id string) *call {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.closed != nil {
		c := &call{done: make(chan struct{}), err: w.closed, refs: 1}
		close(c.done)
		return c
	}
	c := w.m[id]
	if c == nil {
		c = &call{done: make(chan struct{})}
		w.m[id] = c
	}
	c.refs++
	return c
}

// drop gives back a reference taken by acquire: a Produce whose request was not
// recorded, or a released promise. The last reference removes the call.
func (w *waiters) drop(id string, c *call) {
	w.mu.Lock()
	defer w.mu.Unlock()
	c.refs--
	if c.refs <= 0 && w.m[id] == c {
		delete(w.m, id)
	}
}

func (w *waiters) markAppended(c *call) {
	w.mu.Lock()
	if !c.appended {
		c.appended = true
		c.appendedAt = time.Now()
	}
	w.mu.Unlock()
}

// len returns the number of registered calls.
func (w *waiters) len() int {
	w.mu.Lock()
	defer w.mu.Unlock()
	return len(w.m)
}

func (w *waiters) resolveID(id, record string) {
	w.mu.Lock()
	c := w.m[id]
	w.mu.Unlock()
	if c != nil {
		w.resolve(id, c, record, nil)
	}
}

// resolveLost resolves id's call with ErrRecordLost, saying how long ago the
// request was recorded: well within inflightTTL, the record most likely held
// an outcome that expired before this producer saw it.
func (w *waiters) resolveLost(id string, inflightTTL time.Duration) {
	w.mu.Lock()
	c := w.m[id]
	var age time.Duration
	if c != nil {
		age = time.Since(c.appendedAt).Round(time.Millisecond)
	}
	w.mu.Unlock()
	if c == nil {
		return
	}
	var err error
	if age < inflightTTL {
		err = fmt.Errorf("%w (request %q, recorded %v ago, within InflightTTL %v: most likely it ran and its result expired "+
			"before this producer saw it, or Redis lost the key)", ErrRecordLost, id, age, inflightTTL)
	} else {
		err = fmt.Errorf("%w (request %q, recorded %v ago, InflightTTL %v)", ErrRecordLost, id, age, inflightTTL)
	}
	w.resolve(id, c, "", err)
}

// resolve completes c once; later calls are ignored.
func (w *waiters) resolve(id string, c *call, record string, err error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.m[id] == c {
		delete(w.m, id)
	}
	select {
	case <-c.done:
		return
	default:
	}
	c.record, c.err = record, err
	close(c.done)
	if c.prog != nil {
		c.prog.close()
	}
}

func (w *waiters) appendedIDs() []string {
	w.mu.Lock()
	defer w.mu.Unlock()
	ids := make([]string, 0, len(w.m))
	for id, c := range w.m {
		if c.appended {
			ids = append(ids, id)
		}
	}
	return ids
}

// failAll resolves every call with err, and every call acquired later too.
func (w *waiters) failAll(err error) {
	w.mu.Lock()
	calls := w.m
	w.m = make(map[string]*call)
	w.closed = err
	w.mu.Unlock()
	for id, c := range calls {
		w.resolve(id, c, "", err)
	}
}
