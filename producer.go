package streamq

import (
	"context"
	"fmt"
	"log/slog"
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
	client redis.UniversalClient
	queue  string
	shards []keys.Keys // one per shard; shard i holds the ids keys.ShardOf maps to i
	// boxed holds, per shard, the produce.lua arguments that never change,
	// and inflightTTL the in-flight TTL in milliseconds, each boxed once:
	// boxing a string or a large integer into an argument list allocates.
	boxed       []produceConsts
	inflightTTL any
	sharded     bool // notices use sharded pub/sub (Redis Cluster)
	slots       *slotRefresher
	opts        ProducerOptions
	log         *slog.Logger

	// lifetime is cancelled by Close once the accepted requests are sent (or
	// CloseTimeout ran out); sends, setup attempts and the loops use it.
	lifetime context.Context
	cancel   context.CancelFunc
	// closing is closed first thing by Close: callers blocked on the budget,
	// the coalescer channel or a setup attempt give up with ErrClosed.
	closing chan struct{}

	// mu guards closed, the adds to batcher and the Adds to batches. It is
	// never held across Redis I/O or a wait, so Close takes it promptly.
	mu     sync.RWMutex
	closed bool

	batcher *coalescer[*produceItem]
	direct  *directConn // nil: every call goes through batcher (see sendDirect)
	budget  *byteBudget
	waiters *waiters
	sends   sendTracker // requests Send accepted, for Flush
	// flowQueues caches, per queue name, the keys of a queue other than this
	// one that a flow's children went to (ProduceFlow): name -> []keys.Keys.
	flowQueues sync.Map

	metaOK     atomic.Bool // the queue's recorded shard count matches ours
	subscribed atomic.Bool // subs are confirmed and their listeners run
	// testHookNotice, when a test sets it, runs as a listener takes each
	// message (before it handles it).
	testHookNotice atomic.Pointer[func()]
	backstopOn     atomic.Bool // the backstop runs (ensureBackstop); set under setupMu

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
// It does not touch Redis: the first Produce subscribes to completion notices
// (see ProduceBatch for batches).
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
		boxed:   boxProduceConsts(shards, isCluster(client)),
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
	p.inflightTTL = o.InflightTTL.Milliseconds()
	p.waiters.recheck = p.kickBackstop
	p.lifetime, p.cancel = context.WithCancel(context.Background())
	p.batcher = newCoalescer(o.Concurrency, o.MaxBatchItems, o.MaxBatchBytes, o.Linger,
		(*produceItem).size, p.sendCoalesced)
	if p.direct = newDirectConn(client); p.direct != nil {
		// Close's bound (the lifetime's end) cuts a direct send in flight.
		context.AfterFunc(p.lifetime, p.direct.interrupt)
	}
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
// The first Produce subscribes to completion notices; callers wait for that
// with their own contexts, and an attempt that Redis does not confirm within
// 10s fails and is tried again by the next call.
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
	if err := p.ensureMeta(ctx); err != nil {
		return nil, err
	}
	// Its caller waits for the outcome, most likely: listen before the
	// append, so that the notice reaches this producer even when the
	// consumers keep no result (DiscardResults).
	if err := p.listen(ctx); err != nil {
		return nil, err
	}
	c, joined := p.waiters.join(id)
	it.call, it.joined = c, joined
	out, err := p.submit(ctx, it)
	if err != nil {
		p.waiters.drop(id, c)
		return nil, err
	}
	if it.mode != modeNone && it.call != c {
		// Moved to a new run's call by runProduce (after the reply: no race).
		c, joined = it.call, false
	}
	return p.settle(id, c, out, joined)
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
	it.hush()
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
	case outcomeRefused:
		return "", fmt.Errorf("%w: %s (request %q)", ErrInvalidOptions, out.data, id)
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
			if p.direct != nil {
				_ = p.direct.client.Close()
			}
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

// submit sends an item itself when the producer is idle (sendDirect), else
// hands it to the coalescer and waits for its outcome. Every exit, a panic
// included, gives back the budget unless the coalescer took the item.
func (p *Producer[Req, Resp]) submit(ctx context.Context, it *produceItem) (produceOutcome, error) {
	if out, sent, err := p.sendDirect(ctx, it); sent {
		return out, err
	}
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
// closing the coalescer meanwhile.
func (p *Producer[Req, Resp]) hand(ctx context.Context, it *produceItem) error {
	p.mu.RLock()
	defer p.mu.RUnlock()
	if p.closed {
		return ErrClosed
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	if !p.batcher.add(it) {
		return ErrClosed
	}
	return nil
}

// settle turns a produce outcome into a promise, which takes over the
// reference on c. joined says c was marked appended when this caller took
// it (waiters.join): earlier callers of the id in this producer wait on it
// for the outcome of an earlier run, which a new run (code 0) or a stored
// outcome read now (code 2, 4) may not be, so neither answers them or joins
// them (newRun, stored): each caller is answered by a run recorded before
// its Produce returned.
func (p *Producer[Req, Resp]) settle(id string, c *call, out produceOutcome, joined bool) (*Promise[Resp], error) {
	pr := &Promise[Resp]{id: id, c: c, codec: p.opts.Codec, w: p.waiters, src: p, released: make(chan struct{})}
	switch out.code {
	case outcomeAppended, outcomeInflight:
		if out.code == outcomeInflight {
			pr.dedup = DedupInflight
		} else if joined {
			c = p.waiters.newRun(id, c, p.opts.InflightTTL)
			pr.c = c
		}
		pr.entryID = out.data
		p.waiters.markAppended(c)
		return pr, nil
	case outcomeDone:
		pr.dedup = DedupStored
		if joined {
			pr.c = p.waiters.stored(id, c, out.data, p.noticeGrace())
		} else {
			p.waiters.resolve(id, c, out.data, nil)
		}
		return pr, nil
	case outcomeExpired:
		pr.dedup = DedupStored
		err := fmt.Errorf("%w: request %q ran in its Throttle window and its outcome has expired "+
			"(keep the consumers' ResultTTL at least the window)", ErrRecordLost, id)
		if joined {
			pr.c = p.waiters.answered(id, c, "", err)
		} else {
			p.waiters.resolve(id, c, "", err)
		}
		return pr, nil
	case outcomeRefused:
		p.waiters.drop(id, c)
		return nil, fmt.Errorf("%w: %s (request %q)", ErrInvalidOptions, out.data, id)
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
	a, _, err := p.begin(slot, ready, run)
	if a == nil {
		return err
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

// begin returns the attempt in progress at the setup step guarded by slot,
// starting one when there is none (see await; started says it did); nil
// and nil when ready reports the step done, nil and ErrClosed once Close
// began.
func (p *Producer[Req, Resp]) begin(slot **attempt, ready func() bool, run func(context.Context) error) (a *attempt, started bool, err error) {
	p.setupMu.Lock()
	defer p.setupMu.Unlock()
	if ready() {
		return nil, false, nil
	}
	select {
	case <-p.closing:
		return nil, false, ErrClosed
	default:
	}
	a = *slot
	if a == nil && !p.stopping {
		started = true
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
	if a == nil {
		return nil, false, ErrClosed
	}
	return a, started, nil
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
