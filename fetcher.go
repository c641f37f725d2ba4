package streamq

// Fetchers: where a request's payload comes from when the entry does not
// carry it (the entry itself, a Redis cache key, or a Source such as an object
// store), and WrapFetcher to add a layer around one. Public API only; the fetch
// goroutine that calls a Fetcher for a slot is in slot.go.

import (
	"context"
	"errors"
	"fmt"

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

// WrapFetcher returns a Fetcher whose Fetch calls wrap, with next the inner
// fetcher: to time fetches, trace them, or change what they return. The
// result keeps inner's completion hook: it implements FetchCompleter and
// forwards Completed to inner when inner is a FetchCompleter (and does
// nothing otherwise), so wrapping a CacheFetcher keeps DeleteOnComplete
// working. Wrapped fetchers compose: wrap the result again to add another
// layer, the last added outermost. Unwrap returns inner.
func WrapFetcher(inner Fetcher, wrap func(ctx context.Context, e Entry, next Fetcher) ([]byte, error)) Fetcher {
	if inner == nil {
		inner = InlineFetcher{}
	}
	return &wrappedFetcher{inner: inner, wrap: wrap}
}

// wrappedFetcher is WrapFetcher's result.
type wrappedFetcher struct {
	inner Fetcher
	wrap  func(ctx context.Context, e Entry, next Fetcher) ([]byte, error)
}

// Fetch calls the wrapper with the inner fetcher.
func (w *wrappedFetcher) Fetch(ctx context.Context, e Entry) ([]byte, error) {
	mustContext(ctx, "wrappedFetcher.Fetch")
	if w.wrap == nil {
		return w.inner.Fetch(ctx, e)
	}
	return w.wrap(ctx, e, w.inner)
}

// Completed forwards to the inner fetcher's completion hook, if it has one.
func (w *wrappedFetcher) Completed(ctx context.Context, entries []Entry) error {
	mustContext(ctx, "wrappedFetcher.Completed")
	if fc, ok := w.inner.(FetchCompleter); ok {
		return fc.Completed(ctx, entries)
	}
	return nil
}

// Unwrap returns the wrapped fetcher.
func (w *wrappedFetcher) Unwrap() Fetcher { return w.inner }
