// Package faultproxy is a TCP proxy on loopback that a test controls, to put
// network faults between clients and a server: it can cut every live
// connection at once, or stall them (forward nothing, close nothing) for a
// while, or lose the reply to one chosen request (the server runs it, the
// client never hears back and sees its connection drop).
//
//	p, err := faultproxy.New(server.Addr())
//	client := redis.NewClient(&redis.Options{Addr: p.Addr()})
//	...
//	p.Cut()               // every client connection drops now
//	p.Stall(3*time.Second) // every connection hangs for 3 s, then resumes
//	p.DropReplyTo([]byte("xreadgroup")) // the next XREADGROUP runs; its reply is lost
package faultproxy

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
	"sync/atomic"
	"time"
)

// dialTimeout bounds how long a new connection waits for the target.
const dialTimeout = 2 * time.Second

// Proxy forwards TCP connections from its loopback address to a target.
// Its methods are safe for concurrent use.
type Proxy struct {
	target string
	ln     net.Listener

	mu         sync.Mutex
	conns      map[*pair]struct{} // live connections
	stallUntil time.Time          // forwarding waits until then
	resumed    chan struct{}      // closed by Resume; replaced by each Stall
	closed     bool
	dropMatch  []byte        // lower case; non-nil while DropReplyTo is armed
	dropped    chan struct{} // receives one value per reply dropped

	wg sync.WaitGroup // accept loop and copy goroutines
}

// New starts a proxy to target on 127.0.0.1 with a free port.
func New(target string) (*Proxy, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, fmt.Errorf("faultproxy: listen: %w", err)
	}
	p := &Proxy{
		target:  target,
		ln:      ln,
		conns:   make(map[*pair]struct{}),
		resumed: make(chan struct{}),
		dropped: make(chan struct{}, 16),
	}
	p.wg.Add(1)
	go p.accept()
	return p, nil
}

// Addr returns the proxy's address, "127.0.0.1:port". Clients connect there.
func (p *Proxy) Addr() string { return p.ln.Addr().String() }

// Conns returns the number of live proxied connections.
func (p *Proxy) Conns() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.conns)
}

// Cut closes every live connection, on both sides, as a network failure or a
// server-side kill would. New connections are accepted as before.
func (p *Proxy) Cut() {
	p.mu.Lock()
	live := make([]*pair, 0, len(p.conns))
	for c := range p.conns {
		live = append(live, c)
	}
	p.mu.Unlock()
	for _, c := range live {
		c.close()
	}
}

// Stall stops forwarding, in both directions and on every connection
// (including those opened meanwhile), for d from now. Nothing is closed: bytes
// wait in the proxy and in the kernel's buffers, and flow again afterwards. A
// stall that is already running is extended if d ends later.
func (p *Proxy) Stall(d time.Duration) {
	p.mu.Lock()
	defer p.mu.Unlock()
	until := time.Now().Add(d)
	if !p.stalled() {
		p.resumed = make(chan struct{})
	}
	if until.After(p.stallUntil) {
		p.stallUntil = until
	}
}

// Resume ends a stall at once.
func (p *Proxy) Resume() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.stalled() {
		close(p.resumed)
	}
	p.stallUntil = time.Time{}
}

// DropReplyTo arms a one-shot fault: the next chunk a client sends that
// contains match (compared case-insensitively) is forwarded to the server as
// usual, but the server's next bytes on that connection (its reply) are
// discarded and the connection is closed on both sides. The server has run
// the request; the client sees a dropped connection, as when a reply is lost
// in the network. Arming again replaces the pattern.
func (p *Proxy) DropReplyTo(match []byte) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.dropMatch = bytes.ToLower(match)
}

// Dropped returns a channel that receives one value each time a reply was
// dropped by DropReplyTo (the request reached the server and its reply was
// discarded). It holds up to 16 unread values.
func (p *Proxy) Dropped() <-chan struct{} { return p.dropped }

// matchDrop reports whether chunk, sent by a client, is the request whose
// reply must be dropped, and disarms the fault if so.
func (p *Proxy) matchDrop(chunk []byte) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.dropMatch == nil || !bytes.Contains(bytes.ToLower(chunk), p.dropMatch) {
		return false
	}
	p.dropMatch = nil
	return true
}

// stalled reports whether a stall is running; p.mu is held.
func (p *Proxy) stalled() bool { return time.Now().Before(p.stallUntil) }

// Close stops accepting, closes every connection and waits for the proxy's
// goroutines to end. It is idempotent.
func (p *Proxy) Close() error {
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return nil
	}
	p.closed = true
	p.mu.Unlock()
	err := p.ln.Close()
	p.Cut()
	p.wg.Wait()
	p.forgetReplyCuts()
	return err
}

// waitForward blocks while a stall runs. It reports false when the
// connection closed meanwhile.
func (p *Proxy) waitForward(done <-chan struct{}) bool {
	for {
		p.mu.Lock()
		if !p.stalled() {
			p.mu.Unlock()
			return true
		}
		wait := time.Until(p.stallUntil)
		resumed := p.resumed
		p.mu.Unlock()
		t := time.NewTimer(wait)
		select {
		case <-t.C:
		case <-resumed:
		case <-done:
			t.Stop()
			return false
		}
		t.Stop()
	}
}

func (p *Proxy) accept() {
	defer p.wg.Done()
	for {
		client, err := p.ln.Accept()
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return
			}
			continue
		}
		p.wg.Add(1)
		go p.serve(client)
	}
}

// serve connects one client to the target and forwards both ways.
func (p *Proxy) serve(client net.Conn) {
	defer p.wg.Done()
	server, err := net.DialTimeout("tcp", p.target, dialTimeout)
	if err != nil {
		_ = client.Close()
		return
	}
	c := &pair{client: client, server: server, done: make(chan struct{})}
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		c.close()
		return
	}
	p.conns[c] = struct{}{}
	p.mu.Unlock()

	var wg sync.WaitGroup
	wg.Add(2)
	go func() { defer wg.Done(); p.forward(c, server, client) }()
	go func() { defer wg.Done(); p.forward(c, client, server) }()
	wg.Wait()
	p.mu.Lock()
	delete(p.conns, c)
	p.mu.Unlock()
}

// forward copies src to dst until either side fails, then closes the pair.
// Each chunk read waits out any stall before it is written.
func (p *Proxy) forward(c *pair, dst, src net.Conn) {
	defer c.close()
	buf := make([]byte, 32<<10)
	for {
		n, err := src.Read(buf)
		if n > 0 {
			if src == c.client {
				p.markReplyCut(c, buf[:n])
			} else if takeReplyCut(c) {
				return // the reply is dropped; closing the pair cuts the client
			}
			if !p.waitForward(c.done) {
				return
			}
			fromClient := src == c.client
			if !fromClient && c.dropReply.Load() {
				// The reply to the request chosen by DropReplyTo: lose it.
				select {
				case p.dropped <- struct{}{}:
				default:
				}
				return
			}
			if fromClient && p.matchDrop(buf[:n]) {
				c.dropReply.Store(true) // before the request can be answered
			}
			if _, werr := dst.Write(buf[:n]); werr != nil {
				return
			}
		}
		if err != nil {
			if errors.Is(err, io.EOF) {
				// An orderly close is forwarded like data: not during a stall.
				p.waitForward(c.done)
			}
			return
		}
	}
}

// pair is one proxied connection.
type pair struct {
	client, server net.Conn
	done           chan struct{} // closed by close
	once           sync.Once
	dropReply      atomic.Bool // the server's next bytes are dropped and the pair closed
}

func (c *pair) close() {
	c.once.Do(func() {
		close(c.done)
		_ = c.client.Close()
		_ = c.server.Close()
	})
}
