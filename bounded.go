package streamq

import "context"

// callBounded runs call, Redis work, in a goroutine of its own and returns
// its result, or ctx's error as soon as ctx ends, whichever comes first.
//
// go-redis, with its default ContextTimeoutEnabled false, does not interrupt
// a socket read when the ctx of the call ends: a call on a stalled
// connection (Redis or the network stopped answering) returns only after
// the client's ReadTimeout (3s by default), whatever its ctx says. A public
// call that must return within its ctx runs its Redis work here.
//
// What happens to the call given up on: it goes on in the background with
// the same, ended ctx, and its result is dropped. The command it has in
// flight ends when the reply arrives or on the client's ReadTimeout, and
// may still take effect on the server, as a command whose reply is lost
// does. go-redis sends no further command with an ended ctx (it checks the
// ctx before it takes a connection and before a retry), so work of several
// round trips stops at its next one.
func callBounded[T any](ctx context.Context, call func(context.Context) (T, error)) (T, error) {
	type result struct {
		v   T
		err error
	}
	ch := make(chan result, 1)
	go func() {
		v, err := call(ctx)
		ch <- result{v, err}
	}()
	select {
	case r := <-ch:
		return r.v, r.err
	case <-ctx.Done():
		select {
		case r := <-ch: // it ended too: its result says more than ctx's error
			return r.v, r.err
		default:
		}
		var zero T
		return zero, ctx.Err()
	}
}

// callBoundedErr is callBounded for work without a result.
func callBoundedErr(ctx context.Context, call func(context.Context) error) error {
	_, err := callBounded(ctx, func(ctx context.Context) (struct{}, error) {
		return struct{}{}, call(ctx)
	})
	return err
}
