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
	// resolved with it at once, and this call's payload was not used.
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
	// markerAt is when a record check first left the call's done marker to
	// its notice (noticeDue). Guarded by waiters.mu.
	markerAt time.Time
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
	// recheck asks for a check of every appended call's record (the
	// producer's backstop, at once); set before the first call is acquired.
	recheck func()
}

func newWaiters() *waiters { return &waiters{m: make(map[string]*call), recheck: func() {}} }

// hear records that notices published from now on reach the producer. The
// caller then asks for a check of the records of the calls appended before
// (recheck): their notices may have gone to nobody.
func (w *waiters) hear() {
	w.mu.Lock()
	w.heard++
	w.mu.Unlock()
}

// acquire takes a reference on id's call, registering one when there is none.
// After failAll, it returns a call already resolved with failAll's error, so a
// promise settled after Close never waits.
func (w *waiters) acquire(id string) *call {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.closed != nil {
		c := &call{done: make(chan struct{}), err: w.closed, refs: 1}
		close(c.done)
		return c
	}
	c := w.m[id]
	if c == nil {
		c = &call{done: make(chan struct{}), heard: w.heard}
		w.m[id] = c
	}
	c.refs++
	return c
}

// drop gives back a reference taken by acquire: a Produce whose request was not
// recorded, or a released promise. The last reference removes the call.
func (w *waiters) drop(id string, c *call) {
	w.mu.Lock()
	defer w.mu.Unlock()
	c.refs--
	if c.refs <= 0 && w.m[id] == c {
		delete(w.m, id)
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
// the new run's notice resolves.
func (w *waiters) handOver(items []*produceItem, i int, record string) {
	id := items[i].id
	w.mu.Lock()
	old := w.m[id]
	if w.closed != nil {
		w.mu.Unlock()
		return // every call is resolved with the close error
	}
	// The new run's call is made when the reply is read, which may be after
	// the listener handled the run's notice: it is never left to a notice
	// (heard 0, see noticeDue).
	nc := &call{done: make(chan struct{}), appended: true, appendedAt: time.Now()}
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
	w.mu.Unlock()
	if late {
		w.recheck()
	}
	if old != nil {
		w.resolve(id, old, record, nil)
	}
}

// len returns the number of registered calls.
func (w *waiters) len() int {
	w.mu.Lock()
	defer w.mu.Unlock()
	return len(w.m)
}

func (w *waiters) resolveID(id, record string) {
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
	c := w.m[id]
	if c == nil || c.heard == 0 || c.heard != w.heard {
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
	calls := w.m
	w.m = make(map[string]*call)
	w.closed = err
	w.mu.Unlock()
	for id, c := range calls {
		w.resolve(id, c, "", err)
	}
}
