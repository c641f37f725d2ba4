package streamq

import (
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"log/slog"
	"os"
	"time"

	"github.com/streamq/streamq/internal/keys"
)

// Limits and defaults. Each option's doc names the constant it defaults to.
const (
	// MaxIDLen is the longest request id accepted, in bytes.
	MaxIDLen = 512

	// DefaultMaxPayloadBytes is the default ProducerOptions.MaxPayloadBytes.
	DefaultMaxPayloadBytes = 1 << 20
	// DefaultInflightTTL is the default ProducerOptions.InflightTTL.
	DefaultInflightTTL = 24 * time.Hour
	// DefaultMaxBatchItems is the default ProducerOptions.MaxBatchItems.
	DefaultMaxBatchItems = 512
	// DefaultMaxBatchBytes is the default ProducerOptions.MaxBatchBytes.
	DefaultMaxBatchBytes = 8 << 20
	// DefaultMaxPendingBytes is the default ProducerOptions.MaxPendingBytes.
	DefaultMaxPendingBytes = 64 << 20
	// DefaultProduceConcurrency is the default ProducerOptions.Concurrency.
	DefaultProduceConcurrency = 4
	// DefaultBackstopInterval is the default ProducerOptions.BackstopInterval.
	DefaultBackstopInterval = 5 * time.Second
	// DefaultCloseTimeout is the default ProducerOptions.CloseTimeout.
	DefaultCloseTimeout = 10 * time.Second
	// DefaultGroup is the default ConsumerOptions.Group.
	DefaultGroup = "streamq"
	// DefaultWorkers is the default ConsumerOptions.Workers.
	DefaultWorkers = 1
	// DefaultMinPrefetch is the smallest default ConsumerOptions.Prefetch.
	DefaultMinPrefetch = 128
	// DefaultResultTTL is the default ConsumerOptions.ResultTTL.
	DefaultResultTTL = time.Hour
	// DefaultReadBlock is the default ConsumerOptions.ReadBlock.
	DefaultReadBlock = time.Second
	// DefaultMinIdle is the default ConsumerOptions.MinIdle.
	DefaultMinIdle = 30 * time.Second
	// DefaultClaimInterval is the default ConsumerOptions.ClaimInterval.
	DefaultClaimInterval = time.Second
	// DefaultMaxDeliveries is the default ConsumerOptions.MaxDeliveries.
	DefaultMaxDeliveries = 5
	// DefaultRetryBackoff is the default ConsumerOptions.RetryBackoff.
	DefaultRetryBackoff = time.Second
	// DefaultRetryBackoffMax is the default ConsumerOptions.RetryBackoffMax.
	DefaultRetryBackoffMax = 10 * time.Minute
	// DefaultFetchRetries is the default ConsumerOptions.FetchRetries.
	DefaultFetchRetries = 3
	// DefaultFetchBackoff is the default ConsumerOptions.FetchBackoff.
	DefaultFetchBackoff = 50 * time.Millisecond
	// DefaultFetchTimeout is the default ConsumerOptions.FetchTimeout.
	DefaultFetchTimeout = 30 * time.Second
	// DefaultShutdownTimeout is the default ConsumerOptions.ShutdownTimeout.
	DefaultShutdownTimeout = 30 * time.Second
	// DefaultMaxCompleteBatch is the default ConsumerOptions.MaxCompleteBatch.
	DefaultMaxCompleteBatch = 256
	// DefaultTrimInterval is the default ConsumerOptions.TrimInterval.
	DefaultTrimInterval = 30 * time.Second
	// DefaultConsumerIdleTimeout is the default ConsumerOptions.ConsumerIdleTimeout.
	DefaultConsumerIdleTimeout = 24 * time.Hour
	// DefaultDeadLetterMaxLen is the default ConsumerOptions.DeadLetterMaxLen.
	DefaultDeadLetterMaxLen = 100_000

	// MaxWorkers is the largest ConsumerOptions.Workers accepted: Run starts
	// one goroutine per worker before any work.
	MaxWorkers = 10_000
	// MaxPrefetch is the largest ConsumerOptions.Prefetch accepted: a full
	// ring holds that many messages, payloads included, in memory.
	MaxPrefetch = 1_000_000
	// MaxCompleteBatchLimit is the largest ConsumerOptions.MaxCompleteBatch
	// accepted: the completion queue holds two batches, and Redis runs a
	// whole batch in one script, blocking other clients meanwhile.
	MaxCompleteBatchLimit = 10_000
)

// ProducerOptions configure a Producer. The zero value is valid: every field
// has a default, applied by NewProducer.
type ProducerOptions struct {
	// Codec encodes requests and decodes responses.
	// Defaults to JSONCodec. []byte values bypass it.
	Codec Codec

	// MaxPayloadBytes is the largest encoded request accepted.
	// Defaults to DefaultMaxPayloadBytes (1 MiB).
	MaxPayloadBytes int

	// InflightTTL is how long the record of a request that has not completed yet
	// lives while no consumer holds it. While it lives, producing the same id
	// attaches to the queued request. It must outlast the time a request can
	// wait in the queue; it does not bound the time spent working on it: while
	// a consumer holds the request, the record is kept at least 3×MinIdle ahead.
	// Defaults to DefaultInflightTTL (24h).
	InflightTTL time.Duration

	// MaxBatchItems caps the requests in one ProduceBatch call and in one
	// coalesced round trip. Defaults to DefaultMaxBatchItems (512).
	MaxBatchItems int

	// MaxBatchBytes caps the encoded bytes in one ProduceBatch call and in one
	// coalesced round trip. Defaults to DefaultMaxBatchBytes (8 MiB).
	MaxBatchBytes int

	// MaxPendingBytes bounds the encoded bytes of Produce calls accepted but not yet
	// sent; further calls block (respecting their context) until bytes are sent.
	// Defaults to DefaultMaxPendingBytes (64 MiB).
	MaxPendingBytes int

	// Concurrency is how many coalesced round trips may be in flight at once.
	// Defaults to DefaultProduceConcurrency (4).
	Concurrency int

	// Linger is how long the coalescer waits for more calls after the first one
	// before sending. Zero sends at once with whatever is already waiting, which is
	// the right choice almost always. Defaults to 0.
	Linger time.Duration

	// BackstopInterval is how often waiting promises are checked against Redis,
	// to recover results whose notification was lost to a reconnect. The check
	// also runs at once after every resubscription. A result whose notice was
	// lost is found only while its record lives, so keep the consumers'
	// ResultTTL well above BackstopInterval (and above the longest connection
	// outage you expect); otherwise Wait returns ErrRecordLost for a request
	// that ran. Defaults to DefaultBackstopInterval (5s).
	BackstopInterval time.Duration

	// OnSendError receives each request accepted by Send that could not be
	// written (the error says why; the request may or may not be recorded
	// when the round trip failed midway, and sending its id again is safe).
	// It runs on the producer's sending goroutine: it must not block.
	// Defaults to nil: the failure is logged at Error level. Flush reports
	// failures either way.
	OnSendError func(id string, err error)

	// CloseTimeout bounds Close: how long it waits for accepted requests to be
	// sent and for the producer's goroutines to stop, whatever the connection
	// does. Requests still in a round trip after it get ErrClosed with an
	// unknown outcome. Defaults to DefaultCloseTimeout (10s).
	CloseTimeout time.Duration

	// Shards spreads the queue over this many streams, each in its own hash
	// slot, so that one queue can use several Redis Cluster masters. Each id
	// always goes to the same shard. Producers and consumers of a queue must
	// agree; a queue's shard count cannot change (ErrShardMismatch).
	// Defaults to 1.
	Shards int

	// Interceptors wrap every Produce, Enqueue, Send and ProduceBatch call, the
	// first outermost: to set headers from ctx (a trace context), to count
	// or time calls. See ProduceInterceptor. Defaults to none.
	Interceptors []ProduceInterceptor

	// Logger receives the producer's logs. Defaults to slog.Default().
	Logger *slog.Logger
}

func (o *ProducerOptions) resolve() error {
	if o.Codec == nil {
		o.Codec = JSONCodec{}
	}
	if o.Logger == nil {
		o.Logger = slog.Default()
	}
	setDefault(&o.MaxPayloadBytes, DefaultMaxPayloadBytes)
	setDefault(&o.InflightTTL, DefaultInflightTTL)
	setDefault(&o.MaxBatchItems, DefaultMaxBatchItems)
	setDefault(&o.MaxBatchBytes, DefaultMaxBatchBytes)
	setDefault(&o.MaxPendingBytes, DefaultMaxPendingBytes)
	setDefault(&o.Concurrency, DefaultProduceConcurrency)
	setDefault(&o.BackstopInterval, DefaultBackstopInterval)
	setDefault(&o.CloseTimeout, DefaultCloseTimeout)
	setDefault(&o.Shards, 1)
	return firstError(
		shardCount(o.Shards),
		positive("MaxPayloadBytes", o.MaxPayloadBytes),
		atLeast("InflightTTL", o.InflightTTL, time.Millisecond),
		positive("MaxBatchItems", o.MaxBatchItems),
		atLeastInt("MaxBatchBytes", o.MaxBatchBytes, o.MaxPayloadBytes, "MaxPayloadBytes"),
		atLeastInt("MaxPendingBytes", o.MaxPendingBytes, o.MaxBatchBytes, "MaxBatchBytes"),
		positive("Concurrency", o.Concurrency),
		atLeast("Linger", o.Linger, 0),
		atLeast("BackstopInterval", o.BackstopInterval, 10*time.Millisecond),
		atLeast("CloseTimeout", o.CloseTimeout, time.Millisecond),
	)
}

// ConsumerOptions configure a Consumer. The zero value is valid: every field
// has a default, applied by NewConsumer.
type ConsumerOptions struct {
	// Group is the consumer group. Consumers of one group share the work; each
	// group sees every request. Defaults to DefaultGroup ("streamq").
	Group string

	// Fanout makes Group a fan-out group: it sees every request, records no
	// outcome for callers, and its final failures go to its own dead-letter
	// stream (Admin with AdminOptions.Group addresses them). A queue has one
	// answering group, the one whose outcomes callers receive; every other
	// group must set Fanout (Run refuses a second answering group with
	// ErrAnsweringGroup). Defaults to false: the answering group.
	Fanout bool

	// Name identifies this consumer inside its group. A consumer restarted with
	// the same name resumes its own pending entries at once; a new name leaves
	// them to be claimed after MinIdle. Use a name stable per process slot
	// (a pod name, a systemd instance) when you have one.
	// Defaults to "<hostname>-<pid>-<random>".
	Name string

	// Workers is how many handlers run at once. With one worker, messages are
	// handled in stream order. Each worker is a goroutine started by Run; at
	// most MaxWorkers (10,000). Defaults to DefaultWorkers (1).
	Workers int

	// Prefetch is the depth of the prefetch ring: the most messages held at
	// once, read ahead and fetched, waiting, in a handler, or handled with the
	// outcome not yet recorded. The consumer holds fewer while that is
	// enough: it starts at 2×Workers+2 and reads further ahead only while its
	// workers wait for reads or fetches, so slow jobs of a backlog stay in the
	// stream for other consumers to start, and fast ones still read and
	// complete in big batches (see DESIGN.md, "Read-ahead"). With Shards > 1, each shard holds at most its
	// share (Prefetch/Shards), so a shard whose completions fail stalls only
	// itself. It bounds the
	// payloads in the consumer's memory, and how many entries one consumer
	// takes from the stream ahead of others. Deeper rings read and complete in
	// bigger batches (less Redis CPU per message); with large payloads or slow
	// handlers shared by many consumers, use less. It must be at least Workers
	// and at most MaxPrefetch (1,000,000). The ring's memory grows and shrinks
	// with the messages it holds, so a deep ring costs little while the queue
	// is short. Defaults to max(DefaultMinPrefetch (128), 4*Workers).
	Prefetch int

	// Codec decodes requests and encodes responses. Defaults to JSONCodec.
	Codec Codec

	// Fetcher produces each message's payload bytes from its stream entry.
	// Defaults to InlineFetcher: the entry carries the payload.
	Fetcher Fetcher

	// FetchRetries is how many times a failed fetch is retried, with exponential
	// back-off from FetchBackoff, before the message takes the failure path:
	// it is retried through the schedule (RetryBackoff), without counting a
	// delivery since its handler did not start, and dead-lettered after
	// MaxDeliveries failed fetches in a row or at once for a Permanent error.
	// Defaults to DefaultFetchRetries (3); -1 disables retries.
	FetchRetries int

	// FetchBackoff is the first delay between fetch attempts.
	// Defaults to DefaultFetchBackoff (50ms).
	FetchBackoff time.Duration

	// FetchTimeout bounds each Fetch call: its context ends after it, and an
	// attempt that has not returned by then fails like any failed fetch
	// (retried as FetchRetries says). A worker waits for the fetch of the
	// slot it took, so without a bound one source that never answers would
	// hold that worker, and with Workers 1 every job of the consumer.
	// Fetch must return when its context ends. Defaults to
	// DefaultFetchTimeout (30s); -1 disables the bound.
	FetchTimeout time.Duration

	// ResultTTL is how long a completed request's record (its result, and so its
	// deduplication) is kept. Defaults to DefaultResultTTL (1h).
	ResultTTL time.Duration

	// DiscardResults stores only a "done" marker instead of each result, for
	// fire-and-forget queues. Callers waiting at completion still receive the
	// result through the notification, as long as their producer listens
	// (always after a Produce; a ProduceBatch's promises from their first
	// Wait, Done or Progress: see ProduceBatch). Defaults to false.
	DiscardResults bool

	// ReadBlock is the longest a read waits for new entries; reads also block no
	// longer than ShutdownTimeout, so shutdown's last read ends in time for its
	// entries to be released. Defaults to DefaultReadBlock (1s).
	ReadBlock time.Duration

	// MinIdle is how long an entry must be idle before another consumer may claim
	// it. Entries this consumer holds have their lease renewed every MinIdle/3, so
	// handlers may run longer than MinIdle. Defaults to DefaultMinIdle (30s).
	MinIdle time.Duration

	// ClaimInterval is how often idle entries of other consumers are looked for.
	// Defaults to DefaultClaimInterval (1s).
	ClaimInterval time.Duration

	// MaxDeliveries is how many times a message's handler may start before it
	// is dead-lettered. Each start is recorded in Redis before the handler runs,
	// so starts that crashed their process count too; reads, claims and
	// releases of entries that never started do not.
	// Defaults to DefaultMaxDeliveries (5).
	MaxDeliveries int

	// RetryBackoff is the delay before the second delivery of a failed message;
	// it doubles with each delivery up to RetryBackoffMax, and each delay is
	// drawn uniformly from its upper half (jitter). A failed message waits in
	// the queue's schedule in Redis, not in the stream, so the delay is exact
	// and not bounded by MinIdle; RetryAfter sets it per failure.
	// Defaults to DefaultRetryBackoff (1s).
	RetryBackoff time.Duration

	// RetryBackoffMax caps the exponential back-off of RetryBackoff (not the
	// delay asked for with RetryAfter). With the defaults, the five
	// deliveries of a failing message spread over about 8 to 15 s; raise
	// MaxDeliveries to ride out real outages: with 20, a message is retried
	// for about 1 to 2 hours, every 5 to 10 minutes at the end.
	// Defaults to DefaultRetryBackoffMax (10m).
	RetryBackoffMax time.Duration

	// ShutdownTimeout is how long Run waits, after its context ends, for running
	// handlers to finish before cancelling their contexts. Recording outcomes
	// and releasing prefetched entries get as long again: Run returns at most
	// about 2×ShutdownTimeout after its context ends, even while Redis is
	// unreachable or the connection stalls. Defaults to DefaultShutdownTimeout (30s).
	ShutdownTimeout time.Duration

	// MaxCompleteBatch caps the completions recorded in one round trip; at most
	// MaxCompleteBatchLimit (10,000). Defaults to DefaultMaxCompleteBatch (256).
	MaxCompleteBatch int

	// KeyLimit is the most handlers of one key (see Key) that run at once,
	// across every consumer and process of the queue (per shard with
	// Shards > 1). It is enforced in Redis: a keyed job enters the stream
	// only with a slot of its key, and the slot is given back with its
	// outcome or retry, so a crashed consumer's jobs keep their slots until
	// another consumer claims and finishes them. A key at its limit leaves
	// its jobs waiting outside the stream, and other keys' jobs run. Run
	// stores it in Redis (it applies to every consumer of the queue; the
	// last one stored wins), and it holds back the jobs appended from then
	// on: store it with Admin.SetKeyDefaults before producing when the
	// first jobs must respect it. Admin.SetKeyLimit overrides it per key. 0
	// (the default) stores nothing: no limit unless one was stored before.
	KeyLimit int

	// KeyWindow is the most keyed jobs the queue's consumers hold at once
	// per shard (read ahead, waiting in the stream or running): the bound on
	// how far a keyed job can be behind other keys' jobs once its turn came.
	// Keep it at least the workers of every consumer of the queue, or they
	// idle. Run stores it in Redis like KeyLimit. 0 (the default) stores
	// nothing: DefaultKeyWindow (128) unless another was stored.
	KeyWindow int

	// KeyRate limits how fast the jobs of each key (see Key) enter the
	// stream, across every consumer and process of the queue (per shard
	// with Shards > 1): N per Per, spread evenly, plus Burst after a quiet
	// time, as RateLimit, but counted per key at the append of the key's
	// jobs, so their starts follow at that rate (jobs already appended are
	// not held back again: while consumers lag, appended jobs may start
	// closer together). A key over its rate appends nothing more until its
	// rate allows, without holding back other keys, and nothing polls it:
	// the promoter appends its next job at its time. Run stores it in Redis
	// like KeyLimit; Admin.SetKeyRate overrides it per key. nil (the
	// default) stores nothing: no rate limit per key unless one was stored.
	KeyRate *RateLimit

	// FailFast makes Run return the first error it meets at start
	// (connecting, checking the server, creating the consumer groups)
	// instead of logging it and trying again until Redis answers. Use it when
	// the host should stop, or report itself unhealthy, if Redis is not
	// reachable when it starts; after the start, errors are retried either
	// way. Defaults to false: Run retries at start.
	FailFast bool

	// TrimInterval is how often the stream is trimmed of entries every group is
	// done with, and idle consumers are pruned. It is jittered by ±20%.
	// Defaults to DefaultTrimInterval (30s); -1 disables.
	TrimInterval time.Duration

	// ConsumerIdleTimeout is how long a consumer of the group with no pending
	// entries may stay idle before it is deleted from the group.
	// Defaults to DefaultConsumerIdleTimeout (24h).
	ConsumerIdleTimeout time.Duration

	// DeadLetterMaxLen caps the dead-letter stream's length (approximately; the
	// oldest go first). Defaults to DefaultDeadLetterMaxLen (100,000).
	DeadLetterMaxLen int

	// RateLimit limits the handler starts of all the consumers of Group
	// together (in Redis, on the server's clock); give each of them the same
	// value. A worker waits for its turn before it starts a handler: waiting
	// is no failure and no delivery, and the entry stays leased meanwhile.
	// Defaults to nil: no limit.
	RateLimit *RateLimit

	// Shards is the queue's shard count; see ProducerOptions.Shards. The consumer
	// reads every shard through one ring and one set of workers.
	// Defaults to 1.
	Shards int

	// PriorityWeights are the shares of the priority levels (high, normal,
	// low; see Priority) in the order workers take messages from the ring
	// while more than one level has messages waiting there: of every 10
	// starts with the default {6, 3, 1}, 6 are high, 3 normal and 1 low, so
	// the lowest level is never starved; a level with nothing waiting
	// leaves its turns to the others. Each weight is at least 1. Ignored
	// with StrictPriority. Defaults to DefaultPriorityWeights ({6, 3, 1})
	// when all three are 0.
	PriorityWeights [3]int

	// StrictPriority makes workers always take the highest level waiting in
	// the ring: no message of a lower level starts while one of a higher
	// level waits there. A lower level then runs only while the higher ones
	// have nothing read, and may starve under constant higher load.
	// Defaults to false (weighted, see PriorityWeights).
	StrictPriority bool

	// Middleware wraps the handling of every message, the first outermost:
	// tracing, metrics, logging written once for every Consumer type. See
	// Middleware for what it sees and how its errors and panics count.
	// Defaults to none.
	Middleware []Middleware

	// HandlerTimeout bounds each handler run: its context ends after it, with
	// cause ErrHandlerTimeout. A handler that returns an error then fails
	// like any other attempt: it counts as a delivery and is retried up to
	// MaxDeliveries. A request's own deadline (Deadline, Timeout) applies as
	// well; the earlier of the two ends the context. Defaults to 0: no
	// bound.
	HandlerTimeout time.Duration

	// Logger receives the consumer's logs. Defaults to slog.Default().
	Logger *slog.Logger

	// Retention keeps a bounded list of recently completed requests in
	// Redis (see Retention), which Admin.Completed lists. Only for the
	// answering group. Defaults to nil: no list, and completions send no
	// command for it.
	Retention *Retention

	// replyWait (tests only) sends ticks on the client itself, so its hooks
	// see them, and makes workers wait for the reply of their start.
	replyWait bool
	// checkOwner (tests only) sends every start charge through charge.lua,
	// as for entries held longer than MinIdle/2.
	checkOwner bool
	// holdPrefetch (tests only) holds Prefetch entries from the start, as if
	// the read-ahead had grown to its limit: tests of a full ring need one.
	holdPrefetch bool
}

func (o *ConsumerOptions) resolve() error {
	if o.Group == "" {
		o.Group = DefaultGroup
	}
	if o.Name == "" {
		o.Name = defaultConsumerName()
	}
	if o.Codec == nil {
		o.Codec = JSONCodec{}
	}
	if o.Fetcher == nil {
		o.Fetcher = InlineFetcher{}
	}
	if o.Logger == nil {
		o.Logger = slog.Default()
	}
	setDefault(&o.Workers, DefaultWorkers)
	setDefault(&o.Prefetch, max(DefaultMinPrefetch, 4*o.Workers))
	setDefault(&o.FetchRetries, DefaultFetchRetries)
	setDefault(&o.FetchBackoff, DefaultFetchBackoff)
	setDefault(&o.FetchTimeout, DefaultFetchTimeout)
	setDefault(&o.ResultTTL, DefaultResultTTL)
	setDefault(&o.ReadBlock, DefaultReadBlock)
	setDefault(&o.MinIdle, DefaultMinIdle)
	setDefault(&o.ClaimInterval, DefaultClaimInterval)
	setDefault(&o.MaxDeliveries, DefaultMaxDeliveries)
	setDefault(&o.RetryBackoff, DefaultRetryBackoff)
	setDefault(&o.RetryBackoffMax, max(DefaultRetryBackoffMax, o.RetryBackoff))
	setDefault(&o.ShutdownTimeout, DefaultShutdownTimeout)
	setDefault(&o.MaxCompleteBatch, DefaultMaxCompleteBatch)
	setDefault(&o.TrimInterval, DefaultTrimInterval)
	setDefault(&o.ConsumerIdleTimeout, DefaultConsumerIdleTimeout)
	setDefault(&o.DeadLetterMaxLen, DefaultDeadLetterMaxLen)
	setDefault(&o.Shards, 1)
	if o.PriorityWeights == [3]int{} {
		o.PriorityWeights = DefaultPriorityWeights
	}
	var weightErr error
	for i, w := range o.PriorityWeights {
		if w < 1 && weightErr == nil {
			weightErr = optionError("PriorityWeights[%d] is %d; each weight must be at least 1 (or leave all three 0 for the default %v)",
				i, w, DefaultPriorityWeights)
		}
	}
	if o.RateLimit != nil {
		rl := *o.RateLimit // resolve sets defaults: not in the caller's value
		o.RateLimit = &rl
	}
	if o.KeyRate != nil {
		rl := *o.KeyRate
		o.KeyRate = &rl
	}
	if o.Retention != nil {
		keep := *o.Retention // the caller's value may change after the start
		o.Retention = &keep
	}
	var trimErr error
	if o.TrimInterval != -1 {
		trimErr = atLeast("TrimInterval", o.TrimInterval, 10*time.Millisecond)
	}
	var fetchErr, fetchTimeoutErr error
	if o.FetchRetries != -1 {
		fetchErr = positive("FetchRetries", o.FetchRetries)
	}
	if o.FetchTimeout != -1 {
		fetchTimeoutErr = atLeast("FetchTimeout", o.FetchTimeout, time.Millisecond)
	}
	return firstError(
		positive("Workers", o.Workers),
		atMost("Workers", o.Workers, MaxWorkers, "MaxWorkers",
			"Run starts one goroutine per worker before any work; handlers that wait on I/O rarely need more"),
		atLeastInt("Prefetch", o.Prefetch, o.Workers, "Workers"),
		atMost("Prefetch", o.Prefetch, MaxPrefetch, "MaxPrefetch",
			"a full ring holds that many messages, payloads included, in memory; a deeper ring reads in no bigger batches"),
		fetchErr,
		atLeast("FetchBackoff", o.FetchBackoff, time.Millisecond),
		fetchTimeoutErr,
		atLeast("ResultTTL", o.ResultTTL, time.Millisecond),
		atLeast("ReadBlock", o.ReadBlock, time.Millisecond),
		atLeast("MinIdle", o.MinIdle, 10*time.Millisecond),
		atLeast("ClaimInterval", o.ClaimInterval, time.Millisecond),
		positive("MaxDeliveries", o.MaxDeliveries),
		atLeast("HandlerTimeout", o.HandlerTimeout, 0),
		atLeast("RetryBackoff", o.RetryBackoff, time.Millisecond),
		atLeast("RetryBackoffMax", o.RetryBackoffMax, o.RetryBackoff),
		atLeast("ShutdownTimeout", o.ShutdownTimeout, time.Millisecond),
		positive("MaxCompleteBatch", o.MaxCompleteBatch),
		atMost("MaxCompleteBatch", o.MaxCompleteBatch, MaxCompleteBatchLimit, "MaxCompleteBatchLimit",
			"the completion queue holds two batches, and Redis blocks other clients while it records one"),
		trimErr,
		atLeastInt("KeyLimit", o.KeyLimit, 0, "0 (no limit)"),
		atLeastInt("KeyWindow", o.KeyWindow, 0, "0 (the default)"),
		atLeast("ConsumerIdleTimeout", o.ConsumerIdleTimeout, time.Second),
		positive("DeadLetterMaxLen", o.DeadLetterMaxLen),
		shardCount(o.Shards),
		weightErr,
		o.RateLimit.resolve(),
		keyRateError("KeyRate", o.KeyRate),
		o.Retention.resolve(o.Fanout),
		validName("Group", o.Group),
		validName("Name", o.Name),
	)
}

func defaultConsumerName() string {
	host, err := os.Hostname()
	if err != nil || host == "" {
		host = "host"
	}
	var b [4]byte
	_, _ = rand.Read(b[:])
	return fmt.Sprintf("%s-%d-%s", host, os.Getpid(), hex.EncodeToString(b[:]))
}

// setDefault sets *p to def when it is the zero value.
func setDefault[T comparable](p *T, def T) {
	var zero T
	if *p == zero {
		*p = def
	}
}

func firstError(errs ...error) error {
	for _, err := range errs {
		if err != nil {
			return err
		}
	}
	return nil
}

func optionError(format string, args ...any) error {
	return fmt.Errorf("%w: "+format, append([]any{ErrInvalidOptions}, args...)...)
}

func positive(name string, v int) error {
	if v <= 0 {
		return optionError("%s is %d; it must be positive (leave it 0 for the default)", name, v)
	}
	return nil
}

func atLeastInt(name string, v, min int, minName string) error {
	if v < min {
		return optionError("%s is %d; it must be at least %s (%d)", name, v, minName, min)
	}
	return nil
}

// atMost refuses v above limit, saying why the limit exists.
func atMost(name string, v, limit int, limitName, why string) error {
	if v > limit {
		return optionError("%s is %d; it must be at most %d (%s): %s", name, v, limit, limitName, why)
	}
	return nil
}

func atLeast(name string, v, min time.Duration) error {
	if v < min {
		return optionError("%s is %v; it must be at least %v (leave it 0 for the default)", name, v, min)
	}
	return nil
}

func shardCount(n int) error {
	if n < 1 || n > keys.MaxShards {
		return optionError("Shards is %d; it must be in 1..%d (leave it 0 for 1)", n, keys.MaxShards)
	}
	return nil
}

func validName(name, v string) error {
	if len(v) > 256 {
		return optionError("%s is %d bytes; the limit is 256", name, len(v))
	}
	return nil
}
