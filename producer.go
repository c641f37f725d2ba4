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

	// lifetime is cancelled by Close after the last send; coalesced sends use it.
	lifetime context.Context
	cancel   context.CancelFunc

	mu     sync.RWMutex // guards closed and the sends on batcher.in
	closed bool

	batcher *coalescer[*produceItem]
	budget  *byteBudget
	waiters *waiters

	metaOK atomic.Bool // the queue's recorded shard count matches ours

	subMu  sync.Mutex      // guards subs
	subs   []*redis.PubSub // one per shard; nil until the first Produce that waits
	kick   chan struct{}   // asks the backstop loop for a check now
	loops  sync.WaitGroup  // listener and backstop goroutines
	closeO sync.Once
}

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
// dead-lettered. When ctx ends first, the outcome is unknown: producing the same
// id again is safe and attaches to the request if it was recorded.
//
// Promises that are never waited on cost a map entry until the request completes;
// use Enqueue for fire-and-forget.
func (p *Producer[Req, Resp]) Produce(ctx context.Context, id string, req Req) (*Promise[Resp], error) {
	it, err := p.newItem(ctx, id, req)
	if err != nil {
		return nil, err
	}
	if err := p.ensureSubscribed(ctx); err != nil {
		return nil, err
	}
	c := p.waiters.acquire(id)
	out, err := p.submit(ctx, it)
	if err != nil {
		p.waiters.release(id, c)
		return nil, err
	}
	return p.settle(id, c, out)
}

// Enqueue submits a request without waiting for its result: fire-and-forget.
// It has Produce's deduplication and its meaning of a nil error, but needs no
// subscription and keeps nothing in memory once it returns.
func (p *Producer[Req, Resp]) Enqueue(ctx context.Context, id string, req Req) error {
	it, err := p.newItem(ctx, id, req)
	if err != nil {
		return err
	}
	if err := checkShards(ctx, p.client, p.queue, len(p.shards), &p.metaOK, p.log); err != nil {
		return err
	}
	out, err := p.submit(ctx, it)
	if err != nil {
		return err
	}
	if out.code == outcomeRejected {
		return fmt.Errorf("%w: request %q: %s", ErrWrongType, id, out.data)
	}
	return nil
}

// Close flushes the requests already accepted, then stops the producer. Promises
// still waiting resolve with ErrClosed; their requests are still handled, and a
// new producer gets their results by producing the same ids. Close is idempotent.
func (p *Producer[Req, Resp]) Close() error {
	p.closeO.Do(func() {
		p.mu.Lock()
		p.closed = true
		p.mu.Unlock()
		p.batcher.close()
		p.cancel()
		p.subMu.Lock()
		for _, ps := range p.subs {
			_ = ps.Close()
		}
		p.subMu.Unlock()
		p.loops.Wait()
		p.waiters.failAll(ErrClosed)
	})
	return nil
}

func (p *Producer[Req, Resp]) checkOpen() error {
	p.mu.RLock()
	defer p.mu.RUnlock()
	if p.closed {
		return ErrClosed
	}
	return nil
}

// newItem validates and encodes one request.
func (p *Producer[Req, Resp]) newItem(ctx context.Context, id string, req Req) (*produceItem, error) {
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
	// An item is its id plus its payload; it must fit one round trip and the
	// pending budget, or it could never be sent.
	if size, limit := len(id)+len(payload), min(p.opts.MaxBatchBytes, p.opts.MaxPendingBytes); size > limit {
		return nil, fmt.Errorf("%w: request %q is %d bytes with its id, the limit is min(MaxBatchBytes, MaxPendingBytes)=%d",
			ErrPayloadTooLarge, id, size, limit)
	}
	return &produceItem{ctx: ctx, id: id, shard: keys.ShardOf(id, len(p.shards)), payload: payload,
		out: make(chan produceOutcome, 1)}, nil
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

// submit hands an item to the coalescer and waits for its outcome.
func (p *Producer[Req, Resp]) submit(ctx context.Context, it *produceItem) (produceOutcome, error) {
	if err := p.budget.acquire(ctx, it.size()); err != nil {
		return produceOutcome{}, err
	}
	p.mu.RLock()
	if p.closed {
		p.mu.RUnlock()
		p.budget.release(it.size())
		return produceOutcome{}, ErrClosed
	}
	select {
	case p.batcher.in <- it:
		p.mu.RUnlock()
	case <-ctx.Done():
		p.mu.RUnlock()
		p.budget.release(it.size())
		return produceOutcome{}, ctx.Err()
	}
	select {
	case out := <-it.out:
		return out, out.err
	case <-ctx.Done():
		return produceOutcome{}, ctx.Err()
	}
}

// settle turns a produce outcome into a promise.
func (p *Producer[Req, Resp]) settle(id string, c *call, out produceOutcome) (*Promise[Resp], error) {
	pr := &Promise[Resp]{id: id, c: c, codec: p.opts.Codec}
	switch out.code {
	case outcomeAppended, outcomeInflight:
		pr.entryID = out.data
		p.waiters.markAppended(c)
		return pr, nil
	case outcomeDone:
		p.waiters.resolve(id, c, out.data, nil)
		return pr, nil
	default:
		p.waiters.release(id, c)
		return nil, fmt.Errorf("%w: request %q: %s", ErrWrongType, id, out.data)
	}
}

// ensureSubscribed subscribes to the completion notices of every shard once,
// and starts the listener and backstop loops. It returns after Redis confirmed
// the subscriptions, so no notice of a request appended afterwards can be missed.
func (p *Producer[Req, Resp]) ensureSubscribed(ctx context.Context) error {
	p.subMu.Lock()
	defer p.subMu.Unlock()
	if p.subs != nil {
		return nil
	}
	if err := p.checkOpen(); err != nil {
		return err
	}
	if err := checkShards(ctx, p.client, p.queue, len(p.shards), &p.metaOK, p.log); err != nil {
		return err
	}
	subs := make([]*redis.PubSub, 0, len(p.shards))
	fail := func(err error) error {
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
		if _, err := ps.Receive(ctx); err != nil {
			return fail(fmt.Errorf("streamq: subscribe to %s: %w", k.Channel, channelPermission(err, p.queue, len(p.shards))))
		}
	}
	p.subs = subs
	p.loops.Add(len(subs) + 1)
	for _, ps := range subs {
		go p.listen(ps, ps.ChannelWithSubscriptions())
	}
	go p.backstop()
	return nil
}

// listen resolves promises from completion notices. It runs until Close.
func (p *Producer[Req, Resp]) listen(ps *redis.PubSub, ch <-chan any) {
	defer p.loops.Done()
	for m := range ch {
		switch m := m.(type) {
		case *redis.Message:
			if err := parseNotice(m.Payload, p.waiters.resolveID); err != nil {
				p.log.Warn("streamq: ignoring a malformed completion notice", "err", err)
			}
		case *redis.Subscription:
			if m.Kind == "sunsubscribe" && p.lifetime.Err() == nil {
				// The node ended the subscription: it became a replica in a
				// cluster failover. It still relays the shard's notices as a
				// replica, so subscribe again (go-redis does not).
				if err := ps.SSubscribe(p.lifetime, m.Channel); err != nil && p.lifetime.Err() == nil {
					p.log.Warn("streamq: resubscribing to completion notices failed", "channel", m.Channel, "err", err)
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
// results whose notice was lost. It runs until Close.
func (p *Producer[Req, Resp]) backstop() {
	defer p.loops.Done()
	t := time.NewTicker(p.opts.BackstopInterval)
	defer t.Stop()
	for {
		select {
		case <-p.lifetime.Done():
			return
		case <-t.C:
		case <-p.kick:
		}
		if err := p.checkWaiting(p.lifetime); err != nil && p.lifetime.Err() == nil {
			p.slots.onError(err)
			p.log.Warn("streamq: backstop check failed; will retry", "err", err)
		}
	}
}

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
				p.waiters.resolveIDErr(part[i], ErrRecordLost)
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
	id      string
	entryID string
	c       *call
	codec   Codec

	once sync.Once
	resp Resp
	err  error
}

// ID returns the request id.
func (pr *Promise[Resp]) ID() string { return pr.id }

// EntryID returns the stream entry id of the request, or "" when its result was
// already stored when it was produced.
func (pr *Promise[Resp]) EntryID() string { return pr.entryID }

// Done returns a channel closed when the result is available.
func (pr *Promise[Resp]) Done() <-chan struct{} { return pr.c.done }

// Wait blocks until the request completes or ctx ends, and returns the response
// or the error: a *RequestError (errors.Is ErrFailed, ErrDeadLettered) when the
// request failed, ErrNoResult, ErrRecordLost, ErrClosed, or ctx's error. Wait may
// be called any number of times, from any goroutine.
func (pr *Promise[Resp]) Wait(ctx context.Context) (Resp, error) {
	select {
	case <-pr.c.done:
	case <-ctx.Done():
		var zero Resp
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
	default:
		return zero, fmt.Errorf("%w: record starts with %q", ErrWrongType, record[0])
	}
}

// call is the shared state of every promise of one request id in one producer.
type call struct {
	done     chan struct{}
	record   string // set before done is closed
	err      error  // set before done is closed
	refs     int    // guarded by waiters.mu
	appended bool   // guarded by waiters.mu: the request is recorded in Redis
}

// waiters maps request ids to their calls. A call is registered before its
// request is appended, so a notice that races the append reply is not lost.
type waiters struct {
	mu sync.Mutex
	m  map[string]*call
}

func newWaiters() *waiters { return &waiters{m: make(map[string]*call)} }

func (w *waiters) acquire(id string) *call {
	w.mu.Lock()
	defer w.mu.Unlock()
	c := w.m[id]
	if c == nil {
		c = &call{done: make(chan struct{})}
		w.m[id] = c
	}
	c.refs++
	return c
}

// release drops a reference taken by acquire whose request was not recorded.
func (w *waiters) release(id string, c *call) {
	w.mu.Lock()
	defer w.mu.Unlock()
	c.refs--
	if c.refs == 0 && !c.appended && w.m[id] == c {
		delete(w.m, id)
	}
}

func (w *waiters) markAppended(c *call) {
	w.mu.Lock()
	c.appended = true
	w.mu.Unlock()
}

func (w *waiters) resolveID(id, record string) {
	w.mu.Lock()
	c := w.m[id]
	w.mu.Unlock()
	if c != nil {
		w.resolve(id, c, record, nil)
	}
}

func (w *waiters) resolveIDErr(id string, err error) {
	w.mu.Lock()
	c := w.m[id]
	w.mu.Unlock()
	if c != nil {
		w.resolve(id, c, "", err)
	}
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

func (w *waiters) failAll(err error) {
	w.mu.Lock()
	calls := w.m
	w.m = make(map[string]*call)
	w.mu.Unlock()
	for id, c := range calls {
		w.resolve(id, c, "", err)
	}
}
