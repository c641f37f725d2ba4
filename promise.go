package streamq

// Promises: what a Produce call returns, and the per-id calls that let
// every caller of one id share one outcome (waiters).
//
// Goroutines: callers of Produce, Wait and Release; the notice listener and
// the backstop (producer_notices.go) resolve calls. waiters is guarded by its
// mutex; a call's outcome is written once, before done is closed.

import (
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/streamq/streamq/internal/keys"
)

// Promise is the future result of a produced request.
type Promise[Resp any] struct {
	id       string
	entryID  string
	c        *call
	codec    Codec
	w        *waiters
	released chan struct{} // closed by Release
	relOnce  sync.Once

	src      promiseSource // the producer: subscription, a late Progress; nil when none
	progOnce sync.Once
	prog     *progressState // set by the first Progress
	progCh   chan []byte

	once sync.Once
	resp Resp
	err  error

	dedup Dedup // how Produce was answered
}

// Dedup says how Redis answered the Produce call of a promise.
type Dedup int

// The answers of a Produce call.
const (
	// DedupNone: the call recorded a new request (or, with RetryFailed,
	// replaced a stored failure).
	DedupNone Dedup = iota
	// DedupInflight: a request with the id was in flight (queued, running,
	// or waiting in the schedule): the promise waits for that request, and
	// this call's payload and options were not used.
	DedupInflight
	// DedupStored: the id's outcome was stored (ResultTTL): the promise is
	// resolved with it at once, and this call's payload was not used. With
	// DiscardResults the stored outcome is a done marker; while an earlier
	// promise of the id in this producer waits for the notice that carries
	// the result, this one gets that result too, within a second
	// (BackstopInterval if shorter), else ErrNoResult.
	DedupStored
)

// String names the answer.
func (d Dedup) String() string {
	switch d {
	case DedupNone:
		return "new"
	case DedupInflight:
		return "attached to the request in flight"
	case DedupStored:
		return "answered from the stored outcome"
	}
	return fmt.Sprintf("Dedup(%d)", int(d))
}

// Deduplicated tells whether the Produce call was deduplicated, and how:
// DedupNone when it recorded a new request, DedupInflight when it attached to
// the request in flight under the same id, DedupStored when it got the id's
// stored outcome. A deduplicated call's payload is not compared with the
// first one's: it is dropped, whatever it holds.
func (pr *Promise[Resp]) Deduplicated() Dedup { return pr.dedup }

// ID returns the request id.
func (pr *Promise[Resp]) ID() string { return pr.id }

// EntryID returns the stream entry id of the request, or "" when its result was
// already stored when it was produced, or when it was waiting in the schedule
// (At, After): its entry is appended at its due time.
func (pr *Promise[Resp]) EntryID() string { return pr.entryID }

// Done returns a channel closed when the result is available. Release does not
// close it: after Release, use Wait, not Done. Like Wait, Done subscribes a
// producer that has not listened yet, in the background (see Wait).
func (pr *Promise[Resp]) Done() <-chan struct{} {
	if pr.src != nil {
		select {
		case <-pr.c.done:
		default:
			pr.src.listenSoon()
		}
	}
	return pr.c.done
}

// Release gives up interest in the result. Once every promise of the request
// id held in this producer is released, the producer forgets the id: no map
// entry, no record check. The request itself is unaffected: it stays queued
// and is handled. Wait on a released promise returns ErrReleased (a Wait
// already blocked returns it too). Release is idempotent and safe for
// concurrent use; a promise that is neither waited on to the end nor released
// costs its map entry until its request completes or its record expires.
func (pr *Promise[Resp]) Release() {
	pr.relOnce.Do(func() {
		close(pr.released)
		pr.w.drop(pr.id, pr.c)
		pr.progOnce.Do(func() { pr.progCh = closedProgress }) // no channel made after Release
		if pr.prog != nil {
			pr.prog.unsubscribe(pr.progCh)
		}
	})
}

// Wait blocks until the request completes or ctx ends, and returns the response
// or the error: a *RequestError (errors.Is ErrFailed, ErrDeadLettered) when the
// request failed, ErrNoResult, ErrRecordLost, ErrClosed, ErrReleased, an error
// saying the codec failed (or panicked) to decode the response, or ctx's error.
// Wait may be called any number of times, from any goroutine. A nil ctx panics.
//
// A producer that has not listened yet (only ProduceBatch calls so far, see
// there) listens from the first Wait, Done or Progress of any of its
// promises until Close: such a Wait subscribes (one round trip, bounded by
// ctx; an attempt that Redis does not confirm within 10s fails, and the next
// call tries again), then reads the records of the requests appended
// before, whose notices went to nobody. An error from subscribing (a user
// without the channel's permission, say) is returned as is; the promise
// stays valid.
func (pr *Promise[Resp]) Wait(ctx context.Context) (Resp, error) {
	mustContext(ctx, "Promise.Wait")
	var zero Resp
	select {
	case <-pr.released:
		return zero, ErrReleased
	default:
	}
	select {
	case <-pr.c.done:
	default:
		if pr.src != nil {
			if err := pr.src.listenFor(ctx, pr.c.done, pr.released); err != nil {
				select {
				case <-pr.c.done: // resolved meanwhile (the backstop, Close)
				case <-pr.released:
					return zero, ErrReleased
				default:
					return zero, err
				}
			}
		}
	}
	select {
	case <-pr.c.done:
	case <-pr.released:
		return zero, ErrReleased
	case <-ctx.Done():
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
	case keys.RecordResult:
		return decode[Resp](codec, []byte(body))
	case keys.RecordFailed:
		return zero, &RequestError{Message: body}
	case keys.RecordDead:
		return zero, &RequestError{Message: body, DeadLettered: true}
	case keys.RecordNoResult:
		return zero, ErrNoResult
	case keys.RecordCanceled:
		return zero, fmt.Errorf("%w: %s", ErrCanceled, body)
	default:
		return zero, fmt.Errorf("%w: record starts with %q", ErrWrongType, record[0])
	}
}

// call is the shared state of every promise of one request id in one producer.
type call struct {
	done       chan struct{}
	record     string    // set before done is closed
	err        error     // set before done is closed
	refs       int       // guarded by waiters.mu: Produce calls in progress and unreleased promises
	appended   bool      // guarded by waiters.mu: the request is recorded in Redis
	appendedAt time.Time // guarded by waiters.mu: when appended was first set
	// heard is waiters.heard when the call was registered: a call marked
	// appended under a later confirmation of the subscription may have had
	// its notice published while nobody listened (see markAppended), and a
	// call registered under the current one will hear its notice (see
	// noticeDue). Guarded by waiters.mu.
	heard uint64
	// atReply says the call was made when a reply was read (a new run's:
	// handOver, newRun), which may be after the listener handled the run's
	// notice: it is never left to a notice (noticeDue). Guarded by
	// waiters.mu.
	atReply bool
	// markerAt is when a record check first left the call's done marker to
	// its notice (noticeDue). Guarded by waiters.mu.
	markerAt time.Time
	// fallbackRecord and fallbackErr answer a retired call whose notice
	// does not come (retire). Guarded by waiters.mu.
	fallbackRecord string
	fallbackErr    error
	// prog is the request's progress, made by the first Promise.Progress
	// (nil until then: a request nobody asks about pays nothing). Guarded
	// by waiters.mu; its fields by its own mutex.
	prog *progressState
}

// waiters maps request ids to their calls. A call is registered before its
// request is appended, so a notice that races the append reply is not lost
// once the producer listens. A call leaves the map when it is resolved or
// when nobody holds a reference.
//
// The producer subscribes to notices at its first Produce or ProduceFlow, or
// when a caller first listens (Wait, Done, Progress): a producer whose batch
// promises are released unheard is sent no notice. Calls registered before
// that may have missed theirs, and so may calls registered before a
// resubscription (after a reconnect), so the record check that follows each
// confirmation (hear, then recheck) reads every one appended by then, and a
// call appended later asks for one more check (markAppended).
type waiters struct {
	mu     sync.Mutex
	m      map[string]*call
	closed error  // set by failAll: calls acquired later are resolved with it at once
	heard  uint64 // subscriptions confirmed so far (hear): 0 before the first
	// old holds, per id, the calls moved off m while they wait for the
	// notice of an earlier run than the id's current call's (retire), oldest
	// first: the id's next notice answers the first (notices of one id come
	// in the order of its runs).
	old map[string][]*call
	// recheck asks for a check of every appended call's record (the
	// producer's backstop, at once); set before the first call is acquired.
	recheck func()
}

func newWaiters() *waiters {
	return &waiters{m: make(map[string]*call), old: make(map[string][]*call), recheck: func() {}}
}

// hear records that notices published from now on reach the producer. The
// caller then asks for a check of the records of the calls appended before
// (recheck): their notices may have gone to nobody.
func (w *waiters) hear() {
	w.mu.Lock()
	w.heard++
	var retired []*call
	var ids []string
	for id, o := range w.old {
		for _, c := range o {
			retired, ids = append(retired, c), append(ids, id)
		}
	}
	w.mu.Unlock()
	// Their notices may have gone to nobody: they get their fallbacks.
	for j, c := range retired {
		w.resolveFallback(ids[j], c)
	}
}

// acquire takes a reference on id's call, registering one when there is none.
// After failAll, it returns a call already resolved with failAll's error, so a
// promise settled after Close never waits.
func (w *waiters) acquire(id string) *call {
	c, _ := w.join(id)
	return c
}

// join is acquire, and reports whether the call was marked appended
// already: an earlier caller of the id in this producer returned holding
// it, waiting for the outcome of a run recorded before this caller's
// request reaches Redis. A reply that tells of a later run (a new one, or
// an outcome that may be a later run's) then must not answer that caller
// (see settle).
func (w *waiters) join(id string) (c *call, joined bool) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.closed != nil {
		c := &call{done: make(chan struct{}), err: w.closed, refs: 1}
		close(c.done)
		return c, false
	}
	c = w.m[id]
	if c == nil {
		c = &call{done: make(chan struct{}), heard: w.heard}
		w.m[id] = c
	} else {
		joined = c.appended
	}
	c.refs++
	return c, joined
}

// drop gives back a reference taken by acquire: a Produce whose request was not
// recorded, or a released promise. The last reference removes the call.
func (w *waiters) drop(id string, c *call) {
	w.mu.Lock()
	defer w.mu.Unlock()
	c.refs--
	if c.refs <= 0 {
		if w.m[id] == c {
			delete(w.m, id)
		} else {
			w.unretire(id, c)
		}
	}
}

// markAppended records that c's request is in Redis. A call registered
// before a confirmation of the producer's subscription (the first, or one
// after a reconnect) and marked after it asks for a record check: the check
// that followed the confirmation did not read it (it reads appended calls
// only), and its notice may have been published while nobody listened.
// (Marked before hear, the check reads it.)
func (w *waiters) markAppended(c *call) {
	w.mu.Lock()
	late := !c.appended && c.heard != w.heard
	if !c.appended {
		c.appended = true
		c.appendedAt = time.Now()
	}
	w.mu.Unlock()
	if late {
		w.recheck()
	}
}

// handOver answers the callers of items[i].id's call with record, the
// stored outcome a new run replaced (produce.lua's code 3), after moving the
// references of items[i] and of the id's later items to a new call, which
// the new run's notice resolves. When items[i]'s caller joined that call
// while it waited for an earlier run (join), record may be the outcome of a
// run produced after that earlier caller's Produce returned (another
// producer's, while this producer's listener lags behind): the call then
// waits for the id's next notice instead, and gets record only when that
// does not come (retire).
func (w *waiters) handOver(items []*produceItem, i int, record string) {
	id := items[i].id
	w.mu.Lock()
	old := w.m[id]
	if w.closed != nil {
		w.mu.Unlock()
		return // every call is resolved with the close error
	}
	waiting := old != nil && items[i].call == old && items[i].joined
	// The new run's notice may have been handled before this reply was
	// read: it resolved the call the caller registered before the append
	// (not joined: only a notice resolves such a call before its reply).
	// The new call takes that outcome (the new run's, or an earlier run's
	// from a notice handled late) instead of waiting for the id's next
	// notice, which would be a later run's.
	var heard *call
	if c := items[i].call; c != nil && !items[i].joined && isDone(c) && c.err == nil {
		heard = c
	}
	// The new run's call is made when the reply is read, which may be after
	// the listener handled the run's notice: it is never left to a notice
	// (atReply, see noticeDue). It is registered under the current
	// confirmation: a later caller that joins it and opens a run is not
	// late (a check then would answer the calls still waiting for their
	// notices from records that may be later runs').
	nc := &call{done: make(chan struct{}), appended: true, appendedAt: time.Now(), heard: w.heard, atReply: true}
	late := false // as in markAppended: the new run's notice may have gone to nobody
	for _, it := range items[i:] {
		if it.id != id || it.call == nil {
			continue
		}
		late = late || it.call.heard != w.heard
		if c := it.call; c != old {
			c.refs--
			if c.refs <= 0 && w.m[id] == c {
				delete(w.m, id)
			}
		} else {
			old.refs--
		}
		it.call = nc
		nc.refs++
	}
	if nc.refs > 0 {
		w.m[id] = nc
	} else if old != nil {
		delete(w.m, id)
	}
	if waiting && old.refs > 0 && !isDone(old) {
		w.retire(id, old, record, nil)
		old = nil
	}
	w.mu.Unlock()
	if heard != nil {
		w.resolve(id, nc, heard.record, nil)
	} else if late {
		w.recheck()
	}
	if old != nil {
		w.resolve(id, old, record, nil)
	}
}

// newRun gives a caller that joined c (join) and whose request was appended
// as a new run (produce.lua's code 0: the id had no record, or a stored
// failure that RetryFailed replaced) a call of its own, and returns it: c
// waits for the outcome of an earlier run, which is not this one's. c waits
// for the id's next notice, or gets ErrRecordLost when that does not come
// (retire; its record was gone: a check would have said so). When c
// is no longer the id's call (resolved, and another registered), the caller
// stays on c, and so when c is resolved already: by a notice handled
// before this reply was read, this run's or an earlier one's (a later
// call would wait for the id's next notice, a later run's).
func (w *waiters) newRun(id string, c *call, inflightTTL time.Duration) *call {
	w.mu.Lock()
	if w.closed != nil || isDone(c) || (w.m[id] != c && w.m[id] != nil) {
		w.mu.Unlock()
		return c
	}
	// As handOver's: never left to a notice, and registered under the
	// current confirmation.
	nc := &call{done: make(chan struct{}), refs: 1, appended: true, appendedAt: time.Now(), heard: w.heard, atReply: true}
	current := w.m[id] == c // else retired already, or resolved
	w.m[id] = nc
	c.refs--
	if c.refs <= 0 && !current {
		w.unretire(id, c)
	}
	if current && c.refs > 0 && !isDone(c) {
		age := time.Since(c.appendedAt).Round(time.Millisecond)
		w.retire(id, c, "", fmt.Errorf("%w (request %q, recorded %v ago: a later call of this producer appended a new run "+
			"of the id, its record being gone (most likely its outcome expired, ResultTTL) or a failure that RetryFailed replaced, "+
			"and its completion notice did not reach this producer; InflightTTL %v)", ErrRecordLost, id, age, inflightTTL))
	}
	late := c.heard != w.heard // as in markAppended
	w.mu.Unlock()
	if late {
		w.recheck()
	}
	return nc
}

// stored answers a caller that joined c (join) with record, the stored
// outcome produce.lua answered (code 2): it may be the outcome of a run
// produced after c's earlier callers returned, so it does not answer them.
// The caller gets a call of its own answered with record (c, already
// answered, when it was: an outcome of a run produced before this call).
// But a done marker without its result (DiscardResults) while c's notice is
// due, by noticeDue's rule, leaves the caller on c, whose notice carries the
// result, for noticeDue's grace; c is then resolved with the marker, as a
// check after the grace does.
func (w *waiters) stored(id string, c *call, record string, grace time.Duration) *call {
	if isDone(c) {
		return c
	}
	if record == string(keys.RecordNoResult) && w.noticeDueFor(id, c, grace) {
		time.AfterFunc(grace, func() { w.resolve(id, c, record, nil) })
		return c
	}
	return w.answered(id, c, record, nil)
}

// answered moves a caller's reference from c to a call of its own, resolved
// with record or err, and returns it.
func (w *waiters) answered(id string, c *call, record string, err error) *call {
	w.drop(id, c)
	own := &call{done: make(chan struct{}), record: record, err: err, refs: 1}
	close(own.done)
	return own
}

// isDone reports whether c is resolved.
func isDone(c *call) bool {
	select {
	case <-c.done:
		return true
	default:
		return false
	}
}

// retiredBound is how long a retired call waits for its notice: go-redis
// drops the messages of a listener that long behind (its channel's send
// timeout). A listener merely behind delivers the notice, however late:
// answering the call from a record instead may give it a later run's
// outcome. A confirmation of the subscription after a reconnect (hear)
// ends the wait too: the notice may have gone to nobody.
const retiredBound = time.Minute

// retire moves c, no longer id's call in m, to the calls waiting for the
// id's next notice (old), and resolves it with record or err (its
// fallback) after retiredBound, or at the next confirmation of the
// subscription, unless a notice did first. w.mu is held.
func (w *waiters) retire(id string, c *call, record string, err error) {
	w.old[id] = append(w.old[id], c)
	c.fallbackRecord, c.fallbackErr = record, err
	time.AfterFunc(retiredBound, func() { w.resolveFallback(id, c) })
}

// resolveFallback resolves a retired call with its fallback.
func (w *waiters) resolveFallback(id string, c *call) {
	w.mu.Lock()
	record, err := c.fallbackRecord, c.fallbackErr
	w.mu.Unlock()
	w.resolve(id, c, record, err)
}

// unretire removes c from id's retired calls. w.mu is held.
func (w *waiters) unretire(id string, c *call) {
	o := w.old[id]
	for j, x := range o {
		if x == c {
			o = append(o[:j:j], o[j+1:]...)
			break
		}
	}
	if len(o) == 0 {
		delete(w.old, id)
	} else {
		w.old[id] = o
	}
}

// len returns the number of registered calls.
func (w *waiters) len() int {
	w.mu.Lock()
	defer w.mu.Unlock()
	n := len(w.m)
	for _, o := range w.old {
		n += len(o)
	}
	return n
}

// resolveID resolves id's call with a notice's record: the oldest of its
// retired calls (retire) when there is one, else its call.
func (w *waiters) resolveID(id, record string) {
	w.mu.Lock()
	c := w.m[id]
	if o := w.old[id]; len(o) > 0 {
		c = o[0]
	}
	w.mu.Unlock()
	if c != nil {
		w.resolve(id, c, record, nil)
	}
}

// resolveChecked resolves id's call with the record a check read: never a
// retired call, whose run the record no longer tells of.
func (w *waiters) resolveChecked(id, record string) {
	w.mu.Lock()
	c := w.m[id]
	w.mu.Unlock()
	if c != nil {
		w.resolve(id, c, record, nil)
	}
}

// resolveLost resolves id's call with ErrRecordLost, saying how long ago the
// request was recorded: well within inflightTTL, the record most likely held
// an outcome that expired before this producer saw it.
func (w *waiters) resolveLost(id string, inflightTTL time.Duration) {
	w.mu.Lock()
	c := w.m[id]
	var age time.Duration
	if c != nil {
		age = time.Since(c.appendedAt).Round(time.Millisecond)
	}
	w.mu.Unlock()
	if c == nil {
		return
	}
	var err error
	if age < inflightTTL {
		err = fmt.Errorf("%w (request %q, recorded %v ago, within InflightTTL %v: most likely it ran and its result expired "+
			"before this producer saw it, or Redis lost the key)", ErrRecordLost, id, age, inflightTTL)
	} else {
		err = fmt.Errorf("%w (request %q, recorded %v ago, InflightTTL %v)", ErrRecordLost, id, age, inflightTTL)
	}
	w.resolve(id, c, "", err)
}

// resolve completes c once; later calls are ignored.
func (w *waiters) resolve(id string, c *call, record string, err error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.m[id] == c {
		delete(w.m, id)
	} else if len(w.old[id]) > 0 {
		w.unretire(id, c)
	}
	select {
	case <-c.done:
		return
	default:
	}
	c.record, c.err = record, err
	close(c.done)
	if c.prog != nil {
		c.prog.close()
	}
}

// noticeDue reports whether a record check that found id's done marker
// without its result (DiscardResults) leaves the call to its notice, which
// carries the result: when the call was registered under the current
// confirmation of the producer's subscription (so its request was appended,
// and its notice published, while the producer listened), for grace from
// the first such check. A notice can still be lost without a confirmation
// after it (the listener drops a malformed one; go-redis drops messages of
// a listener a minute behind), hence the bound.
func (w *waiters) noticeDue(id string, grace time.Duration) bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.dueLocked(w.m[id], grace)
}

// noticeDueFor is noticeDue for c, which must be id's call.
func (w *waiters) noticeDueFor(id string, c *call, grace time.Duration) bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.m[id] == c && w.dueLocked(c, grace)
}

// dueLocked is noticeDue's rule for c (nil: none). w.mu is held.
func (w *waiters) dueLocked(c *call, grace time.Duration) bool {
	if c == nil || c.atReply || c.heard == 0 || c.heard != w.heard {
		return false
	}
	if c.markerAt.IsZero() {
		c.markerAt = time.Now()
		return true
	}
	return time.Since(c.markerAt) < grace
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

// failAll resolves every call with err, and every call acquired later too.
func (w *waiters) failAll(err error) {
	w.mu.Lock()
	calls, old := w.m, w.old
	w.m, w.old = make(map[string]*call), make(map[string][]*call)
	w.closed = err
	w.mu.Unlock()
	for id, c := range calls {
		w.resolve(id, c, "", err)
	}
	for id, o := range old {
		for _, c := range o {
			w.resolve(id, c, "", err)
		}
	}
}
