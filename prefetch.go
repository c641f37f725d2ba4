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
	// tx holds the writes a successful handler staged, applied with its
	// outcome (complete.lua); nil when none. Set by the worker before the
	// hand-off.
	tx *Tx
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
