package streamq

import "context"

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
