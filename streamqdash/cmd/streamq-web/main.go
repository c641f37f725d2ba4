// Command streamq-web serves the streamq dashboard (package streamqdash) on
// its own: every queue of one Redis, its jobs in every state (scheduled,
// retrying, queued, running, dead letters) with their actions, its
// consumers, a 24-hour chart, and job lookup.
//
//	go install github.com/streamq/streamq/streamqdash/cmd/streamq-web@latest
//	streamq-web --addr 127.0.0.1:8080 --redis redis://localhost:6379/0
//
// It listens on the loopback interface by default and answers only requests
// whose Host header is an IP address, localhost, the name it listens on, or
// a name given with --allow-host (so a web page whose DNS name was rebound to
// 127.0.0.1 cannot drive it). --basic-auth USER:PASSWORD (or
// $STREAMQ_WEB_BASIC_AUTH, which other users of the machine cannot read from
// the process list) requires those credentials on every request; use it
// with TLS in front (a proxy) when it is reached over a network, or put it
// behind a proxy that authenticates users, or mount streamqdash.Handler in a
// program of yours behind its own middleware.
package main

import (
	"context"
	"crypto/sha256"
	"crypto/subtle"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"strconv"
	"strings"
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
	var allowed hostList
	fs.Var(&allowed, "allow-host", "also answer requests for this host name (the name users type, e.g. behind a proxy); repeat or separate with commas")
	basicAuth := fs.String("basic-auth", "", "USER:PASSWORD every request must carry (HTTP basic auth; default $STREAMQ_WEB_BASIC_AUTH, which keeps it out of the process list)")
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return nil // the usage is printed
		}
		return err
	}
	if *basicAuth == "" {
		*basicAuth = os.Getenv("STREAMQ_WEB_BASIC_AUTH")
	}
	var user, password string
	if *basicAuth != "" {
		var ok bool
		if user, password, ok = strings.Cut(*basicAuth, ":"); !ok || user == "" || password == "" {
			return errors.New("--basic-auth (or $STREAMQ_WEB_BASIC_AUTH) must be USER:PASSWORD, both non-empty")
		}
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
	var h http.Handler = dash
	if user != "" {
		h = requireBasicAuth(h, user, password)
	}
	listenHost, _, _ := net.SplitHostPort(*addr)
	h = checkHost(h, listenHost, allowed)
	srv := newServer(h)
	errc := make(chan error, 1)
	go func() { errc <- srv.Serve(ln) }()
	log.Info("streamq-web: serving the dashboard", "url", "http://"+ln.Addr().String()+"/", "read_only", *readOnly, "basic_auth", user != "")
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

// newServer returns the HTTP server of handler h, with time limits on
// reading a request, writing a response (longer than the dashboard's
// longest action, streamqdash.DefaultActionTimeout) and idle connections.
func newServer(h http.Handler) *http.Server {
	return &http.Server{
		Handler:           h,
		ReadHeaderTimeout: 10 * time.Second,
		ReadTimeout:       30 * time.Second,
		WriteTimeout:      streamqdash.DefaultActionTimeout + 30*time.Second,
		IdleTimeout:       2 * time.Minute,
	}
}

// hostList is the value of --allow-host: host names, repeated or
// comma-separated.
type hostList []string

func (l *hostList) String() string { return strings.Join(*l, ",") }

func (l *hostList) Set(v string) error {
	for _, h := range strings.Split(v, ",") {
		if h = strings.TrimSpace(h); h != "" {
			*l = append(*l, normalHost(h))
		}
	}
	return nil
}

// normalHost lowercases a host name and drops a trailing dot.
func normalHost(h string) string { return strings.TrimSuffix(strings.ToLower(h), ".") }

// checkHost answers only requests whose Host header names this server: an IP
// address (a page cannot make a browser send one that is not its own
// origin's), localhost, the host name it listens on, or an allowed name.
// Any other name may be a page whose DNS was rebound to this address, which
// would then be same-origin with the dashboard: refused with 421.
func checkHost(next http.Handler, listenHost string, allowed []string) http.Handler {
	names := map[string]bool{"localhost": true}
	if listenHost != "" && net.ParseIP(listenHost) == nil {
		names[normalHost(listenHost)] = true
	}
	for _, a := range allowed {
		names[a] = true
	}
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		host := r.Host
		if h, _, err := net.SplitHostPort(host); err == nil {
			host = h
		}
		host = normalHost(strings.TrimSuffix(strings.TrimPrefix(host, "["), "]"))
		if net.ParseIP(host) == nil && !names[host] {
			http.Error(w, "streamq-web: this server does not answer for host "+strconv.Quote(host)+
				" (start it with --allow-host "+host+" if that is the name users reach it by)", http.StatusMisdirectedRequest)
			return
		}
		next.ServeHTTP(w, r)
	})
}

// requireBasicAuth answers only requests that carry user and password
// (HTTP basic auth), compared in constant time.
func requireBasicAuth(next http.Handler, user, password string) http.Handler {
	want := sha256.Sum256([]byte(user + ":" + password))
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		u, p, ok := r.BasicAuth()
		got := sha256.Sum256([]byte(u + ":" + p))
		if !ok || subtle.ConstantTimeCompare(got[:], want[:]) != 1 {
			w.Header().Set("WWW-Authenticate", `Basic realm="streamq", charset="UTF-8"`)
			http.Error(w, "streamq-web: log in", http.StatusUnauthorized)
			return
		}
		next.ServeHTTP(w, r)
	})
}
