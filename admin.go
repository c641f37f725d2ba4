package streamq

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/streamq/streamq/internal/keys"
	"github.com/streamq/streamq/internal/scripts"
)

// Admin inspects and repairs a queue: statistics and the dead-letter stream.
// It reads the queue's shard count from Redis and covers every shard. It is
// safe for concurrent use.
type Admin struct {
	client      redis.UniversalClient
	queue       string
	inflightTTL time.Duration
}

// NewAdmin returns an Admin for queue. It does not touch Redis.
func NewAdmin(client redis.UniversalClient, queue string) (*Admin, error) {
	if client == nil {
		return nil, fmt.Errorf("%w: client is nil", ErrInvalidOptions)
	}
	if err := keys.ValidateQueue(queue); err != nil {
		return nil, fmt.Errorf("%w: %v", ErrInvalidOptions, err)
	}
	return &Admin{client: client, queue: queue, inflightTTL: DefaultInflightTTL}, nil
}

// shards returns the names of every shard of the queue.
func (a *Admin) shards(ctx context.Context) ([]keys.Keys, error) {
	n, err := queueShards(ctx, a.client, a.queue)
	if err != nil {
		return nil, err
	}
	return keys.Shards(a.queue, n)
}

// Stats describes a queue at one moment.
type Stats struct {
	// Length is the number of entries in the stream.
	Length int64
	// DeadLetters is the number of entries in the dead-letter stream.
	DeadLetters int64
	// Groups describes each consumer group.
	Groups []GroupStats
}

// GroupStats describes one consumer group.
type GroupStats struct {
	// Name is the group's name.
	Name string
	// Consumers is the number of consumers in the group.
	Consumers int64
	// Pending is the number of entries delivered and not yet acknowledged.
	Pending int64
	// Lag is the number of entries not yet delivered to the group, or -1 when
	// Redis cannot tell (after deletions in the middle of the stream).
	Lag int64
	// OldestPendingAge is the idle time of the longest-idle pending entry.
	OldestPendingAge time.Duration
}

// Stats returns the queue's statistics, summed over its shards. A group's
// Consumers is the largest count over the shards (every consumer reads all).
func (a *Admin) Stats(ctx context.Context) (Stats, error) {
	var s Stats
	shards, err := a.shards(ctx)
	if err != nil {
		return s, err
	}
	byName := map[string]int{}
	for _, k := range shards {
		if err := a.shardStats(ctx, k, &s, byName); err != nil {
			return s, fmt.Errorf("streamq: stats of %s: %w", a.queue, err)
		}
	}
	return s, nil
}

func (a *Admin) shardStats(ctx context.Context, k keys.Keys, s *Stats, byName map[string]int) error {
	length, err := a.client.XLen(ctx, k.Stream).Result()
	if err != nil {
		return err
	}
	dead, err := a.client.XLen(ctx, k.DeadLetter).Result()
	if err != nil {
		return err
	}
	s.Length += length
	s.DeadLetters += dead
	if length == 0 {
		if n, err := a.client.Exists(ctx, k.Stream).Result(); err != nil || n == 0 {
			return err
		}
	}
	groups, err := a.client.XInfoGroups(ctx, k.Stream).Result()
	if err != nil {
		return err
	}
	for _, g := range groups {
		i, ok := byName[g.Name]
		if !ok {
			i = len(s.Groups)
			byName[g.Name] = i
			s.Groups = append(s.Groups, GroupStats{Name: g.Name})
		}
		gs := &s.Groups[i]
		gs.Consumers = max(gs.Consumers, g.Consumers)
		gs.Pending += g.Pending
		switch {
		case g.Lag < 0 || gs.Lag < 0:
			gs.Lag = -1
		default:
			gs.Lag += g.Lag
		}
		if g.Pending > 0 {
			// The oldest pending entry is not always the longest idle one, so
			// look at a bounded window of pending entries.
			pend, err := a.client.XPendingExt(ctx, &redis.XPendingExtArgs{
				Stream: k.Stream, Group: g.Name, Start: "-", End: "+", Count: 1000,
			}).Result()
			if err != nil {
				return err
			}
			for _, p := range pend {
				gs.OldestPendingAge = max(gs.OldestPendingAge, p.Idle)
			}
		}
	}
	return nil
}

// DeadLetter is an entry of the dead-letter stream.
type DeadLetter struct {
	// DeadLetterID identifies the dead letter for Requeue and PurgeDeadLetters:
	// its id in the dead-letter stream, prefixed with "<shard>/" when the queue
	// has several shards.
	DeadLetterID string
	// ID is the request id ("" for an entry that had none).
	ID string
	// EntryID is the original stream entry id.
	EntryID string
	// Payload is the original entry's payload field.
	Payload []byte
	// Error is why the request was dead-lettered.
	Error string
	// Deliveries is how many times it was delivered.
	Deliveries int
	// Consumer is the consumer that dead-lettered it.
	Consumer string
	// At is when it was dead-lettered.
	At time.Time
}

// DeadLetters returns up to count dead letters starting after the one whose
// DeadLetterID is after ("" for the start): oldest first within a shard,
// shard after shard.
func (a *Admin) DeadLetters(ctx context.Context, after string, count int64) ([]DeadLetter, error) {
	shards, err := a.shards(ctx)
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
		msgs, err := a.client.XRangeN(ctx, shards[shard].DeadLetter, start, "+", count-int64(len(out))).Result()
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

// splitDeadLetterID splits a DeadLetterID into its shard and stream id.
func splitDeadLetterID(id string, shards int) (int, string, error) {
	if shards == 1 {
		return 0, id, nil
	}
	prefix, rest, ok := strings.Cut(id, "/")
	shard, err := strconv.Atoi(prefix)
	if !ok || err != nil || shard < 0 || shard >= shards {
		return 0, "", fmt.Errorf("%w: dead letter id %q of a queue with %d shards must look like \"<shard>/<id>\"", ErrNotFound, id, shards)
	}
	return shard, rest, nil
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
	}
	if n, err := strconv.Atoi(str("deliveries")); err == nil {
		d.Deliveries = n // Atoi returns a clamped value with its range error
	}
	if ms, err := strconv.ParseInt(str("at"), 10, 64); err == nil {
		d.At = time.UnixMilli(ms)
	}
	return d
}

// ErrNotFound is returned when a dead letter does not exist (any more).
var ErrNotFound = errors.New("streamq: not found")

// Requeue moves a dead letter back to the queue as a new entry with the same
// request id and payload, and returns the new entry id. The request's record is
// reset to in flight, so callers producing the id from now on attach to the new
// entry and receive its result. Its delivery count starts again.
func (a *Admin) Requeue(ctx context.Context, deadLetterID string) (string, error) {
	shards, err := a.shards(ctx)
	if err != nil {
		return "", err
	}
	shard, id, err := splitDeadLetterID(deadLetterID, len(shards))
	if err != nil {
		return "", err
	}
	k := shards[shard]
	msgs, err := a.client.XRangeN(ctx, k.DeadLetter, id, id, 1).Result()
	if err != nil {
		return "", fmt.Errorf("streamq: requeue %s: %w", deadLetterID, err)
	}
	if len(msgs) == 0 {
		return "", fmt.Errorf("%w: dead letter %s of %s", ErrNotFound, deadLetterID, a.queue)
	}
	d := parseDeadLetter(msgs[0])
	recKey := k.DeadLetter
	if d.ID != "" {
		recKey = k.Record(d.ID)
	}
	res, err := scripts.Requeue.Run(ctx, a.client, []string{k.Stream, k.DeadLetter, recKey},
		id, d.ID, d.Payload, a.inflightTTL.Milliseconds()).Result()
	if errors.Is(err, redis.Nil) {
		return "", fmt.Errorf("%w: dead letter %s of %s", ErrNotFound, deadLetterID, a.queue)
	}
	if err != nil {
		return "", fmt.Errorf("streamq: requeue %s: %w", deadLetterID, err)
	}
	entryID, _ := res.(string)
	return entryID, nil
}

// PurgeDeadLetters deletes dead letters: the given ids, or all of them when
// none is given. It returns how many were deleted.
func (a *Admin) PurgeDeadLetters(ctx context.Context, deadLetterIDs ...string) (int64, error) {
	shards, err := a.shards(ctx)
	if err != nil {
		return 0, err
	}
	var total int64
	if len(deadLetterIDs) == 0 {
		for _, k := range shards {
			n, err := a.client.XLen(ctx, k.DeadLetter).Result()
			if err == nil {
				err = a.client.Del(ctx, k.DeadLetter).Err()
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
		n, err := a.client.XDel(ctx, shards[shard].DeadLetter, ids...).Result()
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
