package streamqotel_test

import (
	"context"
	"errors"
	"testing"

	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/trace"

	"github.com/streamq/streamq"
	"github.com/streamq/streamq/streamqotel"
)

// completer is a fetcher with a completion hook.
type completer struct{ completed []streamq.Entry }

func (c *completer) Fetch(_ context.Context, e streamq.Entry) ([]byte, error) {
	if string(e.Data) == "missing" {
		return nil, errors.New("not found")
	}
	return e.Data, nil
}

func (c *completer) Completed(_ context.Context, es []streamq.Entry) error {
	c.completed = append(c.completed, es...)
	return nil
}

// TestWrapFetcher: a fetch span linked to the producer's span, errors
// marked, and the inner fetcher's completion hook kept.
func TestWrapFetcher(t *testing.T) {
	exp, tp := tracing(t)
	inst, err := streamqotel.New(streamqotel.WithTracerProvider(tp), streamqotel.WithPropagators(propagation.TraceContext{}),
		streamqotel.WithMeterProvider(sdkmetric.NewMeterProvider()))
	require.NoError(t, err)
	inner := &completer{}
	f := inst.WrapFetcher("q", inner)
	producer := "00-0102030405060708090a0b0c0d0e0f10-1112131415161718-01"
	e := streamq.Entry{ID: "j", EntryID: "1-0", Data: []byte("payload"), Headers: map[string]string{"traceparent": producer}}
	b, err := f.Fetch(context.Background(), e)
	require.NoError(t, err)
	require.Equal(t, "payload", string(b))
	_, err = f.Fetch(context.Background(), streamq.Entry{ID: "k", EntryID: "2-0", Data: []byte("missing")})
	require.Error(t, err)

	spans := exp.GetSpans()
	require.Len(t, spans, 2)
	require.Equal(t, "fetch q", spans[0].Name)
	require.Equal(t, trace.SpanKindClient, spans[0].SpanKind)
	require.Contains(t, spans[0].Attributes, attribute.String("messaging.operation.type", "receive"))
	require.Len(t, spans[0].Links, 1)
	require.Equal(t, "0102030405060708090a0b0c0d0e0f10", spans[0].Links[0].SpanContext.TraceID().String())
	require.Equal(t, codes.Error, spans[1].Status.Code)
	require.Empty(t, spans[1].Links, "no headers, no link")

	fc, ok := f.(streamq.FetchCompleter)
	require.True(t, ok)
	require.NoError(t, fc.Completed(context.Background(), []streamq.Entry{e}))
	require.Len(t, inner.completed, 1, "the inner fetcher's completion hook runs")
}
