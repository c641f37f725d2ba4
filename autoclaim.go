package streamq

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/streamq/streamq/internal/scripts"
)

// releaseIdle is the idle time given to released entries: far above any
// sensible MinIdle, so the next XAUTOCLAIM of any consumer takes them.
const releaseIdle = 365 * 24 * time.Hour

// maxReadCount caps the COUNT of one read, claim or resume call.
const maxReadCount = 1000

// feed is the feeder goroutine: it fills the ring. It first resumes this
// consumer's own pending entries (left by an earlier process with the same
// name), then alternates between claim passes (every ClaimInterval) and reads of
// new entries. It reads only as many entries as the ring has room for, and
// waits for room on a signal. Run's end does not interrupt a read: its context
// is the background one, cancelled only at shutdown's hard bound
// (2×ShutdownTimeout), so entries a read returns are admitted and then
// released. A read still running at the hard bound is given up on; entries it
// leaves in this consumer's pending list are claimed after MinIdle.
func (r *run[Req, Resp]) feed(ctx context.Context, shard int) {
	defer r.feeder.Done()
	o := &r.c.opts
	// Each call asks for at most maxReadCount entries: Redis allocates for the
	// whole COUNT of an XAUTOCLAIM up front, and bigger batches gain nothing.
	share := min(max(1, o.Prefetch/len(r.c.shards)), maxReadCount)
	read := r.bg
	history, cursor := true, "-"
	claimCursor, nextClaim := "0-0", time.Now()
	var b backoff
	for ctx.Err() == nil {
		n, err := r.ring.reserve(ctx, share)
		if err != nil {
			return
		}
		var got int
		switch {
		case history:
			var seen int
			seen, got, cursor, err = r.readHistory(read, shard, n, cursor)
			if err == nil && seen == 0 {
				history = false
			}
		case !time.Now().Before(nextClaim):
			got, claimCursor, err = r.claim(read, shard, n, claimCursor)
			if err == nil && claimCursor == "0-0" {
				nextClaim = time.Now().Add(o.ClaimInterval)
			}
		default:
			// A read never blocks past ShutdownTimeout, so shutdown's last read
			// ends in time for its entries to be released.
			block := min(o.ReadBlock, o.ShutdownTimeout, time.Until(nextClaim))
			got, err = r.readNew(read, shard, n, max(block, time.Millisecond))
		}
		r.ring.give(n - got)
		if err != nil {
			if isNoGroup(err) {
				r.c.log.Warn("streamq: consumer group vanished (Redis restarted without persistence, or the stream was deleted); recreating it", "err", err)
				err = r.c.ensureGroup(read, shard)
				history, cursor = true, "-"
			}
			if err != nil {
				r.c.slots.onError(err)
				r.c.log.Error("streamq: reading the stream failed; retrying", "err", err)
				if sleepCtx(ctx, b.next()) != nil {
					return
				}
			}
			continue
		}
		b = backoff{}
	}
}

func isNoGroup(err error) bool { return err != nil && strings.Contains(err.Error(), "NOGROUP") }

// readNew reads up to n new entries of a shard, blocking up to block, and
// returns how many it admitted.
func (r *run[Req, Resp]) readNew(ctx context.Context, shard, n int, block time.Duration) (int, error) {
	res, err := r.c.client.XReadGroup(ctx, &redis.XReadGroupArgs{
		Group:    r.c.opts.Group,
		Consumer: r.c.opts.Name,
		Streams:  []string{r.c.shards[shard].Stream, ">"},
		Count:    int64(n),
		Block:    block,
	}).Result()
	if errors.Is(err, redis.Nil) {
		return 0, nil
	}
	if err != nil {
		return 0, err
	}
	got := 0
	for _, st := range res {
		got += r.admit(shard, st.Messages, false, func(int) int { return 1 })
	}
	return got, nil
}

// readHistory reads up to n of this consumer's own pending entries of a shard
// after cursor, with their delivery counts so far, and returns how many it
// saw and how many it admitted. It does not count a delivery: the handler's
// start does (see charge.lua). Entries deleted while pending are acknowledged.
func (r *run[Req, Resp]) readHistory(ctx context.Context, shard, n int, cursor string) (seen, got int, next string, err error) {
	o := &r.c.opts
	res, err := scripts.Resume.Run(ctx, r.c.client, []string{r.c.shards[shard].Stream},
		o.Group, o.Name, cursor, n).Slice()
	if err != nil {
		return 0, 0, cursor, err
	}
	if len(res) != 4 {
		return 0, 0, cursor, fmt.Errorf("streamq: resume: unexpected reply of %d elements", len(res))
	}
	last, _ := res[0].(string)
	if last == "" {
		return 0, 0, cursor, nil
	}
	msgs := parseEntries(res[1])
	counts, _ := res[2].([]any)
	gone, _ := res[3].([]any)
	if len(gone) > 0 {
		r.c.log.Info("streamq: dropped pending entries whose stream entries were deleted", "count", len(gone))
	}
	if len(msgs) > 0 {
		got = r.admitClaimed(shard, msgs, counts)
		r.c.log.Info("streamq: resumed own pending entries", "count", got)
	}
	return len(msgs) + len(gone), got, last, nil
}

// claim runs one XAUTOCLAIM step on a shard for up to n entries idle for
// MinIdle, from cursor, and returns how many it admitted and the next cursor
// ("0-0" when the pass is over). Claimed entries go through the ring like
// read ones, with their Redis delivery count.
func (r *run[Req, Resp]) claim(ctx context.Context, shard, n int, cursor string) (int, string, error) {
	o := &r.c.opts
	res, err := scripts.Claim.Run(ctx, r.c.client, []string{r.c.shards[shard].Stream},
		o.Group, o.Name, o.MinIdle.Milliseconds(), cursor, n).Slice()
	if err != nil {
		return 0, cursor, err
	}
	if len(res) != 4 {
		return 0, "0-0", fmt.Errorf("streamq: claim: unexpected reply of %d elements", len(res))
	}
	next, _ := res[0].(string)
	msgs := parseEntries(res[1])
	counts, _ := res[2].([]any)
	if gone, _ := res[3].([]any); len(gone) > 0 {
		r.c.log.Info("streamq: dropped claimed entries whose stream entries were deleted", "count", len(gone))
	}
	got := 0
	if len(msgs) > 0 {
		got = r.admitClaimed(shard, msgs, counts)
		r.c.log.Info("streamq: claimed idle entries", "count", got)
	}
	if next == "" {
		next = "0-0"
	}
	return got, next, nil
}

// admitClaimed admits claimed or resumed entries: their counts are the
// deliveries so far, and each is charged one more when its handler starts.
func (r *run[Req, Resp]) admitClaimed(shard int, msgs []redis.XMessage, counts []any) int {
	return r.admit(shard, msgs, true, func(i int) int {
		if i < len(counts) {
			if c, ok := counts[i].(int64); ok {
				return int(c)
			}
		}
		return 1
	})
}

// parseEntries converts entries in a script reply ({id, {field, value, ...}}) to XMessages.
func parseEntries(v any) []redis.XMessage {
	list, _ := v.([]any)
	msgs := make([]redis.XMessage, 0, len(list))
	for _, e := range list {
		pair, _ := e.([]any)
		if len(pair) != 2 {
			continue
		}
		id, _ := pair[0].(string)
		fields, _ := pair[1].([]any)
		values := make(map[string]any, len(fields)/2)
		for i := 0; i+1 < len(fields); i += 2 {
			if k, ok := fields[i].(string); ok {
				values[k] = fields[i+1]
			}
		}
		msgs = append(msgs, redis.XMessage{ID: id, Values: values})
	}
	return msgs
}

// leaseLoop renews the leases of every owned entry (in the ring, in a handler
// or awaiting completion) every MinIdle/3, so they are not claimed while this
// consumer lives. Entries found claimed by another consumer are marked lost and
// their handlers cancelled. It runs until the end of shutdown.
func (r *run[Req, Resp]) leaseLoop() {
	defer r.loops.Done()
	t := time.NewTicker(r.c.opts.MinIdle / 3)
	defer t.Stop()
	for {
		select {
		case <-r.stopLoops:
			return
		case <-t.C:
		}
		byShard := make([][]string, len(r.c.shards))
		r.mu.Lock()
		for k := range r.owned {
			byShard[k.shard] = append(byShard[k.shard], k.id)
		}
		r.mu.Unlock()
		for shard, ids := range byShard {
			lost, err := r.setIdle(r.bg, shard, ids, 0)
			if err != nil {
				r.c.slots.onError(err)
				r.c.log.Warn("streamq: renewing leases failed; will retry", "entries", len(ids), "err", err)
			}
			for _, id := range lost {
				r.mu.Lock()
				s := r.owned[ownedKey{shard, id}]
				r.mu.Unlock()
				if s != nil {
					r.c.log.Warn("streamq: lost a message to another consumer", "id", s.entry.ID, "entry", id)
					s.markLost()
				}
			}
		}
	}
}

// setIdle sets the idle time of the given entries of a shard that this
// consumer still owns, in chunks, and returns those it no longer owns.
func (r *run[Req, Resp]) setIdle(ctx context.Context, shard int, ids []string, idle time.Duration) ([]string, error) {
	o := &r.c.opts
	var lost []string
	const chunk = 500
	for len(ids) > 0 {
		n := min(chunk, len(ids))
		args := make([]any, 0, 3+n)
		args = append(args, o.Group, o.Name, idle.Milliseconds())
		for _, id := range ids[:n] {
			args = append(args, id)
		}
		ids = ids[n:]
		res, err := scripts.Lease.Run(ctx, r.c.client, []string{r.c.shards[shard].Stream}, args...).StringSlice()
		if err != nil {
			return lost, err
		}
		lost = append(lost, res...)
	}
	return lost, nil
}

// retryAfter leaves a failed entry pending and makes it claimable after delay,
// by setting its idle time to MinIdle-delay. The next delivery goes to whichever
// consumer's claim pass comes first, and Redis counts it.
func (r *run[Req, Resp]) retryAfter(s *slot, delay time.Duration) {
	// Untrack first, so that a lease renewal does not undo the new idle time.
	r.untrack(s)
	idle := max(r.c.opts.MinIdle-delay, 0)
	if _, err := r.setIdle(r.bg, s.shard, []string{s.entry.EntryID}, idle); err != nil {
		r.c.log.Warn("streamq: scheduling a retry failed; the entry will be retried after MinIdle",
			"id", s.entry.ID, "entry", s.entry.EntryID, "err", err)
	}
	r.forget(s)
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
	// Untrack first, so that a lease renewal does not undo the release.
	r.untrack(slots...)
	byShard := make([][]string, len(r.c.shards))
	for _, s := range slots {
		byShard[s.shard] = append(byShard[s.shard], s.entry.EntryID)
	}
	ctx, cancel := context.WithTimeout(r.bg, r.c.opts.ShutdownTimeout)
	defer cancel()
	for shard, ids := range byShard {
		if len(ids) == 0 {
			continue
		}
		if _, err := r.setIdle(ctx, shard, ids, releaseIdle); err != nil {
			r.c.log.Warn("streamq: releasing prefetched entries failed; they will be claimed after MinIdle",
				"entries", len(ids), "err", err)
		} else {
			r.c.log.Info("streamq: released prefetched entries that had not started", "entries", len(ids))
		}
	}
	r.forget(slots...)
}
