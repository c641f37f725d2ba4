// Command streamq inspects and repairs streamq queues in Redis: queues and
// their statistics, consumers and whether they are live, dead letters (list,
// show, requeue, purge), one request id's status, forgetting an id, pausing
// and resuming a queue, trimming.
//
//	go install github.com/streamq/streamq/cmd/streamq@latest
//	streamq --redis redis://localhost:6379/0 queues
//	streamq --help
//
// Every read command takes --json; commands that delete need --yes. Exit
// codes: 0 ok, 1 error, 2 wrong usage, 3 not found. It uses only streamq's
// public API (Queues, Admin); "streamq queues" finds queues with SCAN, which
// costs O(keyspace). README.md in this directory lists the commands.
package main

import (
	"context"
	"os"
	"os/signal"
	"syscall"

	"github.com/redis/go-redis/v9"

	"github.com/streamq/streamq/internal/cli"
)

// quiet drops go-redis's log lines ("pool.go: failed to dial..."): the
// command reports every failure itself, once, in its own words.
type quiet struct{}

func (quiet) Printf(context.Context, string, ...any) {}

func main() {
	redis.SetLogger(quiet{})
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := cli.Main(ctx, os.Args[1:], os.Stdout, os.Stderr, os.Getenv)
	stop()
	os.Exit(code)
}
