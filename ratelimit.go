package streamq

import (
	"context"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/streamq/streamq/internal/keys"
	"github.com/streamq/streamq/internal/scripts"
)

// RateLimit limits how many handlers all the consumers of a group start
// together: N starts per Per, spread evenly (one every Per/N), with up to
// Burst of them at once after a quiet time. It is enforced in Redis with
// GCRA on the server's clock, so consumers on any number of hosts share it.
// Give every consumer of the group the same RateLimit.
type RateLimit struct {
	// N is the number of handler starts allowed per Per. Required: at least 1.
	N int
	// Per is the period N applies to. Required: Per/N must be at least 1µs.
	Per time.Duration
	// Burst is how many starts may happen at once when the limit was not used
	// for a while: in any window of length W, at most W*N/Per + Burst
	// handlers start. Defaults to 1 (starts spread evenly); at most N.
	Burst int
}

// interval is the time between two starts at the limit (Per/N), rounded up
// to whole microseconds so that rounding never exceeds the rate.
func (l *RateLimit) interval() time.Duration {
	d := (l.Per + time.Duration(l.N) - 1) / time.Duration(l.N)
	return (d + time.Microsecond - 1).Truncate(time.Microsecond)
}

func (l *RateLimit) resolve() error {
	if l == nil {
		return nil
	}
	setDefault(&l.Burst, 1)
	switch {
	case l.N < 1:
		return optionError("RateLimit.N is %d; it must be at least 1 (set RateLimit to nil for no limit)", l.N)
	case l.Per <= 0:
		return optionError("RateLimit.Per is %v; it must be positive, e.g. time.Second", l.Per)
	case l.Per/time.Duration(l.N) < time.Microsecond:
		return optionError("RateLimit is %d per %v; at most one start per microsecond can be limited (use a longer Per or a smaller N)", l.N, l.Per)
	case l.Burst < 1 || l.Burst > l.N:
		return optionError("RateLimit.Burst is %d; it must be in 1..N (%d) (leave it 0 for 1)", l.Burst, l.N)
	}
	return nil
}

// Rate-limit tuning.
const (
	// rateHorizon is how far ahead a consumer takes tokens: the tokens usable
	// within it are granted in one call and handed to waiting workers each at
	// its time.
	rateHorizon = 100 * time.Millisecond
	// maxTokenGrant bounds the tokens one call asks for.
	maxTokenGrant = 1000
	// maxRateWait bounds a sleep for the next token, so that a changed limit
	// (or a lost key) is seen soon.
	maxRateWait = time.Second
)

// limiter hands a consumer's waiting workers the tokens of the group's shared
// rate limit. One goroutine (loop) asks Redis for as many tokens as workers
// wait, in one ratelimit.lua call, and hands each to a worker at its time.
type limiter struct {
	client   redis.UniversalClient
	key      string
	interval time.Duration
	burst    int
	log      *slog.Logger
	bg       context.Context // ends Redis calls at shutdown's hard bound
	stop     <-chan struct{} // closed after the workers ended
	done     func()

	// onGrant, for tests, sees every grant: the server's time, when the first
	// token may be used (relative to it), and the number of tokens.
	onGrant func(now time.Time, first time.Duration, n int)

	mu      sync.Mutex
	waiting int           // workers waiting for a token; guarded by mu
	wake    chan struct{} // capacity 1: "a worker started waiting"
	tokens  chan struct{} // unbuffered: one token to one waiting worker
	// queued, in a pool of several queues, counts the queue's slots that
	// will wait for a token next (nil: only waiting workers count).
	queued func() int
}

func newLimiter[Req, Resp any](r *run[Req, Resp]) *limiter {
	o := &r.c.opts
	l := &limiter{
		client:   r.c.client,
		key:      keys.RateLimit(r.c.queue, o.Group),
		interval: o.RateLimit.interval(),
		burst:    o.RateLimit.Burst,
		log:      r.c.log,
		bg:       r.bg,
		stop:     r.stopLoops,
		done:     r.loops.Done,
		onGrant:  r.c.onGrant,
		wake:     make(chan struct{}, 1),
		tokens:   make(chan struct{}),
	}
	if r.multi {
		// One worker waits at a time (mayStart): ask for the tokens of the
		// queue's slots waiting in the ring too, up to the workers.
		l.queued = func() int { return min(r.ring.queuedOf(r.queue), r.workers) }
	}
	return l
}

// What take ended with.
const (
	tokenTaken   = iota // the worker holds a token
	tokenPaused         // the queue was paused first
	tokenStopped        // ctx ended first
)

// take waits for a token until ctx ends or paused closes, and tells which
// came first. Waiting is no failure and no delivery: the entry stays leased
// meanwhile.
func (l *limiter) take(ctx context.Context, paused <-chan struct{}) int {
	l.mu.Lock()
	l.waiting++
	l.mu.Unlock()
	select {
	case l.wake <- struct{}{}:
	default:
	}
	defer func() {
		l.mu.Lock()
		l.waiting--
		l.mu.Unlock()
	}()
	select {
	case <-l.tokens:
		return tokenTaken
	case <-paused:
		return tokenPaused
	case <-ctx.Done():
		return tokenStopped
	}
}

func (l *limiter) wanted() int {
	l.mu.Lock()
	n := l.waiting
	l.mu.Unlock()
	if n > 0 && l.queued != nil {
		n += l.queued()
	}
	return min(n, maxTokenGrant)
}

// sleep waits d or until stop, and reports whether stop came first.
func (l *limiter) sleep(d time.Duration) bool {
	if d <= 0 {
		return false
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return false
	case <-l.stop:
		return true
	}
}

// loop serves waiting workers until stop closes.
func (l *limiter) loop() {
	defer l.done()
	var b backoff
	var ltat time.Time // the theoretical arrival time of this limiter's hand-outs
	for {
		want := l.wanted()
		if want == 0 {
			select {
			case <-l.wake:
				continue
			case <-l.stop:
				return
			}
		}
		sent := time.Now() // not after the server's now
		res, err := scripts.RateLimit.Run(l.bg, l.client, []string{l.key},
			l.interval.Microseconds(), l.burst, want, rateHorizon.Microseconds()).Int64Slice()
		if err == nil && len(res) != 3 {
			err = fmt.Errorf("streamq: ratelimit.lua returned %d values, want 3", len(res))
		}
		if err != nil {
			if l.bg.Err() == nil {
				l.log.WarnContext(l.bg, "streamq: taking rate-limit tokens failed; retrying", "key", l.key, "err", err)
			}
			if l.sleep(b.next()) {
				return
			}
			continue
		}
		b = backoff{}
		got, first := int(res[0]), time.Duration(res[1])*time.Microsecond
		if l.onGrant != nil {
			l.onGrant(time.UnixMicro(res[2]), first, got)
		}
		if got == 0 {
			if l.sleep(min(max(first, time.Millisecond), maxRateWait)) {
				return
			}
			continue
		}
		// The reply came after the server's now: waiting from here never
		// uses a token before its time. A token is valid until (Burst-1)
		// intervals after its time (counted from before the call, so never
		// later than on the server's clock): one used later could join the
		// tokens of the next moments, and the starts of a window W would
		// exceed W*N/Per + Burst (a pool's limiter takes tokens for slots
		// waiting in the ring, and a worker may be busy elsewhere at their
		// time). A token nobody takes in time is dropped: the rate only
		// drops.
		//
		// The consumer's own hand-outs also keep the limit on its clock
		// (ltat, GCRA as in ratelimit.lua): a token handed late, when this
		// goroutine ran late, does not let the next one follow at once.
		start := time.Now()
		late := time.Duration(l.burst-1) * l.interval
		for i := range got {
			at := first + time.Duration(i)*l.interval
			when := start.Add(at)
			if e := ltat.Add(-late); when.Before(e) {
				when = e
			}
			if l.sleep(time.Until(when)) {
				return
			}
			handed, stopped := l.offer(sent.Add(at + late))
			if stopped {
				return
			}
			if handed {
				ltat = laterOf(ltat, time.Now()).Add(l.interval)
			}
		}
	}
}

// offer hands one token to a waiting worker, trying until deadline (at
// least once, without waiting), and reports whether a worker took it and
// whether stop came first. A token nobody took is dropped.
func (l *limiter) offer(deadline time.Time) (handed, stopped bool) {
	select {
	case l.tokens <- struct{}{}:
		return true, false
	default:
	}
	d := time.Until(deadline)
	if d <= 0 {
		return false, false
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case l.tokens <- struct{}{}:
		return true, false
	case <-t.C:
		return false, false
	case <-l.stop:
		return false, true
	}
}

// laterOf returns the later of a and b.
func laterOf(a, b time.Time) time.Time {
	if a.After(b) {
		return a
	}
	return b
}

// startGate is what mayStart decided about a slot.
type startGate uint8

const (
	gateStart   startGate = iota // start it now
	gateHeld                     // its queue is paused: it went back into the ring
	gateStopped                  // Run's ctx ended
)

// mayStart decides whether a worker starts slot s now: when the queue is not
// paused and, with a RateLimit, once the worker holds a token. A paused
// queue's slot goes back into the ring (putBack), where it waits without
// holding the worker, also when the pause comes while the worker waits for
// a token (which is then dropped, as is a token that comes after the
// pause). Only while a resume is being applied (the ring already open, the
// gate not yet) does a worker wait at the gate. beforeWait runs before any
// wait.
func (r *run[Req, Resp]) mayStart(s *slot, beforeWait func()) startGate {
	for {
		if !r.pause.isOpen() {
			if r.ring.putBack(s) {
				return gateHeld
			}
			if !r.pause.wait(r.runCtx, beforeWait) {
				return gateStopped
			}
		}
		if r.limiter == nil {
			return gateStart
		}
		beforeWait()
		if r.multi {
			// One worker at a time waits for the queue's token; the others
			// take other queues' slots meanwhile.
			r.ring.addWaiting(r.queue, 1)
		}
		got := r.limiter.take(r.runCtx, r.ring.pausing(r.queue))
		if r.multi {
			r.ring.addWaiting(r.queue, -1)
		}
		switch {
		case got == tokenStopped:
			return gateStopped
		case got == tokenTaken && r.pause.isOpen():
			return gateStart
		case r.ring.putBack(s):
			return gateHeld
		}
		// Paused and resumed while the worker waited: wait again.
	}
}
