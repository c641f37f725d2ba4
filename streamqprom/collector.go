// Package streamqprom exports streamq's metrics to Prometheus: a Collector
// of queue state read from Admin.Stats at scrape time, and Metrics, a
// collector of handler and producer metrics fed by a consumer middleware and
// a producer interceptor. Nothing registers itself: register them with your
// registry.
//
//	reg := prometheus.NewRegistry()
//	m := streamqprom.NewMetrics()
//	reg.MustRegister(m, streamqprom.NewCollector([]*streamq.Admin{admin}))
//	c, _ := streamq.NewConsumer(rdb, "q", handle, &streamq.ConsumerOptions{
//		Middleware: []streamq.Middleware{m.Middleware()}})
//
// It is a module of its own (go get github.com/streamq/streamq/streamqprom),
// so the streamq core does not depend on the Prometheus client. The
// middleware and interceptor cost no measurable client or Redis CPU per job;
// the Collector reads Admin.Stats of each queue at most once per cache
// interval (5s), however often it is scraped. The module's README.md lists
// every metric.
package streamqprom

import (
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/streamq/streamq"
)

// Defaults of the Collector's options.
const (
	// DefaultCacheInterval is how long a scrape reuses the statistics read
	// by an earlier one.
	DefaultCacheInterval = 5 * time.Second
	// DefaultScrapeTimeout bounds the Admin.Stats calls of one scrape.
	DefaultScrapeTimeout = 5 * time.Second
)

// CollectorOption configures NewCollector.
type CollectorOption func(*Collector)

// WithCacheInterval sets how long statistics read by a scrape are reused
// by the next scrapes, so that frequent scrapes (several Prometheus
// servers, say) cost Redis one read per interval. 0 reads at every scrape.
// Defaults to DefaultCacheInterval (5s).
// WithTopKeys exports the waiting and running jobs of each queue's n keys
// with the most waiting jobs (fair queuing by key, Admin.TopKeys), one
// script call per shard and scrape. Default 0: no key gauges, and no call.
func WithTopKeys(n int) CollectorOption {
	return func(c *Collector) { c.topKeys = max(n, 0) }
}

func WithCacheInterval(d time.Duration) CollectorOption {
	return func(c *Collector) { c.cacheInterval = d }
}

// WithScrapeTimeout bounds the Admin.Stats calls of one scrape; a queue
// whose call fails or times out is left out of that scrape and counted in
// streamq_scrape_errors_total. Defaults to DefaultScrapeTimeout (5s).
func WithScrapeTimeout(d time.Duration) CollectorOption {
	return func(c *Collector) { c.timeout = d }
}

// Collector is a prometheus.Collector of queue state. Each scrape reads
// Admin.Stats of every queue, in parallel (unless the last read is younger
// than the cache interval), and exports:
//
//	streamq_queue_entries{queue}                           entries in the stream
//	streamq_queue_scheduled_entries{queue}                 delayed jobs and retries waiting
//	streamq_queue_paused{queue}                            1 while paused
//	streamq_level_entries{queue,priority}                  entries of a priority level (Stats.Levels)
//	streamq_level_pending_entries{queue,priority}          a level's entries delivered, not acknowledged
//	streamq_dead_letter_entries{queue}                     entries in the dead-letter stream
//	streamq_requests_canceled_total{queue}                 requests cancelled by Admin.Cancel (counter)
//	streamq_group_pending_entries{queue,group}             delivered, not acknowledged
//	streamq_group_lag_entries{queue,group}                 not yet delivered (omitted while unknown)
//	streamq_group_consumers{queue,group}                   live consumers
//	streamq_group_oldest_pending_age_seconds{queue,group}  idle time of the oldest pending entry
//	streamq_group_dead_letter_entries{queue,group}         entries in the group's dead-letter stream
//	streamq_processed_last_minute{queue}                   completions of the last complete minute (Admin.History)
//	streamq_failed_last_minute{queue}                      failed attempts of the last complete minute
//	streamq_scrape_errors_total{queue}                     failed Admin.Stats or Admin.History reads
//	streamq_scrape_duration_seconds                        time the last read took
//	streamq_key_waiting_jobs{queue,key}                    with WithTopKeys(n): the n keys with the most
//	streamq_key_running_jobs{queue,key}                    waiting jobs (Admin.TopKeys), waiting and running
//
// The level gauges ("high", "normal", "low") are exported only while the
// queue uses priority levels (Stats.Levels is not nil).
//
// Collect may be called concurrently.
type Collector struct {
	admins        []*streamq.Admin
	cacheInterval time.Duration
	timeout       time.Duration

	queueEntries, scheduled, paused, dead, canceled *prometheus.Desc
	pending, lag, consumers, oldest, groupDead      *prometheus.Desc
	processed, failed                               *prometheus.Desc
	levelEntries, levelPending                      *prometheus.Desc
	keyWaiting, keyRunning                          *prometheus.Desc
	topKeys                                         int
	scrapeDuration                                  *prometheus.Desc
	errors                                          *prometheus.CounterVec

	mu       sync.Mutex // serialises reads; guards the fields below
	readAt   time.Time
	took     time.Duration
	stats    []streamq.Stats
	statsOK  []bool
	history  []*streamq.HistoryPoint // the last complete minute; nil when unread
	keys     [][]streamq.KeyStat     // WithTopKeys: each queue's top keys
	hasReads bool
}

// NewCollector returns a Collector of the queues admins manage. It panics
// on a negative option value, like prometheus's own constructors.
func NewCollector(admins []*streamq.Admin, opts ...CollectorOption) *Collector {
	c := &Collector{admins: admins, cacheInterval: DefaultCacheInterval, timeout: DefaultScrapeTimeout}
	for _, o := range opts {
		o(c)
	}
	if c.cacheInterval < 0 || c.timeout <= 0 {
		panic(fmt.Sprintf("streamqprom: invalid options: cache interval %v (must be >= 0), scrape timeout %v (must be > 0)", c.cacheInterval, c.timeout))
	}
	q := []string{"queue"}
	qg := []string{"queue", "group"}
	c.queueEntries = prometheus.NewDesc("streamq_queue_entries", "Entries in the queue's stream.", q, nil)
	c.scheduled = prometheus.NewDesc("streamq_queue_scheduled_entries", "Delayed jobs and retries waiting in the queue's schedule.", q, nil)
	c.paused = prometheus.NewDesc("streamq_queue_paused", "1 while the queue is paused, else 0.", q, nil)
	c.dead = prometheus.NewDesc("streamq_dead_letter_entries", "Entries in the queue's dead-letter stream.", q, nil)
	c.canceled = prometheus.NewDesc("streamq_requests_canceled_total", "Requests cancelled by Admin.Cancel since the queue was created.", q, nil)
	c.pending = prometheus.NewDesc("streamq_group_pending_entries", "Entries delivered to the group and not yet acknowledged.", qg, nil)
	c.lag = prometheus.NewDesc("streamq_group_lag_entries", "Entries not yet delivered to the group.", qg, nil)
	c.consumers = prometheus.NewDesc("streamq_group_consumers", "Live consumers of the group.", qg, nil)
	c.oldest = prometheus.NewDesc("streamq_group_oldest_pending_age_seconds", "Idle time of the group's longest-idle pending entry.", qg, nil)
	c.groupDead = prometheus.NewDesc("streamq_group_dead_letter_entries", "Entries in the group's dead-letter stream.", qg, nil)
	c.processed = prometheus.NewDesc("streamq_processed_last_minute", "Completions (outcomes and retries scheduled) of the last complete minute, over every consumer.", q, nil)
	c.failed = prometheus.NewDesc("streamq_failed_last_minute", "Failed attempts (retries scheduled and dead letters) of the last complete minute, over every consumer.", q, nil)
	ql := []string{"queue", "priority"}
	c.levelEntries = prometheus.NewDesc("streamq_level_entries", "Entries in the streams of the priority level (exported while the queue uses levels).", ql, nil)
	c.levelPending = prometheus.NewDesc("streamq_level_pending_entries", "Entries of the priority level delivered to a group and not yet acknowledged, over the groups.", ql, nil)
	qk := []string{"queue", "key"}
	c.keyWaiting = prometheus.NewDesc("streamq_key_waiting_jobs", "Jobs of the key waiting for its turn (fair queuing; the top keys by waiting jobs, WithTopKeys).", qk, nil)
	c.keyRunning = prometheus.NewDesc("streamq_key_running_jobs", "Jobs of the key in the stream, read ahead or running (its slots; the top keys, WithTopKeys).", qk, nil)
	c.scrapeDuration = prometheus.NewDesc("streamq_scrape_duration_seconds", "Time the last read of the queues' statistics took.", nil, nil)
	c.errors = prometheus.NewCounterVec(prometheus.CounterOpts{Name: "streamq_scrape_errors_total",
		Help: "Reads of a queue's statistics that failed."}, q)
	for _, a := range admins {
		c.errors.WithLabelValues(a.Queue()) // exported as 0 from the start
	}
	return c
}

// Describe implements prometheus.Collector.
func (c *Collector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{c.queueEntries, c.scheduled, c.paused, c.dead, c.canceled, c.pending, c.lag,
		c.consumers, c.oldest, c.groupDead, c.processed, c.failed, c.levelEntries, c.levelPending, c.keyWaiting, c.keyRunning, c.scrapeDuration} {
		ch <- d
	}
	c.errors.Describe(ch)
}

// Collect implements prometheus.Collector.
func (c *Collector) Collect(ch chan<- prometheus.Metric) {
	stats, ok, hist, took := c.read()
	c.mu.Lock()
	keys := c.keys
	c.mu.Unlock()
	for i, a := range c.admins {
		if i < len(keys) {
			for _, k := range keys[i] {
				ch <- prometheus.MustNewConstMetric(c.keyWaiting, prometheus.GaugeValue, float64(k.Waiting), a.Queue(), k.Key)
				ch <- prometheus.MustNewConstMetric(c.keyRunning, prometheus.GaugeValue, float64(k.Running), a.Queue(), k.Key)
			}
		}
		if h := hist[i]; h != nil {
			ch <- prometheus.MustNewConstMetric(c.processed, prometheus.GaugeValue, float64(h.Processed), a.Queue())
			ch <- prometheus.MustNewConstMetric(c.failed, prometheus.GaugeValue, float64(h.Failed), a.Queue())
		}
		if !ok[i] {
			continue
		}
		q, st := a.Queue(), stats[i]
		gauge := func(d *prometheus.Desc, v float64, labels ...string) {
			ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, v, append([]string{q}, labels...)...)
		}
		gauge(c.queueEntries, float64(st.Length))
		gauge(c.scheduled, float64(st.Scheduled))
		gauge(c.dead, float64(st.DeadLetters))
		ch <- prometheus.MustNewConstMetric(c.canceled, prometheus.CounterValue, float64(st.Canceled), q)
		p := 0.0
		if st.Paused {
			p = 1
		}
		gauge(c.paused, p)
		for _, l := range st.Levels {
			gauge(c.levelEntries, float64(l.Length), l.Priority.String())
			gauge(c.levelPending, float64(l.Pending), l.Priority.String())
		}
		for _, g := range st.Groups {
			gauge(c.pending, float64(g.Pending), g.Name)
			if g.Lag >= 0 {
				gauge(c.lag, float64(g.Lag), g.Name)
			}
			gauge(c.consumers, float64(g.Consumers), g.Name)
			gauge(c.oldest, g.OldestPendingAge.Seconds(), g.Name)
			gauge(c.groupDead, float64(g.DeadLetters), g.Name)
		}
	}
	ch <- prometheus.MustNewConstMetric(c.scrapeDuration, prometheus.GaugeValue, took.Seconds())
	c.errors.Collect(ch)
}

// read returns the statistics and last complete minute of every queue,
// read now or within the cache interval.
func (c *Collector) read() ([]streamq.Stats, []bool, []*streamq.HistoryPoint, time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.hasReads && time.Since(c.readAt) < c.cacheInterval {
		return c.stats, c.statsOK, c.history, c.took
	}
	start := time.Now()
	ctx, cancel := context.WithTimeout(context.Background(), c.timeout)
	defer cancel()
	stats := make([]streamq.Stats, len(c.admins))
	ok := make([]bool, len(c.admins))
	hist := make([]*streamq.HistoryPoint, len(c.admins))
	keys := make([][]streamq.KeyStat, len(c.admins))
	var wg sync.WaitGroup
	for i, a := range c.admins {
		wg.Go(func() {
			st, err := a.Stats(ctx)
			if err != nil {
				c.errors.WithLabelValues(a.Queue()).Inc()
				return
			}
			stats[i], ok[i] = st, true
			// The minute before the current one: the last complete one.
			h, err := a.History(ctx, 2*time.Minute)
			if err != nil || len(h) != 2 {
				c.errors.WithLabelValues(a.Queue()).Inc()
				return
			}
			hist[i] = &h[0]
			if c.topKeys > 0 {
				if keys[i], err = a.TopKeys(ctx, c.topKeys); err != nil {
					c.errors.WithLabelValues(a.Queue()).Inc()
				}
			}
		})
	}
	wg.Wait()
	c.keys = keys
	c.stats, c.statsOK, c.history, c.readAt, c.took, c.hasReads = stats, ok, hist, time.Now(), time.Since(start), true
	return stats, ok, hist, c.took
}
