package main

import (
	"context"
	"io"
	"net"
	"net/http"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/streamq/streamq/internal/redistest"
	"github.com/streamq/streamq/streamqdash"
)

// TestServe runs the command on a free port against a real Redis, reads the
// overview, and stops it through its context.
func TestServe(t *testing.T) {
	srv := redistest.Start(t)
	ctx, cancel := context.WithCancel(context.Background())
	addrc := make(chan string, 1)
	done := make(chan error, 1)
	go func() {
		done <- run(ctx, []string{"--addr", "127.0.0.1:0", "--redis", "redis://" + srv.Addr() + "/0", "--read-only"},
			func(addr string) { addrc <- addr })
	}()
	var addr string
	select {
	case addr = <-addrc:
	case err := <-done:
		t.Fatalf("run ended: %v", err)
	}
	c := &http.Client{Timeout: 10 * time.Second}
	resp, err := c.Get("http://" + addr + "/")
	require.NoError(t, err)
	body, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	require.NoError(t, err)
	require.Equal(t, http.StatusOK, resp.StatusCode)
	require.Contains(t, string(body), "No streamq queue in this Redis yet")
	require.Contains(t, string(body), "read-only")
	cancel()
	select {
	case err := <-done:
		require.NoError(t, err)
	case <-time.After(10 * time.Second):
		t.Fatal("run did not return after its context ended")
	}
	require.Error(t, run(context.Background(), []string{"--redis", "http://x"}, nil), "a bad URL")
}

// serve runs the command with args on a free loopback port and returns its
// address; it stops when the test ends.
func serve(t *testing.T, args ...string) string {
	t.Helper()
	srv := redistest.Start(t)
	ctx, cancel := context.WithCancel(context.Background())
	addrc := make(chan string, 1)
	done := make(chan error, 1)
	args = append([]string{"--addr", "127.0.0.1:0", "--redis", "redis://" + srv.Addr() + "/0"}, args...)
	go func() { done <- run(ctx, args, func(addr string) { addrc <- addr }) }()
	select {
	case addr := <-addrc:
		t.Cleanup(func() {
			cancel()
			require.NoError(t, <-done)
		})
		return addr
	case err := <-done:
		cancel()
		t.Fatalf("run ended: %v", err)
	}
	return ""
}

// get sends GET / to addr with the Host header host and, when user is not
// "", basic auth.
func get(t *testing.T, addr, host, user, password string) int {
	t.Helper()
	req, err := http.NewRequest(http.MethodGet, "http://"+addr+"/", nil)
	require.NoError(t, err)
	req.Host = host
	if user != "" {
		req.SetBasicAuth(user, password)
	}
	resp, err := (&http.Client{Timeout: 10 * time.Second}).Do(req)
	require.NoError(t, err)
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	return resp.StatusCode
}

// TestForeignHostRefused: a request whose Host header names another host
// (a page of that host rebound to the loopback address by its DNS) is
// refused; the listen address, localhost and --allow-host are answered.
func TestForeignHostRefused(t *testing.T) {
	addr := serve(t)
	_, port, err := net.SplitHostPort(addr)
	require.NoError(t, err)
	require.Equal(t, http.StatusMisdirectedRequest, get(t, addr, "evil.example:"+port, "", ""), "a rebound name")
	require.Equal(t, http.StatusOK, get(t, addr, addr, "", ""))
	addr = serve(t, "--allow-host", "dash.example.com")
	_, port, err = net.SplitHostPort(addr)
	require.NoError(t, err)
	require.Equal(t, http.StatusMisdirectedRequest, get(t, addr, "evil.example:"+port, "", ""))
	require.Equal(t, http.StatusMisdirectedRequest, get(t, addr, "evil.example", "", ""))
	require.Equal(t, http.StatusOK, get(t, addr, addr, "", ""))
	require.Equal(t, http.StatusOK, get(t, addr, "localhost:"+port, "", ""))
	require.Equal(t, http.StatusOK, get(t, addr, "dash.example.com", "", ""))
}

// TestBasicAuth: with --basic-auth (or $STREAMQ_WEB_BASIC_AUTH) every
// request needs those credentials.
func TestBasicAuth(t *testing.T) {
	addr := serve(t, "--basic-auth", "ops:s3cret:with-colon")
	require.Equal(t, http.StatusUnauthorized, get(t, addr, addr, "", ""))
	require.Equal(t, http.StatusUnauthorized, get(t, addr, addr, "ops", "wrong"))
	require.Equal(t, http.StatusOK, get(t, addr, addr, "ops", "s3cret:with-colon"))
	t.Setenv("STREAMQ_WEB_BASIC_AUTH", "env:pw")
	addr = serve(t)
	require.Equal(t, http.StatusUnauthorized, get(t, addr, addr, "", ""))
	require.Equal(t, http.StatusOK, get(t, addr, addr, "env", "pw"))
	require.Error(t, run(context.Background(), []string{"--basic-auth", "no-colon"}, nil))
}

// TestHelpExitsZero: --help prints the usage and is no error.
func TestHelpExitsZero(t *testing.T) {
	require.NoError(t, run(context.Background(), []string{"--help"}, nil))
}

// TestServerTimeouts: the server bounds reading a request, writing a
// response and idle connections.
func TestServerTimeouts(t *testing.T) {
	srv := newServer(http.NotFoundHandler())
	require.Positive(t, srv.ReadHeaderTimeout)
	require.Positive(t, srv.ReadTimeout)
	require.Greater(t, srv.WriteTimeout, streamqdash.DefaultActionTimeout, "longer than an action may take")
	require.Positive(t, srv.IdleTimeout)
}
