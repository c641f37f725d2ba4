package streamq

// Each shard's share of the prefetch places (shardPlaces), and the turns
// of the feeders waiting for room (turns): the second place budget, beside
// the ring's (ring.go), so a shard whose completions fail stalls only itself.

import (
	"context"
	"sync"
)

// shardPlaces splits Prefetch between the shards: a shard holds at most its
// share of entries (read, running, or handled and not yet recorded), so a
// shard whose completions fail stalls only itself.
type shardPlaces struct {
	mu   sync.Mutex
	free []int
	max  []int
	// wake[shard] is closed (and dropped) when the shard's free went up,
	// waking every feeder of the shard waiting in reserve; nil while none
	// waits.
	wake []chan struct{}
	// feeders counts the feeders sharing a shard's places (its default
	// level's, and one per priority level in use): one reservation takes
	// at most max/feeders, so a feeder that gives its places back and
	// takes them again at once cannot starve its shard's other levels.
	feeders []int
	turns   []turns // per shard: see stepAside
}

// turns lets a feeder whose read came back empty step aside for the feeders
// waiting for the places it gives back (see run.stepAside): without it, the
// drained feeder takes them again at once, before a waiting feeder wakes,
// and with fewer places than feeders a backlogged level (or queue) never
// reads. Guarded by its owner's mutex.
type turns struct {
	waiting int           // feeders blocked in a reservation
	taken   chan struct{} // closed when one of them got places; nil while none waits
}

// wait counts a feeder that starts waiting for places.
func (t *turns) wait() { t.waiting++ }

// done counts a waiting feeder that stopped waiting, with places (got) or
// without (its ctx ended, or its own limit stops it now).
func (t *turns) done(got bool) {
	t.waiting--
	if got && t.taken != nil {
		close(t.taken)
		t.taken = nil
	}
}

// contended returns a channel closed once a waiting feeder got places, or
// nil when none waits.
func (t *turns) contended() <-chan struct{} {
	if t.waiting == 0 {
		return nil
	}
	if t.taken == nil {
		t.taken = make(chan struct{})
	}
	return t.taken
}

func newShardPlaces(prefetch, shards int) *shardPlaces {
	p := &shardPlaces{free: make([]int, shards), max: make([]int, shards), wake: make([]chan struct{}, shards),
		feeders: make([]int, shards), turns: make([]turns, shards)}
	for i := range shards {
		n := prefetch / shards
		if i < prefetch%shards {
			n++
		}
		p.free[i], p.max[i] = max(n, 1), max(n, 1)
		p.feeders[i] = 1
	}
	return p
}

func (p *shardPlaces) share(shard int) int { return p.max[shard] }

// reserve takes up to limit of the shard's places, at most its share among
// the shard's feeders, waiting until one is free; onWait, when set, runs
// (without the lock) before it first waits.
func (p *shardPlaces) reserve(ctx context.Context, shard, limit int, onWait func()) (int, error) {
	waiting := false
	for {
		p.mu.Lock()
		n := min(p.free[shard], limit, max(1, p.max[shard]/p.feeders[shard]))
		p.free[shard] -= n
		left := p.free[shard]
		switch {
		case n > 0 && waiting:
			p.turns[shard].done(true)
		case n == 0 && !waiting:
			p.turns[shard].wait()
			waiting = true
		}
		if n > 0 {
			if left > 0 && p.feeders[shard] > 1 {
				p.signalLocked(shard) // another level's feeder may wait for the rest
			}
			p.mu.Unlock()
			return n, nil
		}
		if p.wake[shard] == nil {
			p.wake[shard] = make(chan struct{})
		}
		wake := p.wake[shard]
		p.mu.Unlock()
		if onWait != nil {
			onWait()
			onWait = nil
		}
		select {
		case <-wake:
		case <-ctx.Done():
			p.mu.Lock()
			p.turns[shard].done(false)
			p.mu.Unlock()
			return 0, ctx.Err()
		}
	}
}

// contended returns a channel closed once a feeder waiting for the shard's
// places got some, or nil when none waits.
func (p *shardPlaces) contended(shard int) <-chan struct{} {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.turns[shard].contended()
}

func (p *shardPlaces) give(shard, n int) {
	if n == 0 {
		return
	}
	p.mu.Lock()
	p.free[shard] += n
	p.signalLocked(shard)
	p.mu.Unlock()
}

// signalLocked wakes the feeders waiting for the shard's places; mu is held.
func (p *shardPlaces) signalLocked(shard int) {
	if p.wake[shard] != nil {
		close(p.wake[shard])
		p.wake[shard] = nil
	}
}

// addFeeder counts one more feeder (a priority level's) sharing a shard's
// places.
func (p *shardPlaces) addFeeder(shard int) {
	p.mu.Lock()
	p.feeders[shard]++
	p.signalLocked(shard)
	p.mu.Unlock()
}
