package streamq

// Cancelling what a consumer holds (Admin.Cancel of a running request).
//
// cancel.lua decides a cancellation in Redis: the entry is acknowledged and
// deleted, and its record holds the outcome "C..." before any consumer
// hears of it. The consumer that held the entry is then told by a notice on
// the shard's wake channel, which its promoter already listens to, so a
// consumer pays nothing for cancellation until a request is cancelled. The
// promoter hands the notice to cancelNotice, which marks the slot: a slot
// not started yet is dropped (workers check before the start charge), and a
// running handler's context is cancelled with cause ErrCanceled. Either
// way no outcome of the slot is recorded; a slot whose start was charged is
// completed with code "S" (acknowledge only), which also removes a start
// count written after cancel.lua removed it.
//
// A notice lost with a pub/sub reconnection leaves the backstop of every
// held entry: a lease renewal finds the entry no longer pending and its
// record cancelled (lease.lua reports it "c<entry id>"), and marks the slot
// cancelled as the notice would have (cause ErrCanceled). A promoter that (re)subscribed asks
// for that renewal at once (pokeLease), so a notice lost in a reconnection
// is made up for as soon as the subscription is back, not MinIdle/3 later.
// A renewal with nothing held sends nothing.

import (
	"strconv"
	"strings"
)

// cancelNoticePrefix starts a cancel notice on a wake channel; a wake-up's
// payload is a number.
const cancelNoticePrefix = 'c'

// isCancelNotice reports whether a wake channel's payload is a cancel notice.
func isCancelNotice(payload string) bool {
	return len(payload) > 0 && payload[0] == cancelNoticePrefix
}

// parseCancelNotice splits a cancel notice: "c" and four length-prefixed
// strings (group, consumer, stream level, entry id).
func parseCancelNotice(payload string) (group, consumer string, level int, entry string, ok bool) {
	rest := payload[1:]
	var parts [4]string
	for i := range parts {
		n, after, found := strings.Cut(rest, ":")
		if !found {
			return "", "", 0, "", false
		}
		size, err := strconv.Atoi(n)
		if err != nil || size < 0 || size > len(after) {
			return "", "", 0, "", false
		}
		parts[i], rest = after[:size], after[size:]
	}
	level, err := strconv.Atoi(parts[2])
	if rest != "" || err != nil || level < 0 || level >= numLevels {
		return "", "", 0, "", false
	}
	return parts[0], parts[1], level, parts[3], true
}

// cancelNotice acts on a cancel notice received on shard's wake channel:
// when this consumer holds the entry, its slot is marked cancelled.
func (r *run[Req, Resp]) cancelNotice(shard int, payload string) {
	group, consumer, level, entry, ok := parseCancelNotice(payload)
	if !ok {
		r.c.log.WarnContext(r.runCtx, "streamq: malformed cancel notice", "notice", payload)
		return
	}
	if group != r.c.opts.Group || consumer != r.c.opts.Name {
		return
	}
	key := ownedKey{level*r.c.nShards + shard, entry}
	r.mu.Lock()
	s := r.owned[key]
	r.mu.Unlock()
	if s == nil {
		return // completed, or released at shutdown: nothing runs it here
	}
	r.c.log.InfoContext(r.runCtx, "streamq: request canceled by Admin.Cancel; stopping it", "id", s.entry.ID, "entry", entry)
	s.markCanceled()
}

// markCanceled records that Admin.Cancel cancelled the entry's request, and
// cancels its handler's context with cause ErrCanceled.
func (s *slot) markCanceled() {
	s.mu.Lock()
	s.canceled = true
	cancel := s.cancel
	s.mu.Unlock()
	if cancel != nil {
		cancel(ErrCanceled)
	}
}

// ended reports whether the slot was lost to another consumer, and whether
// its request was cancelled (one lock for both: workers ask once per job).
func (s *slot) ended() (lost, canceled bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.lost, s.canceled
}

// isCanceled reports whether the slot's request was cancelled.
func (s *slot) isCanceled() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.canceled
}

// dropCanceled ends a cancelled slot whose start was charged: nothing is
// recorded (cancel.lua recorded the outcome), and the completion with code
// "S" acknowledges nothing new but removes the start count a charge sent
// before the notice may have written after cancel.lua ran.
func (r *run[Req, Resp]) dropCanceled(s *slot) {
	s.tx = nil
	r.handOff(completion{s: s, code: recordSkip})
}

// pokeLease asks the leaser for a renewal of every held entry at once (one
// lease.lua call per shard that holds entries; none when nothing is held).
func (r *run[Req, Resp]) pokeLease() {
	select {
	case r.leaseNow <- struct{}{}:
	default: // one is pending already
	}
}
