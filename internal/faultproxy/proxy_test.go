package faultproxy

import (
	"bufio"
	"errors"
	"io"
	"net"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// echoServer accepts connections and echoes every line back, until the test ends.
func echoServer(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	var wg sync.WaitGroup
	var mu sync.Mutex
	var conns []net.Conn
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			conns = append(conns, c)
			mu.Unlock()
			wg.Add(1)
			go func() {
				defer wg.Done()
				_, _ = io.Copy(c, c)
				_ = c.Close()
			}()
		}
	}()
	t.Cleanup(func() {
		_ = ln.Close()
		mu.Lock()
		for _, c := range conns {
			_ = c.Close()
		}
		mu.Unlock()
		wg.Wait()
	})
	return ln.Addr().String()
}

func newProxy(t *testing.T, target string) *Proxy {
	t.Helper()
	p, err := New(target)
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, p.Close()) })
	return p
}

type client struct {
	net.Conn
	r *bufio.Reader
}

func dial(t *testing.T, p *Proxy) *client {
	t.Helper()
	c, err := net.Dial("tcp", p.Addr())
	require.NoError(t, err)
	t.Cleanup(func() { _ = c.Close() })
	return &client{Conn: c, r: bufio.NewReader(c)}
}

// roundTrip sends a line and reads it back, within a generous deadline.
func (c *client) roundTrip(t *testing.T, line string) {
	t.Helper()
	require.NoError(t, c.SetDeadline(time.Now().Add(10*time.Second)))
	_, err := io.WriteString(c, line+"\n")
	require.NoError(t, err)
	got, err := c.r.ReadString('\n')
	require.NoError(t, err)
	require.Equal(t, line+"\n", got)
}

// waitConns waits until the proxy counts n live connections.
func waitConns(t *testing.T, p *Proxy, n int) {
	t.Helper()
	require.Eventually(t, func() bool { return p.Conns() == n }, 10*time.Second, 5*time.Millisecond,
		"want %d live connections", n)
}

func TestForwardsBothWays(t *testing.T) {
	p := newProxy(t, echoServer(t))
	require.Contains(t, p.Addr(), "127.0.0.1:")
	a, b := dial(t, p), dial(t, p)
	a.roundTrip(t, "hello")
	b.roundTrip(t, "world")
	waitConns(t, p, 2)
	big := make([]byte, 200<<10) // more than one copy buffer
	for i := range big {
		big[i] = 'a' + byte(i%26)
	}
	a.roundTrip(t, string(big))
}

func TestCutClosesLiveConnectionsOnly(t *testing.T) {
	p := newProxy(t, echoServer(t))
	a, b := dial(t, p), dial(t, p)
	a.roundTrip(t, "one")
	b.roundTrip(t, "two")
	waitConns(t, p, 2)

	p.Cut()
	for _, c := range []*client{a, b} {
		require.NoError(t, c.SetReadDeadline(time.Now().Add(10*time.Second)))
		_, err := c.r.ReadString('\n')
		require.Error(t, err)
		var ne net.Error
		require.False(t, errors.As(err, &ne) && ne.Timeout(), "the connection must be closed, not idle: %v", err)
	}
	waitConns(t, p, 0)

	c := dial(t, p) // new connections still work
	c.roundTrip(t, "after the cut")
}

func TestStallHoldsDataWithoutClosing(t *testing.T) {
	p := newProxy(t, echoServer(t))
	a := dial(t, p)
	a.roundTrip(t, "before")

	p.Stall(time.Hour)
	_, err := io.WriteString(a, "held\n")
	require.NoError(t, err)
	// Nothing may come back while stalled. This can only be observed for a
	// while; the read must time out rather than fail or return data.
	require.NoError(t, a.SetReadDeadline(time.Now().Add(300*time.Millisecond)))
	_, err = a.r.ReadString('\n')
	require.ErrorIs(t, err, os.ErrDeadlineExceeded)

	// A connection opened during the stall is accepted but forwards nothing either.
	b := dial(t, p)
	_, err = io.WriteString(b, "late\n")
	require.NoError(t, err)
	require.NoError(t, b.SetReadDeadline(time.Now().Add(100*time.Millisecond)))
	_, err = b.r.ReadString('\n')
	require.ErrorIs(t, err, os.ErrDeadlineExceeded)

	p.Resume()
	for c, want := range map[*client]string{a: "held\n", b: "late\n"} {
		require.NoError(t, c.SetReadDeadline(time.Now().Add(10*time.Second)))
		got, err := c.r.ReadString('\n')
		require.NoError(t, err)
		require.Equal(t, want, got)
	}
	a.roundTrip(t, "after")
}

func TestStallEndsByItself(t *testing.T) {
	p := newProxy(t, echoServer(t))
	a := dial(t, p)
	a.roundTrip(t, "before")

	const d = 200 * time.Millisecond
	start := time.Now()
	p.Stall(d)
	a.roundTrip(t, "through the stall")
	require.GreaterOrEqual(t, time.Since(start), d, "data crossed a stall before it ended")
	p.Resume() // no stall running: harmless
	a.roundTrip(t, "after")
}

func TestCutDuringStall(t *testing.T) {
	p := newProxy(t, echoServer(t))
	a := dial(t, p)
	a.roundTrip(t, "before")
	p.Stall(time.Hour)
	_, err := io.WriteString(a, "held\n")
	require.NoError(t, err)
	p.Cut()
	require.NoError(t, a.SetReadDeadline(time.Now().Add(10*time.Second)))
	_, err = a.r.ReadString('\n')
	require.Error(t, err)
	require.NotErrorIs(t, err, os.ErrDeadlineExceeded)
	waitConns(t, p, 0)
	p.Resume()
}

func TestTargetDownClosesClient(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	target := ln.Addr().String()
	require.NoError(t, ln.Close()) // nothing listens there now
	p := newProxy(t, target)
	c := dial(t, p)
	require.NoError(t, c.SetReadDeadline(time.Now().Add(10*time.Second)))
	_, err = c.r.ReadString('\n')
	require.Error(t, err)
	require.NotErrorIs(t, err, os.ErrDeadlineExceeded)
}

func TestClose(t *testing.T) {
	p, err := New(echoServer(t))
	require.NoError(t, err)
	a := dial(t, p)
	a.roundTrip(t, "before")
	p.Stall(time.Hour) // Close must not wait for a stall
	require.NoError(t, p.Close())
	require.NoError(t, p.Close())
	require.NoError(t, a.SetReadDeadline(time.Now().Add(10*time.Second)))
	_, err = a.r.ReadString('\n')
	require.Error(t, err)
	require.NotErrorIs(t, err, os.ErrDeadlineExceeded)
	_, err = net.DialTimeout("tcp", p.Addr(), time.Second)
	require.Error(t, err)
}

func TestCutReplyToForwardsTheRequestAndDropsTheReply(t *testing.T) {
	var got []string
	var mu sync.Mutex
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			wg.Add(1)
			go func() {
				defer wg.Done()
				defer c.Close()
				r := bufio.NewReader(c)
				for {
					line, err := r.ReadString('\n')
					if err != nil {
						return
					}
					mu.Lock()
					got = append(got, line)
					mu.Unlock()
					if _, err := c.Write([]byte("ok " + line)); err != nil {
						return
					}
				}
			}()
		}
	}()
	t.Cleanup(func() { _ = ln.Close(); wg.Wait() })
	p := newProxy(t, ln.Addr().String())
	fired := p.CutReplyTo([]byte("second"))

	c, err := net.Dial("tcp", p.Addr())
	require.NoError(t, err)
	defer c.Close()
	r := bufio.NewReader(c)
	_, err = c.Write([]byte("first\n"))
	require.NoError(t, err)
	line, err := r.ReadString('\n')
	require.NoError(t, err)
	require.Equal(t, "ok first\n", line)
	_, err = c.Write([]byte("second\n"))
	require.NoError(t, err)
	_, err = r.ReadString('\n')
	require.ErrorIs(t, err, io.EOF, "the reply is dropped and the connection closed")
	<-fired
	mu.Lock()
	require.Equal(t, []string{"first\n", "second\n"}, got, "the server received the request")
	mu.Unlock()

	// The fault fired once: a new connection works.
	c2, err := net.Dial("tcp", p.Addr())
	require.NoError(t, err)
	defer c2.Close()
	_, err = c2.Write([]byte("second\n"))
	require.NoError(t, err)
	line, err = bufio.NewReader(c2).ReadString('\n')
	require.NoError(t, err)
	require.Equal(t, "ok second\n", line)
}

func TestDropReplyToLosesOneReplyAfterForwarding(t *testing.T) {
	server := echoServer(t)
	p := newProxy(t, server)
	c := dial(t, p)
	c.roundTrip(t, "before")
	p.DropReplyTo([]byte("LOSE-ME"))
	require.NoError(t, c.SetDeadline(time.Now().Add(10*time.Second)))
	_, err := io.WriteString(c, "please lose-me\n")
	require.NoError(t, err)
	// The echo server got the line (it answered), but the reply never arrives:
	// the connection drops instead.
	_, err = c.r.ReadString('\n')
	require.Error(t, err)
	select {
	case <-p.Dropped():
	case <-time.After(10 * time.Second):
		t.Fatal("no drop reported")
	}
	// One-shot: a new connection is unaffected.
	dial(t, p).roundTrip(t, "lose-me again")
}
