package streamq

import (
	"context"
	"testing"
)

// TestProgressReturnsWithinContextDuringStall: Message.Progress is one round
// trip bounded by its ctx, as documented, also when the connection stalls
// (Redis or the network stops answering): it returns when its ctx ends, so
// the handler goes on. Before, it waited for the client's ReadTimeout (5 s
// here) and go-redis's retries, whatever its ctx said.
func TestProgressReturnsWithinContextDuringStall(t *testing.T) {
	t.Parallel()
	handlerCallDuringStall(t, "Progress", "job",
		func(ctx context.Context, p *Producer[string, string], _ string) (*Promise[string], error) {
			return p.Produce(ctx, "job", "x")
		},
		func(ctx context.Context, m *Message[string]) error { return m.Progress(ctx, "half") })
}
