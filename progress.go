package streamq

// Progress: a handler reports values (progress.lua stores the last one and
// announces it on the completion channel as a notice of its own kind), and
// the producers' listeners hand them to the promises that asked
// (Promise.Progress). Nothing is polled, and a request whose promises never
// ask costs nothing.

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"sync"

	"github.com/streamq/streamq/internal/keys"
	"github.com/streamq/streamq/internal/scripts"
)

// MaxProgressBytes is the largest encoded progress value Message.Progress
// accepts.
const MaxProgressBytes = 64 << 10

// Progress reports the handler's progress: v, encoded with the consumer's
// codec ([]byte as is), is stored as the request's last progress value (for
// callers that attach later, and Admin.Job) and pushed to every producer
// waiting on the request (Promise.Progress). It is one Redis round trip,
// bounded by ctx; values reported one after another reach callers in that
// order (each carries the next sequence number of the request, and a
// producer drops a value older than one it has). A message whose record no
// longer names its entry (the request completed, or another consumer's copy
// runs now) stores nothing and returns nil; so does a call made after the
// handler returned (from a goroutine of its), and the handler's return
// waits for a call still running. A fan-out group's handler reports
// nothing. A nil ctx panics.
func (m *Message[Req]) Progress(ctx context.Context, v any) error {
	mustContext(ctx, "Message.Progress")
	if m.link == nil {
		return nil // built by hand (a test): nowhere to report
	}
	if st := m.st; st != nil {
		st.reports.RLock()
		defer st.reports.RUnlock()
		st.mu.Lock()
		done := st.done
		st.mu.Unlock()
		if done {
			return nil // the outcome is on its way: nothing to report to
		}
		st.reported.Store(true)
	}
	return m.link.progress(ctx, m.shard, m.ID, m.EntryID, v)
}

// progress runs progress.lua for the message (Message.Progress).
func (r *run[Req, Resp]) progress(ctx context.Context, shard int, id, entryID string, v any) error {
	if r.c.opts.Fanout || id == "" {
		return nil
	}
	b, err := encode[any](r.c.opts.Codec, v)
	if err != nil {
		return err
	}
	if len(b) > MaxProgressBytes {
		return fmt.Errorf("%w: a progress value of %d bytes, the limit is MaxProgressBytes=%d", ErrPayloadTooLarge, len(b), MaxProgressBytes)
	}
	k := r.c.shards[shard]
	// Bounded by ctx even when the connection stalls: go-redis does not
	// interrupt a call whose ctx ended (the call itself ends with its
	// ReadTimeout; its late value is stored only while the record still
	// names the entry).
	_, err = callBounded(ctx, func(ctx context.Context) (struct{}, error) {
		return struct{}{}, scripts.Progress.Run(ctx, r.c.client, []string{k.Record(id), k.Progress(id)},
			entryID, b, r.c.opts.ResultTTL.Milliseconds(), k.Channel, publishCommand(r.c.sharded), id).Err()
	})
	if err != nil {
		return fmt.Errorf("streamq: report the progress of %q: %w", id, err)
	}
	return nil
}

// parseProgressNotice splits a progress notice without its leading '~'
// ("<len>:<id><len>:<seq><len>:<value>").
func parseProgressNotice(s string) (id string, seq int64, value string, err error) {
	parts, ok := splitLengthPrefixed(s)
	if !ok || len(parts) != 3 {
		return "", 0, "", fmt.Errorf("malformed progress notice")
	}
	seq, err = strconv.ParseInt(parts[1], 10, 64)
	if err != nil || seq < 1 {
		return "", 0, "", fmt.Errorf("bad progress sequence %q", parts[1])
	}
	return parts[0], seq, parts[2], nil
}

// parseStoredProgress splits a stored progress value ("<seq>:<value>").
func parseStoredProgress(s string) (int64, string, bool) {
	n, v, ok := strings.Cut(s, ":")
	if !ok {
		return 0, "", false
	}
	seq, err := strconv.ParseInt(n, 10, 64)
	if err != nil || seq < 1 {
		return 0, "", false
	}
	return seq, v, true
}

// progressState is the progress of one request id in one producer: the
// latest value seen and the channels of the promises that asked for it.
// Created by the first Promise.Progress of the id's call; its own mutex.
type progressState struct {
	mu   sync.Mutex
	seq  int64 // of val; 0: none yet
	val  []byte
	subs []chan []byte
	// closed: the request completed; subs are closed, once no fetch runs.
	closed bool
	// fetching: a read of the stored value runs (fetchProgress); the
	// channels stay open until it lands, so a promise asking after the
	// completion gets the stored last value before its channel closes.
	fetching bool
}

// update takes value seq if it is newer than the one held, and offers it to
// every channel.
func (s *progressState) update(seq int64, v []byte) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.take(seq, v)
}

// take is update with s.mu held.
func (s *progressState) take(seq int64, v []byte) {
	if (s.closed && !s.fetching) || seq <= s.seq {
		return
	}
	s.seq, s.val = seq, v
	for _, ch := range s.subs {
		offerLatest(ch, v)
	}
}

// fetched ends a read of the stored value: it takes the value (ok), then
// closes the channels if the request completed meanwhile or before.
func (s *progressState) fetched(seq int64, v []byte, ok bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if ok {
		s.take(seq, v)
	}
	s.fetching = false
	if s.closed {
		for _, ch := range s.subs {
			close(ch)
		}
		s.subs = nil
	}
}

// offerLatest puts v in ch (capacity 1), replacing a value the receiver has
// not taken yet: a slow receiver misses intermediate values, never the last.
// Callers hold the state's mutex, so offers to one channel never interleave.
func offerLatest(ch chan []byte, v []byte) {
	select {
	case ch <- v:
		return
	default:
	}
	select {
	case <-ch:
	default:
	}
	select {
	case ch <- v:
	default:
	}
}

// subscribe returns a new channel holding the latest value, if any; it is
// closed already when the request completed.
func (s *progressState) subscribe() chan []byte {
	ch := make(chan []byte, 1)
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.seq > 0 {
		ch <- s.val
	}
	if s.closed && !s.fetching {
		close(ch)
	} else {
		s.subs = append(s.subs, ch)
	}
	return ch
}

// unsubscribe closes ch and forgets it (a released promise).
func (s *progressState) unsubscribe(ch chan []byte) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for i, c := range s.subs {
		if c == ch {
			s.subs = append(s.subs[:i], s.subs[i+1:]...)
			close(ch)
			return
		}
	}
}

// close closes every channel: the request completed (its last value stays
// in each channel's buffer). With a fetch running, fetched closes them.
func (s *progressState) close() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return
	}
	s.closed = true
	if s.fetching {
		return
	}
	for _, ch := range s.subs {
		close(ch)
	}
	s.subs = nil
}

func (s *progressState) listening() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.subs) > 0
}

// progressOf returns c's progress state, creating it (closed when c is
// resolved already). With canFetch, it reports whether the caller must read
// the stored value (fetchProgress): the state holds no value yet and no read
// runs; the state then counts the read as running.
func (w *waiters) progressOf(c *call, canFetch bool) (*progressState, bool) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if c.prog == nil {
		c.prog = &progressState{}
		select {
		case <-c.done:
			c.prog.closed = true
		default:
		}
	}
	st := c.prog
	st.mu.Lock()
	defer st.mu.Unlock()
	fetch := canFetch && st.seq == 0 && !st.fetching
	if fetch {
		st.fetching = true
	}
	return st, fetch
}

// progressListeners returns the progress states that promises listen to,
// by request id.
func (w *waiters) progressListeners() map[string]*progressState {
	w.mu.Lock()
	defer w.mu.Unlock()
	var out map[string]*progressState
	for id, c := range w.m {
		if c.prog != nil && c.prog.listening() {
			if out == nil {
				out = make(map[string]*progressState)
			}
			out[id] = c.prog
		}
	}
	return out
}

// progress hands a progress notice to id's call, when one listens.
func (w *waiters) progress(id string, seq int64, v string) {
	w.mu.Lock()
	c := w.m[id]
	var st *progressState
	if c != nil {
		st = c.prog
	}
	w.mu.Unlock()
	if st != nil {
		st.update(seq, []byte(v))
	}
}

// closedProgress is the progress channel of a promise released before it
// asked.
var closedProgress = func() chan []byte {
	ch := make(chan []byte)
	close(ch)
	return ch
}()

// promiseSource is what a promise asks of its producer: to hear completion
// notices before a caller waits for one (listenFor with the caller's ctx,
// ending early once the promise resolved or was released; listenSoon
// without waiting, for Done and Progress), and the stored progress value of
// a request whose promise asked for it late.
type promiseSource interface {
	listenFor(ctx context.Context, resolved, released <-chan struct{}) error
	listenSoon()
	fetchProgress(id string, st *progressState)
}

// fetchProgress reads id's stored progress value in a goroutine of its own
// (bounded by setupTimeout, stopped by Close) and hands it to st (fetched),
// which keeps it only if no newer value arrived meanwhile.
func (p *Producer[Req, Resp]) fetchProgress(id string, st *progressState) {
	p.setupMu.Lock()
	if p.stopping {
		p.setupMu.Unlock()
		st.fetched(0, nil, false)
		return
	}
	p.loops.Add(1)
	p.setupMu.Unlock()
	go func() {
		defer p.loops.Done()
		ctx, cancel := context.WithTimeout(p.lifetime, setupTimeout)
		defer cancel()
		seq, val, err := p.storedProgress(ctx, id)
		st.fetched(seq, val, err == nil && seq > 0)
	}()
}

// readProgress reads id's stored progress value into st.
func (p *Producer[Req, Resp]) readProgress(ctx context.Context, id string, st *progressState) error {
	seq, val, err := p.storedProgress(ctx, id)
	if err == nil && seq > 0 {
		st.update(seq, val)
	}
	return err
}

// storedProgress reads id's stored progress value; seq 0 when none parses.
func (p *Producer[Req, Resp]) storedProgress(ctx context.Context, id string) (int64, []byte, error) {
	k := p.shards[keys.ShardOf(id, len(p.shards))]
	v, err := p.client.Get(ctx, k.Progress(id)).Result()
	if err != nil {
		return 0, nil, err
	}
	seq, val, ok := parseStoredProgress(v)
	if !ok {
		return 0, nil, nil
	}
	return seq, []byte(val), nil
}

// Progress returns a channel of the request's progress values (what its
// handler passed to Message.Progress, encoded with the consumer's codec;
// []byte as is). Values are pushed over the producer's completion
// subscription, never polled. The channel holds one value, the latest: a
// receiver slower than the handler misses intermediate values, never the
// last one, and the values it receives come in the order the handler
// reported them. A promise asking while the request runs first gets the
// stored latest value (one Redis read, in the background). The channel is
// closed when the request completes (the last value stays readable) or the
// promise is released. For a request complete already, the channel gives
// the last value: the one this producer saw, else the stored one (one
// Redis read, in the background; it is kept as long as the request's
// outcome, ResultTTL), then it is closed; it is closed without a value when
// none was reported or stored. Every call returns the same channel.
func (pr *Promise[Resp]) Progress() <-chan []byte {
	pr.progOnce.Do(func() {
		if pr.src != nil {
			pr.src.listenSoon() // values are pushed over the subscription
		}
		st, fetch := pr.w.progressOf(pr.c, pr.src != nil)
		pr.prog = st
		pr.progCh = st.subscribe()
		if fetch {
			pr.src.fetchProgress(pr.id, st)
		}
	})
	return pr.progCh
}

// ProgressOf decodes a progress value received from Promise.Progress (or
// stored, as Admin.Job shows it) with q's codec (JSONCodec when q has none):
// the codec the queue's consumers encode progress with, unless their
// options set another Codec, in which case decode with that one. P is the
// type the handler passed to Message.Progress (or one its encoding decodes
// into); []byte returns the value as is:
//
//	for v := range promise.Progress() {
//		pct, err := streamq.ProgressOf[Percent](exports, v)
//		...
//	}
//
// An error names the codec's complaint: check that P matches what the
// handler reports.
func ProgressOf[P, Req, Resp any](q Queue[Req, Resp], value []byte) (P, error) {
	codec := q.codec
	if codec == nil {
		codec = JSONCodec{}
	}
	v, err := decode[P](codec, value)
	if err != nil {
		return v, fmt.Errorf("streamq: a progress value of queue %s (check that the handler passes a %T to Message.Progress, or one that decodes into it): %w", q.name, v, err)
	}
	return v, nil
}
