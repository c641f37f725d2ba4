package streamqprom

import (
	"context"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/streamq/streamq"
)

// Outcomes, the values of the outcome label of streamq_jobs_processed_total.
const (
	// OutcomeOK: the handler succeeded.
	OutcomeOK = "ok"
	// OutcomeRetry: the handler failed and the job will be retried.
	OutcomeRetry = "retry"
	// OutcomeDeadLetter: the handler failed for good (a permanent error, or
	// its last delivery): the job is dead-lettered.
	OutcomeDeadLetter = "dead_letter"
)

// MetricsOption configures NewMetrics.
type MetricsOption func(*Metrics)

// WithBuckets sets the bucket boundaries (seconds) of the duration and
// queue-wait histograms. Defaults to prometheus.DefBuckets (5ms to 10s).
func WithBuckets(b []float64) MetricsOption {
	return func(m *Metrics) { m.buckets = b }
}

// Metrics is a prometheus.Collector of handler and producer metrics, fed by
// its Middleware and Interceptor:
//
//	streamq_jobs_processed_total{queue,outcome}  handler runs, by outcome (ok, retry, dead_letter)
//	streamq_job_duration_seconds{queue}          handler run time (middleware after this one included)
//	streamq_queue_wait_seconds{queue}            from the entry's append (Redis's clock) to the handler's start
//	streamq_jobs_in_flight{queue}                handlers running now
//	streamq_jobs_produced_total{queue,outcome}   requests produced (ok, error)
//
// The outcome series of a queue are exported as 0 from its first job. One
// Metrics serves any number of consumers and producers of any queue types.
type Metrics struct {
	buckets   []float64
	processed *prometheus.CounterVec
	duration  *prometheus.HistogramVec
	wait      *prometheus.HistogramVec
	inFlight  *prometheus.GaugeVec
	produced  *prometheus.CounterVec
	seen      sync.Map // queue -> struct{}: its outcome series exist
}

// NewMetrics returns a Metrics.
func NewMetrics(opts ...MetricsOption) *Metrics {
	m := &Metrics{buckets: prometheus.DefBuckets}
	for _, o := range opts {
		o(m)
	}
	m.processed = prometheus.NewCounterVec(prometheus.CounterOpts{Name: "streamq_jobs_processed_total",
		Help: "Handler runs, by outcome: ok, retry (failed, will be retried), dead_letter (failed for good)."}, []string{"queue", "outcome"})
	m.duration = prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: "streamq_job_duration_seconds",
		Help: "Handler run time.", Buckets: m.buckets}, []string{"queue"})
	m.wait = prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: "streamq_queue_wait_seconds",
		Help: "Time from the entry's append to the stream to its handler's start.", Buckets: m.buckets}, []string{"queue"})
	m.inFlight = prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "streamq_jobs_in_flight",
		Help: "Handlers running now."}, []string{"queue"})
	m.produced = prometheus.NewCounterVec(prometheus.CounterOpts{Name: "streamq_jobs_produced_total",
		Help: "Requests produced, by outcome: ok, error."}, []string{"queue", "outcome"})
	return m
}

// Describe implements prometheus.Collector.
func (m *Metrics) Describe(ch chan<- *prometheus.Desc) {
	m.processed.Describe(ch)
	m.duration.Describe(ch)
	m.wait.Describe(ch)
	m.inFlight.Describe(ch)
	m.produced.Describe(ch)
}

// Collect implements prometheus.Collector.
func (m *Metrics) Collect(ch chan<- prometheus.Metric) {
	m.processed.Collect(ch)
	m.duration.Collect(ch)
	m.wait.Collect(ch)
	m.inFlight.Collect(ch)
	m.produced.Collect(ch)
}

func (m *Metrics) init(queue string) {
	if _, ok := m.seen.Load(queue); ok {
		return
	}
	for _, o := range []string{OutcomeOK, OutcomeRetry, OutcomeDeadLetter} {
		m.processed.WithLabelValues(queue, o)
	}
	m.seen.Store(queue, struct{}{})
}

// Middleware returns the consumer middleware that feeds the handler
// metrics. Put it first in ConsumerOptions.Middleware to time the other
// middleware too.
func (m *Metrics) Middleware() streamq.Middleware {
	return func(ctx context.Context, d *streamq.Delivery, next func(context.Context) error) error {
		m.init(d.Queue)
		if !d.ProducedAt.IsZero() {
			m.wait.WithLabelValues(d.Queue).Observe(max(d.StartedAt.Sub(d.ProducedAt).Seconds(), 0))
		}
		g := m.inFlight.WithLabelValues(d.Queue)
		g.Inc()
		start := time.Now()
		err := next(ctx)
		m.duration.WithLabelValues(d.Queue).Observe(time.Since(start).Seconds())
		g.Dec()
		outcome := OutcomeOK
		switch {
		case err == nil:
		case d.Final(err):
			outcome = OutcomeDeadLetter
		default:
			outcome = OutcomeRetry
		}
		m.processed.WithLabelValues(d.Queue, outcome).Inc()
		return err
	}
}

// Interceptor returns the producer interceptor that counts produced
// requests.
func (m *Metrics) Interceptor() streamq.ProduceInterceptor {
	return func(ctx context.Context, msgs []*streamq.Outgoing, next func(context.Context) error) error {
		err := next(ctx)
		if len(msgs) == 0 {
			return err
		}
		outcome := "ok"
		if err != nil {
			outcome = "error"
		}
		// A flow's requests may be on several queues: each counts on its own.
		for i, n := 0, 0; i < len(msgs); i += n {
			for n = 1; i+n < len(msgs) && msgs[i+n].Queue == msgs[i].Queue; n++ {
			}
			m.produced.WithLabelValues(msgs[i].Queue, outcome).Add(float64(n))
		}
		return err
	}
}

// ProcessedCounter returns the streamq_jobs_processed_total counter of a
// queue and outcome, for tests (prometheus/testutil.ToFloat64).
func (m *Metrics) ProcessedCounter(queue, outcome string) prometheus.Counter {
	return m.processed.WithLabelValues(queue, outcome)
}
