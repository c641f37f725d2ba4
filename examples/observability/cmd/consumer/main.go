// Consumer handles the observability example's queue until interrupted,
// writes its spans ("process observability-example", children of the
// producer's) to stdout, and serves Prometheus metrics on /metrics.
//
//	go run ./cmd/consumer -listen 127.0.0.1:9464
package main

import (
	"context"
	"flag"
	"log"
	"net/http"
	"os"
	"os/signal"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"

	"github.com/streamq/streamq/examples/observability"
)

func main() {
	url := flag.String("redis", envOr("REDIS_URL", "redis://127.0.0.1:6379"), "Redis URL")
	listen := flag.String("listen", "127.0.0.1:9464", "address of the /metrics endpoint")
	flag.Parse()
	opts, err := redis.ParseURL(*url)
	if err != nil {
		log.Fatal(err)
	}
	rdb := redis.NewClient(opts)
	defer rdb.Close()
	inst, shutdown, err := observability.Tracing(os.Stdout)
	if err != nil {
		log.Fatal(err)
	}
	defer shutdown(context.Background())
	reg := prometheus.NewRegistry()
	go func() { log.Fatal(http.ListenAndServe(*listen, observability.MetricsHandler(reg))) }()
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	if err := observability.Consume(ctx, rdb, inst, reg); err != nil {
		log.Fatal(err)
	}
}

func envOr(k, def string) string {
	if v := os.Getenv(k); v != "" {
		return v
	}
	return def
}
