package streamqotel_test

import (
	"context"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/extra/redisotel/v9"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/propagation"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/streamq/streamq"
	"github.com/streamq/streamq/streamqotel"
)

// TestRedisSpansNestUnderProcess: with the go-redis client traced by
// redisotel, the Redis commands a handler runs are children of its process
// span, one tree under the producer's trace (WithProcessParent).
func TestRedisSpansNestUnderProcess(t *testing.T) {
	m := miniredis.RunT(t)
	exp, tp := tracing(t)
	rdb := redis.NewClient(&redis.Options{Addr: m.Addr()})
	t.Cleanup(func() { _ = rdb.Close() })
	require.NoError(t, redisotel.InstrumentTracing(rdb, redisotel.WithTracerProvider(tp)))
	inst, err := streamqotel.New(streamqotel.WithTracerProvider(tp), streamqotel.WithPropagators(propagation.TraceContext{}),
		streamqotel.WithProcessParent(true), streamqotel.WithMeterProvider(sdkmetric.NewMeterProvider()))
	require.NoError(t, err)
	ctx := context.Background()
	q := "nested"
	p, err := streamq.NewProducer[string, string](rdb, q, &streamq.ProducerOptions{Interceptors: []streamq.ProduceInterceptor{inst.Interceptor()}})
	require.NoError(t, err)
	defer p.Close()
	c, err := streamq.NewConsumer(rdb, q, func(ctx context.Context, msg *streamq.Message[string]) (string, error) {
		return rdb.Set(ctx, "handled:"+msg.ID, msg.Payload, time.Minute).Result()
	}, &streamq.ConsumerOptions{Middleware: []streamq.Middleware{inst.Middleware()}})
	require.NoError(t, err)
	runCtx, cancel := context.WithCancel(ctx)
	ran := make(chan error, 1)
	go func() { ran <- c.Run(runCtx) }()
	pr, err := p.Produce(ctx, "j", "v")
	require.NoError(t, err)
	wctx, wcancel := context.WithTimeout(ctx, 10*time.Second)
	defer wcancel()
	res, err := pr.Wait(wctx)
	require.NoError(t, err)
	require.Equal(t, "OK", res)
	cancel()
	require.NoError(t, <-ran)

	var send, process, set *tracetest.SpanStub
	spans := exp.GetSpans()
	for i := range spans {
		s := &spans[i]
		switch {
		case s.Name == "send "+q:
			send = s
		case s.Name == "process "+q:
			process = s
		case s.Name == "set":
			set = s
		}
	}
	require.NotNil(t, send)
	require.NotNil(t, process)
	require.NotNil(t, set, "the handler's SET has a span")
	require.Equal(t, send.SpanContext.TraceID(), process.SpanContext.TraceID())
	require.Equal(t, send.SpanContext.SpanID(), process.Parent.SpanID())
	require.Equal(t, process.SpanContext.TraceID(), set.SpanContext.TraceID(), "one tree")
	require.Equal(t, process.SpanContext.SpanID(), set.Parent.SpanID())
	require.Equal(t, trace.SpanKindClient, set.SpanKind)
}
