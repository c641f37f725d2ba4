// Producer sends requests to the observability example's queue and prints
// their results; its spans ("send observability-example") go to stdout.
//
//	go run ./cmd/producer -n 10
package main

import (
	"context"
	"flag"
	"log"
	"os"

	"github.com/redis/go-redis/v9"

	"github.com/streamq/streamq/examples/observability"
)

func main() {
	url := flag.String("redis", envOr("REDIS_URL", "redis://127.0.0.1:6379"), "Redis URL")
	n := flag.Int("n", 10, "requests to send")
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
	if err := observability.Produce(context.Background(), rdb, inst, *n, os.Stderr); err != nil {
		log.Fatal(err)
	}
}

func envOr(k, def string) string {
	if v := os.Getenv(k); v != "" {
		return v
	}
	return def
}
