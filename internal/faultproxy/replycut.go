package faultproxy

import (
	"bytes"
	"sync"
)

// replyCut is an armed CutReplyTo fault.
type replyCut struct {
	proxy *Proxy
	match []byte
	fired chan struct{}
	once  sync.Once
}

// replyCuts holds the faults armed by CutReplyTo, per proxy, and the
// connections they marked. It is kept beside the Proxy so that the fault is a
// separate mode of the forwarding loop.
var replyCuts struct {
	mu     sync.Mutex
	armed  map[*Proxy][]*replyCut
	marked sync.Map // *pair -> *replyCut: the reply to drop
}

// CutReplyTo arms a one-shot fault: the next request that contains match (in
// one read from the client) is forwarded to the server as usual, and then the
// server's reply to it is dropped and the connection closed on both sides.
// The server has run the command; the client sees a broken connection, as
// when the network fails between the two at the worst moment. A client that
// resends the command then runs it a second time.
//
// The returned channel is closed when the fault fired. Several faults may be
// armed at once; each fires once.
func (p *Proxy) CutReplyTo(match []byte) (fired <-chan struct{}) {
	rc := &replyCut{proxy: p, match: bytes.Clone(match), fired: make(chan struct{})}
	replyCuts.mu.Lock()
	defer replyCuts.mu.Unlock()
	if replyCuts.armed == nil {
		replyCuts.armed = make(map[*Proxy][]*replyCut)
	}
	replyCuts.armed[p] = append(replyCuts.armed[p], rc)
	return rc.fired
}

// markReplyCut is called with each chunk a client sends, before it is
// forwarded: when the chunk matches an armed fault, the fault is disarmed and
// the connection marked so that the server's next reply is dropped.
func (p *Proxy) markReplyCut(c *pair, chunk []byte) {
	replyCuts.mu.Lock()
	defer replyCuts.mu.Unlock()
	list := replyCuts.armed[p]
	for i, rc := range list {
		if bytes.Contains(chunk, rc.match) {
			replyCuts.armed[p] = append(list[:i:i], list[i+1:]...)
			replyCuts.marked.Store(c, rc)
			return
		}
	}
}

// takeReplyCut reports whether the server's reply on c must be dropped, and
// signals the fault as fired.
func takeReplyCut(c *pair) bool {
	v, ok := replyCuts.marked.LoadAndDelete(c)
	if !ok {
		return false
	}
	rc := v.(*replyCut)
	rc.once.Do(func() { close(rc.fired) })
	return true
}

// forgetReplyCuts drops the faults of p still armed or pending (on Close).
func (p *Proxy) forgetReplyCuts() {
	replyCuts.mu.Lock()
	delete(replyCuts.armed, p)
	replyCuts.mu.Unlock()
	replyCuts.marked.Range(func(k, v any) bool {
		if v.(*replyCut).proxy == p {
			replyCuts.marked.Delete(k)
		}
		return true
	})
}
