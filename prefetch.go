package streamq

// The ring and its slots, and the fetchers.
//
// Goroutines: feeders push slots into the ring; one fetch goroutine per slot
// with a remote payload fills it and closes slot.ready; workers take slots in
// ring order and own them from then on. The ring's counters are guarded by
// ring.mu, its queue by ring.qmu.

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"
)

// Entry is what a Fetcher sees of a stream entry.
type Entry struct {
	// ID is the request id.
	ID string
	// EntryID is the stream entry id.
	EntryID string
	// Data is the entry's payload field: the encoded request itself, or a
	// reference to it (a cache key, an object key) when payloads live elsewhere.
	Data []byte
	// Deliveries counts the deliveries of the entry, this one included.
	Deliveries int
	// Headers are the request's headers (see Headers); nil when none.
	Headers map[string]string
}

// Fetcher produces the encoded request of an entry. The consumer calls it ahead
// of the workers, for up to Prefetch entries at once, so fetch latency overlaps
// handling. Fetch must be safe for concurrent use; it is retried on error (see
// ConsumerOptions.FetchRetries), except for an error wrapped with Permanent,
// which dead-letters the message at once.
type Fetcher interface {
	Fetch(ctx context.Context, e Entry) ([]byte, error)
}

// FetchCompleter is implemented by Fetchers that want to hear about entries that
// completed successfully, for instance to delete a cache key.
type FetchCompleter interface {
	// Completed is called after the results of entries were recorded.
	// Errors are logged; they do not affect the entries.
	Completed(ctx context.Context, entries []Entry) error
}

// FetcherFunc adapts a function to the Fetcher interface. A FetcherFunc has
// no Completed method: wrapping a FetchCompleter's Fetch in one drops its
// completion hook (CacheFetcher's DeleteOnComplete, say). Use WrapFetcher to
// wrap a fetcher.
type FetcherFunc func(ctx context.Context, e Entry) ([]byte, error)

// Fetch calls f.
func (f FetcherFunc) Fetch(ctx context.Context, e Entry) ([]byte, error) {
	mustContext(ctx, "FetcherFunc.Fetch")
	return f(ctx, e)
}

// InlineFetcher is the default Fetcher: the entry carries the encoded request.
// It costs nothing: the consumer recognises it and skips the fetch step.
type InlineFetcher struct{}

// Fetch returns e.Data.
func (InlineFetcher) Fetch(ctx context.Context, e Entry) ([]byte, error) {
	mustContext(ctx, "InlineFetcher.Fetch")
	return e.Data, nil
}

// Source is an object store, such as an S3-compatible bucket.
type Source interface {
	// Get returns the object stored under key.
	Get(ctx context.Context, key string) ([]byte, error)
}

// ErrCacheMiss is returned by CacheFetcher when the cache key is missing and no
// Source is configured.
var ErrCacheMiss = errors.New("streamq: payload not in cache and no source configured")

// CacheFetcher reads each payload from a Redis cache key written by an upstream
// service and falls back to a Source on a miss. The entry's Data is the
// reference: by default the cache key and the source key are both string(Data).
type CacheFetcher struct {
	// Client reads the cache. Required.
	Client redis.UniversalClient
	// CacheKey maps an entry to its cache key. Defaults to string(e.Data).
	CacheKey func(e Entry) string
	// SourceKey maps an entry to its key in Source. Defaults to string(e.Data).
	SourceKey func(e Entry) string
	// Source is read on a cache miss. Defaults to nil: a miss is an error
	// (ErrCacheMiss), retried like any fetch error.
	Source Source
	// DeleteOnComplete deletes the cache key once the entry's result is recorded.
	// Defaults to false.
	DeleteOnComplete bool
}

// Fetch reads the cache key, then the Source on a miss.
func (f *CacheFetcher) Fetch(ctx context.Context, e Entry) ([]byte, error) {
	mustContext(ctx, "CacheFetcher.Fetch")
	key := f.cacheKey(e)
	b, err := f.Client.Get(ctx, key).Bytes()
	if err == nil {
		return b, nil
	}
	if !errors.Is(err, redis.Nil) {
		return nil, fmt.Errorf("streamq: read cache key %q: %w", key, err)
	}
	if f.Source == nil {
		return nil, fmt.Errorf("%w: key %q", ErrCacheMiss, key)
	}
	skey := string(e.Data)
	if f.SourceKey != nil {
		skey = f.SourceKey(e)
	}
	b, err = f.Source.Get(ctx, skey)
	if err != nil {
		return nil, wrapf(err, "read %q from source", skey)
	}
	return b, nil
}

// Completed deletes the cache keys of completed entries when DeleteOnComplete is set.
func (f *CacheFetcher) Completed(ctx context.Context, entries []Entry) error {
	mustContext(ctx, "CacheFetcher.Completed")
	if !f.DeleteOnComplete || len(entries) == 0 {
		return nil
	}
	// One DEL per key: cache keys need not share a cluster slot.
	pipe := f.Client.Pipeline()
	for _, e := range entries {
		pipe.Del(ctx, f.cacheKey(e))
	}
	_, err := pipe.Exec(ctx)
	return err
}

func (f *CacheFetcher) cacheKey(e Entry) string {
	if f.CacheKey != nil {
		return f.CacheKey(e)
	}
	return string(e.Data)
}

// slot is one message in the prefetch ring.
//
// The feeder goroutine creates it; its fetch goroutine writes data and fetchErr
// and then closes ready; after ready, the worker that took the slot owns it.
// lost and cancel are shared with the lease loop and guarded by mu.
type slot struct {
	shard int // the stream's index (see Consumer.shards)
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
	// counted is closed once Redis confirmed the start count of the slot's
	// handler (nil before its first charge): its outcome is sent only then
	// (see committer.take). counting guards the close.
	counted  chan struct{}
	counting sync.Once

	mu     sync.Mutex
	lost   bool
	cancel context.CancelCauseFunc // the running handler's, or nil
}

// expectCount makes the slot's outcome wait for the confirmation of its
// start count. Called by the worker before its first charge is queued.
func (s *slot) expectCount() {
	if s.counted == nil {
		s.counted = make(chan struct{})
	}
}

// markCounted confirms the slot's start count (committer ticks).
func (s *slot) markCounted() { s.counting.Do(func() { close(s.counted) }) }

// isCounted reports whether the slot's outcome may be sent: its start count
// is confirmed, or it was never charged.
func (s *slot) isCounted() bool {
	if s.counted == nil {
		return true
	}
	select {
	case <-s.counted:
		return true
	default:
		return false
	}
}

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
// slot was lost already.
func (s *slot) setCancel(cancel context.CancelCauseFunc) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.cancel = cancel
	return !s.lost
}

// ring is the bounded, ordered prefetch ring. The feeder pushes slots in stream
// order and workers take them in that order, within each priority level (one
// queue per level; pick chooses the level). A slot holds its place in the
// budget from reserve until its place is given back, so memory is bounded by
// the depth even when workers finish out of order. Waiting for room uses a
// signal, never a sleep.
//
// The places are a budget, not storage: the queue of waiting slots grows and
// shrinks with what it holds, so a deep ring costs nothing until it fills
// (a channel of Prefetch places cost 8 bytes a place at Run, 76 MiB for
// Prefetch 10,000,000, on an empty queue).
type ring struct {
	mu     sync.Mutex
	depth  int // Prefetch: the places in all
	free   int
	target int // how many places may be out at once (readAhead), <= depth
	// settled counts the places out whose slots were handed off (their
	// outcome waits to be recorded): they bound memory (depth) but are not
	// read-ahead, so the target does not count them.
	settled int
	shards  int  // feeders sharing the ring, one per shard
	capped  bool // the last reservation was cut to its fair share of the target
	// groupReads makes a feeder wait, while entries are out, until half the
	// target is free (see minRead). Set for one shard only: with several, the
	// other feeders' blocked reads hold places that are not entries.
	groupReads bool
	freed      chan struct{} // capacity 1: "free or target went up"
	// With priority levels (leveled, set once a level's feeder joined),
	// out counts each level's places out and not settled, and backlog
	// counts the level's feeders whose last read filled its reservation
	// (more is likely waiting). A backlogged level holds at most its
	// weighted share of the target among the backlogged levels
	// (levelRoom), or, with strict, none while a higher one is
	// backlogged: so the ring holds the levels in about the proportions
	// workers take them.
	leveled bool
	out     [numLevels]int
	backlog [numLevels]int

	qmu    sync.Mutex
	queued sync.Cond // signalled on push and close; L is &qmu
	q      [numLevels]slotQueue
	n      int // slots queued, all levels
	closed bool
	// mixed is set once a slot of a level other than the default was
	// pushed: until then take is today's plain FIFO.
	mixed bool
	// strict takes the highest level queued first (StrictPriority); else
	// weights (per level) share the takes while several levels are queued,
	// by smooth weighted round robin over credit. Set before use.
	strict  bool
	weights [numLevels]int
	credit  [numLevels]int
}

// slotQueue is one level's queue of slots, in push order.
type slotQueue struct {
	buf  []*slot // circular: n slots from head
	head int
	n    int
}

// ringMinCap is the smallest storage the ring allocates; ringKeepCap is the
// size below which it never shrinks (8 KiB), so a ring that fills and drains
// all the time does not reallocate all the time.
const (
	ringMinCap  = 16
	ringKeepCap = 1024
)

func newRing(depth, shards int) *ring {
	r := &ring{depth: depth, free: depth, target: depth, shards: max(shards, 1), freed: make(chan struct{}, 1),
		groupReads: shards <= 1}
	r.queued.L = &r.qmu
	return r
}

// reserve blocks until at least one place is free, and fewer places than the
// target are out, and takes up to limit places within both. The caller
// pushes at most that many slots and gives back the rest. Several feeders
// (one per shard) share the ring; one reservation takes at most a fair share
// of the target, target/shards (at least 1), so a feeder blocked on an empty
// shard holding its places, or one that gives them back and takes them again
// at once, never starves the other shards. A reservation cut to its share
// counts as the target binding (see binding): the target grows when workers
// wait for it.
func (r *ring) reserve(ctx context.Context, limit int) (int, error) {
	return r.reserveLevel(ctx, levelNormal, limit)
}

// reserveLevel is reserve for the feeder of a priority level (see
// levelRoom).
func (r *ring) reserveLevel(ctx context.Context, level, limit int) (int, error) {
	for {
		r.mu.Lock()
		room := max(0, min(r.free, r.target-r.ahead()))
		avail := min(room, limit)
		if r.ahead() > 0 && room < r.minRead() && r.queuedSlots() > 0 {
			avail = 0 // the workers have entries waiting: read more at once later
		}
		if r.leveled {
			avail = min(avail, r.levelRoom(level))
		}
		fair := max(1, r.target/r.shards)
		n := min(avail, fair)
		if n > 0 {
			r.capped = avail > fair
		}
		r.free -= n
		r.out[level] += n
		left := min(r.free, r.target-r.ahead())
		r.mu.Unlock()
		if n > 0 {
			if left > 0 {
				r.signal() // another feeder may be waiting for the rest
			}
			return n, nil
		}
		select {
		case <-r.freed:
		case <-ctx.Done():
			return 0, ctx.Err()
		}
	}
}

// levelRoom is how many more places level may take while levels are
// backlogged. With strict, none while a higher level is. A level whose
// streams are drained (its last reads came back short) takes one place at a
// time while another level is backlogged: enough for a blocking read to take
// what arrives at once (after which its reads fill up and it counts as
// backlogged), and never the places the backlogged levels need (a drained
// feeder gives its places back after each empty read and would take them
// again first). A backlogged level holds at most its weight's share of the
// target among the backlogged levels (at least 1). mu is held.
func (r *ring) levelRoom(level int) int {
	const unlimited = 1 << 30
	sum := 0
	for l, b := range r.backlog {
		if b > 0 {
			sum += r.weights[l]
		}
	}
	if sum == 0 {
		return unlimited
	}
	if r.strict {
		for _, l := range levelOrder {
			if l == level {
				break
			}
			if r.backlog[l] > 0 {
				return 0
			}
		}
	}
	if r.backlog[level] == 0 {
		return 1
	}
	if r.strict {
		return unlimited
	}
	return max(0, max(1, r.target*r.weights[level]/sum)-r.out[level])
}

// setBacklog records that a feeder of level found its stream backlogged (its
// read filled its reservation) or drained, where it was not before.
func (r *ring) setBacklog(level int, backlogged bool) {
	r.mu.Lock()
	if backlogged {
		r.backlog[level]++
	} else {
		r.backlog[level]--
	}
	r.mu.Unlock()
	if !backlogged {
		r.signal() // a lower level may read more now
	}
}

// push appends a slot into a place taken with reserve. It never blocks: the
// reservation is the bound.
func (r *ring) push(s *slot) {
	r.qmu.Lock()
	q := &r.q[s.level]
	if q.n == len(q.buf) {
		q.resize(max(ringMinCap, 2*len(q.buf)))
	}
	q.buf[(q.head+q.n)%len(q.buf)] = s
	q.n++
	r.n++
	if s.level != levelNormal {
		r.mixed = true
	}
	r.qmu.Unlock()
	r.queued.Signal()
}

// take removes the oldest slot, waiting for one; it reports false once the
// ring is closed and empty, and whether it had to wait.
func (r *ring) take() (s *slot, waited, ok bool) {
	r.qmu.Lock()
	defer r.qmu.Unlock()
	for r.n == 0 && !r.closed {
		waited = true
		r.queued.Wait()
	}
	if r.n == 0 {
		return nil, waited, false
	}
	return r.pop(), waited, true
}

// queuedSlots returns how many slots wait to be taken.
func (r *ring) queuedSlots() int {
	r.qmu.Lock()
	defer r.qmu.Unlock()
	return r.n
}

// tryTake removes the oldest slot if one is queued, without waiting.
func (r *ring) tryTake() (*slot, bool) {
	r.qmu.Lock()
	defer r.qmu.Unlock()
	if r.n == 0 {
		return nil, false
	}
	return r.pop(), true
}

// pop removes the next of r.n > 0 queued slots: the oldest of its level,
// the level chosen by pick; qmu is held.
func (r *ring) pop() *slot {
	l := levelNormal
	if r.mixed {
		l = r.pick()
	}
	s := r.q[l].pop()
	r.n--
	if r.n == 0 && r.groupReads {
		r.signal() // a feeder waiting for a fuller read reads what room there is
	}
	return s
}

// pick chooses the level of the next slot taken, among the levels with slots
// queued: the highest with strict, else by smooth weighted round robin (each
// queued level gains its weight in credit, the richest is taken and pays the
// sum), so that while levels stay queued their takes follow the weights,
// evenly spread, and a level with nothing queued gives its turns away. qmu is
// held.
func (r *ring) pick() int {
	best, total := -1, 0
	for _, l := range levelOrder {
		if r.q[l].n == 0 {
			continue
		}
		if r.strict {
			return l
		}
		r.credit[l] += r.weights[l]
		total += r.weights[l]
		if best < 0 || r.credit[l] > r.credit[best] {
			best = l
		}
	}
	r.credit[best] -= total
	return best
}

// pop removes the oldest of q.n > 0 slots.
func (q *slotQueue) pop() *slot {
	s := q.buf[q.head]
	q.buf[q.head] = nil
	q.head = (q.head + 1) % len(q.buf)
	q.n--
	if len(q.buf) > ringKeepCap && q.n <= len(q.buf)/4 {
		q.resize(len(q.buf) / 2) // give memory back after a burst
	}
	return s
}

// resize moves the queued slots into new storage of size c (>= q.n).
func (q *slotQueue) resize(c int) {
	buf := make([]*slot, c)
	for i := range q.n {
		buf[i] = q.buf[(q.head+i)%len(q.buf)]
	}
	q.buf, q.head = buf, 0
}

// addFeeder counts one more feeder sharing the ring (a priority level's,
// started once its stream exists): reservations take a fair share of the
// target among them, and reads no longer wait for half the target.
func (r *ring) addFeeder() {
	r.mu.Lock()
	r.qmu.Lock()
	r.shards++
	r.leveled = true
	r.groupReads = false
	r.qmu.Unlock()
	r.mu.Unlock()
	r.signal()
}

// slots yields queued slots in ring order, waiting for each, until the ring
// is closed and empty.
func (r *ring) slots(yield func(*slot) bool) {
	for {
		s, _, ok := r.take()
		if !ok || !yield(s) {
			return
		}
	}
}

// close ends slots once the queued slots are taken. Nothing is pushed after close.
func (r *ring) close() {
	r.qmu.Lock()
	r.closed = true
	r.qmu.Unlock()
	r.queued.Broadcast()
}

// ahead is how many places are out for entries not handed off yet; mu is held.
func (r *ring) ahead() int { return r.depth - r.free - r.settled }

// settle marks one place out (of a slot of level) as handed off: room for
// the read-ahead.
func (r *ring) settle(level int) {
	r.mu.Lock()
	r.settled++
	r.out[level]--
	r.mu.Unlock()
	r.signal()
}

// giveSettled returns n places that were settled.
func (r *ring) giveSettled(n int) {
	if n == 0 {
		return
	}
	r.mu.Lock()
	r.free += n
	r.settled -= n
	r.mu.Unlock()
	r.signal()
}

// give returns n places to the ring.
func (r *ring) give(n int) { r.giveLevel(levelNormal, n) }

// giveLevel returns n places of a level's feeder or slots to the ring.
func (r *ring) giveLevel(level, n int) {
	if n == 0 {
		return
	}
	r.mu.Lock()
	r.free += n
	r.out[level] -= n
	r.mu.Unlock()
	r.signal()
}

// setTarget sets how many places may be out at once (1..depth). Places out
// beyond a lowered target are not taken back: they come back as their
// entries complete.
func (r *ring) setTarget(n int) {
	n = min(max(n, 1), r.depth)
	r.mu.Lock()
	grew := n > r.target
	r.target = n
	r.mu.Unlock()
	if grew {
		r.signal()
	}
}

// binding reports whether the target is what stops the feeders: as many
// places are out as it allows while some are free, or the last reservation
// was cut to its fair share of the target.
func (r *ring) binding() bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.free > 0 && (r.ahead() >= r.target || r.capped)
}

// minRead is the room a feeder waits for while slots wait in the ring: half
// the target with groupReads, else 1. Under load, reads then take several
// entries each instead of the one or two each completion frees; once no slot
// waits (a worker may be idle) any room is read, so neither an idle consumer
// nor one whose places are held by long handlers waits for more. mu is held.
func (r *ring) minRead() int {
	if !r.groupReads {
		return 1
	}
	return max(1, r.target/2)
}

func (r *ring) signal() {
	select {
	case r.freed <- struct{}{}:
	default:
	}
}

// startFetch fills s.data, calling the fetcher in its own goroutine unless the
// payload is inline. Failed fetches are retried with back-off; the last error
// is kept in s.fetchErr and the message takes the failure path. A failure is
// never remembered beyond this slot, so a redelivery fetches afresh.
func (r *run[Req, Resp]) startFetch(ctx context.Context, s *slot) {
	if _, inline := r.c.opts.Fetcher.(InlineFetcher); inline || s.dead != "" || s.skip {
		s.data = s.entry.Data
		close(s.ready)
		return
	}
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
		b, err = o.Fetcher.Fetch(ctx, e)
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
