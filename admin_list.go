package streamq

import (
	"context"
	"errors"
	"time"
)

// JobRetrying: a failed attempt waiting in the schedule for its back-off.
// Admin.Job reports it (instead of JobScheduled) for a retry waiting in the
// schedule.
const JobRetrying JobState = "retrying"

// JobsQuery selects one page of the jobs in one state (Admin.Jobs).
type JobsQuery struct {
	// State is the state to list: JobScheduled, JobRetrying, JobQueued,
	// JobRunning or JobDeadLettered. Required.
	State JobState
	// Limit is the most jobs per page. Default 0 = 50; at most 1000.
	Limit int
	// Cursor is "" for the first page, else a JobsPage.Next or JobsPage.Prev
	// of a query with the same State, ID and ErrorContains.
	Cursor string
	// ID keeps only this request id (exact match). Default "" = every id.
	ID string
	// ErrorContains keeps, for JobRetrying and JobDeadLettered, only the jobs
	// whose last error contains it. Default "" = every job.
	ErrorContains string
}

// JobsPage is one page of Admin.Jobs.
type JobsPage struct {
	// Jobs are the page's jobs, in the state's order.
	Jobs []JobSummary `json:"jobs"`
	// Next is the cursor of the following page; "" on the last.
	Next string `json:"next,omitempty"`
	// Prev is the cursor of the preceding page; "" on the first.
	Prev string `json:"prev,omitempty"`
	// Total is the number of jobs in this state when the page was read (-1
	// when unknown).
	Total int64 `json:"total"`
}

// JobSummary is one job of a JobsPage. Fields that do not apply to the
// state are zero.
type JobSummary struct {
	// ID is the request id.
	ID string `json:"id"`
	// State is the state the job was listed in.
	State JobState `json:"state"`
	// Shard is the shard holding the job (0 for an unsharded queue).
	Shard int `json:"shard"`
	// EntryID is the stream entry of a queued, running or dead job.
	EntryID string `json:"entry_id,omitempty"`
	// Group is the fan-out group of a fan-out retry or dead letter.
	Group string `json:"group,omitempty"`
	// ProducedAt is when the job was produced, when known.
	ProducedAt time.Time `json:"produced_at,omitzero"`
	// Due is when a scheduled job or retry is appended to the stream.
	Due time.Time `json:"due,omitzero"`
	// Deliveries is the number of handler starts so far.
	Deliveries int `json:"deliveries"`
	// LastError is the last error of a retrying or dead job.
	LastError string `json:"last_error,omitempty"`
	// Consumer is the consumer holding a running job, or the one that
	// dead-lettered a dead job.
	Consumer string `json:"consumer,omitempty"`
	// Idle is, for a running job, the time since it was read or its lease
	// renewed.
	Idle time.Duration `json:"idle_ns,omitempty"`
	// DeadLetterID is a dead job's id for Admin.Requeue and
	// Admin.PurgeDeadLetters.
	DeadLetterID string `json:"dead_letter_id,omitempty"`
	// At is when a dead job was dead-lettered.
	At time.Time `json:"at,omitzero"`
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

var errNotImplemented = errors.New("streamq: not implemented yet")

// Jobs lists one page of the jobs in one state.
func (a *Admin) Jobs(ctx context.Context, q JobsQuery) (JobsPage, error) {
	mustContext(ctx, "Admin.Jobs")
	return JobsPage{Total: -1}, errNotImplemented
}

// RunNow promotes a scheduled job or a waiting retry at once (start count
// and dedup kept): ErrNotScheduled when it is not waiting in the schedule,
// ErrNotFound without a record.
func (a *Admin) RunNow(ctx context.Context, id string) error {
	mustContext(ctx, "Admin.RunNow")
	return errNotImplemented
}

// History returns the last 24 hours (or less: span > 0 and <= 24h), one
// point per minute, oldest first, zero-filled, summed over every shard and
// every replica's completions.
func (a *Admin) History(ctx context.Context, span time.Duration) ([]HistoryPoint, error) {
	mustContext(ctx, "Admin.History")
	return nil, errNotImplemented
}
