package streamq

// The Admin's dead-letter operations: list, read, requeue and purge dead
// letters.

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/streamq/streamq/internal/keys"
	"github.com/streamq/streamq/internal/scripts"
)

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
	return callBounded(ctx, func(ctx context.Context) ([]DeadLetter, error) { return a.deadLetters(ctx, after, count) })
}

// deadLetters is the body of DeadLetters, run by callBounded.
func (a *Admin) deadLetters(ctx context.Context, after string, count int64) ([]DeadLetter, error) {
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
		ID:           str(keys.FieldID),
		EntryID:      str(keys.DeadEntry),
		Payload:      []byte(str(keys.FieldPayload)),
		Error:        str(keys.DeadError),
		Consumer:     str(keys.DeadConsumer),
		Priority:     levelNamed(str(keys.FieldPriority)),
	}
	if n, err := strconv.Atoi(str(keys.DeadDeliveries)); err == nil {
		d.Deliveries = n // Atoi returns a clamped value with its range error
	}
	if ms, err := strconv.ParseInt(str(keys.DeadAt), 10, 64); err == nil {
		d.At = time.UnixMilli(ms)
	}
	return d
}

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
//
// When ctx ends before Redis answers, Requeue returns ctx's error at once
// (see Admin) and the dead letter may or may not have been requeued: call
// it again (within 10 minutes it returns the entry id when it was).
func (a *Admin) Requeue(ctx context.Context, deadLetterID string) (string, error) {
	mustContext(ctx, "Admin.Requeue")
	return callBounded(ctx, func(ctx context.Context) (string, error) { return a.requeue(ctx, deadLetterID) })
}

// requeue is the body of Requeue, run by callBounded.
func (a *Admin) requeue(ctx context.Context, deadLetterID string) (string, error) {
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
	return a.requeueEntry(ctx, k, t, deadLetterID, msgs[0])
}

// requeueEntry requeues dead letter m (read from the target's dead-letter
// stream of shard k; deadLetterID names it in errors), as Requeue does.
func (a *Admin) requeueEntry(ctx context.Context, k keys.Keys, t deadTarget, deadLetterID string, m redis.XMessage) (string, error) {
	dead, id := t.deadLetterKey(k), m.ID
	marker := k.RequeueMarker(dead, id)
	d := parseDeadLetter(m)
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
		id, d.ID, d.Payload, a.opts.InflightTTL.Milliseconds(), requeueMarkerTTL.Milliseconds(), t.group, setRecord, level,
		k.Wake, publishCommand(isCluster(a.client))).Result()
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
	where := "is in flight as entry " + recordEntryID(rec) + " (queued or running)"
	if strings.HasPrefix(rec, "P@") { // "P@<due>", or "P@<due>+" (quiet)
		due := recordEntryID(rec)[1:]
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
// or all of them when none is given. It returns how many were deleted
// (without ids, each shard's count and deletion are one atomic step, so dead
// letters added meanwhile are either counted and deleted, or kept).
func (a *Admin) PurgeDeadLetters(ctx context.Context, deadLetterIDs ...string) (int64, error) {
	mustContext(ctx, "Admin.PurgeDeadLetters")
	return callBounded(ctx, func(ctx context.Context) (int64, error) { return a.purgeDeadLetters(ctx, deadLetterIDs...) })
}

// purgeDeadLetters is the body of PurgeDeadLetters, run by callBounded.
func (a *Admin) purgeDeadLetters(ctx context.Context, deadLetterIDs ...string) (int64, error) {
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
			// XLEN and DEL in one script: a dead letter added between them
			// would be deleted without being counted.
			n, err := scripts.Purge.Run(ctx, a.client, []string{t.deadLetterKey(k)}).Int64()
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

// DeadLetter returns one dead letter of the Admin's group by its DeadLetterID,
// or ErrNotFound.
func (a *Admin) DeadLetter(ctx context.Context, deadLetterID string) (DeadLetter, error) {
	mustContext(ctx, "Admin.DeadLetter")
	return callBounded(ctx, func(ctx context.Context) (DeadLetter, error) { return a.deadLetter(ctx, deadLetterID) })
}

// deadLetter is the body of DeadLetter, run by callBounded.
func (a *Admin) deadLetter(ctx context.Context, deadLetterID string) (DeadLetter, error) {
	shards, err := a.existingShards(ctx)
	if err != nil {
		return DeadLetter{}, err
	}
	shard, id, err := splitDeadLetterID(deadLetterID, len(shards))
	if err != nil {
		return DeadLetter{}, err
	}
	t, err := a.target(ctx)
	if err != nil {
		return DeadLetter{}, err
	}
	msgs, err := a.client.XRangeN(ctx, t.deadLetterKey(shards[shard]), id, id, 1).Result()
	if err != nil {
		return DeadLetter{}, fmt.Errorf("streamq: read dead letter %s of %s: %w", deadLetterID, a.queue, err)
	}
	if len(msgs) == 0 {
		return DeadLetter{}, fmt.Errorf("%w: dead letter %s of %s", ErrNotFound, deadLetterID, a.queue)
	}
	d := parseDeadLetter(msgs[0])
	d.DeadLetterID = deadLetterID
	return d, nil
}

// DeadLetterFilter selects dead letters for Admin.RequeueAll and
// Admin.PurgeMatching. The zero value selects every dead letter.
type DeadLetterFilter struct {
	// ID keeps only the dead letters of this request id (exact match).
	// Default "" = every id.
	ID string
	// ErrorContains keeps only the dead letters whose error contains it.
	// Default "" = every error.
	ErrorContains string
}

func (f DeadLetterFilter) match(d DeadLetter) bool {
	return (f.ID == "" || d.ID == f.ID) && strings.Contains(d.Error, f.ErrorContains)
}

// RequeueAllResult says what Admin.RequeueAll did.
type RequeueAllResult struct {
	// Requeued counts the dead letters requeued.
	Requeued int64 `json:"requeued"`
	// Skipped are the dead letters not requeued because their request ids
	// are in flight again (see ErrRequeueInFlight); they stay dead letters.
	// Their Payload is not filled in.
	Skipped []DeadLetter `json:"skipped,omitempty"`
	// Done reports whether every selected dead letter that was there when
	// the call began was visited; false when ctx ended first (call again for
	// the rest; the dead letter being requeued at that moment may have been
	// requeued without being counted).
	Done bool `json:"done"`
}

// deadLetterBatch is how many dead letters RequeueAll and PurgeMatching read
// at once.
const deadLetterBatch = 100

// RequeueAll requeues, as Requeue does, the dead letters of the Admin's
// group that f selects and that were dead letters when the call began: it
// notes each shard's newest dead letter first and stops there, so a
// requeued request that fails again and is dead-lettered again meanwhile is
// not requeued a second time (a poison request runs once per call). Dead
// letters refused with ErrRequeueInFlight are listed in Skipped and stay;
// dead letters gone meanwhile are passed over. It works until done or ctx
// ends (Done false, and no error for that once it began: a ctx that ended
// before gives its error); any other error stops it, with what it did so
// far.
func (a *Admin) RequeueAll(ctx context.Context, f DeadLetterFilter) (RequeueAllResult, error) {
	mustContext(ctx, "Admin.RequeueAll")
	// The work counts into res under mu, so that when ctx ends while a
	// step waits for Redis, the call returns what was counted by then.
	var (
		mu       sync.Mutex
		res      RequeueAllResult
		begun    bool
		finished bool
	)
	_, err := callBounded(ctx, func(ctx context.Context) (struct{}, error) {
		shards, err := a.shards(ctx)
		if err != nil {
			return struct{}{}, err
		}
		t, err := a.target(ctx)
		if err != nil {
			return struct{}{}, err
		}
		mu.Lock()
		begun = true
		mu.Unlock()
		done, err := a.eachDeadLetter(ctx, shards, t, f, func(shard int, m redis.XMessage, d DeadLetter) error {
			_, err := a.requeueEntry(ctx, shards[shard], t, d.DeadLetterID, m)
			mu.Lock()
			defer mu.Unlock()
			switch {
			case err == nil:
				res.Requeued++
			case errors.Is(err, ErrNotFound): // requeued or purged meanwhile
			case errors.Is(err, ErrRequeueInFlight):
				d.Payload = nil
				res.Skipped = append(res.Skipped, d)
			default:
				return err
			}
			return nil
		})
		mu.Lock()
		finished = done
		mu.Unlock()
		return struct{}{}, err
	})
	mu.Lock()
	defer mu.Unlock()
	out := RequeueAllResult{Requeued: res.Requeued, Skipped: slices.Clone(res.Skipped), Done: finished}
	if err != nil && begun && ctx.Err() != nil && errors.Is(err, ctx.Err()) {
		err = nil // ended by ctx once it began: Done is false
	}
	return out, err
}

// PurgeMatching deletes the dead letters of the Admin's group that f
// selects and that were dead letters when the call began (see RequeueAll),
// and returns how many it deleted. The zero filter deletes every dead
// letter of that moment; PurgeDeadLetters without ids deletes every one in
// one step. It works until done or ctx ends (then it returns what it deleted
// and ctx's error).
func (a *Admin) PurgeMatching(ctx context.Context, f DeadLetterFilter) (int64, error) {
	mustContext(ctx, "Admin.PurgeMatching")
	// The work counts into total under mu, so that when ctx ends while a
	// step waits for Redis, the call returns what was deleted by then.
	var (
		mu    sync.Mutex
		total int64
	)
	_, err := callBounded(ctx, func(ctx context.Context) (struct{}, error) {
		return struct{}{}, a.purgeMatching(ctx, f, func(n int64) {
			mu.Lock()
			total += n
			mu.Unlock()
		})
	})
	mu.Lock()
	defer mu.Unlock()
	return total, err
}

// purgeMatching is the body of PurgeMatching, run by callBounded; it
// reports each batch it deleted to deleted.
func (a *Admin) purgeMatching(ctx context.Context, f DeadLetterFilter, deleted func(int64)) error {
	shards, err := a.shards(ctx)
	if err != nil {
		return err
	}
	t, err := a.target(ctx)
	if err != nil {
		return err
	}
	batch := map[int][]string{}
	flush := func(shard int) error {
		if len(batch[shard]) == 0 {
			return nil
		}
		n, err := a.client.XDel(ctx, t.deadLetterKey(shards[shard]), batch[shard]...).Result()
		if err != nil {
			return fmt.Errorf("streamq: purge dead letters of %s: %w", a.queue, err)
		}
		deleted(n)
		batch[shard] = batch[shard][:0]
		return nil
	}
	last := -1
	done, err := a.eachDeadLetter(ctx, shards, t, f, func(shard int, m redis.XMessage, _ DeadLetter) error {
		if shard != last && last >= 0 {
			if err := flush(last); err != nil {
				return err
			}
		}
		last = shard
		batch[shard] = append(batch[shard], m.ID)
		if len(batch[shard]) >= deadLetterBatch {
			return flush(shard)
		}
		return nil
	})
	if err == nil && last >= 0 {
		err = flush(last)
	}
	if err == nil && !done {
		err = ctx.Err()
	}
	return err
}

// eachDeadLetter calls fn, shard after shard and oldest first, for each dead
// letter of the target that f selects, up to each shard's newest dead letter
// when it began. It returns false when ctx ended first.
func (a *Admin) eachDeadLetter(ctx context.Context, shards []keys.Keys, t deadTarget, f DeadLetterFilter,
	fn func(shard int, m redis.XMessage, d DeadLetter) error) (bool, error) {
	newest := make([]string, len(shards))
	for i, k := range shards {
		msgs, err := a.client.XRevRangeN(ctx, t.deadLetterKey(k), "+", "-", 1).Result()
		if err != nil {
			if ctx.Err() != nil {
				return false, nil
			}
			return false, fmt.Errorf("streamq: read the dead letters of %s: %w", a.queue, err)
		}
		if len(msgs) > 0 {
			newest[i] = msgs[0].ID
		}
	}
	for shard, k := range shards {
		if newest[shard] == "" {
			continue
		}
		start := "-"
		for {
			if ctx.Err() != nil {
				return false, nil
			}
			msgs, err := a.client.XRangeN(ctx, t.deadLetterKey(k), start, newest[shard], deadLetterBatch).Result()
			if err != nil {
				if ctx.Err() != nil {
					return false, nil
				}
				return false, fmt.Errorf("streamq: read the dead letters of %s: %w", a.queue, err)
			}
			for _, m := range msgs {
				d := parseDeadLetter(m)
				if len(shards) > 1 {
					d.DeadLetterID = fmt.Sprintf("%d/%s", shard, m.ID)
				}
				if !f.match(d) {
					continue
				}
				if err := fn(shard, m, d); err != nil {
					if ctx.Err() != nil {
						return false, nil
					}
					return false, err
				}
			}
			if len(msgs) < deadLetterBatch {
				break
			}
			start = "(" + msgs[len(msgs)-1].ID
		}
	}
	return true, nil
}
