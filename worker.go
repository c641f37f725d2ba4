package streamq

// What a worker does with one slot.
//
// Goroutines: the pool's workers (pool.work) run process for each slot they
// take. A worker owns the slot it took (its data, its Deliveries, charging)
// until it hands the outcome to the stream's committer, or the slot itself
// while the stream's start charges fail (committer.holdBack: the worker that
// takes it from the ring again owns it then); it waits on Redis only for the
// answer to its own start charge.

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"runtime/debug"
	"strconv"
	"strings"
	"time"

	"github.com/streamq/streamq/internal/keys"
)

// drain sets aside a slot that will not start, for release at shutdown.
func (r *run[Req, Resp]) drain(s *slot) {
	r.releaseMu.Lock()
	r.unstarted = append(r.unstarted, s)
	r.releaseMu.Unlock()
}

// process handles one ready slot and hands its outcome to the shard's
// committer. flush pokes the committer of the worker's previous outcome; it
// runs before anything that waits (the pause gate, a rate-limit token). It
// reports whether an outcome was queued without a poke (the worker owes it).
// When it reports false the slot is no longer the worker's (it may be back in
// the ring, taken by another worker, or set aside while its shard's start
// charges fail).
func (r *run[Req, Resp]) process(s *slot, flush func()) (owed bool) {
	if lost, canceled := s.ended(); lost || canceled {
		r.forget(s)
		return false
	}
	if s.skip {
		r.handOff(completion{s: s, code: recordSkip})
		return true
	}
	if s.dead != "" {
		r.deadLetter(s, s.dead)
		return true
	}
	if s.meta.flowFailed != "" {
		// A flow's parent whose children failed: its outcome is that
		// failure, and the handler does not run (no start is charged).
		r.handOff(completion{s: s, code: keys.RecordFailed, value: []byte(s.meta.flowFailed)})
		return true
	}
	// While the shard's start charges fail, its slots wait aside, not in a
	// worker, and take no rate-limit token; one at a time is charged, once
	// per back-off (see committer.holdBack).
	if c := r.committers[s.shard]; c.holding.Load() && c.holdBack(s, false) {
		return false
	}
	// A paused queue's slot goes back into the ring; then wait for a
	// rate-limit token: neither counts as a delivery, and the entry stays
	// leased meanwhile.
	switch r.mayStart(s, flush) {
	case gateHeld:
		return false
	case gateStopped:
		r.drain(s)
		return false
	}
	if dl := s.meta.deadline; !dl.IsZero() && !time.Now().Before(dl) {
		// Not started, so not a delivery: the count stays what it was.
		s.entry.Deliveries--
		r.c.outcomes.failed.Add(1)
		r.deadLetter(s, fmt.Sprintf("%s: the deadline %s passed before a handler started it",
			ErrDeadlineExceeded.Error(), dl.UTC().Format(time.RFC3339Nano)))
		return true
	}
	// A failed fetch is not a delivery: the handler does not start, so no
	// start is charged (see fetchFailed).
	if s.fetchErr != nil {
		r.fetchFailed(s, s.fetchErr)
		return true
	}
	// The handler's start is charged here, before it runs; the tick that
	// carries it also carries the outcomes queued before it. A charge that
	// failed leaves the slot set aside for its shard: no longer the
	// worker's.
	switch r.charge(s) {
	case chargeSkip:
		r.forget(s)
		return false
	case chargeStopped:
		r.drain(s)
		return false
	case chargeHeld:
		return false
	}
	req, err := decode[Req](r.c.opts.Codec, s.data)
	if err != nil {
		r.deadLetter(s, "undecodable request: "+unprefixed(err))
		return true
	}
	ctx, cancel := context.WithCancelCause(r.handlerCtx)
	if !s.setCancel(cancel) {
		cancel(nil)
		if s.isCanceled() {
			r.dropCanceled(s)
			return true
		}
		r.forget(s)
		return false
	}
	hctx, stop := r.bound(ctx, s.meta.deadline)
	msg := &Message[Req]{ID: s.entry.ID, EntryID: s.entry.EntryID, Payload: req, Deliveries: s.entry.Deliveries,
		Headers: s.meta.headers, ProducedAt: entryTime(s.entry.EntryID), ReadAt: s.meta.readAt, StartedAt: time.Now(),
		Deadline: s.meta.deadline, Priority: levelValue[s.level], Key: s.meta.key, tx: r.c.tx[s.shard], st: &s.msg, link: r, shard: s.shard, flow: s.meta.flow}
	resp, err := r.call(hctx, s, msg)
	tx, reported := s.msg.finish() // tx: nil unless the handler staged writes
	s.reported = reported
	stop()
	cancel(nil)
	lost, canceled := s.ended()
	if canceled {
		r.dropCanceled(s)
		return true
	}
	if lost {
		r.c.log.WarnContext(s.logContext(r.runCtx), "streamq: message was claimed by another consumer while its handler ran; its outcome is dropped",
			"id", s.entry.ID, "entry", s.entry.EntryID, "deliveries", s.entry.Deliveries)
		r.forget(s)
		return false
	}
	if err != nil {
		r.fail(s, err)
		return true
	}
	payload, err := encode(r.c.opts.Codec, resp)
	if err != nil {
		r.fail(s, Permanent(err))
		return true
	}
	s.tx = tx
	r.handOff(completion{s: s, code: keys.RecordResult, value: payload})
	return true
}

// handOff queues an outcome with its shard's committer, without waking it
// (the worker pokes it: see work). The slot keeps its place (the entry is
// held, and leased, until its outcome is recorded), so the entries a consumer
// holds never exceed Prefetch; the payload is dropped at once. The outcome
// is kept in the slot (slot.completion): a slot is handed off once.
func (r *run[Req, Resp]) handOff(out completion) {
	cp := &out.s.completion
	*cp = out
	cp.done = make(chan struct{})
	cp.s.outcome = cp.done
	cp.s.handedOff.Store(true)
	r.ring.settle(classOf(cp.s.queue, cp.s.level)) // no longer read-ahead: the feeder may read in its place
	cp.s.data = nil                                // the fetched payload
	if _, inline := r.c.opts.Fetcher.(InlineFetcher); inline && cp.code != keys.RecordDead && cp.code != recordRetry && cp.s.tx == nil {
		cp.s.entry.Data = nil // the payload itself; dead letters and retries keep it
	}
	r.committers[cp.s.shard].add(cp)
}

// bound applies HandlerTimeout and the request's deadline to a handler's
// context; stop releases their timers.
// Without either it allocates nothing (the common case, once per job).
func (r *run[Req, Resp]) bound(ctx context.Context, deadline time.Time) (context.Context, func()) {
	t := r.c.opts.HandlerTimeout
	switch {
	case t <= 0 && deadline.IsZero():
		return ctx, noStop
	case deadline.IsZero():
		return context.WithTimeoutCause(ctx, t, ErrHandlerTimeout)
	case t <= 0:
		return context.WithDeadlineCause(ctx, deadline, ErrDeadlineExceeded)
	}
	ctx, stop0 := context.WithTimeoutCause(ctx, t, ErrHandlerTimeout)
	ctx, stop1 := context.WithDeadlineCause(ctx, deadline, ErrDeadlineExceeded)
	return ctx, func() { stop1(); stop0() }
}

// noStop is bound's stop when there is nothing to release.
func noStop() {}

// call runs the middleware and the handler, turning a panic into an error
// matching ErrPanic.
func (r *run[Req, Resp]) call(ctx context.Context, s *slot, msg *Message[Req]) (resp Resp, err error) {
	s.logCtx = ctx
	mws := r.c.opts.Middleware
	if len(mws) == 0 {
		defer r.recovered(ctx, "handler", msg, &err)
		return r.c.handler(ctx, msg)
	}
	defer r.recovered(ctx, "middleware", msg, &err)
	d := &Delivery{Queue: r.c.queue, Group: r.c.opts.Group, Consumer: r.c.opts.Name, Shard: r.c.realShard(s.shard),
		ID: msg.ID, EntryID: msg.EntryID, Deliveries: msg.Deliveries, MaxDeliveries: r.c.opts.MaxDeliveries,
		Headers: msg.Headers, ProducedAt: msg.ProducedAt, ReadAt: msg.ReadAt, StartedAt: msg.StartedAt,
		Deadline: msg.Deadline}
	err = chainMiddleware(ctx, mws, d, func(ctx context.Context) (err error) {
		s.logCtx = ctx // the middleware's context: log lines about the outcome join its trace
		defer r.recovered(ctx, "handler", msg, &err)
		resp, err = r.c.handler(ctx, msg)
		return err
	})
	if err != nil {
		var zero Resp
		resp = zero
	}
	return resp, err
}

// recovered, deferred, turns a panic of what into *err, matching ErrPanic.
func (r *run[Req, Resp]) recovered(ctx context.Context, what string, msg *Message[Req], err *error) {
	if v := recover(); v != nil {
		r.c.log.ErrorContext(ctx, "streamq: "+what+" panicked", "id", msg.ID, "entry", msg.EntryID,
			"deliveries", msg.Deliveries, "panic", v, "stack", string(debug.Stack()))
		*err = fmt.Errorf("%w: %v", ErrPanic, v)
	}
}

// fail handles a failed attempt: dead-letter when the error is permanent or the
// deliveries are used up, else hand the entry to its completer, which
// acknowledges it and schedules its retry in one step (retry.lua).
func (r *run[Req, Resp]) fail(s *slot, err error) {
	o := &r.c.opts
	r.c.outcomes.failed.Add(1)
	if IsPermanent(err) || s.entry.Deliveries >= o.MaxDeliveries {
		r.deadLetter(s, err.Error())
		return
	}
	delay := retryDelay(o.RetryBackoff, s.entry.Deliveries, o.RetryBackoffMax)
	var ra retryAfterError
	if errors.As(err, &ra) {
		delay = min(max(ra.delay, 0), maxDelay)
	}
	r.c.log.InfoContext(s.logContext(r.runCtx), "streamq: handler failed; will retry", "id", s.entry.ID, "entry", s.entry.EntryID,
		"deliveries", s.entry.Deliveries, "retry_in", delay, "err", err)
	// Round up: a retry never runs before its delay.
	ms := int64((delay + time.Millisecond - 1) / time.Millisecond)
	r.handOff(completion{s: s, code: recordRetry, value: []byte(strconv.FormatInt(ms, 10)), errMsg: err.Error()})
}

// fetchFailed handles a message whose payload could not be fetched (after
// FetchRetries): its handler did not start, so no start is charged and the
// failure is not a handler failure. The message is retried through the
// schedule like a failed handler, its fetch failures counted in the entry's
// field "f" (retry.lua), and dead-lettered when the error is permanent or
// after MaxDeliveries failed fetches in a row.
func (r *run[Req, Resp]) fetchFailed(s *slot, err error) {
	o := &r.c.opts
	s.entry.Deliveries-- // admit counted the start that did not happen
	failures := s.fetchFailures + 1
	if IsPermanent(err) || failures >= o.MaxDeliveries {
		r.c.outcomes.failed.Add(1)
		r.deadLetter(s, fmt.Sprintf("payload fetch failed %d times (the handler did not run): %s", failures, unprefixed(err)))
		return
	}
	delay := retryDelay(o.RetryBackoff, failures, o.RetryBackoffMax)
	r.c.log.WarnContext(s.logContext(r.runCtx), "streamq: fetch failed; will retry (the handler did not run)", "id", s.entry.ID, "entry", s.entry.EntryID,
		"fetch_failures", failures, "retry_in", delay, "err", err)
	ms := int64((delay + time.Millisecond - 1) / time.Millisecond)
	r.handOff(completion{s: s, code: recordRetry, value: []byte(strconv.FormatInt(ms, 10) + retryFetchFailed),
		errMsg: fmt.Sprintf("payload fetch failed %d times (the handler did not run): %s", failures, unprefixed(err))})
}

// retryFetchFailed ends the value of a recordRetry completion whose payload
// could not be fetched: retry.lua then counts the failure in field "f"
// instead of moving a start count that was not charged.
const retryFetchFailed = ":f"

// recordRetry is the completion of a failed attempt to retry after a delay
// (value: milliseconds): acknowledged and scheduled (retry.lua).
const recordRetry = 'T'

// retryDelay is the exponential back-off before delivery number deliveries+1:
// base * 2^(deliveries-1), with jitter, capped at limit.
func retryDelay(base time.Duration, deliveries int, limit time.Duration) time.Duration {
	d := base
	for i := 1; i < deliveries && d < limit; i++ {
		d *= 2
	}
	return min(jitter(d), limit)
}

// jitter returns a duration drawn uniformly from [d/2, d].
func jitter(d time.Duration) time.Duration {
	if d <= 1 {
		return d
	}
	return d/2 + rand.N(d/2+1)
}

func (r *run[Req, Resp]) deadLetter(s *slot, reason string) {
	// The caller's error reads "streamq: request dead-lettered: <reason>".
	reason = strings.TrimPrefix(reason, "streamq: ")
	r.c.log.WarnContext(s.logContext(r.runCtx), "streamq: dead-lettering message", "id", s.entry.ID, "entry", s.entry.EntryID,
		"deliveries", s.entry.Deliveries, "reason", reason)
	r.handOff(completion{s: s, code: keys.RecordDead, value: []byte(reason)})
}

// recordSkip completes an entry requeued for another group: acknowledged,
// nothing recorded.
const recordSkip = 'S'

// completion is the outcome of one message on its way to Redis.
type completion struct {
	s      *slot
	code   byte
	value  []byte
	errMsg string        // recordRetry: the attempt's error, kept with the waiting retry
	done   chan struct{} // closed once the outcome is recorded, or given up on
}
