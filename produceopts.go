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
	// mode is the flow-control mode set by Throttle, Debounce or Replace
	// (modeNone: none), with its durations.
	mode         byte
	modeA, modeB time.Duration
	// key is set by Key (fairkeys.go); used when keySet.
	key    string
	keySet bool
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

// Throttle runs the request's id at most once per window d: the first
// produce of the id opens a window of d (on the Redis server's clock) and
// appends the request as usual; every produce of the id while the window is
// open attaches to that run (DedupInflight while it is in flight) or gets its
// stored outcome (DedupStored), and its payload is not used. The first
// produce after the window closed starts a new run and a new window, even
// when the id's outcome is still stored; while the previous run is still in
// flight, it attaches to that run instead, so runs of one id never overlap.
// The window is decided in Redis, in the same step as the append, so it holds
// across producers and survives their restarts.
//
// A produce inside the window whose run's outcome has already expired
// (ConsumerOptions.ResultTTL shorter than d) does not run the id again: its
// promise fails with ErrRecordLost. Keep ResultTTL at least d.
//
// Throttle cannot be combined with At or After, with ProduceBatch (an atomic
// batch) or with a flow (ProduceFlow): those calls fail with
// ErrInvalidOptions. d must be at least a millisecond. Throttle, Debounce
// and Replace override each other; the last one given applies.
func Throttle(d time.Duration) ProduceOption {
	return func(s *produceSettings) { s.mode, s.modeA, s.modeB = modeThrottle, d, 0 }
}

// Debounce runs the request's id once things calm down: d after its last
// produce, with the last produce's payload (and headers, deadline and
// priority), but never later than maxWait after the produce that started the
// wait. Each produce while the id waits replaces the waiting payload and
// pushes its start back to min(now + d, first produce + maxWait); every
// caller of that wait gets the one outcome (the first one's promise says
// DedupNone, the others' DedupInflight: their payloads replaced it in turn,
// the last one runs). The waiting request is a scheduled request
// (Admin.Job shows it scheduled, with its due time and Mode "debounce";
// Admin.Cancel and Admin.RunNow act on it); the wait is kept in Redis, so it
// survives producer and consumer restarts.
//
// Once the wait is over and the request was appended to the stream (queued
// or running), a produce of the id attaches to that run like a plain
// produce: its payload is not used. Once the run's outcome is stored, a
// produce starts a new wait.
//
// Which outcome each caller gets: the outcome of the run its call joined.
// One limit: notices name the id, not the run, so within one Producer the
// waiting callers of an id share one promise state; a caller that joins a
// new wait of the id (opened by another producer) while a caller in the same
// Producer still waits for the previous run's notice is answered with that
// previous run's outcome. Callers that need the run of their own payload
// should produce an id from one Producer at a time, or release old promises.
//
// Debounce cannot be combined with At or After, with ProduceBatch (an
// atomic batch) or with a flow (ProduceFlow): those calls fail with
// ErrInvalidOptions. d must be at least a millisecond and maxWait at least
// d. Throttle, Debounce and Replace override each other; the last one given
// applies.
func Debounce(d, maxWait time.Duration) ProduceOption {
	return func(s *produceSettings) { s.mode, s.modeA, s.modeB = modeDebounce, d, maxWait }
}

// Replace keeps the latest payload of the request's id: every payload
// produced with it either runs or is replaced by a later one, and the id
// never runs twice at once. What a call does depends on where the id stands
// (decided in Redis, in the same step as the append, so it holds across
// producers and survives producer and consumer crashes):
//
//   - Not known, or completed (its outcome stored, whatever it is): a new run
//     with this payload (appended now, or scheduled with At or After: they
//     apply only to a call that starts a new run); the stored outcome is
//     replaced. Deduplicated: DedupNone.
//   - Waiting in the schedule (delayed, debounced, or a retry waiting for its
//     back-off): the waiting request takes this call's payload, headers,
//     deadline and priority and keeps its due time (a retry's start count
//     restarts: the payload is new). One run. DedupInflight.
//   - Queued and not yet read by any consumer: its entry is replaced by one
//     with this call's payload (Promise.EntryID names it). One run.
//     DedupInflight.
//   - Read by a consumer (running, or in a consumer's prefetch): it runs on
//     with its payload, and one more run is kept behind it with this call's
//     payload; later Replace calls replace that one's payload. When the
//     current run ends (succeeds, fails for good, or fails with retries left:
//     the follow-up runs instead of the retry), the follow-up is appended in
//     the same step. DedupInflight, EntryID "".
//
// Which outcome each caller gets: the outcome of the run that carried its
// payload, or of a later run of the id. A run followed by a follow-up stores
// and announces no outcome: every caller waiting for it (Replace or not, in
// any producer) gets the follow-up's outcome; its dead letter, if it failed
// for good, stays in the dead-letter stream. A consumer crash while a run
// holds a follow-up reruns that run (at least once, with its own payload)
// and then the follow-up, once.
//
// Calls without Replace keep their meaning on the same id: they attach to
// what is in flight, or get the stored outcome. A Replace on an id that is
// part of a flow (a parent waiting for its children, a child), or whose
// request in flight has a key (Key), is refused with ErrInvalidOptions and
// nothing is written; Key cannot be combined with Replace. Replace cannot be used in
// ProduceBatch (an atomic batch) or in ProduceFlow (ErrInvalidOptions).
// Admin.Job shows a waiting follow-up (JobInfo.Replacement). A plain produce
// pays nothing for it: the completion of an entry without a follow-up runs
// the same commands as before. Throttle, Debounce and Replace override each
// other; the last one given applies. Default: off.
func Replace() ProduceOption {
	return func(s *produceSettings) { s.mode, s.modeA, s.modeB = modeReplace, 0, 0 }
}

// The flow-control modes of an item (produce.lua's mode argument).
const (
	modeNone     = 0
	modeThrottle = 't'
	modeDebounce = 'd'
	modeReplace  = 'r'
)

// modeArgs validates the mode and returns produce.lua's mode and its two
// numbers (milliseconds).
func (s produceSettings) modeArgs() (byte, int64, int64, error) {
	if s.mode == modeNone {
		return modeNone, 0, 0, nil
	}
	if s.mode == modeReplace {
		return modeReplace, 0, 0, nil // with or without a due time
	}
	if s.afterSet || !s.at.IsZero() {
		return 0, 0, 0, fmt.Errorf("%w: Throttle and Debounce cannot be combined with At or After", ErrInvalidOptions)
	}
	ms := func(d time.Duration) int64 { return int64((d + time.Millisecond - 1) / time.Millisecond) }
	switch s.mode {
	case modeThrottle:
		if s.modeA < time.Millisecond || s.modeA > maxDelay {
			return 0, 0, 0, fmt.Errorf("%w: Throttle(%v): the window must be from 1ms to %v", ErrInvalidOptions, s.modeA, maxDelay)
		}
		return modeThrottle, ms(s.modeA), 0, nil
	default:
		if s.modeA < time.Millisecond || s.modeB < s.modeA || s.modeB > maxDelay {
			return 0, 0, 0, fmt.Errorf("%w: Debounce(%v, %v): the quiet period must be at least 1ms and maxWait from it to %v",
				ErrInvalidOptions, s.modeA, s.modeB, maxDelay)
		}
		return modeDebounce, ms(s.modeA), ms(s.modeB), nil
	}
}

// flagRetryFailed marks an item produced with RetryFailed (produce.lua).
const flagRetryFailed = "f"

// flagQuiet marks an item whose outcome nobody waits for (Enqueue,
// EnqueueBatch, Send, and ProduceBatch while its producer does not listen):
// produce.lua records it as quiet, and its
// completion publishes no notice unless a caller that waits attaches first.
const flagQuiet = "q"

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
