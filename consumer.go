package streamq

// The consumer: the public type, Run, and group creation. A Run is a pool
// (pool.go) of one queue's run (run.go).
//
// Goroutines: Run's caller waits in Run; one goroutine per Run creates the
// groups (ensureGroupRetry); the pool runs the shutdown steps (pool.stop).
// The rest are started by run.begin and listed on the run type (run.go).

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
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
	// Key is the request's key (see Key); "" when none.
	Key string

	// tx is the shard's template (a Consumer's message), or the Tx that Tx
	// made for a message built by hand.
	tx *Tx
	// st is what the handler's goroutines share with the worker (a Consumer's
	// message; it lives in the slot): nil when built by hand.
	st    *msgState
	link  messageLink // the run, for Progress and Children; nil when built by hand
	shard int
	flow  bool // a flow's parent (entry field "fp")
}

// msgState is the part of a Consumer's Message that the handler's
// goroutines share with the worker, which finishes it when the handler
// returned (finish).
type msgState struct {
	// mu guards tx and done.
	mu sync.Mutex
	// tx is the Tx that Message.Tx made; nil while none.
	tx *Tx
	// done is set when the handler returned: Message.Tx then hands out a
	// closed Tx, and Message.Progress stores nothing.
	done bool
	// reports is read-held by each Message.Progress call while it runs and
	// taken by finish, so that no report is stored after finish: the
	// outcome's completion call knows whether the delivery reported.
	reports  sync.RWMutex
	reported atomic.Bool // a Progress call of this delivery ran progress.lua
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
	shards []keys.Keys
	// levelsAtStart tells, per index of shards, whether a priority level's
	// stream existed at Run's start (findLevels; written by start, in
	// Run's goroutine, before the run begins).
	levelsAtStart []bool
	nShards       int
	sharded       bool  // notices use sharded pub/sub (Redis Cluster)
	tx            []*Tx // per index of shards, the template Tx of its messages
	slots         *slotRefresher
	metaOK        atomic.Bool
	opts          ConsumerOptions
	handler       Handler[Req, Resp]
	log           *slog.Logger
	running       atomic.Bool
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
// retrying until it succeeds or ctx ends. It returns, per index of shards,
// whether a priority level's stream exists (findLevels).
func (c *Consumer[Req, Resp]) ensureGroupRetry(ctx context.Context) ([]bool, error) {
	var b backoff
	for {
		var live []bool
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
			live, err = c.findLevels(ctx)
		}
		if err == nil {
			err = c.writeKeySettings(ctx)
		}
		if err == nil {
			return live, nil
		}
		err = classifyRedisError(err)
		if fatalStartError(err) {
			return nil, err
		}
		if ctx.Err() != nil {
			return nil, ctx.Err() // Run's ctx ended while it started: no error to report
		}
		if c.opts.FailFast {
			return nil, wrapf(err, "consumer start failed (FailFast)")
		}
		c.log.ErrorContext(ctx, "streamq: cannot create the consumer group; retrying", "err", err)
		if sleepCtx(ctx, b.next()) != nil {
			return nil, ctx.Err()
		}
	}
}

// findLevels returns which priority levels' streams exist at Run's start
// (per index of shards; start stores it in levelsAtStart) and creates their
// groups: their feeders read from the start, and the queue's first take
// waits for their first reads (see run.startLevels), so a backlog on
// several levels starts in level order. It costs one EXISTS per level
// stream, once per Run.
func (c *Consumer[Req, Resp]) findLevels(ctx context.Context) ([]bool, error) {
	live := make([]bool, len(c.shards))
	for v := c.nShards; v < len(c.shards); v++ {
		n, err := c.client.Exists(ctx, c.shards[v].Stream).Result()
		if err != nil {
			return nil, fmt.Errorf("streamq: look for the priority level stream %s: %w", c.shards[v].Stream, err)
		}
		if n == 1 {
			if err := c.ensureGroup(ctx, v); err != nil {
				return nil, err
			}
			live[v] = true
		}
	}
	return live, nil
}

// realShard returns the shard of stream index v (see Consumer.shards): the
// levels of a shard share its places.
func (c *Consumer[Req, Resp]) realShard(v int) int { return v % c.nShards }

// levelIndex returns the level of stream index v (see levelNames).
func (c *Consumer[Req, Resp]) levelIndex(v int) int { return v / c.nShards }

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
