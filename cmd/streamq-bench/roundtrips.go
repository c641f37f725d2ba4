package main

import (
	"context"
	"errors"
	"net"
	"sync/atomic"
	"syscall"
)

// roundTrips counts the round trips of every client the benchmark hands to a
// system under test (env.client), streamq's own connections included: the
// committer's lanes clone the client's options, dialer and all, so they are
// counted too. The measuring client (env.admin) dials without it.
var roundTrips atomic.Int64

// countingDialer wraps dial so that each connection counts one round trip
// per burst of writes that follows a read (or opens the connection): go-redis
// writes a command or a whole pipeline, then reads its replies, so a burst is
// one round trip. A subscription's pushed messages are reads with no write
// and count nothing.
func countingDialer(dial func(ctx context.Context, network, addr string) (net.Conn, error)) func(ctx context.Context, network, addr string) (net.Conn, error) {
	if dial == nil {
		var d net.Dialer
		dial = d.DialContext
	}
	return func(ctx context.Context, network, addr string) (net.Conn, error) {
		c, err := dial(ctx, network, addr)
		if err != nil {
			return nil, err
		}
		return &countingConn{Conn: c, read: true}, nil
	}
}

// SyscallConn passes the socket through, as the connection it wraps does:
// go-redis's pool checks a pooled connection's health through it, and the
// committer's lanes write ahead only on a connection whose socket they can
// reach (lanes.go). Without it the benchmark would measure streamq without
// write-ahead.
func (c *countingConn) SyscallConn() (syscall.RawConn, error) {
	if sc, ok := c.Conn.(syscall.Conn); ok {
		return sc.SyscallConn()
	}
	return nil, errors.ErrUnsupported
}

// countingConn is a connection that counts its write bursts. go-redis uses
// a connection from one goroutine at a time, so read needs no lock.
type countingConn struct {
	net.Conn
	read bool // the last call was a Read (or none yet)
}

func (c *countingConn) Write(b []byte) (int, error) {
	if c.read {
		c.read = false
		roundTrips.Add(1)
	}
	return c.Conn.Write(b)
}

func (c *countingConn) Read(b []byte) (int, error) {
	c.read = true
	return c.Conn.Read(b)
}
