package streamq

// A slot: one entry held by the consumer, from its read to its recorded
// outcome, and the fetch of its payload.
//
// Goroutines: a feeder creates the slot and pushes it into the ring; one fetch
// goroutine per slot with a remote payload (run.startFetch) fills it and
// closes slot.ready; a worker takes it in ring order and owns it from then on;
// the committer records its start and outcome and forgets it.

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"time"
)

// slot is one message in the prefetch ring.
//
// The feeder goroutine creates it and sets ready (startFetch) before it pushes
// it into the ring; its fetch goroutine writes data and fetchErr and then
// closes ready; after ready, the worker that took the slot owns it.
// lost and cancel are shared with the lease loop and guarded by mu.
type slot struct {
	shard int // the stream's index (see Consumer.shards)
	queue int // its queue's index in the pool (see ring)
	level int // its priority level (see levelNames)
	entry Entry
	dead  string // non-empty: dead-letter with this reason instead of handling
	skip  bool   // requeued for another group: acknowledge without handling
	meta  messageMeta
	// logCtx is the context the handler ran with (after middleware), for
	// logs about its outcome; nil before. Owned by the worker.
	logCtx context.Context

	ready    chan struct{}
	data     []byte
	fetchErr error
	// fetchFailures is the entry's count of failed fetches before this one
	// (field "f", set by retry.lua).
	fetchFailures int

	outcome <-chan struct{} // set by the worker at hand-off: closed when recorded
	// completion is the slot's outcome from its hand-off (run.handOff) until
	// it is recorded, owned by the committer then: a slot is handed off
	// once, so its outcome needs no allocation of its own.
	completion completion
	// tx holds the writes a successful handler staged, applied with its
	// outcome (complete.lua); nil when none. Set by the worker before the
	// hand-off.
	tx *Tx
	// msg is the state its Message shares with the handler's goroutines.
	msg msgState
	// reported: the handler reported progress (Message.Progress), whose key
	// complete.lua then expires with the record. Set by the worker before
	// the hand-off.
	reported bool
	// earlier: the entry had started before this delivery (a count at
	// admission), so an earlier delivery may have stored progress, which
	// the leases keep alive (lease.lua). Set by admit.
	earlier bool
	// handedOff is set at hand-off: the entry leaves the pending list when its
	// outcome is recorded, which the lease loop must not take for a loss.
	handedOff atomic.Bool

	// ownedAt is when this consumer last confirmed it owns the entry (mono
	// time taken before the read, claim or lease renewal that did), or 0
	// when its lease may have lapsed since: the committer counts a start
	// without an owner check only within MinIdle/2 of it. Written by the
	// feeder, then by the leaser.
	ownedAt atomic.Int64
	// charging is set while a start charge is sent and not answered: a slot
	// released then has its possible count taken back (release.lua). Owned
	// by the worker.
	charging bool
	// scriptCharge sends the slot's next charge through charge.lua (an HSET
	// was refused). Set by a committer tick before it answers the worker.
	scriptCharge bool
	// counting is countNone before the slot's first charge, countExpected
	// from then until Redis confirmed the start count of its handler, then
	// countConfirmed: its outcome is sent only when it is not countExpected
	// (see committer.take). Nothing waits on it: the committer looks when it
	// takes outcomes, and the tick that confirms a count wakes a tick worker
	// when it settles.
	counting atomic.Int32

	mu       sync.Mutex
	lost     bool
	canceled bool                    // Admin.Cancel cancelled it (cancelnotice.go)
	cancel   context.CancelCauseFunc // the running handler's, or nil
}

// The states of slot.counting.
const (
	countNone      = iota // never charged
	countExpected         // charged, its count not confirmed yet
	countConfirmed        // Redis confirmed the count
)

// expectCount makes the slot's outcome wait for the confirmation of its
// start count. Called by the worker before its first charge is queued.
func (s *slot) expectCount() { s.counting.CompareAndSwap(countNone, countExpected) }

// markCounted confirms the slot's start count (committer ticks).
func (s *slot) markCounted() { s.counting.Store(countConfirmed) }

// isCounted reports whether the slot's outcome may be sent: its start count
// is confirmed, or it was never charged.
func (s *slot) isCounted() bool { return s.counting.Load() != countExpected }

// fetchedInline is the ready channel of every slot whose payload came with
// its entry: closed from the start, shared, so that such a slot costs no
// channel of its own.
var fetchedInline = func() chan struct{} {
	c := make(chan struct{})
	close(c)
	return c
}()

// monoBase anchors mono.
var monoBase = time.Now()

// mono returns the time on the monotonic clock, in nanoseconds above 0.
func mono() int64 { return int64(time.Since(monoBase)) + 1 }

// ownedSince returns how long ago (now: mono time) this consumer last
// confirmed it owns the entry, or a very long time when it may have lapsed.
func (s *slot) ownedSince(now int64) time.Duration {
	at := s.ownedAt.Load()
	if at == 0 {
		return 1<<63 - 1
	}
	return time.Duration(now - at)
}

// ownedKey identifies an entry: entry ids are unique within one shard's
// stream only, and two shards can hand out the same id.
type ownedKey struct {
	shard int
	id    string
}

// logContext is the context for logs about s: the handler's, or def.
func (s *slot) logContext(def context.Context) context.Context {
	if s.logCtx != nil {
		return s.logCtx
	}
	return def
}

func (s *slot) key() ownedKey { return ownedKey{s.shard, s.entry.EntryID} }

// markLost records that another consumer owns the entry now, and cancels its handler.
func (s *slot) markLost() {
	s.mu.Lock()
	s.lost = true
	cancel := s.cancel
	s.mu.Unlock()
	if cancel != nil {
		cancel(ErrLeaseLost)
	}
}

func (s *slot) isLost() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.lost
}

// setCancel installs the handler's cancel function; it reports false when the
// slot was lost or cancelled already.
func (s *slot) setCancel(cancel context.CancelCauseFunc) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.cancel = cancel
	return !s.lost && !s.canceled
}

// startFetch fills s.data, calling the fetcher in its own goroutine unless the
// payload is inline. Failed fetches are retried with back-off; the last error
// is kept in s.fetchErr and the message takes the failure path. A failure is
// never remembered beyond this slot, so a redelivery fetches afresh.
func (r *run[Req, Resp]) startFetch(ctx context.Context, s *slot) {
	if _, inline := r.c.opts.Fetcher.(InlineFetcher); inline || s.dead != "" || s.skip {
		s.data = s.entry.Data
		s.ready = fetchedInline
		return
	}
	s.ready = make(chan struct{})
	r.fetches.Add(1)
	go func() {
		defer r.fetches.Done()
		defer close(s.ready)
		s.data, s.fetchErr = r.fetch(ctx, s.entry)
	}()
}

func (r *run[Req, Resp]) fetch(ctx context.Context, e Entry) ([]byte, error) {
	o := &r.c.opts
	delay := o.FetchBackoff
	attempts := 1 + max(o.FetchRetries, 0)
	var err error
	for i := range attempts {
		var b []byte
		b, err = r.fetchOnce(ctx, e)
		if err == nil {
			return b, nil
		}
		if ctx.Err() != nil {
			return nil, ctx.Err()
		}
		if IsPermanent(err) {
			return nil, wrapf(err, "fetch failed")
		}
		if i+1 < attempts {
			r.c.log.DebugContext(ctx, "streamq: fetch failed; retrying", "id", e.ID, "entry", e.EntryID, "attempt", i+1, "err", err)
			if sleepCtx(ctx, jitter(delay)) != nil {
				return nil, ctx.Err()
			}
			delay *= 2
		}
	}
	return nil, wrapf(err, "fetch failed after %d attempts", attempts)
}

// fetchOnce is one Fetch call, bounded by FetchTimeout: an attempt that has
// not returned by then fails, saying so.
func (r *run[Req, Resp]) fetchOnce(ctx context.Context, e Entry) ([]byte, error) {
	o := &r.c.opts
	if o.FetchTimeout <= 0 {
		return o.Fetcher.Fetch(ctx, e)
	}
	fctx, cancel := context.WithTimeout(ctx, o.FetchTimeout)
	defer cancel()
	b, err := o.Fetcher.Fetch(fctx, e)
	if err != nil && ctx.Err() == nil && fctx.Err() != nil {
		err = fmt.Errorf("did not return within FetchTimeout (%s): %w", o.FetchTimeout, err)
	}
	return b, err
}

// sleepCtx waits for d or until ctx ends.
func sleepCtx(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}
