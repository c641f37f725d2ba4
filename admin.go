package streamq

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/streamq/streamq/internal/keys"
	"github.com/streamq/streamq/internal/scripts"
)

// Admin inspects and repairs a queue: statistics and the dead-letter stream.
// It reads the queue's shard count from Redis and covers every shard. It is
// safe for concurrent use.
type Admin struct {
	client   redis.UniversalClient
	queue    string
	opts     AdminOptions
	serverOK atomic.Bool // checkServer passed
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

// deadTarget says where the dead letters of the Admin's group are, and which
// group a requeue is for.
type deadTarget struct {
	group  string // the group a requeued entry is for; "" when unknown (every group runs it)
	fanout bool   // a fan-out group: its own dead-letter stream, no record
}

// target resolves the Admin's group against the queue's answering group.
func (a *Admin) target(ctx context.Context) (deadTarget, error) {
	answering, err := a.client.Get(ctx, keys.AnsweringGroup(a.queue)).Result()
	if err != nil && !errors.Is(err, redis.Nil) {
		return deadTarget{}, fmt.Errorf("streamq: read the answering group of %s: %w", a.queue, err)
	}
	if a.opts.Group == "" || a.opts.Group == answering {
		return deadTarget{group: answering}, nil
	}
	return deadTarget{group: a.opts.Group, fanout: true}, nil
}

// deadLetterKey returns the dead-letter stream of the target in shard k.
func (t deadTarget) deadLetterKey(k keys.Keys) string {
	if t.fanout {
		return k.GroupDeadLetter(t.group)
	}
	return k.DeadLetter
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
	Lag int64 `json:"lag"`
	// OldestPendingAge is the idle time of the longest-idle pending entry.
	OldestPendingAge time.Duration `json:"oldest_pending_age_ns"`
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
	_, err = a.streamGroupStats(ctx, k, length, dead, answering, s, byName)
	return err
}

// levelStats adds the streams of the priority levels other than the default
// to s, and fills s.Levels when one of them exists.
func (a *Admin) levelStats(ctx context.Context, shards []keys.Keys, s *Stats, byName map[string]int) error {
	var levels [numLevels]LevelStats
	found := false
	for _, l := range [...]int{levelHigh, levelLow, levelNormal} {
		if l == levelNormal && !found {
			break // only the default level: no split
		}
		levels[l].Priority = levelValue[l]
		for _, k := range shards {
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
			pending, err := a.streamGroupStats(ctx, k, length, -1, "", s, byName)
			if err != nil {
				return err
			}
			levels[l].Pending += pending
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
// s and returns their pending entries. dead is the length of the answering
// group's dead-letter stream (group answering); -1 counts no dead letters (a
// priority level's stream: they are the shard's).
func (a *Admin) streamGroupStats(ctx context.Context, k keys.Keys, length, dead int64, answering string, s *Stats, byName map[string]int) (int64, error) {
	var pending int64
	groups, err := a.client.XInfoGroups(ctx, k.Stream).Result()
	if err != nil {
		return 0, err
	}
	for _, g := range groups {
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
					return 0, err
				}
			}
			gs.DeadLetters += groupDead
		}
		lag := g.Lag
		switch {
		case lag < 0 || lag > length-g.Pending:
			// Redis cannot tell, or counts entries deleted unread.
			if lag, err = a.countLag(ctx, k.Stream, g.LastDeliveredID, length); err != nil {
				return 0, err
			}
		case lag > 0 && lag < length-g.Pending:
			if lag, err = a.checkLag(ctx, k.Stream, g.LastDeliveredID, lag); err != nil {
				return 0, err
			}
		}
		switch {
		case lag < 0 || gs.Lag < 0:
			gs.Lag = -1
		default:
			gs.Lag += lag
		}
		if g.Pending > 0 {
			// The oldest pending entry is not always the longest idle one, so
			// look at a bounded window of pending entries.
			pend, err := a.client.XPendingExt(ctx, &redis.XPendingExtArgs{
				Stream: k.Stream, Group: g.Name, Start: "-", End: "+", Count: 1000,
			}).Result()
			if err != nil {
				return 0, err
			}
			for _, p := range pend {
				gs.OldestPendingAge = max(gs.OldestPendingAge, p.Idle)
			}
		}
	}
	return pending, nil
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

// DeadLetter is an entry of the dead-letter stream.
type DeadLetter struct {
	// DeadLetterID identifies the dead letter for Requeue and PurgeDeadLetters:
	// its id in the dead-letter stream, prefixed with "<shard>/" when the queue
	// has several shards.
	DeadLetterID string `json:"dead_letter_id"`
	// ID is the request id ("" for an entry that had none).
	ID string `json:"id"`
	// EntryID is the original stream entry id.
	EntryID string `json:"entry_id"`
	// Payload is the original entry's payload field. In JSON it is base64
	// ("payload"), and its text is added as "payload_text" when it is valid
	// UTF-8 (see MarshalJSON).
	Payload []byte `json:"payload"`
	// Error is why the request was dead-lettered.
	Error string `json:"error"`
	// Deliveries is how many times its handler started (0 when it was
	// dead-lettered at admission, without starting).
	Deliveries int `json:"deliveries"`
	// Consumer is the consumer that dead-lettered it.
	Consumer string `json:"consumer"`
	// At is when it was dead-lettered.
	At time.Time `json:"at"`
	// Priority is the priority level the request had (see Priority): the
	// level of the stream it was dead-lettered from, which Requeue appends
	// it to again. Default (and for dead letters written before levels were
	// recorded): PriorityNormal, omitted in JSON.
	Priority PriorityLevel `json:"priority,omitempty"`
}

// DeadLetters returns up to count dead letters of the Admin's group (see
// AdminOptions.Group) starting after the one whose DeadLetterID is after (""
// for the start): oldest first within a shard, shard after shard.
func (a *Admin) DeadLetters(ctx context.Context, after string, count int64) ([]DeadLetter, error) {
	mustContext(ctx, "Admin.DeadLetters")
	shards, err := a.shards(ctx)
	if err != nil {
		return nil, err
	}
	t, err := a.target(ctx)
	if err != nil {
		return nil, err
	}
	first, start := 0, "-"
	if after != "" {
		var id string
		if first, id, err = splitDeadLetterID(after, len(shards)); err != nil {
			return nil, err
		}
		start = "(" + id
	}
	var out []DeadLetter
	for shard := first; shard < len(shards) && int64(len(out)) < count; shard++ {
		msgs, err := a.client.XRangeN(ctx, t.deadLetterKey(shards[shard]), start, "+", count-int64(len(out))).Result()
		if err != nil {
			return nil, fmt.Errorf("streamq: list dead letters of %s: %w", a.queue, err)
		}
		for _, m := range msgs {
			d := parseDeadLetter(m)
			if len(shards) > 1 {
				d.DeadLetterID = fmt.Sprintf("%d/%s", shard, m.ID)
			}
			out = append(out, d)
		}
		start = "-"
	}
	return out, nil
}

// splitDeadLetterID splits a DeadLetterID into its shard and stream id. The
// stream id must be complete ("<ms>-<seq>"): Redis reads "<ms>" alone as
// every entry of that millisecond in XRANGE and as "<ms>-0" in XDEL, so
// another dead letter would be requeued, shown or deleted.
func splitDeadLetterID(id string, shards int) (int, string, error) {
	shard, rest := 0, id
	if shards > 1 {
		prefix, r, ok := strings.Cut(id, "/")
		n, err := strconv.Atoi(prefix)
		if !ok || err != nil || n < 0 || n >= shards {
			// Also ErrNotFound, as before ErrInvalidDeadLetterID existed.
			return 0, "", &wrappedError{
				msg: fmt.Sprintf("%v: dead letter id %q of a queue with %d shards must look like \"<shard>/<ms>-<seq>\", as DeadLetters lists it", ErrInvalidDeadLetterID, id, shards),
				err: errors.Join(ErrInvalidDeadLetterID, ErrNotFound),
			}
		}
		shard, rest = n, r
	}
	if !fullStreamID(rest) {
		return 0, "", fmt.Errorf("%w: %q is not a complete stream id \"<ms>-<seq>\" as DeadLetters lists it (both parts, digits only)", ErrInvalidDeadLetterID, id)
	}
	return shard, rest, nil
}

// fullStreamID reports whether s is a stream id with both its parts:
// digits, "-", digits, each part within 64 bits.
func fullStreamID(s string) bool {
	ms, seq, ok := strings.Cut(s, "-")
	for _, part := range []string{ms, seq} {
		if part == "" || strings.TrimLeft(part, "0123456789") != "" {
			return false
		}
		if _, err := strconv.ParseUint(part, 10, 64); err != nil {
			return false
		}
	}
	return ok
}

func parseDeadLetter(m redis.XMessage) DeadLetter {
	str := func(k string) string { s, _ := m.Values[k].(string); return s }
	d := DeadLetter{
		DeadLetterID: m.ID,
		ID:           str("id"),
		EntryID:      str("entry"),
		Payload:      []byte(str("p")),
		Error:        str("error"),
		Consumer:     str("consumer"),
		Priority:     levelNamed(str(fieldPriority)),
	}
	if n, err := strconv.Atoi(str("deliveries")); err == nil {
		d.Deliveries = n // Atoi returns a clamped value with its range error
	}
	if ms, err := strconv.ParseInt(str("at"), 10, 64); err == nil {
		d.At = time.UnixMilli(ms)
	}
	return d
}

// ErrNotFound is returned when a queue, a request id or a dead letter does
// not exist (any more).
var ErrNotFound = errors.New("streamq: not found")

// requeueMarkerTTL is how long Requeue remembers the entry a dead letter was
// requeued as, so that a call sent again (after a lost reply, or by a caller
// retrying) returns that entry instead of ErrNotFound.
const requeueMarkerTTL = 10 * time.Minute

// Requeue moves a dead letter back to the queue as a new entry with the same
// request id and payload, and returns the new entry id. The new entry runs in
// the Admin's group only (other groups acknowledge it without running it).
// For the answering group, the request's record is reset to in flight for
// AdminOptions.InflightTTL, so callers producing the id from now on attach to
// the new entry and receive its result; a fan-out group's requeue leaves the
// record alone. Its delivery count starts again. It keeps its priority level
// (DeadLetter.Priority): it is appended to that level's stream.
//
// Requeue is idempotent for 10 minutes: asking again for a dead letter it
// already requeued returns the same entry id and adds nothing.
//
// A dead letter whose request id is in flight again (produced again, say with
// RetryFailed, and queued, running or waiting in the schedule) is not
// requeued: Requeue returns ErrRequeueInFlight and changes nothing, since a
// second entry would run the request twice. (A fan-out group's requeue does
// not check: the record is the answering group's.) A malformed deadLetterID
// (not as DeadLetters lists it) is ErrInvalidDeadLetterID.
func (a *Admin) Requeue(ctx context.Context, deadLetterID string) (string, error) {
	mustContext(ctx, "Admin.Requeue")
	shards, err := a.shards(ctx)
	if err != nil {
		return "", err
	}
	shard, id, err := splitDeadLetterID(deadLetterID, len(shards))
	if err != nil {
		return "", err
	}
	k := shards[shard]
	t, err := a.target(ctx)
	if err != nil {
		return "", err
	}
	dead := t.deadLetterKey(k)
	marker := k.RequeueMarker(dead, id)
	msgs, err := a.client.XRangeN(ctx, dead, id, id, 1).Result()
	if err != nil {
		return "", fmt.Errorf("streamq: requeue %s: %w", deadLetterID, err)
	}
	if len(msgs) == 0 {
		// Gone: requeued already (say so again), or never there.
		entryID, err := a.client.Get(ctx, marker).Result()
		if errors.Is(err, redis.Nil) {
			return "", fmt.Errorf("%w: dead letter %s of %s", ErrNotFound, deadLetterID, a.queue)
		}
		if err != nil {
			return "", fmt.Errorf("streamq: requeue %s: %w", deadLetterID, err)
		}
		return entryID, nil
	}
	d := parseDeadLetter(msgs[0])
	recKey := dead
	if d.ID != "" {
		recKey = k.Record(d.ID)
	}
	setRecord := "1"
	if t.fanout {
		setRecord = "0"
	}
	// The dead letter's level: its stream, and the new entry's "pr" field
	// (as produce.lua writes it), "" for the default level.
	level := levelNames[levelOf[d.Priority]]
	res, err := scripts.Requeue.Run(ctx, a.client, []string{k.AtLevel(level).Stream, dead, recKey, marker},
		id, d.ID, d.Payload, a.opts.InflightTTL.Milliseconds(), requeueMarkerTTL.Milliseconds(), t.group, setRecord, level).Result()
	if errors.Is(err, redis.Nil) {
		return "", fmt.Errorf("%w: dead letter %s of %s", ErrNotFound, deadLetterID, a.queue)
	}
	if err != nil {
		return "", fmt.Errorf("streamq: requeue %s: %w", deadLetterID, err)
	}
	switch r := res.(type) {
	case string:
		return r, nil
	case []any:
		if len(r) == 2 && r[0] == "inflight" {
			rec, _ := r[1].(string)
			return "", requeueInFlightError(deadLetterID, d.ID, a.queue, rec)
		}
	}
	return "", fmt.Errorf("streamq: requeue %s: unexpected reply %v", deadLetterID, res)
}

// requeueInFlightError says why a dead letter was not requeued: its request
// id's record rec says the request is in flight again.
func requeueInFlightError(deadLetterID, id, queue, rec string) error {
	where := "is in flight as entry " + strings.TrimPrefix(rec, "P") + " (queued or running)"
	if due, ok := strings.CutPrefix(rec, "P@"); ok {
		where = "waits in the schedule"
		if ms, err := strconv.ParseInt(due, 10, 64); err == nil {
			where += " until " + time.UnixMilli(ms).UTC().Format(time.RFC3339)
		}
	}
	return fmt.Errorf("%w: dead letter %s of %s not requeued: request %q %s; "+
		"wait until it finished (Admin.Job) and requeue the dead letter then if it must run again, or purge it",
		ErrRequeueInFlight, deadLetterID, queue, id, where)
}

// PurgeDeadLetters deletes dead letters of the Admin's group: the given ids,
// or all of them when none is given. It returns how many were deleted.
func (a *Admin) PurgeDeadLetters(ctx context.Context, deadLetterIDs ...string) (int64, error) {
	mustContext(ctx, "Admin.PurgeDeadLetters")
	shards, err := a.shards(ctx)
	if err != nil {
		return 0, err
	}
	t, err := a.target(ctx)
	if err != nil {
		return 0, err
	}
	var total int64
	if len(deadLetterIDs) == 0 {
		for _, k := range shards {
			n, err := a.client.XLen(ctx, t.deadLetterKey(k)).Result()
			if err == nil {
				err = a.client.Del(ctx, t.deadLetterKey(k)).Err()
			}
			if err != nil {
				return total, fmt.Errorf("streamq: purge dead letters of %s: %w", a.queue, err)
			}
			total += n
		}
		return total, nil
	}
	byShard := make([][]string, len(shards))
	for _, did := range deadLetterIDs {
		shard, id, err := splitDeadLetterID(did, len(shards))
		if err != nil {
			return total, err
		}
		byShard[shard] = append(byShard[shard], id)
	}
	for shard, ids := range byShard {
		if len(ids) == 0 {
			continue
		}
		n, err := a.client.XDel(ctx, t.deadLetterKey(shards[shard]), ids...).Result()
		if err != nil {
			return total, fmt.Errorf("streamq: purge dead letters of %s: %w", a.queue, err)
		}
		total += n
	}
	return total, nil
}

// QueueKeys are the Redis names of one shard of a queue.
type QueueKeys struct {
	// Stream is the stream of requests.
	Stream string
	// DeadLetter is the dead-letter stream.
	DeadLetter string
	// Channel is the pub/sub channel of completion notices.
	Channel string
	// RecordPattern is a SCAN pattern matching the per-request record keys.
	RecordPattern string
}

// Keys returns the Redis names the queue uses, one QueueKeys per shard, for
// operators and scripts.
func (a *Admin) Keys(ctx context.Context) ([]QueueKeys, error) {
	mustContext(ctx, "Admin.Keys")
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
