package streamq

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/streamq/streamq/internal/keys"
	"github.com/streamq/streamq/internal/scripts"
)

// Admin inspects and repairs a queue: statistics and the dead-letter stream.
// It is safe for concurrent use and holds no state beyond the queue's names.
type Admin struct {
	client      redis.UniversalClient
	keys        keys.Keys
	inflightTTL time.Duration
}

// NewAdmin returns an Admin for queue.
func NewAdmin(client redis.UniversalClient, queue string) (*Admin, error) {
	if client == nil {
		return nil, fmt.Errorf("%w: client is nil", ErrInvalidOptions)
	}
	k, err := keys.New(queue)
	if err != nil {
		return nil, fmt.Errorf("%w: %v", ErrInvalidOptions, err)
	}
	return &Admin{client: client, keys: k, inflightTTL: DefaultInflightTTL}, nil
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

// Stats returns the queue's statistics.
func (a *Admin) Stats(ctx context.Context) (Stats, error) {
	var s Stats
	var err error
	if s.Length, err = a.client.XLen(ctx, a.keys.Stream).Result(); err != nil {
		return s, fmt.Errorf("streamq: stats of %s: %w", a.keys.Queue, err)
	}
	if s.DeadLetters, err = a.client.XLen(ctx, a.keys.DeadLetter).Result(); err != nil {
		return s, fmt.Errorf("streamq: stats of %s: %w", a.keys.Queue, err)
	}
	if s.Length == 0 {
		if n, _ := a.client.Exists(ctx, a.keys.Stream).Result(); n == 0 {
			return s, nil
		}
	}
	groups, err := a.client.XInfoGroups(ctx, a.keys.Stream).Result()
	if err != nil {
		return s, fmt.Errorf("streamq: stats of %s: %w", a.keys.Queue, err)
	}
	for _, g := range groups {
		gs := GroupStats{Name: g.Name, Consumers: g.Consumers, Pending: g.Pending, Lag: g.Lag}
		if g.Pending > 0 {
			// The oldest pending entry is not always the longest idle one, so ask
			// for the most idle entries by scanning a bounded window.
			pend, err := a.client.XPendingExt(ctx, &redis.XPendingExtArgs{
				Stream: a.keys.Stream, Group: g.Name, Start: "-", End: "+", Count: 1000,
			}).Result()
			if err != nil {
				return s, fmt.Errorf("streamq: stats of %s: %w", a.keys.Queue, err)
			}
			for _, p := range pend {
				gs.OldestPendingAge = max(gs.OldestPendingAge, p.Idle)
			}
		}
		s.Groups = append(s.Groups, gs)
	}
	return s, nil
}

// DeadLetter is an entry of the dead-letter stream.
type DeadLetter struct {
	// DeadLetterID is the entry's id in the dead-letter stream.
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

// DeadLetters returns up to count dead letters, oldest first, starting after
// the dead-letter id after ("" for the start).
func (a *Admin) DeadLetters(ctx context.Context, after string, count int64) ([]DeadLetter, error) {
	start := "-"
	if after != "" {
		start = "(" + after
	}
	msgs, err := a.client.XRangeN(ctx, a.keys.DeadLetter, start, "+", count).Result()
	if err != nil {
		return nil, fmt.Errorf("streamq: list dead letters of %s: %w", a.keys.Queue, err)
	}
	out := make([]DeadLetter, len(msgs))
	for i, m := range msgs {
		out[i] = parseDeadLetter(m)
	}
	return out, nil
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
	d.Deliveries, _ = strconv.Atoi(str("deliveries"))
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
	msgs, err := a.client.XRangeN(ctx, a.keys.DeadLetter, deadLetterID, deadLetterID, 1).Result()
	if err != nil {
		return "", fmt.Errorf("streamq: requeue %s: %w", deadLetterID, err)
	}
	if len(msgs) == 0 {
		return "", fmt.Errorf("%w: dead letter %s of %s", ErrNotFound, deadLetterID, a.keys.Queue)
	}
	d := parseDeadLetter(msgs[0])
	recKey := a.keys.DeadLetter
	if d.ID != "" {
		recKey = a.keys.Record(d.ID)
	}
	res, err := scripts.Requeue.Run(ctx, a.client, []string{a.keys.Stream, a.keys.DeadLetter, recKey},
		deadLetterID, d.ID, d.Payload, a.inflightTTL.Milliseconds()).Result()
	if errors.Is(err, redis.Nil) {
		return "", fmt.Errorf("%w: dead letter %s of %s", ErrNotFound, deadLetterID, a.keys.Queue)
	}
	if err != nil {
		return "", fmt.Errorf("streamq: requeue %s: %w", deadLetterID, err)
	}
	id, _ := res.(string)
	return id, nil
}

// PurgeDeadLetters deletes dead letters: the given ids, or all of them when
// none is given. It returns how many were deleted.
func (a *Admin) PurgeDeadLetters(ctx context.Context, deadLetterIDs ...string) (int64, error) {
	if len(deadLetterIDs) == 0 {
		n, err := a.client.XLen(ctx, a.keys.DeadLetter).Result()
		if err != nil {
			return 0, fmt.Errorf("streamq: purge dead letters of %s: %w", a.keys.Queue, err)
		}
		if err := a.client.Del(ctx, a.keys.DeadLetter).Err(); err != nil {
			return 0, fmt.Errorf("streamq: purge dead letters of %s: %w", a.keys.Queue, err)
		}
		return n, nil
	}
	n, err := a.client.XDel(ctx, a.keys.DeadLetter, deadLetterIDs...).Result()
	if err != nil {
		return 0, fmt.Errorf("streamq: purge dead letters of %s: %w", a.keys.Queue, err)
	}
	return n, nil
}

// Keys returns the Redis names the queue uses, for operators and scripts:
// the stream, the dead-letter stream, the notification channel, and the
// pattern of the per-request record keys.
func (a *Admin) Keys() (stream, deadLetter, channel, recordPattern string) {
	return a.keys.Stream, a.keys.DeadLetter, a.keys.Channel, a.keys.RecordPattern()
}

