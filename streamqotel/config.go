package streamqotel

import (
	"fmt"
	"time"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
)

// ScopeName is the instrumentation scope name of the tracers and meters this
// package creates.
const ScopeName = "github.com/streamq/streamq/streamqotel"

// Option configures New.
type Option interface{ apply(*config) }

type optionFunc func(*config)

func (f optionFunc) apply(c *config) { f(c) }

type config struct {
	tracerProvider trace.TracerProvider
	meterProvider  metric.MeterProvider
	propagators    propagation.TextMapPropagator
	processParent  bool
	statsMaxAge    time.Duration
	statsTimeout   time.Duration
}

// WithTracerProvider sets the TracerProvider spans are created with.
// Defaults to the global one (otel.GetTracerProvider) at New.
func WithTracerProvider(tp trace.TracerProvider) Option {
	return optionFunc(func(c *config) { c.tracerProvider = tp })
}

// WithMeterProvider sets the MeterProvider instruments are created with.
// Defaults to the global one (otel.GetMeterProvider) at New.
func WithMeterProvider(mp metric.MeterProvider) Option {
	return optionFunc(func(c *config) { c.meterProvider = mp })
}

// WithPropagators sets the propagators that write the producer's trace
// context into a request's headers and read it back in the consumer.
// Defaults to the global ones (otel.GetTextMapPropagator) at New. The
// global propagator does nothing until the program sets one: call
// otel.SetTextMapPropagator(propagation.TraceContext{}) or pass
// WithPropagators(propagation.TraceContext{}).
func WithPropagators(p propagation.TextMapPropagator) Option {
	return optionFunc(func(c *config) { c.propagators = p })
}

// WithProcessParent makes a consumer's process span a child of the
// producer's span (one trace from producer to consumer), still with a link
// to it. Defaults to false: the process span starts a new trace, linked to
// the producer's span, as the OpenTelemetry messaging conventions recommend
// for jobs that may run long after they were produced.
func WithProcessParent(parent bool) Option {
	return optionFunc(func(c *config) { c.processParent = parent })
}

// WithStatsMaxAge sets how long the queue statistics read for the
// observable gauges (ObserveQueues) are reused before Admin.Stats is called
// again. Defaults to 5s.
func WithStatsMaxAge(d time.Duration) Option {
	return optionFunc(func(c *config) { c.statsMaxAge = d })
}

// WithStatsTimeout bounds each Admin.Stats call made for the gauges.
// Defaults to 5s.
func WithStatsTimeout(d time.Duration) Option {
	return optionFunc(func(c *config) { c.statsTimeout = d })
}

func newConfig(opts []Option) (config, error) {
	c := config{statsMaxAge: 5 * time.Second, statsTimeout: 5 * time.Second}
	for _, o := range opts {
		if o != nil {
			o.apply(&c)
		}
	}
	if c.tracerProvider == nil {
		c.tracerProvider = otel.GetTracerProvider()
	}
	if c.meterProvider == nil {
		c.meterProvider = otel.GetMeterProvider()
	}
	if c.propagators == nil {
		c.propagators = otel.GetTextMapPropagator()
	}
	if c.statsMaxAge < 0 {
		return c, fmt.Errorf("streamqotel: WithStatsMaxAge(%v) is negative", c.statsMaxAge)
	}
	if c.statsTimeout <= 0 {
		return c, fmt.Errorf("streamqotel: WithStatsTimeout(%v) must be positive", c.statsTimeout)
	}
	return c, nil
}
