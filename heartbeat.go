package streamq

import (
	"context"
	"strconv"
	"time"

	"github.com/streamq/streamq/internal/keys"
)

// maxHeartbeatInterval bounds the time between two heartbeats of a running
// consumer (ClaimInterval when shorter). Admin calls a consumer live while its
// last heartbeat is younger than AdminOptions.StaleAfter.
const maxHeartbeatInterval = 5 * time.Second

// seenTTL is how long a group's heartbeat hash outlives its last heartbeat.
const seenTTL = 7 * 24 * time.Hour

// heartbeatLoop records, every min(ClaimInterval, 5s), that this consumer is
// alive: it sets its field of the group's heartbeat hash (keys.Seen) to the
// time. Redis's own consumer idle time cannot tell: on Redis 7.0 a blocking
// read that finds nothing does not reset it, so a healthy consumer of an
// empty queue would look dead. On stop the field is deleted, so a consumer
// that shut down cleanly is not counted, live or stale.
func (r *run[Req, Resp]) heartbeatLoop() {
	defer r.loops.Done()
	key := keys.Seen(r.c.queue, r.c.opts.Group)
	beat := func() {
		pipe := r.c.client.Pipeline()
		pipe.HSet(r.bg, key, r.c.opts.Name, strconv.FormatInt(time.Now().UnixMilli(), 10))
		pipe.PExpire(r.bg, key, seenTTL)
		if _, err := pipe.Exec(r.bg); err != nil && r.bg.Err() == nil {
			r.c.log.Debug("streamq: heartbeat failed; will retry", "err", err)
		}
	}
	beat()
	t := time.NewTicker(min(r.c.opts.ClaimInterval, maxHeartbeatInterval))
	defer t.Stop()
	for {
		select {
		case <-r.stopLoops:
			ctx, cancel := context.WithTimeout(r.bg, time.Second)
			_ = r.c.client.HDel(ctx, key, r.c.opts.Name).Err()
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
	old := time.Now().Add(-c.opts.ConsumerIdleTimeout).UnixMilli()
	drop := append([]string(nil), deleted...)
	for name, v := range seen {
		if ms, err := strconv.ParseInt(v, 10, 64); err != nil || ms < old {
			drop = append(drop, name)
		}
	}
	if len(drop) == 0 {
		return nil
	}
	return c.client.HDel(ctx, key, drop...).Err()
}
