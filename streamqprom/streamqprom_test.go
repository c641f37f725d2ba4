package streamqprom_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	dto "github.com/prometheus/client_model/go"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/streamq/streamq"
	"github.com/streamq/streamq/internal/redistest"
	"github.com/streamq/streamq/streamqprom"
)

// backends runs fn on miniredis and on a real redis-server.
func backends(t *testing.T, fn func(t *testing.T, rdb *redis.Client)) {
	t.Run("miniredis", func(t *testing.T) {
		m := miniredis.RunT(t)
		rdb := redis.NewClient(&redis.Options{Addr: m.Addr()})
		t.Cleanup(func() { _ = rdb.Close() })
		fn(t, rdb)
	})
	t.Run("redis", func(t *testing.T) {
		fn(t, redistest.Start(t).Client(t))
	})
}

// TestHandlerMetricsCount: 100 jobs, 90 succeeding and 10 failing for good,
// give exactly those counts, and as many observations in each histogram.
func TestHandlerMetricsCount(t *testing.T) {
	backends(t, func(t *testing.T, rdb *redis.Client) {
		ctx := context.Background()
		q := "prom"
		m := streamqprom.NewMetrics()
		reg := prometheus.NewPedanticRegistry()
		reg.MustRegister(m)
		p, err := streamq.NewProducer[int, int](rdb, q, &streamq.ProducerOptions{Interceptors: []streamq.ProduceInterceptor{m.Interceptor()}})
		require.NoError(t, err)
		defer p.Close()
		c, err := streamq.NewConsumer(rdb, q, func(ctx context.Context, msg *streamq.Message[int]) (int, error) {
			if msg.Payload%10 == 0 {
				return 0, streamq.Permanent(errors.New("multiple of ten"))
			}
			return msg.Payload, nil
		}, &streamq.ConsumerOptions{Workers: 4, Middleware: []streamq.Middleware{m.Middleware()}})
		require.NoError(t, err)
		runCtx, cancel := context.WithCancel(ctx)
		ran := make(chan error, 1)
		go func() { ran <- c.Run(runCtx) }()
		var prs []*streamq.Promise[int]
		for i := range 100 {
			pr, err := p.Produce(ctx, fmt.Sprint(i), i)
			require.NoError(t, err)
			prs = append(prs, pr)
		}
		wctx, wcancel := context.WithTimeout(ctx, 30*time.Second)
		defer wcancel()
		for _, pr := range prs {
			_, _ = pr.Wait(wctx)
		}
		require.NoError(t, wctx.Err())
		cancel()
		require.NoError(t, <-ran)

		require.Equal(t, 90.0, testutil.ToFloat64(m.ProcessedCounter(q, streamqprom.OutcomeOK)))
		require.Equal(t, 10.0, testutil.ToFloat64(m.ProcessedCounter(q, streamqprom.OutcomeDeadLetter)))
		require.Equal(t, 0.0, testutil.ToFloat64(m.ProcessedCounter(q, streamqprom.OutcomeRetry)), "pre-set to 0")
		families, err := reg.Gather()
		require.NoError(t, err)
		counts := map[string]uint64{}
		for _, f := range families {
			for _, mm := range f.GetMetric() {
				if h := mm.GetHistogram(); h != nil {
					counts[f.GetName()] += h.GetSampleCount()
				}
				if f.GetType() == dto.MetricType_COUNTER && f.GetName() == "streamq_jobs_produced_total" {
					counts[f.GetName()] += uint64(mm.GetCounter().GetValue())
				}
				if f.GetName() == "streamq_jobs_in_flight" {
					require.Zero(t, mm.GetGauge().GetValue())
				}
			}
		}
		require.Equal(t, map[string]uint64{"streamq_job_duration_seconds": 100, "streamq_queue_wait_seconds": 100,
			"streamq_jobs_produced_total": 100}, counts)
		problems, err := testutil.CollectAndLint(m)
		require.NoError(t, err)
		require.Empty(t, problems)
	})
}

// TestCollectorEqualsStats: the queue gauges equal Admin.Stats; reads are
// cached for the interval; the metrics pass the linter.
func TestCollectorEqualsStats(t *testing.T) {
	backends(t, func(t *testing.T, rdb *redis.Client) {
		ctx := context.Background()
		q := "collected"
		p, err := streamq.NewProducer[int, int](rdb, q, nil)
		require.NoError(t, err)
		defer p.Close()
		for i := range 12 {
			require.NoError(t, p.Enqueue(ctx, fmt.Sprint(i), i))
		}
		require.NoError(t, p.Enqueue(ctx, "later", 1, streamq.After(time.Hour)))
		require.NoError(t, p.Enqueue(ctx, "dropped", 1, streamq.After(time.Hour)))
		// A consumer that takes 3 entries and stops without completing them
		// (its handler blocks until shutdown): 3 pending, 9 lag.
		started := make(chan struct{}, 3)
		c, err := streamq.NewConsumer(rdb, q, func(ctx context.Context, msg *streamq.Message[int]) (int, error) {
			started <- struct{}{}
			<-ctx.Done()
			return 0, ctx.Err()
		}, &streamq.ConsumerOptions{Workers: 3, Prefetch: 3, ShutdownTimeout: 10 * time.Millisecond, ReadBlock: 10 * time.Millisecond})
		require.NoError(t, err)
		runCtx, cancel := context.WithCancel(ctx)
		ran := make(chan error, 1)
		go func() { ran <- c.Run(runCtx) }()
		for range 3 {
			<-started
		}

		a, err := streamq.NewAdmin(rdb, q, nil)
		require.NoError(t, err)
		require.NoError(t, a.Cancel(ctx, "dropped"))
		col := streamqprom.NewCollector([]*streamq.Admin{a}, streamqprom.WithCacheInterval(time.Hour))
		reg := prometheus.NewPedanticRegistry()
		reg.MustRegister(col)
		st, err := a.Stats(ctx)
		require.NoError(t, err)
		require.Len(t, st.Groups, 1)
		g := st.Groups[0]
		expected := fmt.Sprintf(`
# HELP streamq_dead_letter_entries Entries in the queue's dead-letter stream.
# TYPE streamq_dead_letter_entries gauge
streamq_dead_letter_entries{queue="%[1]s"} %[2]d
# HELP streamq_group_consumers Live consumers of the group.
# TYPE streamq_group_consumers gauge
streamq_group_consumers{group="streamq",queue="%[1]s"} %[3]d
# HELP streamq_group_dead_letter_entries Entries in the group's dead-letter stream.
# TYPE streamq_group_dead_letter_entries gauge
streamq_group_dead_letter_entries{group="streamq",queue="%[1]s"} %[2]d
# HELP streamq_failed_last_minute Failed attempts (retries scheduled and dead letters) of the last complete minute, over every consumer.
# TYPE streamq_failed_last_minute gauge
streamq_failed_last_minute{queue="%[1]s"} 0
# HELP streamq_processed_last_minute Completions (outcomes and retries scheduled) of the last complete minute, over every consumer.
# TYPE streamq_processed_last_minute gauge
streamq_processed_last_minute{queue="%[1]s"} 0
# HELP streamq_group_lag_entries Entries not yet delivered to the group.
# TYPE streamq_group_lag_entries gauge
streamq_group_lag_entries{group="streamq",queue="%[1]s"} %[4]d
# HELP streamq_group_pending_entries Entries delivered to the group and not yet acknowledged.
# TYPE streamq_group_pending_entries gauge
streamq_group_pending_entries{group="streamq",queue="%[1]s"} %[5]d
# HELP streamq_queue_entries Entries in the queue's stream.
# TYPE streamq_queue_entries gauge
streamq_queue_entries{queue="%[1]s"} %[6]d
# HELP streamq_queue_paused 1 while the queue is paused, else 0.
# TYPE streamq_queue_paused gauge
streamq_queue_paused{queue="%[1]s"} 0
# HELP streamq_queue_scheduled_entries Delayed jobs and retries waiting in the queue's schedule.
# TYPE streamq_queue_scheduled_entries gauge
streamq_queue_scheduled_entries{queue="%[1]s"} %[7]d
# HELP streamq_requests_canceled_total Requests cancelled by Admin.Cancel since the queue was created.
# TYPE streamq_requests_canceled_total counter
streamq_requests_canceled_total{queue="%[1]s"} %[8]d
# HELP streamq_scrape_errors_total Reads of a queue's statistics that failed.
# TYPE streamq_scrape_errors_total counter
streamq_scrape_errors_total{queue="%[1]s"} 0
`, q, st.DeadLetters, g.Consumers, g.Lag, g.Pending, st.Length, st.Scheduled, st.Canceled)
		require.EqualValues(t, 12, st.Length)
		require.EqualValues(t, 1, st.Scheduled)
		require.EqualValues(t, 1, st.Canceled)
		require.EqualValues(t, 3, g.Pending)
		// g.Lag is 9 on Redis; miniredis reports lag its own way. The gauge
		// must equal whatever Stats says.
		// Nothing completed, so the last minute's history is 0.
		names := []string{"streamq_dead_letter_entries", "streamq_group_consumers", "streamq_group_lag_entries",
			"streamq_group_dead_letter_entries", "streamq_processed_last_minute", "streamq_failed_last_minute",
			"streamq_group_pending_entries", "streamq_queue_entries", "streamq_queue_paused",
			"streamq_queue_scheduled_entries", "streamq_requests_canceled_total", "streamq_scrape_errors_total"}
		require.NoError(t, testutil.GatherAndCompare(reg, strings.NewReader(expected), names...))

		// Cached: a new entry is not seen until the interval has passed.
		require.NoError(t, p.Enqueue(ctx, "extra", 1))
		require.NoError(t, testutil.GatherAndCompare(reg, strings.NewReader(expected), names...))
		fresh := streamqprom.NewCollector([]*streamq.Admin{a}, streamqprom.WithCacheInterval(0))
		require.Equal(t, 13.0, gaugeValue(t, fresh, "streamq_queue_entries"))

		problems, err := testutil.CollectAndLint(col)
		require.NoError(t, err)
		require.Empty(t, problems)
		cancel()
		require.NoError(t, <-ran)
	})
}

func gaugeValue(t *testing.T, c prometheus.Collector, name string) float64 {
	reg := prometheus.NewRegistry()
	reg.MustRegister(c)
	families, err := reg.Gather()
	require.NoError(t, err)
	for _, f := range families {
		if f.GetName() == name {
			return f.GetMetric()[0].GetGauge().GetValue()
		}
	}
	t.Fatalf("no metric %s", name)
	return 0
}

// TestCollectorLastMinute: the last-minute gauges are the history's minute
// before the current one (written here as the completion scripts write it:
// processed + failed<<32 in the hour's hash).
func TestCollectorLastMinute(t *testing.T) {
	backends(t, func(t *testing.T, rdb *redis.Client) {
		ctx := context.Background()
		q := fmt.Sprintf("hist-%d", time.Now().UnixNano())
		p, err := streamq.NewProducer[int, int](rdb, q, nil)
		require.NoError(t, err)
		defer p.Close()
		require.NoError(t, p.Enqueue(ctx, "x", 1))
		prev := time.Now().Truncate(time.Minute).Add(-time.Minute)
		key := fmt.Sprintf("streamq:{%s}:hist:%d", q, prev.Unix()/3600)
		require.NoError(t, rdb.HIncrBy(ctx, key, fmt.Sprint(prev.Minute()), 7+3<<32).Err())
		a, err := streamq.NewAdmin(rdb, q, nil)
		require.NoError(t, err)
		col := streamqprom.NewCollector([]*streamq.Admin{a}, streamqprom.WithCacheInterval(0))
		processed := gaugeValue(t, col, "streamq_processed_last_minute")
		failed := gaugeValue(t, col, "streamq_failed_last_minute")
		if !time.Now().Truncate(time.Minute).Add(-time.Minute).Equal(prev) {
			t.Skip("a minute began while reading; the written minute is no longer the last complete one")
		}
		require.Equal(t, 7.0, processed)
		require.Equal(t, 3.0, failed)
	})
}

// TestCollectorLevels: the level gauges equal Stats.Levels (entries and
// pending per level, one of them held by a consumer), and are absent from a
// queue that uses no priority levels.
func TestCollectorLevels(t *testing.T) {
	backends(t, func(t *testing.T, rdb *redis.Client) {
		ctx := context.Background()
		p, err := streamq.NewProducer[int, int](rdb, "leveled", nil)
		require.NoError(t, err)
		defer p.Close()
		plain, err := streamq.NewProducer[int, int](rdb, "plain", nil)
		require.NoError(t, err)
		defer plain.Close()
		require.NoError(t, plain.Enqueue(ctx, "x", 1))
		for i := range 3 {
			require.NoError(t, p.Enqueue(ctx, fmt.Sprint("h", i), i, streamq.Priority(streamq.PriorityHigh)))
		}
		require.NoError(t, p.Enqueue(ctx, "n", 1))
		for i := range 2 {
			require.NoError(t, p.Enqueue(ctx, fmt.Sprint("l", i), i, streamq.Priority(streamq.PriorityLow)))
		}
		// One entry held by a consumer: pending on its level.
		started := make(chan struct{}, 1)
		c, err := streamq.NewConsumer(rdb, "leveled", func(ctx context.Context, msg *streamq.Message[int]) (int, error) {
			started <- struct{}{}
			<-ctx.Done()
			return 0, ctx.Err()
		}, &streamq.ConsumerOptions{Workers: 1, Prefetch: 1, ShutdownTimeout: 10 * time.Millisecond, ReadBlock: 10 * time.Millisecond})
		require.NoError(t, err)
		runCtx, cancel := context.WithCancel(ctx)
		ran := make(chan error, 1)
		go func() { ran <- c.Run(runCtx) }()
		<-started

		a, err := streamq.NewAdmin(rdb, "leveled", nil)
		require.NoError(t, err)
		ap, err := streamq.NewAdmin(rdb, "plain", nil)
		require.NoError(t, err)
		st, err := a.Stats(ctx)
		require.NoError(t, err)
		require.Len(t, st.Levels, 3)
		var pending int64
		var b strings.Builder
		b.WriteString("# HELP streamq_level_entries Entries in the streams of the priority level (exported while the queue uses levels).\n# TYPE streamq_level_entries gauge\n")
		for _, l := range st.Levels {
			fmt.Fprintf(&b, "streamq_level_entries{priority=%q,queue=\"leveled\"} %d\n", l.Priority.String(), l.Length)
		}
		b.WriteString("# HELP streamq_level_pending_entries Entries of the priority level delivered to a group and not yet acknowledged, over the groups.\n# TYPE streamq_level_pending_entries gauge\n")
		for _, l := range st.Levels {
			fmt.Fprintf(&b, "streamq_level_pending_entries{priority=%q,queue=\"leveled\"} %d\n", l.Priority.String(), l.Pending)
			pending += l.Pending
		}
		require.EqualValues(t, []int64{3, 1, 2}, []int64{st.Levels[0].Length, st.Levels[1].Length, st.Levels[2].Length})
		require.EqualValues(t, 1, pending, "the held entry is pending on its level")
		col := streamqprom.NewCollector([]*streamq.Admin{a, ap}, streamqprom.WithCacheInterval(time.Hour))
		reg := prometheus.NewPedanticRegistry()
		reg.MustRegister(col)
		require.NoError(t, testutil.GatherAndCompare(reg, strings.NewReader(b.String()), "streamq_level_entries", "streamq_level_pending_entries"))
		problems, err := testutil.CollectAndLint(col)
		require.NoError(t, err)
		require.Empty(t, problems)
		cancel()
		require.NoError(t, <-ran)
	})
}

// TestProducedCountsAFlowPerQueue: a flow whose children are on another
// queue counts each request on its own queue.
func TestProducedCountsAFlowPerQueue(t *testing.T) {
	m := miniredis.RunT(t)
	rdb := redis.NewClient(&redis.Options{Addr: m.Addr()})
	t.Cleanup(func() { _ = rdb.Close() })
	metrics := streamqprom.NewMetrics()
	reg := prometheus.NewPedanticRegistry()
	reg.MustRegister(metrics)
	parent, child := streamq.NewQueue[int, int]("flowparent"), streamq.NewQueue[int, int]("flowchild")
	p, err := parent.NewProducer(rdb, &streamq.ProducerOptions{Interceptors: []streamq.ProduceInterceptor{metrics.Interceptor()}})
	require.NoError(t, err)
	defer p.Close()
	_, err = p.ProduceFlow(context.Background(), "p", 0, []streamq.Child{
		streamq.ChildOf(child, "c1", 1), streamq.ChildOf(child, "c2", 2), streamq.ChildOf(parent, "c3", 3),
	}, nil)
	require.NoError(t, err)
	require.NoError(t, testutil.GatherAndCompare(reg, strings.NewReader(`
# HELP streamq_jobs_produced_total Requests produced, by outcome: ok, error.
# TYPE streamq_jobs_produced_total counter
streamq_jobs_produced_total{outcome="ok",queue="flowchild"} 2
streamq_jobs_produced_total{outcome="ok",queue="flowparent"} 2
`), "streamq_jobs_produced_total"))
}

// TestCollectorTopKeys: with WithTopKeys, the keys with the most waiting
// jobs are exported with their waiting and running jobs; without it, no key
// gauge is.
func TestCollectorTopKeys(t *testing.T) {
	backends(t, func(t *testing.T, rdb *redis.Client) {
		ctx := context.Background()
		a, err := streamq.NewAdmin(rdb, "keyed", nil)
		require.NoError(t, err)
		require.NoError(t, a.PauseKey(ctx, "big"))
		p, err := streamq.NewProducer[int, int](rdb, "keyed", nil)
		require.NoError(t, err)
		defer p.Close()
		for i := range 4 {
			require.NoError(t, p.Enqueue(ctx, fmt.Sprint("b", i), i, streamq.Key("big")))
		}
		require.NoError(t, p.Enqueue(ctx, "s", 1, streamq.Key("small")))
		want := `# HELP streamq_key_running_jobs Jobs of the key in the stream, read ahead or running (its slots; the top keys, WithTopKeys).
# TYPE streamq_key_running_jobs gauge
streamq_key_running_jobs{key="big",queue="keyed"} 0
streamq_key_running_jobs{key="small",queue="keyed"} 1
# HELP streamq_key_waiting_jobs Jobs of the key waiting for its turn (fair queuing; the top keys by waiting jobs, WithTopKeys).
# TYPE streamq_key_waiting_jobs gauge
streamq_key_waiting_jobs{key="big",queue="keyed"} 4
streamq_key_waiting_jobs{key="small",queue="keyed"} 0
`
		reg := prometheus.NewPedanticRegistry()
		require.NoError(t, reg.Register(streamqprom.NewCollector([]*streamq.Admin{a}, streamqprom.WithTopKeys(5))))
		require.NoError(t, testutil.GatherAndCompare(reg, strings.NewReader(want), "streamq_key_waiting_jobs", "streamq_key_running_jobs"))
		plain := prometheus.NewPedanticRegistry()
		require.NoError(t, plain.Register(streamqprom.NewCollector([]*streamq.Admin{a})))
		n, err := testutil.GatherAndCount(plain, "streamq_key_waiting_jobs")
		require.NoError(t, err)
		require.Zero(t, n)
	})
}
