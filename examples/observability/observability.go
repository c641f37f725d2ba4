// Package observability is the wiring of the observability example: a
// producer and a consumer process (cmd/producer, cmd/consumer) whose traces
// go to stdout through OpenTelemetry, joined across the two processes by the
// trace context each request carries in its headers, and whose metrics the
// consumer serves on /metrics for Prometheus.
//
//	redis-server &   # or any Redis 7+; REDIS_URL defaults to redis://127.0.0.1:6379
//	go run ./cmd/consumer -listen 127.0.0.1:9464 &
//	go run ./cmd/producer -n 10
//	curl -s 127.0.0.1:9464/metrics | grep ^streamq_
package observability

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/redis/go-redis/v9"
	"go.opentelemetry.io/otel/exporters/stdout/stdouttrace"
	"go.opentelemetry.io/otel/propagation"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"

	"github.com/streamq/streamq"
	"github.com/streamq/streamq/streamqotel"
	"github.com/streamq/streamq/streamqprom"
)

// Queue is the example's queue.
const Queue = "observability-example"

// Tracing returns an OpenTelemetry instrumentation whose spans are written
// to out as JSON, and its shutdown (which flushes them).
func Tracing(out io.Writer) (*streamqotel.Instrumentation, func(context.Context) error, error) {
	exp, err := stdouttrace.New(stdouttrace.WithWriter(out))
	if err != nil {
		return nil, nil, err
	}
	tp := sdktrace.NewTracerProvider(sdktrace.WithSyncer(exp))
	inst, err := streamqotel.New(streamqotel.WithTracerProvider(tp), streamqotel.WithPropagators(propagation.TraceContext{}),
		streamqotel.WithProcessParent(true)) // one trace from producer to consumer
	return inst, tp.Shutdown, err
}

// Produce sends n requests with the tracing interceptor and prints each
// result.
func Produce(ctx context.Context, rdb redis.UniversalClient, inst *streamqotel.Instrumentation, n int, out io.Writer) error {
	p, err := streamq.NewProducer[string, string](rdb, Queue, &streamq.ProducerOptions{
		Interceptors: []streamq.ProduceInterceptor{inst.Interceptor()}})
	if err != nil {
		return err
	}
	defer p.Close()
	for i := range n {
		pr, err := p.Produce(ctx, fmt.Sprintf("job-%d", i), fmt.Sprintf("hello %d", i), streamq.Timeout(time.Minute))
		if err != nil {
			return err
		}
		res, err := pr.Wait(ctx)
		fmt.Fprintf(out, "%s: %q %v\n", pr.ID(), res, err)
	}
	return nil
}

// Consume runs a consumer with the tracing and metrics middleware until ctx
// ends, and registers the metrics and the queue's collector with reg.
func Consume(ctx context.Context, rdb redis.UniversalClient, inst *streamqotel.Instrumentation, reg prometheus.Registerer) error {
	metrics := streamqprom.NewMetrics()
	admin, err := streamq.NewAdmin(rdb, Queue, nil)
	if err != nil {
		return err
	}
	if err := errors.Join(reg.Register(metrics), reg.Register(streamqprom.NewCollector([]*streamq.Admin{admin}))); err != nil {
		return err
	}
	c, err := streamq.NewConsumer(rdb, Queue, func(ctx context.Context, m *streamq.Message[string]) (string, error) {
		if strings.HasSuffix(m.ID, "3") {
			return "", streamq.Permanent(errors.New("jobs ending in 3 fail, to show a failure"))
		}
		return strings.ToUpper(m.Payload), nil
	}, &streamq.ConsumerOptions{
		Workers:        4,
		HandlerTimeout: 30 * time.Second,
		Middleware:     []streamq.Middleware{metrics.Middleware(), inst.Middleware()},
	})
	if err != nil {
		return err
	}
	return c.Run(ctx)
}

// MetricsHandler serves the metrics of g on /metrics.
func MetricsHandler(g prometheus.Gatherer) http.Handler {
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(g, promhttp.HandlerOpts{}))
	return mux
}
