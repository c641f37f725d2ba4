package streamq

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/streamq/streamq/internal/keys"
)

// Admin inspects and repairs a queue: statistics and the dead-letter stream.
// It reads the queue's shard count from Redis and covers every shard. It is
// safe for concurrent use.
//
// Every call returns within its ctx, also when Redis or the network stops
// answering (go-redis alone would wait for the client's ReadTimeout): when
// ctx ends first, the call returns ctx's error at once and its Redis work
// is left to finish in the background, where it sends no further command.
// A write under way then may or may not have taken effect, as when a reply
// is lost: after a Cancel, Requeue or Forget that returned ctx's error, look
// (Job) before trying again.
type Admin struct {
	client   redis.UniversalClient
	queue    string
	opts     AdminOptions
	serverOK atomic.Bool // checkServer passed
	// beforeCancel, when set (tests), runs right before each cancel.lua call.
	beforeCancel func()
}

// AdminOptions configures an Admin. The zero value (or nil) uses the defaults.
type AdminOptions struct {
	// Group is the consumer group whose dead letters DeadLetters, Requeue and
	// PurgeDeadLetters address. Default "" = the queue's answering group.
	Group string
	// InflightTTL is the in-flight record TTL Requeue gives a requeued request.
	// Default DefaultInflightTTL; use the producers' value.
	InflightTTL time.Duration
	// StaleAfter is how long after its last heartbeat (or, for a consumer
	// without heartbeats, its last read) a consumer counts as stale rather
	// than live, in Stats and Consumers. Running consumers heartbeat every
	// ClaimInterval, at most every 5s. Default DefaultStaleAfter (30s).
	StaleAfter time.Duration
	// ResultTTL is how long Cancel keeps the outcome of a cancelled request
	// (callers get ErrCanceled meanwhile). Default DefaultResultTTL; use the
	// consumers' value.
	ResultTTL time.Duration
}

// DefaultStaleAfter is the default AdminOptions.StaleAfter.
const DefaultStaleAfter = 30 * time.Second

// NewAdmin returns an Admin for queue. opts may be nil for the defaults. It
// does not touch Redis.
func NewAdmin(client redis.UniversalClient, queue string, opts *AdminOptions) (*Admin, error) {
	if client == nil {
		return nil, fmt.Errorf("%w: client is nil", ErrInvalidOptions)
	}
	if err := keys.ValidateQueue(queue); err != nil {
		return nil, fmt.Errorf("%w: %v", ErrInvalidOptions, err)
	}
	var o AdminOptions
	if opts != nil {
		o = *opts
	}
	if err := validName("Group", o.Group); err != nil {
		return nil, err
	}
	switch {
	case o.InflightTTL == 0:
		o.InflightTTL = DefaultInflightTTL
	case o.InflightTTL < time.Millisecond:
		return nil, optionError("InflightTTL is %v; it must be at least 1ms (leave it 0 for the default %v)", o.InflightTTL, DefaultInflightTTL)
	}
	switch {
	case o.StaleAfter == 0:
		o.StaleAfter = DefaultStaleAfter
	case o.StaleAfter < time.Millisecond:
		return nil, optionError("StaleAfter is %v; it must be at least 1ms (leave it 0 for the default %v)", o.StaleAfter, DefaultStaleAfter)
	}
	switch {
	case o.ResultTTL == 0:
		o.ResultTTL = DefaultResultTTL
	case o.ResultTTL < time.Millisecond:
		return nil, optionError("ResultTTL is %v; it must be at least 1ms (leave it 0 for the default %v)", o.ResultTTL, DefaultResultTTL)
	}
	return &Admin{client: client, queue: queue, opts: o}, nil
}

// shards returns the names of every shard of the queue.
func (a *Admin) shards(ctx context.Context) ([]keys.Keys, error) {
	if !a.serverOK.Load() {
		if err := checkServer(ctx, a.client, nil); err != nil {
			return nil, err
		}
		a.serverOK.Store(true)
	}
	n, err := queueShards(ctx, a.client, a.queue)
	if err != nil {
		return nil, err
	}
	return keys.Shards(a.queue, n)
}

// Stats describes a queue at one moment.
type Stats struct {
	// Length is the number of entries in the stream (in the streams of
	// every priority level).
	Length int64 `json:"length"`
	// Levels splits Length and the groups' pending entries by priority level
	// (see Priority), highest first; nil while the queue has only the
	// default level's stream.
	Levels []LevelStats `json:"levels,omitempty"`
	// DeadLetters is the number of entries in the dead-letter stream.
	DeadLetters int64 `json:"dead_letters"`
	// Scheduled is the number of jobs waiting in the schedule: delayed
	// requests (At, After) and retries waiting for their back-off.
	Scheduled int64 `json:"scheduled"`
	// Retrying is the part of Scheduled that are retries waiting for their
	// back-off (of every group); Scheduled - Retrying are delayed requests.
	Retrying int64 `json:"retrying"`
	// Completed is the number of requests in the list of recently completed
	// ones (ConsumerOptions.Retention; Admin.Completed); 0 without one.
	Completed int64 `json:"completed"`
	// Canceled is the number of requests Admin.Cancel cancelled since the
	// queue was created; cancelling a cancelled request again counts
	// nothing. Each shard keeps its total in a hash that never expires
	// (streamq:{<queue>}:counts, see DESIGN.md's key layout), so the sum only
	// increases: sample it twice for a rate. streamq has no call that
	// deletes a queue; deleting its keys by hand starts the count again.
	Canceled int64 `json:"canceled"`
	// Groups describes each consumer group.
	Groups []GroupStats `json:"groups"`
	// Paused reports whether the queue is paused (Admin.Pause).
	Paused bool `json:"paused"`
	// PausedAt is when the queue was paused; the zero time when it is not.
	PausedAt time.Time `json:"paused_at,omitzero"`
}

// LevelStats describes one priority level of a queue.
type LevelStats struct {
	// Priority is the level.
	Priority PriorityLevel `json:"priority"`
	// Length is the number of entries in the level's streams.
	Length int64 `json:"length"`
	// Pending is the number of the level's entries delivered to a group and
	// not yet acknowledged, summed over the groups.
	Pending int64 `json:"pending"`
}

// GroupStats describes one consumer group.
type GroupStats struct {
	// Name is the group's name.
	Name string `json:"name"`
	// Answering says the group is the queue's answering group (the one
	// whose outcomes callers receive; every other group is a fan-out
	// group). False for every group while no consumer recorded which one
	// answers (older versions).
	Answering bool `json:"answering,omitempty"`
	// Consumers is the number of live consumers in the group: those whose
	// last heartbeat (or read) is within AdminOptions.StaleAfter. A consumer
	// that was killed is not counted, though Redis lists it until pruned.
	Consumers int64 `json:"consumers"`
	// StaleConsumers is the number of consumers Redis still lists that are
	// not live and did not stop cleanly (killed, hung, or cut off from Redis);
	// see Admin.Consumers. Consumers that stopped cleanly count in neither.
	StaleConsumers int64 `json:"stale_consumers"`
	// Succeeded and Failed sum the outcome totals the group's consumers
	// report in their heartbeats (see ConsumerInfo): sample them twice for a
	// rate. A consumer's totals start again from 0 when it restarts, so a
	// sum can go down; count only increases.
	Succeeded int64 `json:"succeeded"`
	Failed    int64 `json:"failed"`
	// Pending is the number of entries delivered and not yet acknowledged.
	Pending int64 `json:"pending"`
	// Lag is the number of entries not yet delivered to the group: those in
	// the stream after the group's position. Redis's own figure (entries
	// added minus entries read) also counts entries deleted before the group
	// read them (Admin.Forget of a queued request, say), and is nil while
	// such an entry was past the group's position. So Stats counts the
	// entries itself when Redis gives no figure or one the stream cannot hold
	// (more than its length minus the group's pending entries), reading up to
	// 10,000 entries (payloads included) on each side of the group's position
	// and reporting -1 when both sides hold more; and when other entries sit
	// before the position too (several groups), it checks Redis's figure
	// against the entries after the position, reading up to 100 of them.
	// A priority level's stream where the group does not exist yet (no
	// consumer of the group has seen the level: consumers down, or paused
	// when its first job came) counts wholly: the group reads it from the
	// start once created.
	Lag int64 `json:"lag"`
	// OldestPendingAge is the idle time of the longest-idle pending entry.
	OldestPendingAge time.Duration `json:"oldest_pending_age_ns"`
	// OldestQueuedAge is the age of the oldest entry not yet delivered to
	// the group (its stream id's time, against this process's clock): how
	// long the next job this group reads has waited in the stream, the
	// queue's latency. The entry right after the group's position (XRANGE
	// from its last-delivered id, COUNT 1: one cheap read per stream while
	// the group has a lag), the oldest over the shards and priority levels;
	// 0 when nothing waits. Entries released unstarted by a consumer that
	// shut down are not looked at (they are in the group's past).
	OldestQueuedAge time.Duration `json:"oldest_queued_age_ns"`
	// DeadLetters is the number of entries in this group's dead-letter
	// stream, summed over the shards: the answering group's is
	// Stats.DeadLetters, a fan-out group's its own stream's.
	DeadLetters int64 `json:"dead_letters"`
}

// Stats returns the queue's statistics, summed over its shards; a consumer
// counts once however many shards it reads. An unknown queue (no producer or
// consumer ever used it) is ErrNotFound.
func (a *Admin) Stats(ctx context.Context) (Stats, error) {
	mustContext(ctx, "Admin.Stats")
	return callBounded(ctx, a.stats)
}

// stats is the body of Stats, run by callBounded.
func (a *Admin) stats(ctx context.Context) (Stats, error) {
	var s Stats
	shards, err := a.existingShards(ctx)
	if err != nil {
		return s, err
	}
	if s.PausedAt, s.Paused, err = pausedSince(ctx, a.client, a.queue); err != nil {
		return s, fmt.Errorf("streamq: stats of %s: %w", a.queue, err)
	}
	answering, err := a.client.Get(ctx, keys.AnsweringGroup(a.queue)).Result()
	if err != nil && !errors.Is(err, redis.Nil) {
		return s, fmt.Errorf("streamq: read the answering group of %s: %w", a.queue, err)
	}
	byName := map[string]int{}
	for _, k := range shards {
		if err := a.shardStats(ctx, k, answering, &s, byName); err != nil {
			return s, fmt.Errorf("streamq: stats of %s: %w", a.queue, err)
		}
	}
	if err := a.levelStats(ctx, shards, &s, byName); err != nil {
		return s, fmt.Errorf("streamq: stats of %s: %w", a.queue, err)
	}
	for i := range s.Groups {
		g := &s.Groups[i]
		g.Answering = g.Name == answering
		cs, err := a.groupConsumers(ctx, shards, g.Name)
		if err != nil {
			return s, err
		}
		for _, c := range cs {
			g.Succeeded += c.Succeeded
			g.Failed += c.Failed
			switch {
			case c.Live:
				g.Consumers++
			case !c.Stopped:
				g.StaleConsumers++
			}
		}
	}
	return s, nil
}

func (a *Admin) shardStats(ctx context.Context, k keys.Keys, answering string, s *Stats, byName map[string]int) error {
	length, err := a.client.XLen(ctx, k.Stream).Result()
	if err != nil {
		return err
	}
	scheduled, err := a.client.ZCard(ctx, k.Schedule).Result()
	if err != nil {
		return err
	}
	retries, err := a.client.ZCard(ctx, k.Retry).Result()
	if err != nil {
		return err
	}
	s.Scheduled += scheduled + retries
	s.Retrying += retries
	completed, err := a.client.ZCard(ctx, k.Completed).Result()
	if err != nil {
		return err
	}
	s.Completed += completed
	dead, err := a.client.XLen(ctx, k.DeadLetter).Result()
	if err != nil {
		return err
	}
	canceled, err := a.client.HGet(ctx, k.Counts, "canceled").Int64()
	if err != nil && !errors.Is(err, redis.Nil) {
		return err
	}
	s.Length += length
	s.DeadLetters += dead
	s.Canceled += canceled
	if length == 0 {
		if n, err := a.client.Exists(ctx, k.Stream).Result(); err != nil || n == 0 {
			return err
		}
	}
	_, _, err = a.streamGroupStats(ctx, k, length, dead, answering, s, byName)
	return err
}

// levelStats adds the streams of the priority levels other than the default
// to s, and fills s.Levels when one of them exists.
func (a *Admin) levelStats(ctx context.Context, shards []keys.Keys, s *Stats, byName map[string]int) error {
	var levels [numLevels]LevelStats
	found := false
	// The groups of each shard's default stream: a level stream that no
	// consumer has seen yet has no group, and each of them reads its
	// entries from the start once it creates its group there.
	defaultGroups := make(map[int][]string)
	groupsOf := func(shard int) ([]string, error) {
		if names, ok := defaultGroups[shard]; ok {
			return names, nil
		}
		groups, err := a.client.XInfoGroups(ctx, shards[shard].Stream).Result()
		if err != nil && !isNoSuchKey(err) {
			return nil, err
		}
		names := []string{}
		for _, g := range groups {
			names = append(names, g.Name)
		}
		defaultGroups[shard] = names
		return names, nil
	}
	for _, l := range [...]int{levelHigh, levelLow, levelNormal} {
		if l == levelNormal && !found {
			break // only the default level: no split
		}
		levels[l].Priority = levelValue[l]
		for shard, k := range shards {
			k = k.AtLevel(levelNames[l])
			n, err := a.client.Exists(ctx, k.Stream).Result()
			if err != nil {
				return err
			}
			if n == 0 {
				continue
			}
			length, err := a.client.XLen(ctx, k.Stream).Result()
			if err != nil {
				return err
			}
			levels[l].Length += length
			if l == levelNormal {
				// Counted in s by shardStats: only the pending entries here.
				groups, err := a.client.XInfoGroups(ctx, k.Stream).Result()
				if err != nil {
					return err
				}
				for _, g := range groups {
					levels[l].Pending += g.Pending
				}
				continue
			}
			found = true
			s.Length += length
			// The dead letters are the shard's, counted once by shardStats.
			pending, seen, err := a.streamGroupStats(ctx, k, length, -1, "", s, byName)
			if err != nil {
				return err
			}
			levels[l].Pending += pending
			names, err := groupsOf(shard)
			if err != nil {
				return err
			}
			for _, name := range names {
				if slices.Contains(seen, name) {
					continue
				}
				// No group here yet: every entry of the level waits for it.
				i, ok := byName[name]
				if !ok {
					i = len(s.Groups)
					byName[name] = i
					s.Groups = append(s.Groups, GroupStats{Name: name})
				}
				gs := &s.Groups[i]
				if gs.Lag >= 0 {
					gs.Lag += length
				}
				if first, err := a.client.XRangeN(ctx, k.Stream, "-", "+", 1).Result(); err != nil {
					return err
				} else if len(first) == 1 {
					ms, _ := parseStreamID(first[0].ID)
					gs.OldestQueuedAge = max(gs.OldestQueuedAge, time.Since(time.UnixMilli(int64(ms))))
				}
			}
		}
	}
	if found {
		for _, l := range levelOrder {
			s.Levels = append(s.Levels, levels[l])
		}
	}
	return nil
}

// streamGroupStats adds the groups of k.Stream (holding length entries) to
// s and returns their pending entries and their names. dead is the length of the answering
// group's dead-letter stream (group answering); -1 counts no dead letters (a
// priority level's stream: they are the shard's).
func (a *Admin) streamGroupStats(ctx context.Context, k keys.Keys, length, dead int64, answering string, s *Stats, byName map[string]int) (int64, []string, error) {
	var pending int64
	groups, err := a.client.XInfoGroups(ctx, k.Stream).Result()
	if err != nil {
		return 0, nil, err
	}
	names := make([]string, 0, len(groups))
	for _, g := range groups {
		names = append(names, g.Name)
		pending += g.Pending
		i, ok := byName[g.Name]
		if !ok {
			i = len(s.Groups)
			byName[g.Name] = i
			s.Groups = append(s.Groups, GroupStats{Name: g.Name})
		}
		gs := &s.Groups[i]
		gs.Pending += g.Pending
		if dead >= 0 {
			groupDead := dead
			if g.Name != answering {
				if groupDead, err = a.client.XLen(ctx, k.GroupDeadLetter(g.Name)).Result(); err != nil {
					return 0, nil, err
				}
			}
			gs.DeadLetters += groupDead
		}
		lag := g.Lag
		switch {
		case lag < 0 || lag > length-g.Pending:
			// Redis cannot tell, or counts entries deleted unread.
			if lag, err = a.countLag(ctx, k.Stream, g.LastDeliveredID, length); err != nil {
				return 0, nil, err
			}
		case lag > 0 && lag < length-g.Pending:
			if lag, err = a.checkLag(ctx, k.Stream, g.LastDeliveredID, lag); err != nil {
				return 0, nil, err
			}
		}
		switch {
		case lag < 0 || gs.Lag < 0:
			gs.Lag = -1
		default:
			gs.Lag += lag
		}
		if lag != 0 {
			next, err := a.client.XRangeN(ctx, k.Stream, "("+g.LastDeliveredID, "+", 1).Result()
			if err != nil {
				return 0, nil, err
			}
			if len(next) == 1 {
				ms, _ := parseStreamID(next[0].ID)
				gs.OldestQueuedAge = max(gs.OldestQueuedAge, time.Since(time.UnixMilli(int64(ms))))
			}
		}
		if g.Pending > 0 {
			// The oldest pending entry is not always the longest idle one, so
			// look at a bounded window of pending entries.
			pend, err := a.client.XPendingExt(ctx, &redis.XPendingExtArgs{
				Stream: k.Stream, Group: g.Name, Start: "-", End: "+", Count: 1000,
			}).Result()
			if err != nil {
				return 0, nil, err
			}
			for _, p := range pend {
				gs.OldestPendingAge = max(gs.OldestPendingAge, p.Idle)
			}
		}
	}
	return pending, names, nil
}

// lagCountLimit bounds the entries countLag reads on each side of a group's
// position.
const lagCountLimit = 10000

// countLag counts the entries of stream after a group's last-delivered id,
// for when Redis cannot tell (XINFO GROUPS lag is nil after an entry past that
// id was deleted, as Admin.Forget of a queued request does) or counts entries
// deleted before the group read them. It reads the entries up to the
// id, normally only the pending ones since completed entries are deleted, and
// subtracts them from length; when there are more than lagCountLimit, it reads
// the entries after the id instead. It returns -1 when both sides hold more.
func (a *Admin) countLag(ctx context.Context, stream, lastDelivered string, length int64) (int64, error) {
	count := func(start, end string) (int64, bool, error) {
		var n int64
		for n < lagCountLimit {
			msgs, err := a.client.XRangeN(ctx, stream, start, end, 1000).Result()
			if err != nil {
				return 0, false, err
			}
			n += int64(len(msgs))
			if len(msgs) < 1000 {
				return n, true, nil
			}
			start = "(" + msgs[len(msgs)-1].ID
		}
		return n, false, nil
	}
	before, ok, err := count("-", lastDelivered)
	if err != nil || ok {
		return max(length-before, 0), err
	}
	after, ok, err := count("("+lastDelivered, "+")
	if err != nil || !ok {
		return -1, err
	}
	return after, nil
}

// lagCheckLimit bounds the entries checkLag reads.
const lagCheckLimit = 100

// checkLag returns Redis's lag of a group, or fewer when fewer entries follow
// the group's position: Redis counts entries deleted before the group read
// them. Used when entries the group has acknowledged stay in the stream (for
// other groups), so that the stream's length and the group's pending count
// cannot tell. It reads at most lagCheckLimit entries; a lag beyond that is
// taken as Redis reports it.
func (a *Admin) checkLag(ctx context.Context, stream, lastDelivered string, lag int64) (int64, error) {
	want := min(lag, lagCheckLimit)
	msgs, err := a.client.XRangeN(ctx, stream, "("+lastDelivered, "+", want).Result()
	if err != nil {
		return 0, err
	}
	if n := int64(len(msgs)); n < want {
		return n, nil
	}
	return lag, nil
}

// ErrNotFound is returned when a queue, a request id or a dead letter does
// not exist (any more).
var ErrNotFound = errors.New("streamq: not found")

// QueueKeys are the Redis names of one shard of a queue.
type QueueKeys struct {
	// Stream is the stream of requests.
	Stream string
	// DeadLetter is the dead-letter stream.
	DeadLetter string
	// Channel is the pub/sub channel of completion notices: the outcomes
	// of requests produced by Produce, ProduceBatch and ProduceFlow (or
	// attached to by one of them); Enqueue, EnqueueBatch and Send announce
	// none, since nobody waits for them.
	Channel string
	// RecordPattern is a SCAN pattern matching the per-request record keys.
	RecordPattern string
}

// Keys returns the Redis names the queue uses, one QueueKeys per shard, for
// operators and scripts.
func (a *Admin) Keys(ctx context.Context) ([]QueueKeys, error) {
	mustContext(ctx, "Admin.Keys")
	return callBounded(ctx, a.keys)
}

// keys is the body of Keys, run by callBounded.
func (a *Admin) keys(ctx context.Context) ([]QueueKeys, error) {
	shards, err := a.shards(ctx)
	if err != nil {
		return nil, err
	}
	out := make([]QueueKeys, len(shards))
	for i, k := range shards {
		out[i] = QueueKeys{Stream: k.Stream, DeadLetter: k.DeadLetter, Channel: k.Channel, RecordPattern: k.RecordPattern()}
	}
	return out, nil
}

// HistoryPoint is one minute of Admin.History.
type HistoryPoint struct {
	// Minute is the start of the minute (UTC).
	Minute time.Time `json:"minute"`
	// Processed counts the outcomes recorded (succeeded and dead-lettered)
	// plus the retries scheduled in the minute.
	Processed int64 `json:"processed"`
	// Failed counts the failed attempts (retries scheduled and dead letters).
	Failed int64 `json:"failed"`
}

// History returns processed and failed per minute over the last span (0 or
// more than 24h: 24 hours), one point per minute, oldest first, the current
// minute last, minutes without completions zero-filled, summed over every
// shard and every consumer of the Admin's group (AdminOptions.Group; default
// the answering group: a job that fan-out groups process too counts once;
// every replica writes the same hashes). It reads one hash per hour and
// shard in one pipelined round trip (after reading the shard count and the
// answering group). The minutes are those of the consumers' clocks; a span is
// clamped to 24 hours, which the hashes keep (25 hours). The consumers add
// their completions about once per second, so the counts lag by about that.
func (a *Admin) History(ctx context.Context, span time.Duration) ([]HistoryPoint, error) {
	mustContext(ctx, "Admin.History")
	return callBounded(ctx, func(ctx context.Context) ([]HistoryPoint, error) { return a.history(ctx, span) })
}

// history is the body of History, run by callBounded.
func (a *Admin) history(ctx context.Context, span time.Duration) ([]HistoryPoint, error) {
	if span <= 0 || span > 24*time.Hour {
		span = 24 * time.Hour
	}
	shards, err := a.shards(ctx)
	if err != nil {
		return nil, err
	}
	t, err := a.target(ctx)
	if err != nil {
		return nil, err
	}
	now := time.Now().UTC().Truncate(time.Minute)
	n := int(span / time.Minute)
	if n < 1 {
		n = 1
	}
	first := now.Add(-time.Duration(n-1) * time.Minute)
	firstHour, lastHour := first.Unix()/3600, now.Unix()/3600
	pipe := a.client.Pipeline()
	type read struct {
		hour int64
		cmd  *redis.MapStringStringCmd
	}
	var reads []read
	for _, k := range shards {
		for h := firstHour; h <= lastHour; h++ {
			key := k.History(h)
			if t.fanout {
				key = k.GroupHistory(t.group, h)
			}
			reads = append(reads, read{h, pipe.HGetAll(ctx, key)})
		}
	}
	if _, err := pipe.Exec(ctx); err != nil && !errors.Is(err, redis.Nil) {
		return nil, fmt.Errorf("streamq: read the history of %s: %w", a.queue, err)
	}
	points := make([]HistoryPoint, n)
	for i := range points {
		points[i].Minute = first.Add(time.Duration(i) * time.Minute)
	}
	for _, r := range reads {
		for field, v := range r.cmd.Val() {
			m, err1 := strconv.ParseInt(field, 10, 64)
			x, err2 := strconv.ParseInt(v, 10, 64)
			if err1 != nil || err2 != nil || m < 0 || m > 59 {
				continue
			}
			at := time.Unix(r.hour*3600+m*60, 0).UTC()
			i := int(at.Sub(first) / time.Minute)
			if at.Before(first) || i >= n {
				continue
			}
			points[i].Processed += x & (1<<32 - 1)
			points[i].Failed += x >> 32
		}
	}
	return points, nil
}
