package streamq

import (
	"context"
	"errors"
	"strconv"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/streamq/streamq/internal/keys"
)

// PauseCheckInterval is how often a running consumer reads whether its queue
// is paused: consumers stop starting handlers within about this long after
// Admin.Pause returns (plus one round trip), and start again as soon after
// Admin.Resume. One GET per interval per consumer, whatever the job rate.
const PauseCheckInterval = 500 * time.Millisecond

// pausedSince reads the queue's pause key: whether it exists, and since
// when (the zero time when its value is no unix time in milliseconds).
func pausedSince(ctx context.Context, client redis.UniversalClient, queue string) (time.Time, bool, error) {
	v, err := client.Get(ctx, keys.Paused(queue)).Result()
	switch {
	case errors.Is(err, redis.Nil):
		return time.Time{}, false, nil
	case err != nil:
		return time.Time{}, false, err
	}
	ms, err := strconv.ParseInt(v, 10, 64)
	if err != nil {
		return time.Time{}, true, nil // the key's presence pauses
	}
	return time.UnixMilli(ms), true, nil
}

// pauseGate holds workers while the queue is paused. Its state comes from
// the pause watcher (watchPause); until the first successful read it is
// closed, so that a consumer started on a paused queue starts nothing.
type pauseGate struct {
	mu     sync.Mutex
	known  bool          // a read succeeded
	paused bool          // the last read found the queue paused
	open   chan struct{} // closed while known && !paused
}

func newPauseGate() *pauseGate { return &pauseGate{open: make(chan struct{})} }

// set records a read of the pause key and reports whether the queue was
// open before and is paused now.
func (g *pauseGate) set(paused bool) (closed bool) {
	g.mu.Lock()
	defer g.mu.Unlock()
	wasOpen := g.known && !g.paused
	g.known, g.paused = true, paused
	switch {
	case !paused && !wasOpen:
		close(g.open)
	case paused && wasOpen:
		g.open = make(chan struct{})
	}
	return wasOpen && paused
}

// isOpen reports whether the gate is open now.
func (g *pauseGate) isOpen() bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.known && !g.paused
}

// wait blocks until the gate is open or ctx ends, and reports whether it is
// open. beforeWait runs first when the gate is closed.
func (g *pauseGate) wait(ctx context.Context, beforeWait func()) bool {
	g.mu.Lock()
	open := g.open
	g.mu.Unlock()
	select {
	case <-open:
		return true
	default:
	}
	beforeWait()
	select {
	case <-open:
		return true
	case <-ctx.Done():
		return false
	}
}

// watchPause reads the queue's pause key every PauseCheckInterval until
// stopLoops closes (after the workers ended). A failed read keeps the last
// state and is retried at the next tick.
func (r *run[Req, Resp]) watchPause() {
	defer r.loops.Done()
	t := time.NewTimer(0)
	defer t.Stop()
	for {
		select {
		case <-t.C:
		case <-r.stopLoops:
			return
		}
		ctx, cancel := context.WithTimeout(r.bg, PauseCheckInterval)
		_, paused, err := pausedSince(ctx, r.c.client, r.c.queue)
		cancel()
		switch {
		case err != nil:
			if r.bg.Err() == nil {
				r.c.log.WarnContext(r.runCtx, "streamq: reading whether the queue is paused failed; keeping the last state", "err", err)
			}
		default:
			// The ring first: workers stop taking the queue's slots (and
			// take other queues' meanwhile), then the gate holds a worker
			// that took one a moment before.
			r.ring.setPaused(r.queue, paused)
			if r.pause.set(paused) && paused {
				r.c.log.InfoContext(r.runCtx, "streamq: queue paused; running handlers finish, no new ones start")
			}
		}
		t.Reset(PauseCheckInterval)
	}
}
