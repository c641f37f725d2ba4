// Command streamq-web serves the streamq dashboard (package streamqdash) on
// its own: every queue of one Redis, its jobs in every state (scheduled,
// retrying, queued, running, dead letters) with their actions, its
// consumers, a 24-hour chart, and job lookup.
//
//	go install github.com/streamq/streamq/streamqdash/cmd/streamq-web@latest
//	streamq-web --addr 127.0.0.1:8080 --redis redis://localhost:6379/0
//
// It has no login: it listens on the loopback interface by default. To open
// it to others, put it behind a proxy that authenticates them, or mount
// streamqdash.Handler in a program of yours behind its own middleware.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/streamq/streamq/streamqdash"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := run(ctx, os.Args[1:], nil)
	stop()
	if err != nil {
		fmt.Fprintln(os.Stderr, "streamq-web:", err)
		os.Exit(1)
	}
}

// run serves until ctx ends; ready, when not nil, gets the address it listens on.
func run(ctx context.Context, args []string, ready func(addr string)) error {
	fs := flag.NewFlagSet("streamq-web", flag.ContinueOnError)
	defURL := os.Getenv("REDIS_URL")
	if defURL == "" {
		defURL = "redis://localhost:6379/0"
	}
	addr := fs.String("addr", "127.0.0.1:8080", "address to listen on (host:port)")
	redisURL := fs.String("redis", defURL, "Redis URL: redis://[user:password@]host:port/db, rediss:// for TLS (default $REDIS_URL)")
	cluster := fs.Bool("cluster", false, "the URL names a Redis Cluster node (more as ?addr=host:port)")
	readOnly := fs.Bool("read-only", false, "show only: no requeue, purge, pause or resume")
	if err := fs.Parse(args); err != nil {
		return err
	}
	var client redis.UniversalClient
	if *cluster {
		o, err := redis.ParseClusterURL(*redisURL)
		if err != nil {
			return fmt.Errorf("--redis: %w", err)
		}
		client = redis.NewClusterClient(o)
	} else {
		o, err := redis.ParseURL(*redisURL)
		if err != nil {
			return fmt.Errorf("--redis: %w", err)
		}
		client = redis.NewClient(o)
	}
	defer client.Close()
	log := slog.New(slog.NewTextHandler(os.Stderr, nil))
	dash, err := streamqdash.New(client, &streamqdash.Options{ReadOnly: *readOnly, Logger: log})
	if err != nil {
		return err
	}
	ln, err := net.Listen("tcp", *addr)
	if err != nil {
		return err
	}
	srv := &http.Server{Handler: dash, ReadHeaderTimeout: 10 * time.Second}
	errc := make(chan error, 1)
	go func() { errc <- srv.Serve(ln) }()
	log.Info("streamq-web: serving the dashboard", "url", "http://"+ln.Addr().String()+"/", "read_only", *readOnly)
	if ready != nil {
		ready(ln.Addr().String())
	}
	select {
	case err := <-errc:
		return err
	case <-ctx.Done():
	}
	sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := srv.Shutdown(sctx); err != nil && !errors.Is(err, http.ErrServerClosed) {
		return err
	}
	return nil
}
