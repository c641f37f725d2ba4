package streamq

import "sync"

// readAhead decides how many entries a consumer holds at once, up to
// Prefetch: enough that its workers do not wait for reads and fetches, and no
// more, so that a backlog stays in the stream where other consumers can start
// it sooner (a consumer started a moment earlier must not take the whole
// backlog of slow jobs).
//
// It is a feedback loop on what the workers see, not a model of handler and
// round-trip times, whose spread on a loaded machine matters more than their
// means. A worker that finds nothing ready while the target is what stops the
// feeder from reading (the target "binds") was starved by the target: the
// target grows by half. Each quiet stretch of 4×target takes without such a
// wait lowers it by one, down to the floor, min(Prefetch, 2×Workers+2), where
// it starts. Slow handlers stay near the floor; fast ones, whose workers catch
// up with every read, grow it to Prefetch, so reads and completions keep
// their batches.
type readAhead struct {
	mu     sync.Mutex
	limit  int // Prefetch
	floor  int
	target int
	calm   int // takes since the last starved one
}

func newReadAhead(workers, limit int, hold bool) *readAhead {
	floor := min(limit, 2*workers+2)
	if hold {
		floor = limit
	}
	return &readAhead{limit: limit, floor: floor, target: floor}
}

// took records one slot taken by a worker, which had to wait for it (an empty
// ring, or a fetch not done) while the target bound, or not; it returns the
// new target and whether it changed.
func (a *readAhead) took(starved bool) (int, bool) {
	a.mu.Lock()
	defer a.mu.Unlock()
	old := a.target
	switch {
	case starved:
		a.calm = 0
		a.target = min(a.limit, a.target+max(1, a.target/2))
	default:
		a.calm++
		if a.calm >= 4*a.target {
			a.calm = 0
			a.target = max(a.floor, a.target-1)
		}
	}
	return a.target, a.target != old
}

// current is the target now.
func (a *readAhead) current() int {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.target
}
