package streamq

// The feeder: what a consumer reads, claims, resumes and adopts.
//
// Goroutines: one feeder per shard (run.feed) owns that shard's reads, claim and
// adoption passes and their cursors; it creates slots and pushes them into
// places it reserved in the ring (ring.go) and its shard's share (places.go).

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/streamq/streamq/internal/scripts"
)

// shortReadPause bounds how long a feeder whose read came back short, while
// the shard was busy, waits for its next read to ride a tick of the shard's
// committer (see rideReq) before that read goes with the next tick at once.
// It is the most that a request arriving while the shard is busy waits
// longer to be read; at idle a blocking read is already waiting for it.
const shortReadPause = 2 * time.Millisecond

// maxReadCount caps the COUNT of one read, claim or resume call.
const maxReadCount = 1000

// feed is the feeder goroutine: it fills the ring. It first resumes this
// consumer's own pending entries (left by an earlier process with the same
// name), then alternates between claim passes and adoption passes (each every
// ClaimInterval) and reads of new entries. It reads only as many entries as the
// ring has room for, and waits for room on a signal. Run's end does not
// interrupt a read: its context is the background one, cancelled only at
// shutdown's hard bound (2×ShutdownTimeout), so entries a read returns are
// admitted and then released. A read still running at the hard bound is given
// up on; entries it leaves in this consumer's pending list are adopted or
// claimed later.
func (r *run[Req, Resp]) feed(ctx context.Context, shard int) {
	defer r.feeder.Done()
	o := &r.c.opts
	read := r.bg
	atStart := shard < len(r.c.levelsAtStart) && r.c.levelsAtStart[shard]
	if r.c.levelIndex(shard) != levelNormal && !atStart && !r.awaitLevel(ctx, read, shard) {
		return
	}
	// Each call asks for at most maxReadCount entries: Redis allocates for the
	// whole COUNT of an XAUTOCLAIM up front, and bigger batches gain nothing.
	share := min(max(1, r.prefetch/r.c.nShards), maxReadCount)
	class := r.class(shard)
	// What this feeder last told the ring (setBacklog). In a ring of several
	// queues, the default level's feeders start as backlogged (newRun told
	// the ring so): until a queue's first read of new entries says
	// otherwise, the other queues hold no more than their weight's share,
	// and with Strict the lower ones read nothing, so a backlog there before
	// Run is taken in order from the first start.
	// The same for the levels whose streams existed at Run's start (see
	// startLevels): until each read once, the queue's takes wait
	// (startHeld), so the levels' weights order the starts from the first.
	backlogged := r.presumed[shard]
	firstRead, holding := backlogged, backlogged && r.startHeld
	history, cursor := true, "-"
	ride := false // the next read of new entries rides a tick (see rideReq)
	claimCursor, nextClaim := "0-0", time.Now()
	nextAdopt := time.Now().Add(o.ClaimInterval)
	var b backoff
	for ctx.Err() == nil {
		var onWait func()
		if holding {
			// Its first read waits for places that only the workers can
			// free: the queue's start hold ends now.
			onWait = func() { r.ring.endStart(r.queue, -1) }
		}
		n, err := r.reservePlaces(ctx, shard, share, onWait)
		if err != nil {
			return
		}
		var got int
		drained := false // a read of new entries came back empty
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
		case !time.Now().Before(nextAdopt):
			got, err = r.adopt(read, shard, n)
			nextAdopt = time.Now().Add(o.ClaimInterval)
		default:
			// A read never blocks past ShutdownTimeout, so shutdown's last read
			// ends in time for its entries to be released.
			block := min(o.ReadBlock, o.ShutdownTimeout, time.Until(nextClaim), time.Until(nextAdopt))
			if backlogged && (r.multi || firstRead) {
				// An empty stream that was backlogged tells the ring at once,
				// not after a blocking read, so the other queues read in its
				// place without waiting for ReadBlock.
				block = time.Millisecond
			}
			var busy bool
			if ride {
				got, busy, err = r.readRiding(shard, n)
			} else {
				got, busy, err = r.readNew(read, shard, n, max(block, time.Millisecond))
			}
			firstRead = false
			drained = err == nil && got == 0
			// A short read while the shard was busy with earlier entries:
			// the stream is drained and requests trickle in. The next read
			// rides the tick that records what this one brought (up to
			// shortReadPause later, see rideReq): what arrives meanwhile
			// comes in one read, with no round trip of its own, and its
			// starts and outcomes in one tick each, instead of a read and
			// two ticks per entry. A read that found the shard quiet blocks
			// again at once: a request at a time (a caller that waits for
			// each outcome before the next) finds a read waiting in Redis.
			ride = err == nil && got > 0 && got < n && busy
			if full := got == n; err == nil && full != backlogged {
				backlogged = full
				r.ring.setBacklog(class, full) // only read with priority levels in use
			}
		}
		if holding && (err != nil || got > 0 || !firstRead) {
			holding = false
			r.ring.startRead(r.queue)
		}
		if err != nil && backlogged && (r.multi || firstRead) {
			// A queue whose Redis calls fail stalls only itself: the others
			// read (with Strict, the lower ones too) until it reads again.
			backlogged = false
			r.ring.setBacklog(class, false)
		}
		r.givePlaces(shard, n-got)
		if drained {
			r.stepAside(ctx, shard)
		}
		if err != nil {
			if isNoGroup(err) {
				r.c.log.WarnContext(r.runCtx, "streamq: consumer group vanished (Redis restarted without persistence, or the stream was deleted); recreating it", "err", err)
				err = r.c.ensureGroup(read, shard)
				history, cursor = true, "-"
			}
			if err != nil {
				r.c.slots.onError(err)
				r.c.log.ErrorContext(r.runCtx, "streamq: reading the stream failed; retrying", "err", err)
				if sleepCtx(ctx, b.next()) != nil {
					return
				}
			}
			continue
		}
		b = backoff{}
	}
}

// awaitLevel is how the feeder of a priority level's stream that did not
// exist at Run's start starts: it looks for the stream when the shard's
// promoter signals (levelWake: a producer created the stream, or the wake
// subscription started, after which no creation goes unnoticed) and once
// per ClaimInterval (the stream was created by a delayed request's
// promotion, a requeue, or a producer of an earlier version, or a notice was
// lost). So a queue that never uses a level never reads, claims or holds
// places for it, and the first request of a level starts without waiting
// for a check. Then it creates the group on the stream and joins the ring's
// feeders. It reports false when ctx ended first.
func (r *run[Req, Resp]) awaitLevel(ctx, read context.Context, shard int) bool {
	o := &r.c.opts
	stream := r.c.shards[shard].Stream
	var b backoff
	wait := o.ClaimInterval // Consumer.findLevels looked at Run's start
	for {
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			return false
		case <-r.levelWake[shard]:
		case <-t.C:
		}
		t.Stop()
		n, err := r.c.client.Exists(read, stream).Result()
		if err == nil && n == 1 {
			if err = r.c.ensureGroup(read, shard); err == nil {
				r.ring.addFeeder()
				r.places.addFeeder(r.c.realShard(shard))
				return true
			}
		}
		wait = o.ClaimInterval
		if err != nil {
			r.c.log.WarnContext(r.runCtx, "streamq: checking a priority level's stream failed; retrying", "stream", stream, "err", err)
			wait = b.next()
		}
	}
}

func isNoGroup(err error) bool { return err != nil && strings.Contains(err.Error(), "NOGROUP") }

// readNew reads up to n new entries of a shard, blocking up to block, and
// returns how many it admitted, and whether the shard's committer had work
// queued or in flight when the read returned, before its entries were
// admitted (busy).
func (r *run[Req, Resp]) readNew(ctx context.Context, shard, n int, block time.Duration) (got int, busy bool, err error) {
	at := mono()
	res, err := r.c.client.XReadGroup(ctx, &redis.XReadGroupArgs{
		Group:    r.c.opts.Group,
		Consumer: r.c.opts.Name,
		Streams:  []string{r.c.shards[shard].Stream, ">"},
		Count:    int64(n),
		Block:    block,
	}).Result()
	if errors.Is(err, redis.Nil) {
		r.c.markReady()
		return 0, false, nil
	}
	if err != nil {
		return 0, false, err
	}
	r.c.markReady()
	busy = !r.committers[shard].quietNow()
	for _, st := range res {
		got += r.admit(shard, st.Messages, at, func(i int) int { return carriedStarts(st.Messages[i]) })
	}
	return got, busy, nil
}

// readRiding reads up to n new entries of a shard in a tick of its
// committer (see rideReq), and returns what readNew returns.
func (r *run[Req, Resp]) readRiding(shard, n int) (got int, busy bool, err error) {
	c := r.committers[shard]
	q := &rideReq{count: n, done: make(chan struct{})}
	c.rideAlong(q)
	t := time.NewTimer(shortReadPause)
	select {
	case <-q.done:
	case <-t.C:
		c.hurry()
		<-q.done // a tick worker answers every ride it takes, and abandon the one left
	}
	t.Stop()
	if q.err != nil {
		return 0, false, q.err
	}
	r.c.markReady()
	for _, st := range q.res {
		got += r.admit(shard, st.Messages, q.at, func(i int) int { return carriedStarts(st.Messages[i]) })
	}
	return got, q.busy, nil
}

// readHistory reads up to n of this consumer's own pending entries of a shard
// after cursor, with their handler starts so far, and returns how many it
// saw and how many it admitted. It does not count a delivery: the handler's
// start does (see charge.lua). Entries deleted while pending are acknowledged.
func (r *run[Req, Resp]) readHistory(ctx context.Context, shard, n int, cursor string) (seen, got int, next string, err error) {
	o := &r.c.opts
	k := r.c.shards[shard]
	at := mono()
	res, err := scripts.Resume.Run(ctx, r.c.client, []string{k.Stream, k.Starts(o.Group)},
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
		r.c.log.InfoContext(r.runCtx, "streamq: dropped pending entries whose stream entries were deleted", "count", len(gone))
	}
	if len(msgs) > 0 {
		got = r.admitClaimed(shard, msgs, at, counts)
		r.c.log.InfoContext(r.runCtx, "streamq: resumed own pending entries", "count", got)
	}
	return len(msgs) + len(gone), got, last, nil
}

// claim runs one XAUTOCLAIM step on a shard for up to n entries idle for
// MinIdle, from cursor, and returns how many it admitted and the next cursor
// ("0-0" when the pass is over). Claimed entries go through the ring like
// read ones, with their handler starts so far.
func (r *run[Req, Resp]) claim(ctx context.Context, shard, n int, cursor string) (int, string, error) {
	o := &r.c.opts
	k := r.c.shards[shard]
	at := mono()
	res, err := scripts.Claim.Run(ctx, r.c.client, []string{k.Stream, k.Starts(o.Group)},
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
		r.c.log.InfoContext(r.runCtx, "streamq: dropped claimed entries whose stream entries were deleted", "count", len(gone))
	}
	got := 0
	if len(msgs) > 0 {
		got = r.admitClaimed(shard, msgs, at, counts)
		r.c.log.InfoContext(r.runCtx, "streamq: claimed idle entries", "count", got)
	}
	if next == "" {
		next = "0-0"
	}
	return got, next, nil
}

// admitClaimed admits claimed, resumed or adopted entries: their counts are
// the handler starts so far, and each start is charged when it happens.
func (r *run[Req, Resp]) admitClaimed(shard int, msgs []redis.XMessage, at int64, counts []any) int {
	return r.admit(shard, msgs, at, func(i int) int {
		if i < len(counts) {
			if c, ok := counts[i].(int64); ok {
				return int(c)
			}
		}
		return 0
	})
}

// adopt is the adoption pass of a shard: it admits up to n entries of this
// consumer's own pending list that it does not hold, and returns how many.
//
// go-redis sends a command again after a connection error even when the
// server ran it. A resent XREADGROUP or claim.lua leaves the entries the first
// run took in this consumer's pending list, unseen: without this pass they
// would wait for MinIdle and some claim pass. It costs one XPENDING summary
// per ClaimInterval; only when this consumer's pending count exceeds what it
// holds does it list its pending ids and take
// the unheld ones (adopt.lua), with their start counts. So such entries run
// within about ClaimInterval, counted once.
func (r *run[Req, Resp]) adopt(ctx context.Context, shard, n int) (int, error) {
	o := &r.c.opts
	k := r.c.shards[shard]
	sum, err := r.c.client.XPending(ctx, k.Stream, o.Group).Result()
	if err != nil {
		return 0, err
	}
	pending := sum.Consumers[o.Name]
	if pending <= int64(r.held(shard)) {
		return 0, nil
	}
	list, err := r.c.client.XPendingExt(ctx, &redis.XPendingExtArgs{
		Stream: k.Stream, Group: o.Group, Start: "-", End: "+", Count: pending, Consumer: o.Name,
	}).Result()
	if err != nil {
		return 0, err
	}
	args := []any{o.Group, o.Name}
	r.mu.Lock()
	for _, p := range list {
		key := ownedKey{shard, p.ID}
		if _, held := r.owned[key]; held {
			continue
		}
		if len(args)-2 < n {
			args = append(args, p.ID)
		}
	}
	r.mu.Unlock()
	if len(args) == 2 {
		return 0, nil
	}
	at := mono()
	res, err := scripts.Adopt.Run(ctx, r.c.client, []string{k.Stream, k.Starts(o.Group)}, args...).Slice()
	if err != nil {
		return 0, err
	}
	if len(res) != 3 {
		return 0, fmt.Errorf("streamq: adopt: unexpected reply of %d elements", len(res))
	}
	msgs := parseEntries(res[0])
	counts, _ := res[1].([]any)
	if gone, _ := res[2].([]any); len(gone) > 0 {
		r.c.log.InfoContext(r.runCtx, "streamq: dropped own pending entries whose stream entries were deleted", "count", len(gone))
	}
	got := r.admitClaimed(shard, msgs, at, counts)
	if got > 0 {
		r.c.log.InfoContext(r.runCtx, "streamq: took back own pending entries whose read or claim reply was lost", "count", got)
	}
	return got, nil
}

// held counts the entries of a shard that this consumer holds (a failed
// entry stays held until retry.lua acknowledged it and scheduled its retry).
func (r *run[Req, Resp]) held(shard int) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	n := 0
	for k := range r.owned {
		if k.shard == shard {
			n++
		}
	}
	return n
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
