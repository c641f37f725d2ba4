package streamq

import (
	"strconv"
	"time"
)

// Retention keeps a bounded list of a queue's recently completed requests
// in Redis (ConsumerOptions.Retention), for operators: Admin.Completed pages
// through it, the dashboard's Completed tab and `streamq completed` show it.
// Each entry is a request id (or, for a request produced without one, its
// stream entry id), its outcome (succeeded, failed, dead-lettered) and when
// it completed; the result or error is the request's record, kept
// ResultTTL, which Admin.Job shows. A request counts once, at its first
// outcome (a duplicate that finishes later adds nothing).
//
// The list lives in one sorted set per shard (streamq:{<queue>}:completed),
// written by the same script step that records the outcomes; a consumer
// without Retention sends exactly the commands it sends today, and leaves
// the list alone. Give every consumer of the answering group the same
// Retention: each trims the list to its own bounds after the completions it
// records. At least one of the bounds must be set.
type Retention struct {
	// MaxCount keeps at most this many of the newest completions per shard
	// (the oldest are dropped after each completion step). 0: no bound by
	// count. At most MaxRetentionCount.
	MaxCount int
	// MaxAge drops completions older than this after each completion step,
	// and the whole list expires MaxAge after the last completion (so an
	// idle queue keeps none). At least a second; 0: no bound by age.
	MaxAge time.Duration
	// Errors keeps the errors of the newest Errors failed attempts of each
	// request that were retried (when, at which start, the error), in a list
	// per request that lives as long as its record; Admin.Job returns them
	// (JobInfo.Errors), the final error being the record's. The step that
	// schedules a retry writes them (three more commands per retry). 0: none;
	// at most MaxRetentionErrors. With only Errors set (MaxCount and MaxAge
	// 0) no list of completed requests is kept.
	Errors int
}

// MaxRetentionErrors is the largest Retention.Errors.
const MaxRetentionErrors = 100

// MaxRetentionCount is the largest Retention.MaxCount: the list of one shard
// is trimmed in the script that records outcomes, and its memory (about 100
// bytes per entry plus the id) is Redis's.
const MaxRetentionCount = 10_000_000

// resolve validates r (nil: no retention) for a consumer; fanout is
// ConsumerOptions.Fanout.
func (r *Retention) resolve(fanout bool) error {
	if r == nil {
		return nil
	}
	switch {
	case fanout:
		return optionError("Retention is set on a fan-out group; the list of completed requests is the answering group's (a fan-out group records no outcome): set it on the answering group's consumers")
	case r.MaxCount == 0 && r.MaxAge == 0 && r.Errors == 0:
		return optionError("Retention sets none of MaxCount, MaxAge and Errors; set at least one, or leave Retention nil to keep nothing")
	case r.Errors < 0 || r.Errors > MaxRetentionErrors:
		return optionError("Retention.Errors is %d; it must be 0 (none) to %d", r.Errors, MaxRetentionErrors)
	case r.MaxCount < 0 || r.MaxCount > MaxRetentionCount:
		return optionError("Retention.MaxCount is %d; it must be 0 (no bound by count) to %d", r.MaxCount, MaxRetentionCount)
	case r.MaxAge != 0 && r.MaxAge < time.Second:
		return optionError("Retention.MaxAge is %v; it must be 0 (no bound by age) or at least 1s", r.MaxAge)
	}
	return nil
}

// flag returns complete.lua's ARGV[9] mark for r: "#<count>,<age ms>", or ""
// when r keeps no list of completed requests (nil, or only Errors).
func (r *Retention) flag() string {
	if r == nil || (r.MaxCount == 0 && r.MaxAge == 0) {
		return ""
	}
	return "#" + strconv.Itoa(r.MaxCount) + "," + strconv.FormatInt(r.MaxAge.Milliseconds(), 10)
}

// errorsKept returns Retention.Errors (0 for nil).
func (r *Retention) errorsKept() int {
	if r == nil {
		return 0
	}
	return r.Errors
}
