package streamq

import (
	"context"
	"errors"
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
	s, ok := m.Values[fieldStarts].(string)
	if !ok {
		return 0
	}
	n, err := strconv.Atoi(s)
	if err != nil || n < 0 {
		return 0
	}
	return n
}

// fieldStarts is the entry field of a promoted retry holding its starts so far.
const fieldStarts = "n"

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
			case *redis.Message:
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
			promoteBatch, startsTTL.Milliseconds()).Int64Slice()
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

// retryArgs builds the keys and arguments of a retry.lua call for failed
// attempts of a shard (code recordRetry, value: the delay in milliseconds):
// each is acknowledged and scheduled with its start count in one step.
func (r *run[Req, Resp]) retryArgs(shard int, batch []*completion) ([]string, []any) {
	o := &r.c.opts
	k := r.c.shards[shard]
	keyList := make([]string, 4, 5+len(batch))
	keyList[0], keyList[1], keyList[2], keyList[3] = k.Stream, k.Starts(o.Group), k.Retry, k.ScheduleData
	fanout := "0"
	if o.Fanout {
		fanout = "1"
	}
	now := time.Now().UnixMilli()
	args := make([]any, 7, 7+5*len(batch))
	args[0], args[1], args[2], args[3] = o.Group, o.Name, max(r.recordFloor(), DefaultInflightTTL).Milliseconds(), fanout
	args[4], args[5], args[6] = k.Wake, publishCommand(r.c.sharded), now
	for _, cp := range batch {
		e := cp.s.entry
		if e.ID != "" && !o.Fanout {
			keyList = append(keyList, k.Record(e.ID))
		} else {
			keyList = append(keyList, k.Stream)
		}
		args = append(args, e.EntryID, e.ID, string(cp.value), e.Data, truncateUTF8(cp.errMsg, maxRetryError))
	}
	keyList = append(keyList, k.History(now/msPerHour))
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

// Cancel cancels a request that waits in the schedule: one produced with At
// or After whose time has not come, or a retry waiting for its back-off; or
// a flow's parent waiting for its children (ProduceFlow), whose children
// that are scheduled, queued or waiting are cancelled with it (running ones
// finish; what is cancelled counts once each in Stats.Canceled).
// Its callers get ErrCanceled (through the stored outcome, kept ResultTTL,
// and a notice), and producing the id again meanwhile returns that outcome.
// A cancelled child of a flow counts as a failed child for its parent.
// Each cancellation counts once in Stats.Canceled. Cancelling a cancelled
// request again returns nil and counts nothing (so does a resend after a lost
// reply). A request that is already in the stream, running or completed
// cannot be cancelled: Cancel returns ErrNotScheduled; an id with no record
// returns ErrNotFound. A nil ctx panics.
func (a *Admin) Cancel(ctx context.Context, id string) error {
	mustContext(ctx, "Admin.Cancel")
	if err := validateID(id); err != nil {
		return err
	}
	shards, err := a.shards(ctx)
	if err != nil {
		return err
	}
	k := shards[keys.ShardOf(id, len(shards))]
	// A flow's child names its parent in its stream fields: in the schedule's
	// data while it waits there, in its own flow hash while it is a nested
	// parent waiting for its children.
	pipe := a.client.Pipeline()
	data := pipe.HGet(ctx, k.ScheduleData, "r"+id)
	stored := pipe.HGet(ctx, k.Flow(id), "e")
	_, _ = pipe.Exec(ctx)
	parent := ""
	if raw, err := data.Result(); err == nil {
		if d, ok := splitLengthPrefixed(raw); ok && len(d) >= 4 {
			parent = fieldOf(d[3], fieldParent)
		}
	}
	if raw, err := stored.Result(); err == nil && parent == "" {
		parent = fieldOf(raw, fieldParent)
	}
	answering, err := a.client.Get(ctx, keys.AnsweringGroup(a.queue)).Result()
	if err != nil && !errors.Is(err, redis.Nil) {
		return fmt.Errorf("streamq: cancel %q: read the answering group: %w", id, err)
	}
	msg := "canceled by Admin.Cancel at " + time.Now().UTC().Format(time.RFC3339Nano)
	res, err := a.cancel(ctx, k, id, answering, parent, msg, false)
	if err != nil {
		return err
	}
	code, _ := res[0].(int64)
	switch code {
	case 0:
		return fmt.Errorf("%w: request %q of %s has no record (never produced, or its outcome expired)", ErrNotFound, id, a.queue)
	case 1:
		rec, _ := res[1].(string)
		state := "completed"
		if len(rec) > 0 {
			state = "completed (" + describeRecord(rec[0]) + ")"
		}
		if len(rec) > 0 && rec[0] == recordInflight {
			state = "already in the stream as entry " + rec[1:] + " (queued or running)"
		}
		return fmt.Errorf("%w: request %q of %s is %s", ErrNotScheduled, id, a.queue, state)
	}
	return a.cancelChildren(ctx, k.Flow(id), msg, 0)
}

// cancel runs cancel.lua for id in shard k; parent is the flow hash of the
// request's parent, or "".
func (a *Admin) cancel(ctx context.Context, k keys.Keys, id, group, parent, msg string, queued bool) ([]any, error) {
	keyList := []string{k.Record(id), k.Schedule, k.ScheduleData, k.Counts, k.Retry, k.Stream}
	if rec, stream, ok := keys.FlowParent(parent); ok {
		keyList = append(keyList, parent, rec, stream)
	}
	q := ""
	if queued {
		q = "q"
	}
	res, err := scripts.Cancel.Run(ctx, a.client, keyList,
		id, a.opts.ResultTTL.Milliseconds(), k.Channel, publishCommand(isCluster(a.client)), msg, group, q).Slice()
	if err != nil {
		if errors.Is(err, redis.Nil) {
			return nil, fmt.Errorf("%w: request %q of %s", ErrNotFound, id, a.queue)
		}
		return nil, fmt.Errorf("streamq: cancel %q: %w", id, err)
	}
	return res, nil
}

// cancelChildren cancels the children of a cancelled flow parent (flow is
// its flow hash) that have no outcome yet and are scheduled, queued or
// waiting for children of their own (recursively); running children finish.
// A flow hash that is gone (not a flow) cancels nothing.
func (a *Admin) cancelChildren(ctx context.Context, flow, msg string, depth int) error {
	h, err := a.client.HGetAll(ctx, flow).Result()
	if err != nil {
		return fmt.Errorf("streamq: read the children of %s: %w", flow, err)
	}
	if len(h) == 0 || depth > MaxFlowChildren {
		return nil
	}
	order, ok := splitLengthPrefixed(h["o"])
	if !ok {
		return nil
	}
	for i := 0; i+2 < len(order); i += 3 {
		if h["k:"+order[i]] != "" {
			continue // has its outcome
		}
		queue, id := order[i+1], order[i+2]
		n, err := queueShards(ctx, a.client, queue)
		if err != nil {
			return err
		}
		ks, err := keys.Shards(queue, n)
		if err != nil {
			return err
		}
		ck := ks[keys.ShardOf(id, n)]
		group, err := a.client.Get(ctx, keys.AnsweringGroup(queue)).Result()
		if err != nil && !errors.Is(err, redis.Nil) {
			return fmt.Errorf("streamq: cancel child %q: read the answering group: %w", id, err)
		}
		// The parent is cancelled: the child's outcome need not count there.
		res, err := a.cancel(ctx, ck, id, group, "", msg, true)
		if err != nil {
			return err
		}
		if code, _ := res[0].(int64); code == 2 {
			if prev, _ := res[1].(string); prev == "P&" {
				if err := a.cancelChildren(ctx, ck.Flow(id), msg, depth+1); err != nil {
					return err
				}
			}
		}
	}
	return nil
}

// fieldOf returns the value of stream field name in length-prefixed fields
// (name, value, ...), or "".
func fieldOf(encoded, name string) string {
	f, ok := splitLengthPrefixed(encoded)
	if !ok {
		return ""
	}
	for i := 0; i+1 < len(f); i += 2 {
		if f[i] == name {
			return f[i+1]
		}
	}
	return ""
}
