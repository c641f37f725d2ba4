package streamqotel

import (
	"context"
	"errors"
	"sync"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"

	"github.com/streamq/streamq"
)

// ObserveQueues registers observable gauges of the queues the admins manage,
// read from Admin.Stats when the meter's reader collects (at most once per
// WithStatsMaxAge per queue, each call bounded by WithStatsTimeout; the
// queues are read in parallel):
//
//	streamq.queue.length        entries in the stream ({message})
//	streamq.queue.scheduled     delayed jobs and retries waiting ({message})
//	streamq.queue.dead_letters  entries in the dead-letter stream ({message})
//	streamq.queue.canceled      requests cancelled by Admin.Cancel, in all ({request})
//	streamq.group.pending       delivered, not yet acknowledged ({message})
//	streamq.group.lag           not yet delivered to the group ({message}; omitted while unknown)
//	streamq.group.consumers     live consumers ({consumer})
//
// with messaging.destination.name (and messaging.consumer.group.name for the
// group gauges). A queue whose Stats fails is left out of that collection.
// Unregister the returned registration to stop.
func (i *Instrumentation) ObserveQueues(admins ...*streamq.Admin) (metric.Registration, error) {
	g := func(name, unit, desc string) (metric.Int64ObservableGauge, error) {
		return i.meter.Int64ObservableGauge(name, metric.WithUnit(unit), metric.WithDescription(desc))
	}
	errs := make([]error, 7)
	var length, scheduled, dead, pending, lag, consumers metric.Int64ObservableGauge
	length, errs[0] = g("streamq.queue.length", "{message}", "Entries in the queue's stream.")
	scheduled, errs[1] = g("streamq.queue.scheduled", "{message}", "Delayed jobs and retries waiting in the schedule.")
	dead, errs[2] = g("streamq.queue.dead_letters", "{message}", "Entries in the dead-letter stream.")
	pending, errs[3] = g("streamq.group.pending", "{message}", "Entries delivered to the group and not yet acknowledged.")
	lag, errs[4] = g("streamq.group.lag", "{message}", "Entries not yet delivered to the group.")
	consumers, errs[5] = g("streamq.group.consumers", "{consumer}", "Live consumers of the group.")
	canceled, err := i.meter.Int64ObservableCounter("streamq.queue.canceled", metric.WithUnit("{request}"),
		metric.WithDescription("Requests cancelled by Admin.Cancel since the queue was created."))
	errs[6] = err
	if err := errors.Join(errs...); err != nil {
		return nil, err
	}
	caches := make([]*statsCache, len(admins))
	for n, a := range admins {
		caches[n] = &statsCache{admin: a}
	}
	return i.meter.RegisterCallback(func(ctx context.Context, o metric.Observer) error {
		var wg sync.WaitGroup
		for _, c := range caches {
			wg.Go(func() { c.refresh(ctx, i.cfg.statsMaxAge, i.cfg.statsTimeout) })
		}
		wg.Wait()
		for _, c := range caches {
			st, ok := c.get()
			if !ok {
				continue
			}
			q := metric.WithAttributes(semconv.MessagingSystemKey.String(System), semconv.MessagingDestinationName(c.admin.Queue()))
			o.ObserveInt64(length, st.Length, q)
			o.ObserveInt64(scheduled, st.Scheduled, q)
			o.ObserveInt64(dead, st.DeadLetters, q)
			o.ObserveInt64(canceled, st.Canceled, q)
			for _, gs := range st.Groups {
				ga := metric.WithAttributes(semconv.MessagingSystemKey.String(System), semconv.MessagingDestinationName(c.admin.Queue()),
					attribute.String(string(semconv.MessagingConsumerGroupNameKey), gs.Name))
				o.ObserveInt64(pending, gs.Pending, ga)
				if gs.Lag >= 0 {
					o.ObserveInt64(lag, gs.Lag, ga)
				}
				o.ObserveInt64(consumers, gs.Consumers, ga)
			}
		}
		return nil
	}, length, scheduled, dead, pending, lag, consumers, canceled)
}

// statsCache holds the last Stats of one queue.
type statsCache struct {
	admin *streamq.Admin
	mu    sync.Mutex
	at    time.Time
	stats streamq.Stats
	ok    bool
}

func (c *statsCache) refresh(ctx context.Context, maxAge, timeout time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.ok && time.Since(c.at) < maxAge {
		return
	}
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	st, err := c.admin.Stats(ctx)
	c.stats, c.ok, c.at = st, err == nil, time.Now()
}

func (c *statsCache) get() (streamq.Stats, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.stats, c.ok
}
