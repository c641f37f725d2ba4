package streamq

// The multi-queue consumer: one pool of workers and one prefetch ring over
// the consumers of several queues (see pool).
//
// Goroutines: Run's caller waits in Run; one goroutine per queue creates its
// groups at start (ensureGroupRetry); one waits for every queue's Ready.
// The rest are the pool's and each queue's run's.

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
)

// MultiConsumer runs the consumers of several queues over one pool of
// workers and one prefetch ring. Each queue keeps its own handler, request
// and result types, consumer group, options, dead letters, pause and rate
// limit; the queues share Workers and Prefetch, and their weights share the
// workers while several queues have work waiting:
//
//   - weighted (the default): while every queue has work waiting, the
//     handler starts follow the weights (6:3:1 gives 60%, 30% and 10%),
//     evenly spread by smooth weighted round robin; a queue with nothing
//     waiting gives its turns to the others, so no queue starves while it
//     has work and a weight of at least 1.
//   - strict (MultiOptions.Strict): a queue's requests start only while no
//     queue of a higher weight has one waiting in the ring.
//
// Within a queue, its requests start in stream order within each priority
// level, the levels chosen by the queue's own PriorityWeights or
// StrictPriority. A paused queue's entries wait in the ring without holding
// a worker, and a rate-limited queue holds at most one worker waiting for
// its next token, so neither stalls the other queues.
//
// The Consumers given to NewMultiConsumer belong to it: their own Run must
// not be called while the MultiConsumer runs (it returns an error), and
// their Workers and Prefetch options are not used (MultiOptions' are).
type MultiConsumer struct {
	queues    []MultiQueue
	opts      MultiOptions
	running   atomic.Bool
	ready     chan struct{}
	readyOnce sync.Once
	// lastPool is the latest Run's pool, for tests to look into.
	lastPool atomic.Pointer[pool]
}

// MultiQueue is one queue of a MultiConsumer.
type MultiQueue struct {
	// Consumer is the queue's consumer: a *Consumer of any request and
	// result types, made with NewConsumer or Queue.NewConsumer. Required.
	Consumer QueueConsumer
	// Weight is the queue's share of the handler starts while several
	// queues have work waiting (see MultiConsumer), and of Prefetch: the
	// queue holds at most Prefetch×Weight/(sum of weights) entries (at
	// least one per shard), so a queue whose Redis calls fail stalls only
	// itself. With MultiOptions.Strict it orders the queues, highest first
	// (equal weights: the order given). Defaults to 1; at most
	// MaxQueueWeight (1,000).
	Weight int
}

// MaxQueueWeight is the largest MultiQueue.Weight accepted.
const MaxQueueWeight = 1000

// QueueConsumer is a consumer as NewMultiConsumer takes it: a *Consumer of
// any request and result types. Only this package implements it.
type QueueConsumer interface {
	// Name returns the consumer's name in its group.
	Name() string
	// Queue returns the consumer's queue.
	Queue() string
	// Ready is the consumer's Ready.
	Ready() <-chan struct{}

	member() memberConsumer
}

// memberConsumer is what a MultiConsumer needs of a *Consumer.
type memberConsumer interface {
	group() string
	shardCount() int
	claim() bool // marks the consumer running; false when it already is
	unclaim()    // clears the mark
	start(ctx context.Context) error
	join(r *ring, queue, prefetch, workers int) queueRun
}

// MultiOptions configures a MultiConsumer. The zero value is valid.
type MultiOptions struct {
	// Workers is how many handlers run at once, over all the queues. At
	// most MaxWorkers. Defaults to DefaultWorkers (1).
	Workers int
	// Prefetch is the depth of the shared prefetch ring: the most entries
	// held at once over all the queues (see ConsumerOptions.Prefetch; each
	// queue holds at most its weight's share). At least Workers and the
	// number of queues' shards, at most MaxPrefetch. Defaults to
	// max(DefaultMinPrefetch (128), 4*Workers).
	Prefetch int
	// Strict starts a queue's requests only while no queue of a higher
	// weight has one waiting. Defaults to false: weighted shares.
	Strict bool
}

// NewMultiConsumer returns a consumer of several queues, one MultiQueue
// each (see MultiConsumer). opts may be nil for the defaults. Each queue
// (with its group) may appear once. It does not touch Redis; Run does.
func NewMultiConsumer(opts *MultiOptions, queues ...MultiQueue) (*MultiConsumer, error) {
	var o MultiOptions
	if opts != nil {
		o = *opts
	}
	if len(queues) == 0 {
		return nil, optionError("NewMultiConsumer needs at least one MultiQueue")
	}
	setDefault(&o.Workers, DefaultWorkers)
	setDefault(&o.Prefetch, max(DefaultMinPrefetch, 4*o.Workers))
	qs := make([]MultiQueue, len(queues))
	seen := make(map[[2]string]bool, len(queues))
	shards := 0
	for i, q := range queues {
		if q.Consumer == nil || q.Consumer.member() == nil {
			return nil, optionError("MultiQueue[%d].Consumer is nil", i)
		}
		setDefault(&q.Weight, 1)
		if q.Weight < 1 || q.Weight > MaxQueueWeight {
			return nil, optionError("MultiQueue[%d].Weight is %d; it must be in 1..%d (leave it 0 for 1)", i, q.Weight, MaxQueueWeight)
		}
		key := [2]string{q.Consumer.Queue(), q.Consumer.member().group()}
		if seen[key] {
			return nil, optionError("MultiQueue[%d]: queue %q with group %q is given twice; give each queue once (two consumers of one group in one process share its work: raise Workers instead)",
				i, key[0], key[1])
		}
		seen[key] = true
		shards += q.Consumer.member().shardCount()
		qs[i] = q
	}
	if err := firstError(
		positive("MultiOptions.Workers", o.Workers),
		atMost("MultiOptions.Workers", o.Workers, MaxWorkers, "MaxWorkers",
			"Run starts one goroutine per worker before any work; handlers that wait on I/O rarely need more"),
		atLeastInt("MultiOptions.Prefetch", o.Prefetch, o.Workers, "Workers"),
		atLeastInt("MultiOptions.Prefetch", o.Prefetch, shards, "the queues' shards together"),
		atMost("MultiOptions.Prefetch", o.Prefetch, MaxPrefetch, "MaxPrefetch",
			"a full ring holds that many messages, payloads included, in memory; a deeper ring reads in no bigger batches"),
	); err != nil {
		return nil, err
	}
	return &MultiConsumer{queues: qs, opts: o, ready: make(chan struct{})}, nil
}

// Ready returns a channel that is closed once every queue's consumer is
// working (see Consumer.Ready; a consumer that was ready in a Run of its
// own before counts as ready).
func (m *MultiConsumer) Ready() <-chan struct{} { return m.ready }

// Run consumes every queue until ctx ends, then shuts down gracefully and
// returns nil, as Consumer.Run does for one queue: it stops reading, lets
// running handlers finish (cancelling a queue's handlers after its
// ShutdownTimeout), records their outcomes, and releases the prefetched
// messages that had not started. It returns at most about 2×ShutdownTimeout
// (the largest of the queues') after ctx ended, whatever Redis does. At start
// it creates each queue's consumer groups, all at once, and starts
// consuming once every queue's exist (while Redis is unreachable, it
// retries, as Consumer.Run does); Run returns the first error a queue's
// consumer would return from its own Run (ErrShardMismatch,
// ErrAnsweringGroup, ...), and an error when it, or one of its consumers,
// is already running.
func (m *MultiConsumer) Run(ctx context.Context) error {
	mustContext(ctx, "MultiConsumer.Run")
	if !m.running.CompareAndSwap(false, true) {
		return errors.New("streamq: MultiConsumer.Run called while it is already running; use one MultiConsumer per Run")
	}
	defer m.running.Store(false)
	for i, q := range m.queues {
		if !q.Consumer.member().claim() {
			for _, p := range m.queues[:i] {
				p.Consumer.member().unclaim()
			}
			return fmt.Errorf("streamq: the consumer of queue %q is already running (its own Run, or another MultiConsumer's)", q.Consumer.Queue())
		}
	}
	defer func() {
		for _, q := range m.queues {
			q.Consumer.member().unclaim()
		}
	}()
	if err := m.start(ctx); err != nil {
		return err
	}
	if ctx.Err() != nil {
		return nil
	}
	go m.awaitReady(ctx)
	total, shards, weights := 0, 0, make([]int, len(m.queues))
	for i, q := range m.queues {
		total += q.Weight
		shards += q.Consumer.member().shardCount()
		weights[i] = q.Weight
	}
	ring := newSharedRing(m.opts.Prefetch, shards, len(m.queues))
	ring.qstrict, ring.qorder = m.opts.Strict, queueOrder(weights)
	for i, w := range weights {
		ring.qs[i].weight = w
	}
	p := newPool(ring, newReadAhead(m.opts.Workers, m.opts.Prefetch, false), m.opts.Workers)
	for i, q := range m.queues {
		mc := q.Consumer.member()
		prefetch := max(mc.shardCount(), m.opts.Prefetch*q.Weight/total)
		p.add(mc.join(ring, i, prefetch, m.opts.Workers))
	}
	m.lastPool.Store(p)
	p.run(ctx)
	return nil
}

// start creates every queue's groups, all at once. A fatal error of one
// queue (see Consumer.Run) stops the others' retries and is returned; ctx
// ending first returns nil (as Consumer.Run does).
func (m *MultiConsumer) start(ctx context.Context) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	errs := make(chan error, len(m.queues))
	for _, q := range m.queues {
		go func() { errs <- q.Consumer.member().start(ctx) }()
	}
	var first error
	for range m.queues {
		if err := <-errs; err != nil && first == nil && !errors.Is(err, context.Canceled) {
			first = err
			cancel()
		}
	}
	return first
}

// awaitReady closes m's Ready once every queue's consumer is ready.
func (m *MultiConsumer) awaitReady(ctx context.Context) {
	for _, q := range m.queues {
		select {
		case <-q.Consumer.Ready():
		case <-ctx.Done():
			return
		}
	}
	m.readyOnce.Do(func() { close(m.ready) })
}

// Queue returns the consumer's queue.
func (c *Consumer[Req, Resp]) Queue() string { return c.queue }

func (c *Consumer[Req, Resp]) member() memberConsumer {
	if c == nil {
		return nil
	}
	return c
}

func (c *Consumer[Req, Resp]) group() string   { return c.opts.Group }
func (c *Consumer[Req, Resp]) shardCount() int { return c.nShards }
func (c *Consumer[Req, Resp]) claim() bool     { return c.running.CompareAndSwap(false, true) }
func (c *Consumer[Req, Resp]) unclaim()        { c.running.Store(false) }

// start creates the consumer's groups, returning the errors Run returns
// (nil when ctx ended first). go-redis does not interrupt a call when its
// context ends (unless the client has ContextTimeoutEnabled): a call
// stalled on the connection would hold Run for the client's timeouts, so
// start stops waiting for it.
func (c *Consumer[Req, Resp]) start(ctx context.Context) error {
	type started struct {
		live []bool
		err  error
	}
	ready := make(chan started, 1)
	c.background.Add(1)
	go func() {
		defer c.background.Done()
		live, err := c.ensureGroupRetry(ctx)
		ready <- started{live, err}
	}()
	var err error
	select {
	case s := <-ready:
		c.levelsAtStart, err = s.live, s.err
	case <-ctx.Done():
		select {
		case s := <-ready:
			c.levelsAtStart, err = s.live, s.err
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
	return nil
}

// join returns the consumer's run as queue index queue of a shared pool.
func (c *Consumer[Req, Resp]) join(r *ring, queue, prefetch, workers int) queueRun {
	run := newRun(c, r, queue, prefetch)
	run.workers = workers
	c.lastRun.Store(run)
	return run
}
