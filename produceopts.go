package streamq

import (
	"fmt"
	"time"
)

// ProduceOption sets something about one request at produce time, for
// Produce, Enqueue and (per job) ProduceBatch. Options apply in order; a later
// option overrides an earlier one that sets the same thing. Options only take
// effect when the call appends a new entry: a call that attaches to a request
// already in flight, or is answered from a stored outcome, changes nothing
// about that request.
type ProduceOption func(*produceSettings)

// produceSettings is what the ProduceOptions of one call set. The zero value
// is a plain request: appended now, no extra entry fields.
type produceSettings struct {
	// at is the due time set by At (zero: none).
	at time.Time
	// after is the delay set by After; used when afterSet.
	after    time.Duration
	afterSet bool
	// headers are set by Headers (nil: none).
	headers map[string]string
	// deadline is set by Deadline or Timeout (zero: none).
	deadline time.Time
	// retryFailed is set by RetryFailed.
	retryFailed bool
	// priority is set by Priority; used when prioritySet.
	priority    PriorityLevel
	prioritySet bool
}

// RetryFailed lets the request run again when its id's stored outcome is a
// failure: an error, a dead letter or a permanent error (the record that
// ConsumerOptions.ResultTTL keeps). Without it, producing such an id returns
// the stored failure at once, as it returns a stored result. With it, the
// failure record is replaced and the request is appended (or scheduled, with
// At or After) with this call's payload, as if the id were new. An id in
// flight, or whose stored outcome is a success, is deduplicated as usual.
// The old dead letter, if any, stays in the dead-letter stream.
// Default: off.
func RetryFailed() ProduceOption {
	return func(s *produceSettings) { s.retryFailed = true }
}

// flagRetryFailed marks an item produced with RetryFailed (produce.lua).
const flagRetryFailed = "f"

// At delays the request until t: it is recorded (and deduplicated) at once,
// kept in the queue's schedule, and appended to the stream when Redis's clock
// reaches t, so that no handler starts it before t. A t that is not in the
// future appends it now. Callers wait for it like for any request (Wait,
// Done); Admin.Cancel cancels it while it waits. The record of a delayed
// request lives until t plus InflightTTL, so a request nobody runs by then
// is reported lost. Default: no delay. At and After override each other;
// the last one given applies.
//
// Due times are compared with the Redis server's clock: keep the producers'
// clocks in step with it (NTP), or use After, which does not depend on the
// producer's clock.
func At(t time.Time) ProduceOption {
	return func(s *produceSettings) { s.at, s.afterSet = t, false }
}

// After delays the request by d, measured on the Redis server's clock from
// the moment Redis records it: see At. A d of zero or less appends it now.
// Default: no delay.
func After(d time.Duration) ProduceOption {
	return func(s *produceSettings) { s.after, s.afterSet, s.at = d, true, time.Time{} }
}

// Headers adds h to the request's headers: string metadata stored in its
// entry and given to the handler (Message.Headers) and to middleware
// (Delivery.Headers), such as a trace context. Several Headers options
// merge; for a name given twice the last value applies. The encoded headers
// count against MaxPayloadBytes together with the request. Headers travel
// with retries; a dead letter requeued by Admin.Requeue loses them.
// Default: no headers.
func Headers(h map[string]string) ProduceOption {
	return func(s *produceSettings) {
		if len(h) == 0 {
			return
		}
		if s.headers == nil {
			s.headers = make(map[string]string, len(h))
		}
		for k, v := range h {
			s.headers[k] = v
		}
	}
}

// Deadline sets the request's deadline: a handler starting after t does not
// run; the request is dead-lettered with an error matching
// ErrDeadlineExceeded (its waiting callers get it too), without counting a
// delivery. A handler that starts in time runs with a context ending at t
// (cause ErrDeadlineExceeded); if it fails, its retry is dead-lettered the
// same way once t has passed. t is compared with the consumers' clocks.
// Deadline and Timeout override each other; the last one given applies.
// Default: no deadline.
func Deadline(t time.Time) ProduceOption {
	return func(s *produceSettings) { s.deadline = t }
}

// Timeout sets the request's deadline to d from now (the producer's clock):
// see Deadline. A d of zero or less gives a deadline that has passed.
// Default: no deadline.
func Timeout(d time.Duration) ProduceOption {
	return func(s *produceSettings) { s.deadline = time.Now().Add(d) }
}

// maxDelay bounds how far ahead a request can be scheduled: its record must
// live until then, and Redis's millisecond TTLs stay exact far beyond it.
const maxDelay = 10 * 365 * 24 * time.Hour

// applyProduceOptions folds opts into one produceSettings.
func applyProduceOptions(opts []ProduceOption) produceSettings {
	if len(opts) == 0 {
		return produceSettings{} // nothing escapes
	}
	var s produceSettings
	for _, o := range opts {
		if o != nil {
			o(&s)
		}
	}
	return s
}

// due returns the item's due time and flags for produce.lua: an absolute
// Unix millisecond time, or with flag "r" a delay in milliseconds from the
// server's clock; 0 means now.
func (s produceSettings) due() (int64, string, error) {
	switch {
	case s.afterSet:
		if s.after > maxDelay {
			return 0, "", fmt.Errorf("%w: After(%v) is beyond the limit of %v", ErrInvalidOptions, s.after, maxDelay)
		}
		if s.after <= 0 {
			return 0, "", nil
		}
		// Round up: a job is never due before the delay has passed.
		return int64((s.after + time.Millisecond - 1) / time.Millisecond), flagRelative, nil
	case !s.at.IsZero():
		if d := time.Until(s.at); d > maxDelay {
			return 0, "", fmt.Errorf("%w: At(%v) is %v ahead, beyond the limit of %v", ErrInvalidOptions, s.at, d, maxDelay)
		}
		ms := s.at.UnixMilli()
		if s.at.After(time.UnixMilli(ms)) {
			ms++ // round up: never due before t
		}
		if ms <= 0 {
			return 0, "", nil
		}
		return ms, "", nil
	}
	return 0, "", nil
}

// flagRelative marks an item whose due time is a delay from the server's
// clock (produce.lua).
const flagRelative = "r"
