package streamq

import (
	"cmp"
	"context"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/streamq/streamq/internal/keys"
)

// CompletedJob is one entry of the list of recently completed requests
// (ConsumerOptions.Retention).
type CompletedJob struct {
	// ID is the request id; "" for a request produced without one (then
	// EntryID names it).
	ID string `json:"id,omitempty"`
	// EntryID is the stream entry of a request produced without an id.
	EntryID string `json:"entry_id,omitempty"`
	// State is its first outcome: JobSucceeded, JobFailed or
	// JobDeadLettered.
	State JobState `json:"state"`
	// Shard is the shard it completed in.
	Shard int `json:"shard"`
	// At is when its outcome was recorded (the consumer's clock, to the
	// millisecond).
	At time.Time `json:"at"`
}

// CompletedPage is one page of Admin.Completed.
type CompletedPage struct {
	// Jobs are the completions of the page, newest first.
	Jobs []CompletedJob `json:"jobs"`
	// Next is the cursor of the next (older) page; "" on the last one.
	Next string `json:"next,omitempty"`
	// Total is how many completions the list holds now, over the shards.
	Total int64 `json:"total"`
}

// Completed returns a page of the queue's recently completed requests,
// newest first: the list the consumers keep when they set
// ConsumerOptions.Retention (empty without one). cursor is "" for the first
// page, else a CompletedPage.Next; limit is the page's size (0: 50; at most
// 1000). A page costs one round trip (two commands per shard) whatever the
// list's length, and a completion between two pages neither repeats nor
// skips an entry (the list is ordered by a score unique per shard). A nil
// ctx panics.
func (a *Admin) Completed(ctx context.Context, cursor string, limit int) (CompletedPage, error) {
	mustContext(ctx, "Admin.Completed")
	return callBounded(ctx, func(ctx context.Context) (CompletedPage, error) { return a.completed(ctx, cursor, limit) })
}

// completed is the body of Completed, run by callBounded.
func (a *Admin) completed(ctx context.Context, cursor string, limit int) (CompletedPage, error) {
	var page CompletedPage
	switch {
	case limit == 0:
		limit = defaultJobsLimit
	case limit < 0 || limit > maxJobsLimit:
		return page, fmt.Errorf("%w: limit is %d; it must be 1 to %d (0 for %d)", ErrInvalidOptions, limit, maxJobsLimit, defaultJobsLimit)
	}
	after, afterShard, err := decodeCompletedCursor(cursor)
	if err != nil {
		return page, err
	}
	shards, err := a.existingShards(ctx)
	if err != nil {
		return page, err
	}
	pipe := a.client.Pipeline()
	ranges := make([]*redis.ZSliceCmd, len(shards))
	cards := make([]*redis.IntCmd, len(shards))
	for i, k := range shards {
		// After the cursor (score S of shard j) come, in (score desc, shard
		// asc) order, the lower scores, and S itself in the later shards.
		max := "+inf"
		if cursor != "" {
			max = strconv.FormatInt(after, 10)
			if i <= afterShard {
				max = "(" + max
			}
		}
		// ZRANGE ... BYSCORE REV (Redis 6.2): the command the schedule's
		// least-privilege rule already allows.
		ranges[i] = pipe.ZRangeArgsWithScores(ctx, redis.ZRangeArgs{Key: k.Completed, Start: max, Stop: "-inf", ByScore: true, Rev: true, Count: int64(limit) + 1})
		cards[i] = pipe.ZCard(ctx, k.Completed)
	}
	if _, err := pipe.Exec(ctx); err != nil {
		return page, fmt.Errorf("streamq: list the completed requests of %s: %w", a.queue, err)
	}
	type scored struct {
		job   CompletedJob
		score int64
	}
	var all []scored
	for i := range shards {
		page.Total += cards[i].Val()
		for _, z := range ranges[i].Val() {
			m, _ := z.Member.(string)
			j, ok := parseCompletedMember(m)
			if !ok {
				continue // not one streamq writes
			}
			score := int64(z.Score)
			j.Shard, j.At = i, time.UnixMilli(score/1000)
			all = append(all, scored{j, score})
		}
	}
	slices.SortFunc(all, func(x, y scored) int {
		if c := cmp.Compare(y.score, x.score); c != 0 {
			return c
		}
		return cmp.Compare(x.job.Shard, y.job.Shard)
	})
	if len(all) > limit {
		last := all[limit-1]
		page.Next = "c" + strconv.FormatInt(last.score, 10) + "." + strconv.Itoa(last.job.Shard)
		all = all[:limit]
	}
	page.Jobs = make([]CompletedJob, len(all))
	for i, s := range all {
		page.Jobs[i] = s.job
	}
	return page, nil
}

// decodeCompletedCursor parses a CompletedPage.Next: "c<score>.<shard>".
func decodeCompletedCursor(s string) (int64, int, error) {
	if s == "" {
		return 0, 0, nil
	}
	rest, ok := strings.CutPrefix(s, "c")
	score, shard, ok2 := strings.Cut(rest, ".")
	n, err1 := strconv.ParseInt(score, 10, 64)
	sh, err2 := strconv.Atoi(shard)
	if !ok || !ok2 || err1 != nil || err2 != nil || sh < 0 {
		return 0, 0, fmt.Errorf("%w: %q is not a cursor Admin.Completed returned", ErrInvalidCursor, s)
	}
	return n, sh, nil
}

// parseCompletedMember parses a member of the completed list: the outcome's
// code, 'i' and the request id or 'e' and the entry id.
func parseCompletedMember(m string) (CompletedJob, bool) {
	var j CompletedJob
	if len(m) < 3 {
		return j, false
	}
	switch m[0] {
	case keys.RecordResult:
		j.State = JobSucceeded
	case keys.RecordFailed:
		j.State = JobFailed
	case keys.RecordDead:
		j.State = JobDeadLettered
	default:
		return j, false
	}
	switch m[1] {
	case 'i':
		j.ID = m[2:]
	case 'e':
		j.EntryID = m[2:]
	default:
		return j, false
	}
	return j, true
}

// completedMember returns the member of the completed list of request id
// whose record starts with code (its first outcome).
func completedMember(code byte, id string) string {
	if code == keys.RecordNoResult {
		code = keys.RecordResult
	}
	return string(code) + "i" + id
}
