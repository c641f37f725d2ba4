package streamq

// The promoter: moves delayed and retrying requests whose time has come
// from the schedule and retry sets into the stream (promote.lua).
//
// Goroutines: one promoter per shard (run.promoteLoop), woken by its timer,
// by the schedule's notices and by a backstop; it owns that shard's promote
// cursor. The committer builds the retry calls (retryArgs) that put requests
// into the retry set.

import (
	"context"
	"fmt"
	"strconv"
	"time"
	"unicode/utf8"

	"github.com/redis/go-redis/v9"

	"github.com/streamq/streamq/internal/keys"
	"github.com/streamq/streamq/internal/scripts"
)

// The schedule: delayed requests (At, After) and retries waiting for their
// back-off live in a sorted set per shard, scored by due time on the Redis
// server's clock, and are appended to the stream by promote.lua. Every
// consumer runs one promoter per shard: a timer set to the earliest due time
// (as promote.lua reports it), woken early by a notice on the shard's wake
// channel when a job is scheduled ahead of all others, and a long backstop.

// promoteBackstop is the longest a promoter sleeps without running
// promote.lua: it bounds how late a job is when its wake notice was lost (a
// pub/sub reconnection) and costs one script call per consumer and shard
// per period while nothing is due.
const promoteBackstop = 10 * time.Second

// promoteBatch is the most jobs one promote.lua call appends; a call that
// appends that many is followed at once by another.
const promoteBatch = 1000

// publishCommand is the pub/sub command for notices: sharded on a cluster.
func publishCommand(sharded bool) string {
	if sharded {
		return "SPUBLISH"
	}
	return "PUBLISH"
}

// carriedStarts returns the start count a promoted retry carries in its
// field "n" (0 for every other entry): an entry read as new is admitted with
// it, so MaxDeliveries holds across reschedules.
func carriedStarts(m redis.XMessage) int {
	s, ok := m.Values[keys.FieldStarts].(string)
	if !ok {
		return 0
	}
	n, err := strconv.Atoi(s)
	if err != nil || n < 0 {
		return 0
	}
	return n
}

// promoteLoop is the promoter of one shard; it ends when Run's context ends
// or the loops stop, within one promote.lua round trip.
func (r *run[Req, Resp]) promoteLoop(shard int) {
	defer r.loops.Done()
	k := r.c.shards[shard]
	ctx, cancel := context.WithCancel(r.runCtx)
	defer cancel()
	go func() {
		select {
		case <-r.stopLoops:
			cancel()
		case <-ctx.Done():
		}
	}()
	var ps *redis.PubSub
	if r.c.sharded {
		ps = r.c.client.SSubscribe(ctx, k.Wake)
	} else {
		ps = r.c.client.Subscribe(ctx, k.Wake)
	}
	defer func() { _ = ps.Close() }()
	wake := ps.ChannelWithSubscriptions(redis.WithChannelSize(64))

	timer := time.NewTimer(0) // the first run at once
	defer timer.Stop()
	var (
		b        backoff
		next     int64        = -1 // the earliest due time known, server ms; -1: none
		base     int64             // the server's time at the last promote.lua reply, ms
		baseMono = time.Now()      // when that reply arrived
	)
	reset := func(d time.Duration) {
		timer.Stop()
		select {
		case <-timer.C:
		default:
		}
		timer.Reset(max(d, 0))
	}
	for {
		select {
		case <-ctx.Done():
			return
		case m := <-wake:
			switch v := m.(type) {
			case *redis.Subscription:
				// (Re)subscribed: a notice may have been missed meanwhile.
				reset(0)
				r.pokeLease()
				for l := range numLevels {
					if l != levelNormal {
						r.signalLevel(l*r.c.nShards + shard)
					}
				}
			case *redis.Message:
				if isCancelNotice(v.Payload) {
					r.cancelNotice(shard, v.Payload)
					continue
				}
				if l, ok := levelNotice(v.Payload); ok {
					r.signalLevel(l*r.c.nShards + shard)
					continue
				}
				due, err := strconv.ParseInt(v.Payload, 10, 64)
				if err != nil {
					reset(0)
					continue
				}
				if next < 0 || due < next {
					next = due
					now := base + time.Since(baseMono).Milliseconds()
					reset(time.Duration(due-now) * time.Millisecond)
				}
			}
			continue
		case <-timer.C:
		}
		res, err := scripts.Promote.Run(ctx, r.c.client, []string{k.Stream, k.Schedule, k.ScheduleData, k.Retry,
			k.Stream, k.Stream, k.LevelStream(levelNames[levelHigh]), k.LevelStream(levelNames[levelLow])},
			promoteBatch, startsTTL.Milliseconds(), "", 0, k.Wake, publishCommand(r.c.sharded)).Int64Slice()
		if err == nil && len(res) != 3 {
			err = fmt.Errorf("streamq: promote: unexpected reply of %d elements", len(res))
		}
		if err != nil {
			if ctx.Err() != nil {
				return
			}
			r.c.slots.onError(err)
			r.c.log.WarnContext(r.runCtx, "streamq: promoting scheduled jobs failed; retrying", "stream", k.Stream, "err", err)
			reset(b.next())
			continue
		}
		b = backoff{}
		next, base, baseMono = res[1], res[2], time.Now()
		switch {
		case res[0] >= promoteBatch:
			reset(0) // more are due
		case next < 0:
			reset(promoteBackstop)
		default:
			reset(min(time.Duration(next-base)*time.Millisecond, promoteBackstop))
		}
	}
}

// levelNotice parses a wake notice that a priority level's stream was
// created ("+high", "+low": see produce.lua) and returns the level.
func levelNotice(payload string) (int, bool) {
	if len(payload) < 2 || payload[0] != '+' {
		return 0, false
	}
	for l, name := range levelNames {
		if name != "" && payload[1:] == name {
			return l, true
		}
	}
	return 0, false
}

// signalLevel tells the feeder of stream index v, if it waits for its
// level's stream (awaitLevel), to look again.
func (r *run[Req, Resp]) signalLevel(v int) {
	select {
	case r.levelWake[v] <- struct{}{}:
	default:
	}
}

// retryArgs builds the keys and arguments of a retry.lua call for failed
// attempts of a shard (code recordRetry, value: the delay in milliseconds):
// each is acknowledged and scheduled with its start count in one step.
func (r *run[Req, Resp]) retryArgs(shard int, batch []*completion) ([]string, []any) {
	o := &r.c.opts
	k := r.c.shards[shard]
	keyList := make([]string, 4, 6+len(batch))
	keyList[0], keyList[1], keyList[2], keyList[3] = k.Stream, k.Starts(o.Group), k.Retry, k.ScheduleData
	fanout := "0"
	if o.Fanout {
		fanout = "1"
	}
	now := time.Now().UnixMilli()
	args := make([]any, 7, 7+5*len(batch))
	args[0], args[1], args[2], args[3] = o.Group, o.Name, max(r.recordFloor(), DefaultInflightTTL).Milliseconds(), fanout
	args[4], args[5], args[6] = k.Wake, publishCommand(r.c.sharded), now
	keyed := false // an item is keyed (Key): "%" ends ARGV[4]
	for _, cp := range batch {
		e := cp.s.entry
		if e.ID != "" && !o.Fanout {
			keyList = append(keyList, k.Record(e.ID))
		} else {
			keyList = append(keyList, k.Stream)
		}
		args = append(args, e.EntryID, e.ID, string(cp.value), e.Data, truncateUTF8(cp.errMsg, maxRetryError))
		keyed = keyed || cp.s.meta.key != ""
	}
	keyList = append(keyList, historyKey(k, o, now))
	if keep := o.Retention.errorsKept(); keep > 0 && !o.Fanout {
		// Retention.Errors: each item's error list, after the history.
		args[3] = "0#" + strconv.Itoa(keep)
		for _, cp := range batch {
			if id := cp.s.entry.ID; id != "" {
				keyList = append(keyList, k.Errors(id))
			} else {
				keyList = append(keyList, k.Stream)
			}
		}
	}
	if keyed && !o.Fanout {
		args[3] = args[3].(string) + "%" // keyed entries give back their slots (fair.lua)
	}
	keyList = append(keyList, k.Fanout) // last: the fan-out marker (retry.lua deletes only without it)
	return keyList, args
}

// maxRetryError is the longest error message (in bytes) a waiting retry
// keeps for Admin.Jobs; a longer one is cut at a rune boundary.
const maxRetryError = 1024

// msPerHour is the number of milliseconds of an hour of the history.
const msPerHour = 3600 * 1000

// truncateUTF8 cuts s to at most n bytes without splitting a UTF-8 sequence.
func truncateUTF8(s string, n int) string {
	if len(s) <= n {
		return s
	}
	for n > 0 && !utf8.RuneStart(s[n]) {
		n--
	}
	return s[:n]
}

// describeRecord names the outcome a record's first byte stands for.
func describeRecord(b byte) string {
	switch b {
	case 'R', 'N':
		return "succeeded"
	case 'L':
		return "dead-lettered"
	case 'E':
		return "failed"
	}
	return "record " + string(b)
}
