// Package streamq turns Redis Streams into a reliable work queue with
// results: producers submit requests under an id, consumers in a consumer
// group run a handler on each, and the producer's promise receives the
// handler's response or error.
//
// # Guarantees
//
// Every request is handled at least once, and once per id while the id's
// record lives: producing an id that is in flight attaches to that request,
// and producing an id whose outcome is stored (ResultTTL) returns that
// outcome, in one atomic step in Redis. A consumer that crashes or hangs
// loses its entries to another consumer after MinIdle, so a request can run
// more than once after a crash; handlers should be idempotent. A failed
// handler is retried with back-off until MaxDeliveries handler starts, then
// its request is dead-lettered (Permanent skips the retries). Delivery counts
// are handler starts, kept by streamq itself, the same on every Redis 7.0+
// server and on miniredis. A handler's Redis writes staged with
// [Message.Tx] are applied exactly once per request, atomically with its
// recorded outcome. docs/guarantees.md and docs/reliability.md state the limits.
//
// # Where to start
//
//   - Define a queue with its types once: [NewQueue], then
//     [Queue.NewProducer] and [Queue.NewConsumer] (or [NewProducer] and
//     [NewConsumer] directly).
//   - Produce: [Producer.Produce] returns a [Promise] to [Promise.Wait] on;
//     [Producer.Enqueue] is fire-and-forget; [Producer.ProduceBatch] is all
//     or nothing. [After] and [At] delay a request; [RetryFailed] reruns a
//     failed id.
//   - Consume: [Consumer.Run] with a [Handler]; [Permanent] and [RetryAfter]
//     steer retries; [Consumer.Ready] tells when it works; a [Fetcher] such as
//     [CacheFetcher] brings payloads kept outside the stream.
//   - Operate: [Admin] for statistics, jobs, dead letters, pause and resume;
//     [Periodic] for jobs on a schedule.
//   - Test: package streamqtest gives each test a Redis (a real server or
//     miniredis), drains queues and asserts what was produced.
//
// Every function and method that takes a context panics when it is nil, as
// the standard library does, in the caller's goroutine and before it does
// anything.
//
// Errors match the exported sentinels (ErrDeadLettered, ErrNotFound...) with
// errors.Is, and their text starts with "streamq: " once. Logs go to a
// *slog.Logger.
package streamq
