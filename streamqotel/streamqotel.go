// Package streamqotel instruments streamq with OpenTelemetry: a producer
// interceptor that starts a span per produce call and writes its trace
// context into each request's headers, a consumer middleware that starts a
// process span per handled message (linked to, or a child of, the producer's
// span), a fetcher wrapper with a span per fetch, metrics of processing, and
// observable gauges of queue state read from Admin.Stats.
//
// Span names, kinds and attributes follow the OpenTelemetry messaging
// semantic conventions (semconv v1.43.0): "send {queue}" (PRODUCER; CLIENT
// for a batch, with a "create {queue}" PRODUCER span per message), "process
// {queue}" (CONSUMER) and "fetch {queue}" (CLIENT), messaging.system
// "streamq". streamq-specific attributes are under messaging.streamq.
//
// It is a module of its own (go get github.com/streamq/streamq/streamqotel),
// so the streamq core does not depend on OpenTelemetry:
//
//	otel.SetTextMapPropagator(propagation.TraceContext{}) // the global one does nothing until set
//	inst, err := streamqotel.New() // global providers and propagators
//	p, _ := streamq.NewProducer[Req, Resp](rdb, "q", &streamq.ProducerOptions{
//		Interceptors: []streamq.ProduceInterceptor{inst.Interceptor()}})
//	c, _ := streamq.NewConsumer(rdb, "q", handle, &streamq.ConsumerOptions{
//		Middleware: []streamq.Middleware{inst.Middleware()}})
//	reg, err := inst.ObserveQueues(admin) // queue gauges
//
// Cost, measured with a handler that does nothing and every trace sampled:
// about 55 µs of client CPU and 6 µs of Redis CPU per job, around 1-2% of a
// handler of a few milliseconds; sample traces for faster handlers. The
// module's README.md has the table of spans and metrics and the measurement.
package streamqotel

import (
	"context"
	"errors"
	"strconv"
	"sync"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/propagation"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"
	"go.opentelemetry.io/otel/trace"

	"github.com/streamq/streamq"
)

// System is the value of messaging.system.
const System = "streamq"

// Attribute keys specific to streamq, under the messaging.streamq namespace.
const (
	// DeliveryCountKey is the handler starts of a message, this one included.
	DeliveryCountKey = attribute.Key("messaging.streamq.message.delivery_count")
	// EntryIDKey is the stream entry id of a message.
	EntryIDKey = attribute.Key("messaging.streamq.message.entry_id")
	// OutcomeKey is what became of a handled message: "ok", "retry" or
	// "dead_letter".
	OutcomeKey = attribute.Key("messaging.streamq.outcome")
)

// Outcomes, the values of OutcomeKey.
const (
	OutcomeOK         = "ok"
	OutcomeRetry      = "retry"
	OutcomeDeadLetter = "dead_letter"
)

// durationBuckets are the bucket boundaries the messaging conventions
// recommend for duration histograms, in seconds.
var durationBuckets = []float64{0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10}

// Instrumentation holds the tracer, the instruments and the propagators.
// One Instrumentation serves any number of producers and consumers, of any
// queue types.
type Instrumentation struct {
	cfg    config
	tracer trace.Tracer
	meter  metric.Meter

	sent      metric.Int64Counter
	processed metric.Int64Counter
	duration  metric.Float64Histogram
	queueWait metric.Float64Histogram
	fetchTime metric.Float64Histogram

	// sets caches the attribute sets of the process metrics (attrKey ->
	// attribute.Set): building one per message costs more than the
	// measurement. Bounded by queues x groups x error types x outcomes.
	sets sync.Map
}

// attrKey identifies an attribute set of the process metrics.
type attrKey struct{ queue, group, errorType, outcome string }

// processAttrs returns the attribute set of the process metrics for a queue
// and group, with error.type and the outcome when not empty.
func (i *Instrumentation) processAttrs(queue, group, errType, outcome string) attribute.Set {
	k := attrKey{queue, group, errType, outcome}
	if s, ok := i.sets.Load(k); ok {
		return s.(attribute.Set)
	}
	kvs := []attribute.KeyValue{
		semconv.MessagingSystemKey.String(System),
		semconv.MessagingOperationName("process"),
		semconv.MessagingDestinationName(queue),
		semconv.MessagingConsumerGroupName(group),
	}
	if errType != "" {
		kvs = append(kvs, semconv.ErrorTypeKey.String(errType))
	}
	if outcome != "" {
		kvs = append(kvs, OutcomeKey.String(outcome))
	}
	s := attribute.NewSet(kvs...)
	i.sets.Store(k, s)
	return s
}

// New returns an Instrumentation. Options default to OpenTelemetry's
// globals; see each option.
func New(opts ...Option) (*Instrumentation, error) {
	cfg, err := newConfig(opts)
	if err != nil {
		return nil, err
	}
	i := &Instrumentation{
		cfg:    cfg,
		tracer: cfg.tracerProvider.Tracer(ScopeName, trace.WithInstrumentationVersion(Version()), trace.WithSchemaURL(semconv.SchemaURL)),
		meter:  cfg.meterProvider.Meter(ScopeName, metric.WithInstrumentationVersion(Version()), metric.WithSchemaURL(semconv.SchemaURL)),
	}
	errs := make([]error, 5)
	i.sent, errs[0] = i.meter.Int64Counter("messaging.client.sent.messages", metric.WithUnit("{message}"),
		metric.WithDescription("Messages a producer attempted to send (error.type set when it failed)."))
	i.processed, errs[1] = i.meter.Int64Counter("streamq.process.messages", metric.WithUnit("{message}"),
		metric.WithDescription("Messages whose handler ran, by outcome (messaging.streamq.outcome: ok, retry, dead_letter)."))
	i.duration, errs[2] = i.meter.Float64Histogram("messaging.process.duration", metric.WithUnit("s"),
		metric.WithDescription("Duration of processing operations (handler and middleware)."),
		metric.WithExplicitBucketBoundaries(durationBuckets...))
	i.queueWait, errs[3] = i.meter.Float64Histogram("streamq.queue.wait.duration", metric.WithUnit("s"),
		metric.WithDescription("Time from the entry's append to the stream (Redis's clock) to its handler's start."),
		metric.WithExplicitBucketBoundaries(durationBuckets...))
	i.fetchTime, errs[4] = i.meter.Float64Histogram("streamq.fetch.duration", metric.WithUnit("s"),
		metric.WithDescription("Duration of payload fetches (WrapFetcher)."),
		metric.WithExplicitBucketBoundaries(durationBuckets...))
	if err := errors.Join(errs...); err != nil {
		return nil, err
	}
	return i, nil
}

// Interceptor returns the producer interceptor: a "send {queue}" span per
// Produce or Enqueue call (PRODUCER), or per ProduceBatch or ProduceFlow
// call (CLIENT, with a "create {queue}" PRODUCER span per message, named by
// the message's own queue: a flow's children may be on other queues), whose
// context is written into each request's headers.
func (i *Instrumentation) Interceptor() streamq.ProduceInterceptor {
	return func(ctx context.Context, msgs []*streamq.Outgoing, next func(context.Context) error) error {
		if len(msgs) == 0 {
			return next(ctx)
		}
		queue := msgs[0].Queue
		batch := len(msgs) > 1
		kind := trace.SpanKindProducer
		attrs := []attribute.KeyValue{
			semconv.MessagingSystemKey.String(System),
			semconv.MessagingOperationName("send"),
			semconv.MessagingOperationTypeSend,
			semconv.MessagingDestinationName(queue),
		}
		if batch {
			kind = trace.SpanKindClient
			attrs = append(attrs, semconv.MessagingBatchMessageCount(len(msgs)))
		} else {
			attrs = append(attrs, semconv.MessagingMessageID(msgs[0].ID))
		}
		ctx, span := i.tracer.Start(ctx, "send "+queue, trace.WithSpanKind(kind), trace.WithAttributes(attrs...))
		defer span.End()
		var creates []trace.Span
		for _, m := range msgs {
			mctx := ctx
			if batch {
				var cs trace.Span
				// A flow's requests may be on several queues: each create
				// span names its own.
				mctx, cs = i.tracer.Start(ctx, "create "+m.Queue, trace.WithSpanKind(trace.SpanKindProducer),
					trace.WithAttributes(
						semconv.MessagingSystemKey.String(System),
						semconv.MessagingOperationName("create"),
						semconv.MessagingOperationTypeCreate,
						semconv.MessagingDestinationName(m.Queue),
						semconv.MessagingMessageID(m.ID)))
				creates = append(creates, cs)
			}
			if m.Headers == nil {
				m.Headers = make(map[string]string, 2)
			}
			i.cfg.propagators.Inject(mctx, propagation.MapCarrier(m.Headers))
		}
		err := next(ctx)
		for _, cs := range creates {
			cs.End()
		}
		mattrs := []attribute.KeyValue{
			semconv.MessagingSystemKey.String(System),
			semconv.MessagingOperationName("send"),
			semconv.MessagingDestinationName(queue),
		}
		if err != nil {
			et := errorType(err)
			span.SetStatus(codes.Error, err.Error())
			span.SetAttributes(semconv.ErrorTypeKey.String(et))
			mattrs = append(mattrs, semconv.ErrorTypeKey.String(et))
		} else if !batch && msgs[0].EntryID != "" {
			span.SetAttributes(EntryIDKey.String(msgs[0].EntryID))
		}
		i.sent.Add(ctx, int64(len(msgs)), metric.WithAttributes(mattrs...))
		return err
	}
}

// Middleware returns the consumer middleware: a "process {queue}" CONSUMER
// span per handled message, linked to the span that produced it (its child
// too with WithProcessParent), and the processing metrics. The handler's
// context carries the span, so its own spans (and the Redis client's, when
// the client is instrumented) nest under it, and streamq's log lines about
// the message carry it.
func (i *Instrumentation) Middleware() streamq.Middleware {
	return func(ctx context.Context, d *streamq.Delivery, next func(context.Context) error) error {
		producer := trace.SpanContextFromContext(i.cfg.propagators.Extract(context.Background(), propagation.MapCarrier(d.Headers)))
		opts := []trace.SpanStartOption{
			trace.WithSpanKind(trace.SpanKindConsumer),
			trace.WithTimestamp(d.StartedAt),
			trace.WithAttributes(
				semconv.MessagingSystemKey.String(System),
				semconv.MessagingOperationName("process"),
				semconv.MessagingOperationTypeProcess,
				semconv.MessagingDestinationName(d.Queue),
				semconv.MessagingConsumerGroupName(d.Group),
				semconv.MessagingClientID(d.Consumer),
				semconv.MessagingDestinationPartitionID(strconv.Itoa(d.Shard)),
				semconv.MessagingMessageID(d.ID),
				EntryIDKey.String(d.EntryID),
				DeliveryCountKey.Int(d.Deliveries),
			),
		}
		if producer.IsValid() {
			opts = append(opts, trace.WithLinks(trace.Link{SpanContext: producer}))
			if i.cfg.processParent {
				ctx = trace.ContextWithRemoteSpanContext(ctx, producer)
			} else {
				opts = append(opts, trace.WithNewRoot())
			}
		}
		ctx, span := i.tracer.Start(ctx, "process "+d.Queue, opts...)
		defer span.End()
		start := time.Now()
		err := next(ctx)
		elapsed := time.Since(start).Seconds()

		outcome, et := OutcomeOK, ""
		switch {
		case err == nil:
		case d.Final(err):
			outcome = OutcomeDeadLetter
		default:
			outcome = OutcomeRetry
		}
		span.SetAttributes(OutcomeKey.String(outcome))
		if err != nil {
			et = errorType(err)
			span.SetStatus(codes.Error, err.Error())
			span.SetAttributes(semconv.ErrorTypeKey.String(et))
		}
		i.duration.Record(ctx, elapsed, metric.WithAttributeSet(i.processAttrs(d.Queue, d.Group, et, "")))
		i.processed.Add(ctx, 1, metric.WithAttributeSet(i.processAttrs(d.Queue, d.Group, et, outcome)))
		if !d.ProducedAt.IsZero() {
			i.queueWait.Record(ctx, max(d.StartedAt.Sub(d.ProducedAt).Seconds(), 0),
				metric.WithAttributeSet(i.processAttrs(d.Queue, d.Group, "", "")))
		}
		return err
	}
}

// WrapFetcher wraps f (streamq.InlineFetcher when nil) with a "fetch
// {queue}" CLIENT span per fetch, linked to the producer's span, and the
// streamq.fetch.duration histogram. The result keeps f's completion hook
// (see streamq.WrapFetcher).
func (i *Instrumentation) WrapFetcher(queue string, f streamq.Fetcher) streamq.Fetcher {
	return streamq.WrapFetcher(f, func(ctx context.Context, e streamq.Entry, next streamq.Fetcher) ([]byte, error) {
		opts := []trace.SpanStartOption{
			trace.WithSpanKind(trace.SpanKindClient),
			trace.WithAttributes(
				semconv.MessagingSystemKey.String(System),
				semconv.MessagingOperationName("fetch"),
				semconv.MessagingOperationTypeReceive,
				semconv.MessagingDestinationName(queue),
				semconv.MessagingMessageID(e.ID),
				EntryIDKey.String(e.EntryID),
			),
		}
		if producer := trace.SpanContextFromContext(i.cfg.propagators.Extract(context.Background(), propagation.MapCarrier(e.Headers))); producer.IsValid() {
			opts = append(opts, trace.WithLinks(trace.Link{SpanContext: producer}))
		}
		ctx, span := i.tracer.Start(ctx, "fetch "+queue, opts...)
		defer span.End()
		start := time.Now()
		b, err := next.Fetch(ctx, e)
		attrs := []attribute.KeyValue{semconv.MessagingSystemKey.String(System), semconv.MessagingDestinationName(queue)}
		if err != nil {
			et := errorType(err)
			span.SetStatus(codes.Error, err.Error())
			span.SetAttributes(semconv.ErrorTypeKey.String(et))
			attrs = append(attrs, semconv.ErrorTypeKey.String(et))
		}
		i.fetchTime.Record(ctx, time.Since(start).Seconds(), metric.WithAttributes(attrs...))
		return b, err
	})
}

// errorType is the error.type of err: a fixed, low-cardinality set.
func errorType(err error) string {
	switch {
	case errors.Is(err, streamq.ErrPanic):
		return "panic"
	case errors.Is(err, streamq.ErrDeadlineExceeded):
		return "deadline_exceeded"
	case errors.Is(err, streamq.ErrHandlerTimeout):
		return "handler_timeout"
	case errors.Is(err, streamq.ErrLeaseLost):
		return "lease_lost"
	case errors.Is(err, context.DeadlineExceeded):
		return "timeout"
	case errors.Is(err, context.Canceled):
		return "canceled"
	case errors.Is(err, streamq.ErrPayloadTooLarge), errors.Is(err, streamq.ErrInvalidID), errors.Is(err, streamq.ErrBatchTooLarge):
		return "invalid_request"
	case errors.Is(err, streamq.ErrClosed):
		return "closed"
	}
	return semconv.ErrorTypeOther.Value.AsString()
}
