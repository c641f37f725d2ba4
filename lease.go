package streamq

// The leases of what a consumer holds, and their release at stop.
//
// Goroutines: the lease goroutine (run.leaseLoop) starts a renewal round
// every MinIdle/3; each shard's renewal runs in a goroutine of its own
// (run.renewShard, at most one per shard at a time), which renews the
// leases of the shard's owned slots, moves their ownedAt, and marks lost the
// slots another consumer took. leaseMu guards leasing and leaseAgain. The
// shutdown goroutine releases unstarted slots (run.releaseUnstarted), one
// goroutine per shard, so that another consumer claims them at once.

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/streamq/streamq/internal/scripts"
)

// releaseIdle is the idle time given to released entries: far above any
// sensible MinIdle, so the next XAUTOCLAIM of any consumer takes them.
const releaseIdle = 365 * 24 * time.Hour

// leaseLoop renews the leases of every owned entry (in the ring, in a handler
// or awaiting completion) every MinIdle/3, so they are not claimed while this
// consumer lives. Entries found claimed by another consumer are marked lost and
// their handlers cancelled. It runs until the end of shutdown; the renewals
// it started are counted in loops too, so finish waits for them.
func (r *run[Req, Resp]) leaseLoop() {
	defer r.loops.Done()
	t := time.NewTicker(r.c.opts.MinIdle / 3)
	defer t.Stop()
	for {
		select {
		case <-r.stopLoops:
			return
		case <-t.C:
		case <-r.leaseNow: // see pokeLease
		}
		r.renew()
	}
}

// renew starts a renewal of the leases of every owned entry: one goroutine
// per shard that holds entries (renewShard), so a shard whose node or
// connection stalls delays the renewals of no other shard. A shard whose
// previous renewal is still in flight gets no second one: it is marked to
// renew again as soon as that one is answered (once, however many rounds
// found it busy). The snapshot of owned is taken under leaseMu (see
// releaseUnstarted).
func (r *run[Req, Resp]) renew() {
	r.leaseMu.Lock()
	defer r.leaseMu.Unlock()
	byShard := make([][]*slot, len(r.c.shards))
	r.mu.Lock()
	for k, s := range r.owned {
		if r.leasing[k.shard] == nil {
			byShard[k.shard] = append(byShard[k.shard], s)
		}
	}
	r.mu.Unlock()
	for shard, slots := range byShard {
		switch {
		case r.leasing[shard] != nil:
			r.leaseAgain[shard] = true
		case len(slots) > 0:
			done := make(chan struct{})
			r.leasing[shard] = done
			r.loops.Add(1) // leaseLoop's own count is held: never Add from zero
			go r.renewShard(shard, slots, done)
		}
	}
}

// renewShard renews the leases of a shard's slots, snapshotted by renew,
// then closes done. When a round found it busy meanwhile (leaseAgain), it
// snapshots the shard's owned slots again and renews those at once, with a
// new done, until shutdown closed stopLoops.
func (r *run[Req, Resp]) renewShard(shard int, slots []*slot, done chan struct{}) {
	defer r.loops.Done()
	for {
		r.renewSlots(shard, slots)
		r.leaseMu.Lock()
		close(done)
		r.leasing[shard] = nil
		again := r.leaseAgain[shard]
		r.leaseAgain[shard] = false
		slots = nil
		if again && !r.loopsStopped() {
			r.mu.Lock()
			for k, s := range r.owned {
				if k.shard == shard {
					slots = append(slots, s)
				}
			}
			r.mu.Unlock()
		}
		if len(slots) > 0 {
			done = make(chan struct{})
			r.leasing[shard] = done
		}
		r.leaseMu.Unlock()
		if len(slots) == 0 {
			return
		}
	}
}

// loopsStopped reports whether shutdown asked the loops to stop.
func (r *run[Req, Resp]) loopsStopped() bool {
	select {
	case <-r.stopLoops:
		return true
	default:
		return false
	}
}

// renewSlots sends one renewal of the leases of a shard's slots, moves their
// ownership time (renewed) and marks the slots it found lost or cancelled.
func (r *run[Req, Resp]) renewSlots(shard int, slots []*slot) {
	at := mono()
	lost, err := r.leaseShard(r.bg, shard, slots, 0, r.recordFloor())
	if err != nil {
		r.c.slots.onError(err)
		r.c.log.WarnContext(r.runCtx, "streamq: renewing leases failed; will retry", "entries", len(slots), "err", err)
	} else {
		r.renewed(slots, lost, at)
	}
	for _, id := range lost {
		id, canceled := strings.CutPrefix(id, "c")
		r.mu.Lock()
		s := r.owned[ownedKey{shard, id}]
		r.mu.Unlock()
		// A handed-off entry leaves the pending list when its outcome
		// is recorded; a renewal that raced with that is no loss (and
		// if another consumer ran it too, the first outcome wins).
		switch {
		case s == nil || s.handedOff.Load() || s.isCanceled():
		case canceled:
			// Admin.Cancel's notice was lost, or has not arrived yet.
			r.c.log.InfoContext(r.runCtx, "streamq: request canceled by Admin.Cancel; stopping it", "id", s.entry.ID, "entry", id)
			s.markCanceled()
		default:
			r.c.log.WarnContext(r.runCtx, "streamq: lost a message to another consumer", "id", s.entry.ID, "entry", id)
			s.markLost()
		}
	}
}

// renewed moves the ownership time of renewed slots to at (taken before the
// renewal was sent), when their ownership was continuous: the renewal came
// back less than MinIdle after the last confirmation, so no claim could
// have taken the entry in between. Otherwise the slot's starts go through
// charge.lua's owner check from now on (see committer.tick).
func (r *run[Req, Resp]) renewed(slots []*slot, lost []string, at int64) {
	now := mono()
	gone := make(map[string]bool, len(lost))
	for _, id := range lost {
		gone[strings.TrimPrefix(id, "c")] = true // "c": cancelled (see renew)
	}
	for _, s := range slots {
		prev := s.ownedAt.Load()
		if prev != 0 && !gone[s.entry.EntryID] && time.Duration(now-prev) < r.c.opts.MinIdle {
			s.ownedAt.CompareAndSwap(prev, at)
		} else {
			s.ownedAt.Store(0)
		}
	}
}

// leaseShard sets the idle time of the entries of the given slots of a shard
// that this consumer still owns, in chunks, and returns those it no longer
// owns. With a floor > 0 it also keeps their in-flight records alive at least
// that long, and the progress values of those that may have one (this
// delivery reported, or an earlier one started: see lease.lua); 0 leaves
// records alone.
func (r *run[Req, Resp]) leaseShard(ctx context.Context, shard int, slots []*slot, idle, floor time.Duration) ([]string, error) {
	o := &r.c.opts
	k := r.c.shards[shard]
	var lost []string
	const chunk = 500
	for len(slots) > 0 {
		n := min(chunk, len(slots))
		args := make([]any, 5, 5+n)
		args[0], args[1], args[2], args[3] = o.Group, o.Name, idle.Milliseconds(), floor.Milliseconds()
		keyList := make([]string, 1, 1+n)
		keyList[0] = k.Stream
		var progKeys []string
		var progressed []byte // ARGV[5]: the entries (1-based, in order) whose progress key follows the records
		for i, s := range slots[:n] {
			args = append(args, s.entry.EntryID)
			keyList = append(keyList, r.recordKey(shard, s))
			if floor > 0 && !o.Fanout && s.entry.ID != "" && (s.earlier || s.msg.reported.Load()) {
				progKeys = append(progKeys, k.Progress(s.entry.ID))
				progressed = appendItem(progressed, '~', i+1)
			}
		}
		args[4] = string(progressed)
		keyList = append(keyList, progKeys...)
		slots = slots[n:]
		res, err := scripts.Lease.Run(ctx, r.c.client, keyList, args...).StringSlice()
		if err != nil {
			return lost, err
		}
		lost = append(lost, res...)
	}
	return lost, nil
}

// releaseUnstarted makes the entries that were prefetched but never started
// claimable at once by any consumer.
func (r *run[Req, Resp]) releaseUnstarted() {
	r.releaseMu.Lock()
	slots := r.unstarted
	r.unstarted = nil
	r.releaseMu.Unlock()
	if len(slots) == 0 {
		return
	}
	// Untrack first, so that a lease renewal does not undo the release: no
	// renewal snapshots owned after this, but one in flight may have
	// snapshotted these entries, and its shard's release is sent only once
	// it is answered (TestReleaseNotUndoneByLeaseInFlight). Each shard's
	// release runs in a goroutine of its own, so a shard whose renewal or
	// release stalls holds up no other's
	// (TestStalledLeaseOfOneShardHoldsNoOtherRelease).
	r.leaseMu.Lock()
	r.untrack(slots...)
	inFlight := slices.Clone(r.leasing)
	r.leaseMu.Unlock()
	byShard := make([][]*slot, len(r.c.shards))
	for _, s := range slots {
		byShard[s.shard] = append(byShard[s.shard], s)
	}
	ctx, cancel := context.WithTimeout(r.bg, r.c.opts.ShutdownTimeout)
	defer cancel()
	var wg sync.WaitGroup
	for shard, ids := range byShard {
		if len(ids) == 0 {
			continue
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			var err error
			if done := inFlight[shard]; done != nil {
				select {
				case <-done:
				case <-ctx.Done():
					err = fmt.Errorf("a lease renewal of these entries is still in flight: %w", context.Cause(ctx))
				}
			}
			if err == nil {
				err = r.releaseShard(ctx, shard, ids)
			}
			if err != nil {
				r.c.log.WarnContext(r.runCtx, "streamq: releasing prefetched entries failed; they will be claimed after MinIdle",
					"entries", len(ids), "err", err)
			} else {
				r.c.log.InfoContext(r.runCtx, "streamq: released prefetched entries that had not started", "entries", len(ids))
			}
		}()
	}
	wg.Wait()
	r.forget(slots...)
}

// releaseShard releases unstarted entries of a shard (release.lua): their
// idle time is set past any MinIdle, and a start charge sent for one of them
// without an answer is taken back, since its handler never ran.
func (r *run[Req, Resp]) releaseShard(ctx context.Context, shard int, slots []*slot) error {
	o := &r.c.opts
	k := r.c.shards[shard]
	const chunk = 500
	for len(slots) > 0 {
		n := min(chunk, len(slots))
		args := make([]any, 3, 3+2*n)
		args[0], args[1], args[2] = o.Group, o.Name, releaseIdle.Milliseconds()
		for _, s := range slots[:n] {
			seen := -1
			if s.charging {
				seen = s.entry.Deliveries - 1
			}
			args = append(args, s.entry.EntryID, seen)
		}
		slots = slots[n:]
		if err := scripts.Release.Run(ctx, r.c.client, []string{k.Stream, k.Starts(o.Group)}, args...).Err(); err != nil {
			return err
		}
	}
	return nil
}
