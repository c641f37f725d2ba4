// Overhead measures what the OpenTelemetry and Prometheus instrumentation
// costs: the same jobs produced and handled with the interceptors and
// middleware off and on, alternating rounds in one run, on a redis-server
// it starts on a loopback port (or REDIS_URL). Modes: off, prom (the
// Prometheus middleware and interceptor), otel (OpenTelemetry's), both.
// Traces are sampled always and batched to an exporter that drops them, so
// the figures are the instrumentation's, not an exporter's encoding; metrics
// are recorded and never collected.
//
//	go run ./cmd/overhead -n 20000 -rounds 3
//
// Per round it prints produce and handle throughput (jobs/s), Redis CPU per
// job (INFO cpu: used_cpu_user + used_cpu_sys) and this process's CPU per
// job (getrusage), then the medians per mode and their differences from the
// first mode's.
package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"log"
	"log/slog"
	"os"
	"runtime/pprof"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"
	"go.opentelemetry.io/otel/propagation"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"

	"github.com/streamq/streamq"
	"github.com/streamq/streamq/internal/redistest"
	"github.com/streamq/streamq/streamqotel"
	"github.com/streamq/streamq/streamqprom"
)

type result struct {
	produceRate, handleRate float64 // jobs/s
	redisUs, clientUs       float64 // CPU µs per job, produce and handle together
}

func main() {
	n := flag.Int("n", 20000, "jobs per round")
	rounds := flag.Int("rounds", 3, "rounds per mode")
	workers := flag.Int("workers", 8, "consumer workers")
	producers := flag.Int("producers", 16, "concurrent producing goroutines")
	modeList := flag.String("modes", "off,prom,otel,both", "modes to run, in this order each round")
	cpuprofile := flag.String("cpuprofile", "", "write a CPU profile of the run to this file")
	flag.Parse()
	if *cpuprofile != "" {
		f, err := os.Create(*cpuprofile)
		if err != nil {
			log.Fatal(err)
		}
		if err := pprof.StartCPUProfile(f); err != nil {
			log.Fatal(err)
		}
		defer pprof.StopCPUProfile()
	}
	ctx := context.Background()
	addr := ""
	if url := os.Getenv("REDIS_URL"); url != "" {
		o, err := redis.ParseURL(url)
		if err != nil {
			log.Fatal(err)
		}
		addr = o.Addr
	} else {
		p, err := redistest.StartProcess(ctx)
		if err != nil {
			log.Fatal(err)
		}
		defer p.Stop()
		addr = p.Addr()
	}
	rdb := redis.NewClient(&redis.Options{Addr: addr, PoolSize: 64})
	defer rdb.Close()

	tp := sdktrace.NewTracerProvider(sdktrace.WithBatcher(discard{}))
	defer tp.Shutdown(ctx)
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(sdkmetric.NewManualReader()))
	inst, err := streamqotel.New(streamqotel.WithTracerProvider(tp), streamqotel.WithMeterProvider(mp),
		streamqotel.WithPropagators(propagation.TraceContext{}))
	if err != nil {
		log.Fatal(err)
	}
	metrics := streamqprom.NewMetrics()
	prometheus.NewRegistry().MustRegister(metrics)

	modes := strings.Split(*modeList, ",")
	res := map[string][]result{}
	fmt.Println("mode  round  produce_jobs_s  handle_jobs_s  redis_cpu_us_per_job  client_cpu_us_per_job")
	for r := range *rounds {
		for _, m := range modes {
			var ics []streamq.ProduceInterceptor
			var mws []streamq.Middleware
			if m == "prom" || m == "both" {
				ics = append(ics, metrics.Interceptor())
				mws = append(mws, metrics.Middleware())
			}
			if m == "otel" || m == "both" {
				ics = append(ics, inst.Interceptor())
				mws = append(mws, inst.Middleware())
			}
			x, err := round(ctx, rdb, fmt.Sprintf("overhead-%d-%s", time.Now().UnixNano(), m), *n, *workers, *producers, ics, mws)
			if err != nil {
				log.Fatal(err)
			}
			res[m] = append(res[m], x)
			fmt.Printf("%-5s %5d  %14.0f  %13.0f  %20.1f  %21.1f\n", m, r+1, x.produceRate, x.handleRate, x.redisUs, x.clientUs)
		}
	}
	off := medians(res[modes[0]])
	for _, m := range modes {
		x := medians(res[m])
		fmt.Printf("median %-4s: produce %6.0f/s (%+5.1f%%), handle %6.0f/s (%+5.1f%%), Redis %5.1f µs/job (%+5.1f%%), client %6.1f µs/job (%+5.1f%%)\n",
			m, x.produceRate, pct(x.produceRate, off.produceRate), x.handleRate, pct(x.handleRate, off.handleRate),
			x.redisUs, pct(x.redisUs, off.redisUs), x.clientUs, pct(x.clientUs, off.clientUs))
	}
}

// discard is a span exporter that drops every span.
type discard struct{}

func (discard) ExportSpans(context.Context, []sdktrace.ReadOnlySpan) error { return nil }
func (discard) Shutdown(context.Context) error                             { return nil }

func pct(a, b float64) float64 { return (a/b - 1) * 100 }

func medians(rs []result) result {
	med := func(f func(result) float64) float64 {
		v := make([]float64, len(rs))
		for i, r := range rs {
			v[i] = f(r)
		}
		slices.Sort(v)
		return v[len(v)/2]
	}
	return result{med(func(r result) float64 { return r.produceRate }), med(func(r result) float64 { return r.handleRate }),
		med(func(r result) float64 { return r.redisUs }), med(func(r result) float64 { return r.clientUs })}
}

// round enqueues n jobs from producers goroutines, then handles them with
// one consumer, and measures both phases.
func round(ctx context.Context, rdb *redis.Client, queue string, n, workers, producers int,
	ics []streamq.ProduceInterceptor, mws []streamq.Middleware) (result, error) {
	p, err := streamq.NewProducer[string, string](rdb, queue, &streamq.ProducerOptions{Interceptors: ics})
	if err != nil {
		return result{}, err
	}
	defer p.Close()
	cpu0, err := redisCPU(ctx, rdb)
	if err != nil {
		return result{}, err
	}
	client0 := clientCPU()
	start := time.Now()
	var next atomic.Int64
	var wg sync.WaitGroup
	errs := make(chan error, producers)
	for range producers {
		wg.Go(func() {
			for i := next.Add(1); i <= int64(n); i = next.Add(1) {
				if err := p.Enqueue(ctx, "j"+strconv.FormatInt(i, 10), "payload"); err != nil {
					errs <- err
					return
				}
			}
		})
	}
	wg.Wait()
	produced := time.Since(start)
	select {
	case err := <-errs:
		return result{}, err
	default:
	}

	var handled atomic.Int64
	done := make(chan struct{})
	c, err := streamq.NewConsumer(rdb, queue, func(ctx context.Context, m *streamq.Message[string]) (string, error) {
		if handled.Add(1) == int64(n) {
			close(done)
		}
		return "", nil
	}, &streamq.ConsumerOptions{Workers: workers, DiscardResults: true, Middleware: mws,
		Logger: slogDiscard()})
	if err != nil {
		return result{}, err
	}
	runCtx, cancel := context.WithCancel(ctx)
	ran := make(chan error, 1)
	start = time.Now()
	go func() { ran <- c.Run(runCtx) }()
	select {
	case <-done:
	case <-time.After(5 * time.Minute):
		cancel()
		return result{}, fmt.Errorf("handled %d of %d jobs in 5 minutes", handled.Load(), n)
	}
	took := time.Since(start)
	cancel()
	if err := <-ran; err != nil {
		return result{}, err
	}
	cpu1, err := redisCPU(ctx, rdb)
	if err != nil {
		return result{}, err
	}
	client1 := clientCPU()
	iter := rdb.Scan(ctx, 0, "*"+queue+"*", 1000).Iterator()
	for iter.Next(ctx) {
		rdb.Unlink(ctx, iter.Val())
	}
	return result{
		produceRate: float64(n) / produced.Seconds(),
		handleRate:  float64(n) / took.Seconds(),
		redisUs:     (cpu1 - cpu0) / float64(n),
		clientUs:    float64((client1 - client0).Microseconds()) / float64(n),
	}, nil
}

// redisCPU is used_cpu_user + used_cpu_sys of INFO cpu, in microseconds.
func redisCPU(ctx context.Context, rdb *redis.Client) (float64, error) {
	info, err := rdb.Info(ctx, "cpu").Result()
	if err != nil {
		return 0, err
	}
	var us float64
	for _, line := range strings.Split(info, "\n") {
		k, v, ok := strings.Cut(strings.TrimSpace(line), ":")
		if ok && (k == "used_cpu_user" || k == "used_cpu_sys") {
			f, err := strconv.ParseFloat(v, 64)
			if err != nil {
				return 0, err
			}
			us += f * 1e6
		}
	}
	return us, nil
}

// clientCPU is this process's user + system time.
func clientCPU() time.Duration {
	var ru syscall.Rusage
	_ = syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

func slogDiscard() *slog.Logger { return slog.New(slog.NewTextHandler(io.Discard, nil)) }
