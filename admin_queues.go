package streamq

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/streamq/streamq/internal/keys"
)

// Queues returns the names of the streamq queues present in the Redis that
// client talks to, sorted. A queue is found by the key in which its first
// producer or consumer recorded its shard count ("streamq:{<queue>}:meta"),
// with SCAN MATCH (never KEYS, which blocks the server); on a Redis Cluster
// every master is scanned. A queue used only through hand-written keys (no
// producer or consumer ever ran) is not listed.
func Queues(ctx context.Context, client redis.UniversalClient) ([]string, error) {
	mustContext(ctx, "Queues")
	if client == nil {
		return nil, fmt.Errorf("%w: client is nil", ErrInvalidOptions)
	}
	return callBounded(ctx, func(ctx context.Context) ([]string, error) { return queues(ctx, client) })
}

// queues is the body of Queues, run by callBounded.
func queues(ctx context.Context, client redis.UniversalClient) ([]string, error) {
	var mu sync.Mutex
	seen := map[string]bool{}
	scan := func(ctx context.Context, c redis.Cmdable) error {
		it := c.Scan(ctx, 0, keys.MetaPattern, 1000).Iterator()
		for it.Next(ctx) {
			if q, ok := keys.QueueOfMeta(it.Val()); ok {
				mu.Lock()
				seen[q] = true
				mu.Unlock()
			}
		}
		return it.Err()
	}
	var err error
	if cc, ok := client.(*redis.ClusterClient); ok {
		err = cc.ForEachMaster(ctx, func(ctx context.Context, m *redis.Client) error { return scan(ctx, m) })
	} else {
		err = scan(ctx, client)
	}
	if err != nil {
		return nil, fmt.Errorf("streamq: list queues: %w", err)
	}
	out := make([]string, 0, len(seen))
	for q := range seen {
		out = append(out, q)
	}
	slices.Sort(out)
	return out, nil
}

// ConsumerInfo describes one consumer of a group, over every shard.
type ConsumerInfo struct {
	// Group is the consumer group.
	Group string `json:"group"`
	// Name is the consumer's name.
	Name string `json:"name"`
	// Pending is the number of entries it holds, read and not yet
	// acknowledged, summed over the shards.
	Pending int64 `json:"pending"`
	// Idle is the time since it last read or claimed an entry (Redis's own
	// idle time, the smallest over the shards). On Redis 7.0 a read that
	// finds nothing does not reset it, so an idle consumer of a quiet queue
	// can be live with a large Idle: see LastSeen.
	Idle time.Duration `json:"idle_ns"`
	// LastSeen is its last heartbeat (a running consumer records one every
	// ClaimInterval, at most every 5s, and one when it stops); zero when it
	// recorded none (pruned, or a streamq version without heartbeats).
	LastSeen time.Time `json:"last_seen,omitzero"`
	// Stopped says it shut down cleanly (its last heartbeat said so): neither
	// live nor stale.
	Stopped bool `json:"stopped"`
	// Succeeded and Failed are its totals since its process created it, as of
	// LastSeen: requests whose response was recorded, and handler attempts
	// that failed (retried or dead-lettered). Their change over time is the
	// consumer's rate; a restart starts them again from 0.
	Succeeded int64 `json:"succeeded"`
	Failed    int64 `json:"failed"`
	// Live says it is running: it has not stopped and its last heartbeat is
	// within AdminOptions.StaleAfter; a consumer neither Live nor Stopped is
	// stale (killed, hung, or cut off from Redis). (For a group whose consumers record no
	// heartbeats, older streamq versions, its Idle is used instead.) A consumer that was killed stays listed as stale
	// until pruned (ConsumerOptions.ConsumerIdleTimeout); its pending entries
	// are claimed by others after MinIdle.
	Live bool `json:"live"`
}

// Consumers returns the consumers of every group of the queue, by group then
// name, with whether each is live. Unknown queue: ErrNotFound.
func (a *Admin) Consumers(ctx context.Context) ([]ConsumerInfo, error) {
	mustContext(ctx, "Admin.Consumers")
	return callBounded(ctx, a.consumers)
}

// consumers is the body of Consumers, run by callBounded.
func (a *Admin) consumers(ctx context.Context) ([]ConsumerInfo, error) {
	shards, err := a.existingShards(ctx)
	if err != nil {
		return nil, err
	}
	groups, err := a.groupNames(ctx, shards)
	if err != nil {
		return nil, err
	}
	var out []ConsumerInfo
	for _, g := range groups {
		cs, err := a.groupConsumers(ctx, shards, g)
		if err != nil {
			return nil, err
		}
		out = append(out, cs...)
	}
	return out, nil
}

// groupNames returns the consumer groups of the queue's shards, in order of
// first appearance.
func (a *Admin) groupNames(ctx context.Context, shards []keys.Keys) ([]string, error) {
	var names []string
	for _, k := range shards {
		groups, err := a.client.XInfoGroups(ctx, k.Stream).Result()
		if err != nil {
			if isNoSuchKey(err) {
				continue
			}
			return nil, fmt.Errorf("streamq: list the groups of %s: %w", a.queue, err)
		}
		for _, g := range groups {
			if !slices.Contains(names, g.Name) {
				names = append(names, g.Name)
			}
		}
	}
	return names, nil
}

// isNoSuchKey reports the error XINFO returns for a stream that does not exist.
func isNoSuchKey(err error) bool {
	return err != nil && strings.HasPrefix(err.Error(), "ERR no such key")
}

// groupConsumers lists the consumers of group over the shards, merged with
// the group's heartbeats, sorted by name.
func (a *Admin) groupConsumers(ctx context.Context, shards []keys.Keys, group string) ([]ConsumerInfo, error) {
	byName := map[string]*ConsumerInfo{}
	get := func(name string) *ConsumerInfo {
		c := byName[name]
		if c == nil {
			c = &ConsumerInfo{Group: group, Name: name, Idle: -1}
			byName[name] = c
		}
		return c
	}
	for _, k := range shards {
		cs, err := a.client.XInfoConsumers(ctx, k.Stream, group).Result()
		if err != nil {
			if isNoSuchKey(err) || isNoGroup(err) {
				continue
			}
			return nil, fmt.Errorf("streamq: list the consumers of %s group %s: %w", a.queue, group, err)
		}
		for _, x := range cs {
			c := get(x.Name)
			c.Pending += x.Pending
			if c.Idle < 0 || x.Idle < c.Idle {
				c.Idle = x.Idle
			}
		}
	}
	seen, err := a.client.HGetAll(ctx, keys.Seen(a.queue, group)).Result()
	if err != nil {
		return nil, fmt.Errorf("streamq: read the heartbeats of %s group %s: %w", a.queue, group, err)
	}
	now := time.Now()
	for name, v := range seen {
		at, succeeded, failed, stopped, ok := parseHeartbeat(v)
		if !ok {
			continue
		}
		c := get(name)
		c.LastSeen, c.Succeeded, c.Failed, c.Stopped = at, succeeded, failed, stopped
	}
	out := make([]ConsumerInfo, 0, len(byName))
	for _, c := range byName {
		if c.Idle < 0 { // heartbeat only: not known to Redis's group yet
			c.Idle = now.Sub(c.LastSeen)
		}
		if len(seen) > 0 {
			// The group's consumers heartbeat: one without a heartbeat
			// stopped cleanly (or was pruned) and is not live.
			c.Live = !c.LastSeen.IsZero() && !c.Stopped && now.Sub(c.LastSeen) < a.opts.StaleAfter
		} else {
			// Consumers of a streamq version without heartbeats: go by
			// Redis's idle time, which an empty blocking read does not reset.
			c.Live = c.Idle < a.opts.StaleAfter
		}
		out = append(out, *c)
	}
	slices.SortFunc(out, func(x, y ConsumerInfo) int {
		switch {
		case x.Name < y.Name:
			return -1
		case x.Name > y.Name:
			return 1
		}
		return 0
	})
	return out, nil
}

// Trim removes, from every shard, the stream entries every consumer group has
// acknowledged, as the consumers' periodic trim does (ConsumerOptions.
// TrimInterval), and returns how many were removed. It never removes an entry
// a group has not acknowledged. Unknown queue: ErrNotFound.
func (a *Admin) Trim(ctx context.Context) (int64, error) {
	mustContext(ctx, "Admin.Trim")
	return callBounded(ctx, a.trim)
}

// trim is the body of Trim, run by callBounded.
func (a *Admin) trim(ctx context.Context) (int64, error) {
	shards, err := a.existingShards(ctx)
	if err != nil {
		return 0, err
	}
	total, err := trimShards(ctx, a.client, shards)
	if err != nil {
		return total, fmt.Errorf("streamq: trim %s: %w", a.queue, err)
	}
	return total, nil
}

// Queue returns the name of the Admin's queue.
func (a *Admin) Queue() string { return a.queue }

// Pause pauses the queue: from at most PauseCheckInterval (500ms) after Pause
// returns, no consumer of any group starts a handler. Handlers already running
// finish and their outcomes are recorded; producers keep accepting requests,
// which wait in the stream. Entries a consumer holds while paused keep their
// lease, and waiting costs them no delivery (a delivery is a handler start).
// The state is a key in Redis (see DESIGN.md), so it survives consumer
// restarts and, with persistence, Redis restarts. Pausing a paused queue
// changes nothing. A nil ctx panics.
func (a *Admin) Pause(ctx context.Context) error {
	mustContext(ctx, "Admin.Pause")
	return callBoundedErr(ctx, a.pause)
}

// pause is the body of Pause, run by callBounded.
func (a *Admin) pause(ctx context.Context) error {
	err := a.client.SetArgs(ctx, keys.Paused(a.queue), time.Now().UnixMilli(), redis.SetArgs{Mode: "NX"}).Err()
	if err != nil && !errors.Is(err, redis.Nil) {
		return fmt.Errorf("streamq: pause %s: %w", a.queue, err)
	}
	return nil
}

// Resume undoes Pause: within about PauseCheckInterval consumers start
// handlers again and drain what waited. Resuming a queue that is not paused
// changes nothing. A nil ctx panics.
func (a *Admin) Resume(ctx context.Context) error {
	mustContext(ctx, "Admin.Resume")
	return callBoundedErr(ctx, a.resume)
}

// resume is the body of Resume, run by callBounded.
func (a *Admin) resume(ctx context.Context) error {
	if err := a.client.Del(ctx, keys.Paused(a.queue)).Err(); err != nil {
		return fmt.Errorf("streamq: resume %s: %w", a.queue, err)
	}
	return nil
}
