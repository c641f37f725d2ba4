package streamq

import (
	"context"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/streamq/streamq/internal/keys"
)

// maxHeartbeatInterval bounds the time between two heartbeats of a running
// consumer (ClaimInterval when shorter). Admin calls a consumer live while its
// last heartbeat is younger than AdminOptions.StaleAfter.
const maxHeartbeatInterval = 5 * time.Second

// seenTTL is how long a group's heartbeat hash outlives its last heartbeat.
const seenTTL = 7 * 24 * time.Hour

// outcomeCounts are a consumer's totals since it was created, reported in
// each heartbeat so that operators can draw rates without a counter written
// on every completion.
type outcomeCounts struct {
	succeeded atomic.Int64 // outcomes recorded with a response
	failed    atomic.Int64 // handler attempts that failed (retried or dead-lettered)
}

// countRecorded counts the successes of a recorded completion batch.
func (c *outcomeCounts) countRecorded(batch []*completion) {
	var n int64
	for _, cp := range batch {
		if cp.code == keys.RecordResult {
			n++
		}
	}
	c.succeeded.Add(n)
}

// stoppedSuffix ends the last heartbeat of a consumer that stopped cleanly.
const stoppedSuffix = ":stopped"

// heartbeatValue is a heartbeat field's value: "<unix ms>:<succeeded>:<failed>",
// followed by stoppedSuffix in the last one of a clean stop.
func heartbeatValue(now time.Time, c *outcomeCounts) string {
	return strconv.FormatInt(now.UnixMilli(), 10) + ":" + strconv.FormatInt(c.succeeded.Load(), 10) +
		":" + strconv.FormatInt(c.failed.Load(), 10)
}

// parseHeartbeat reads a heartbeat value; ok is false when it is not one.
func parseHeartbeat(v string) (at time.Time, succeeded, failed int64, stopped, ok bool) {
	v, stopped = strings.CutSuffix(v, stoppedSuffix)
	parts := strings.Split(v, ":")
	ms, err := strconv.ParseInt(parts[0], 10, 64)
	if err != nil {
		return time.Time{}, 0, 0, false, false
	}
	if len(parts) == 3 {
		succeeded, _ = strconv.ParseInt(parts[1], 10, 64)
		failed, _ = strconv.ParseInt(parts[2], 10, 64)
	}
	return time.UnixMilli(ms), succeeded, failed, stopped, true
}

// heartbeatLoop records, every min(ClaimInterval, 5s), that this consumer is
// alive: it sets its field of the group's heartbeat hash (keys.Seen) to the
// time and its outcome totals. Redis's own consumer idle time cannot tell: on Redis 7.0 a blocking
// read that finds nothing does not reset it, so a healthy consumer of an
// empty queue would look dead. On stop the value gets stoppedSuffix, so a
// consumer that shut down cleanly counts as neither live nor stale.
func (r *run[Req, Resp]) heartbeatLoop() {
	defer r.loops.Done()
	key := keys.Seen(r.c.queue, r.c.opts.Group)
	beat := func() {
		pipe := r.c.client.Pipeline()
		pipe.HSet(r.bg, key, r.c.opts.Name, heartbeatValue(time.Now(), &r.c.outcomes))
		pipe.PExpire(r.bg, key, seenTTL)
		if _, err := pipe.Exec(r.bg); err != nil && r.bg.Err() == nil {
			r.c.log.DebugContext(r.runCtx, "streamq: heartbeat failed; will retry", "err", err)
		}
	}
	beat()
	t := time.NewTicker(min(r.c.opts.ClaimInterval, maxHeartbeatInterval))
	defer t.Stop()
	for {
		select {
		case <-r.stopLoops:
			ctx, cancel := context.WithTimeout(r.bg, time.Second)
			_ = r.c.client.HSet(ctx, key, r.c.opts.Name, heartbeatValue(time.Now(), &r.c.outcomes)+stoppedSuffix).Err()
			cancel()
			return
		case <-t.C:
			beat()
		}
	}
}

// pruneSeen deletes heartbeat fields of consumers that pruning deleted, and of
// any consumer whose last heartbeat is older than ConsumerIdleTimeout (one
// that was killed and never came back).
func pruneSeen[Req, Resp any](ctx context.Context, c *Consumer[Req, Resp], deleted []string) error {
	key := keys.Seen(c.queue, c.opts.Group)
	seen, err := c.client.HGetAll(ctx, key).Result()
	if err != nil {
		return err
	}
	old := time.Now().Add(-c.opts.ConsumerIdleTimeout)
	drop := append([]string(nil), deleted...)
	for name, v := range seen {
		if at, _, _, _, ok := parseHeartbeat(v); !ok || at.Before(old) {
			drop = append(drop, name)
		}
	}
	if len(drop) == 0 {
		return nil
	}
	return c.client.HDel(ctx, key, drop...).Err()
}
