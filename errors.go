package streamq

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"
)

// Sentinel errors. Match them with errors.Is.
var (
	// ErrClosed is returned by calls on a closed Producer, by Wait on promises
	// still waiting when it closed, and to calls still in a round trip when
	// Close stopped waiting for them (CloseTimeout): their outcome is unknown,
	// and producing the id again is safe.
	ErrClosed = errors.New("streamq: producer is closed")
	// ErrInvalidID is returned when a request id is empty or longer than MaxIDLen.
	ErrInvalidID = errors.New("streamq: invalid request id")
	// ErrPayloadTooLarge is returned when an encoded request exceeds MaxPayloadBytes.
	ErrPayloadTooLarge = errors.New("streamq: payload too large")
	// ErrBatchTooLarge is returned when a batch exceeds MaxBatchItems or MaxBatchBytes.
	// Nothing of such a batch is written; split it and retry.
	ErrBatchTooLarge = errors.New("streamq: batch too large")
	// ErrInvalidOptions wraps every option validation error.
	ErrInvalidOptions = errors.New("streamq: invalid options")
	// ErrFailed matches a request whose handler returned an error (see RequestError).
	ErrFailed = errors.New("streamq: request failed")
	// ErrDeadLettered matches a request that was moved to the dead-letter stream.
	// Such errors also match ErrFailed.
	ErrDeadLettered = errors.New("streamq: request dead-lettered")
	// ErrNoResult is returned by Wait when the request completed but the consumer
	// does not store results (ConsumerOptions.DiscardResults) and the completion
	// notice was missed.
	ErrNoResult = errors.New("streamq: request completed, result not stored")
	// ErrRecordLost is returned by Wait when the request's record vanished before
	// this producer saw its outcome. Either the request completed and its record
	// expired (ConsumerOptions.ResultTTL) before the completion notice reached
	// this producer (the notice was lost, for example during a connection outage,
	// and the record check came later), or the record expired unhandled
	// (ProducerOptions.InflightTTL), or Redis lost the key (eviction, a restart
	// without persistence). So the request may have run: producing the id again
	// enqueues it again and may run it a second time. Keep ResultTTL well above
	// BackstopInterval and above the longest outage you expect.
	ErrRecordLost = errors.New("streamq: request record vanished before its outcome was seen: the request may have run " +
		"and its result expired (ResultTTL), or it expired unhandled (InflightTTL); producing the id again may run it again")
	// ErrReleased is returned by Promise.Wait after Promise.Release. The request
	// is unaffected; produce the id again to wait for its result.
	ErrReleased = errors.New("streamq: promise released; produce the id again to wait for its result")
	// ErrWrongType is returned when a key the queue needs holds a value of another
	// kind, usually because another program wrote it. Delete or rename that key.
	ErrWrongType = errors.New("streamq: key holds a value streamq did not write")
	// ErrCanceled is returned by Wait (and given to Send's callbacks) for a
	// request that Admin.Cancel cancelled: scheduled, queued or running
	// (then no outcome of its handler is recorded). It is also the cause
	// (context.Cause) of a running handler's context when its request is
	// cancelled. Producing the id again, once its stored outcome expired
	// (AdminOptions.ResultTTL), runs it anew.
	ErrCanceled = errors.New("streamq: request canceled")
	// ErrNotScheduled is returned by Admin.Cancel with AdminOptions.Group
	// naming a fan-out group that has no retry of the id waiting, and by
	// Admin.RunNow for a request that is not waiting in the schedule: it is
	// already in the stream (or running), or it completed.
	ErrNotScheduled = errors.New("streamq: request is not scheduled: it is already queued, running or completed")
	// ErrFinished is returned by Admin.Cancel for a request whose outcome is
	// recorded already (succeeded, failed or dead-lettered): the outcome
	// stands, and its callers get it.
	ErrFinished = errors.New("streamq: request already finished")
	// ErrRequeueInFlight is returned by Admin.Requeue for a dead letter whose
	// request id is in flight again (produced again, with RetryFailed, or
	// requeued from another dead letter): queued, running, or waiting in the
	// schedule. Requeueing it would run the request a second time beside
	// that one. Wait until it finished and requeue it then if it must run
	// again, or purge the dead letter.
	ErrRequeueInFlight = errors.New("streamq: the dead letter's request id is in flight again")
	// ErrInvalidDeadLetterID is returned for a dead-letter id that is not one
	// DeadLetters lists: a stream id "<ms>-<seq>" (Redis would read "<ms>"
	// alone as a range, or as "<ms>-0", another dead letter), prefixed with
	// "<shard>/" when the queue has several shards.
	ErrInvalidDeadLetterID = errors.New("streamq: invalid dead letter id")
	// ErrAccessDenied is returned by Consumer.Run when Redis refuses the
	// client at start: no or wrong credentials (NOAUTH, WRONGPASS) or an ACL
	// that does not allow a command or key the queue needs (NOPERM). The
	// error names what was refused; docs/operating.md ("Security") lists the ACL rules.
	ErrAccessDenied = errors.New("streamq: Redis refused access")
	// ErrLeaseLost is the cause of a handler context cancelled because another
	// consumer claimed the message.
	ErrLeaseLost = errors.New("streamq: message claimed by another consumer")
	// ErrDeadlineExceeded matches a request whose deadline (Deadline,
	// Timeout) passed: as the cause of its handler's context, and as the
	// error of a request that was dead-lettered because its deadline passed
	// before a handler started it (callers' RequestError matches it).
	ErrDeadlineExceeded = errors.New("streamq: request deadline exceeded")
	// ErrHandlerTimeout is the cause of a handler context ended by
	// ConsumerOptions.HandlerTimeout.
	ErrHandlerTimeout = errors.New("streamq: handler timeout")
	// ErrPanic matches the error of an attempt whose handler (or middleware)
	// panicked.
	ErrPanic = errors.New("streamq: handler panicked")
	// ErrIntercepted is returned by a produce call whose ProduceInterceptor
	// returned nil without calling next: nothing was sent.
	ErrIntercepted = errors.New("streamq: a produce interceptor did not send the request")
)

// mustContext panics when ctx is nil, as the standard library does: a nil
// Context is a programming error (use context.Background or context.TODO). The
// check runs before any lock is taken or any state changes, so the panic leaves
// the object usable.
func mustContext(ctx context.Context, method string) {
	if ctx == nil {
		panic("streamq: nil Context passed to " + method + "; use context.Background()")
	}
}

// RequestError is the error a waiting caller receives when a request failed.
// It matches ErrFailed, and ErrDeadLettered when the request was dead-lettered.
type RequestError struct {
	// Message is the handler's error text (or the reason for dead-lettering).
	Message string
	// DeadLettered reports whether the request was moved to the dead-letter stream.
	DeadLettered bool
}

// Error implements error. The text carries the "streamq: " prefix once,
// also for a Message that starts with it.
func (e *RequestError) Error() string {
	msg := strings.TrimPrefix(e.Message, "streamq: ")
	if e.DeadLettered {
		return "streamq: request dead-lettered: " + msg
	}
	return "streamq: request failed: " + msg
}

// wrappedError is an error wrapping another with context, its text carrying
// the "streamq: " prefix once.
type wrappedError struct {
	msg string
	err error
}

func (e *wrappedError) Error() string { return e.msg }
func (e *wrappedError) Unwrap() error { return e.err }

// wrapf is fmt.Errorf("streamq: <format>: %w", ..., err) without repeating
// the prefix when err's own text starts with it.
func wrapf(err error, format string, args ...any) error {
	return &wrappedError{msg: "streamq: " + fmt.Sprintf(format, args...) + ": " + unprefixed(err), err: err}
}

// unprefixed is err's text without a leading "streamq: ".
func unprefixed(err error) string { return strings.TrimPrefix(err.Error(), "streamq: ") }

// Is makes errors.Is match ErrFailed, ErrDeadLettered when dead-lettered,
// and ErrChildFailed for a flow's parent failed by its children.
func (e *RequestError) Is(target error) bool {
	return target == ErrFailed || (e.DeadLettered && target == ErrDeadLettered) ||
		(!e.DeadLettered && target == ErrChildFailed && strings.HasPrefix(e.Message, unprefixed(ErrChildFailed))) ||
		(e.DeadLettered && target == ErrDeadlineExceeded &&
			strings.HasPrefix(strings.TrimPrefix(e.Message, "streamq: "), unprefixed(ErrDeadlineExceeded)))
}

// permanentError marks an error that must not be retried.
type permanentError struct{ err error }

func (e permanentError) Error() string { return e.err.Error() }
func (e permanentError) Unwrap() error { return e.err }

// Permanent wraps err so that the consumer does not retry the message: it is
// dead-lettered at once and its callers receive err. Permanent(nil) is nil.
func Permanent(err error) error {
	if err == nil {
		return nil
	}
	return permanentError{err}
}

// IsPermanent reports whether err was wrapped by Permanent.
func IsPermanent(err error) bool {
	var p permanentError
	return errors.As(err, &p)
}

// retryAfterError asks for a retry after a given delay.
type retryAfterError struct {
	err   error
	delay time.Duration
}

func (e retryAfterError) Error() string { return e.err.Error() }
func (e retryAfterError) Unwrap() error { return e.err }

// RetryAfter wraps err so that the next delivery of the message happens no sooner
// than d (capped at ConsumerOptions.MinIdle) instead of after the exponential
// back-off. The delivery still counts toward MaxDeliveries. RetryAfter(nil, d) is nil.
func RetryAfter(err error, d time.Duration) error {
	if err == nil {
		return nil
	}
	return retryAfterError{err, d}
}

// classifyRedisError makes a Redis refusal that waiting does not fix match
// its sentinel: NOAUTH, WRONGPASS and NOPERM match ErrAccessDenied, WRONGTYPE
// matches ErrWrongType. Other errors are returned as they are.
func classifyRedisError(err error) error {
	if err == nil || errors.Is(err, ErrAccessDenied) || errors.Is(err, ErrWrongType) {
		return err
	}
	var rerr redis.Error
	msg := err.Error()
	if errors.As(err, &rerr) {
		msg = rerr.Error()
	}
	for _, code := range []string{"NOAUTH", "WRONGPASS", "NOPERM"} {
		if strings.HasPrefix(msg, code) || strings.Contains(err.Error(), ": "+code+" ") {
			return &wrappedError{msg: "streamq: Redis refused access: " + unprefixed(err), err: errors.Join(ErrAccessDenied, err)}
		}
	}
	if strings.HasPrefix(msg, "WRONGTYPE") || strings.Contains(err.Error(), ": WRONGTYPE ") {
		return &wrappedError{msg: "streamq: a key of the queue holds another type: " + unprefixed(err), err: errors.Join(ErrWrongType, err)}
	}
	return err
}
