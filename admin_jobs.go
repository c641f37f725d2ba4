package streamq

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/streamq/streamq/internal/keys"
	"github.com/streamq/streamq/internal/scripts"
)

// JobState is where a request stands, as Admin.Job reports it.
type JobState string

// The states of a request.
const (
	// JobScheduled: waiting in the schedule for its due time (Due): produced
	// with At or After. (A retry waiting for its back-off is JobRetrying.)
	JobScheduled JobState = "scheduled"
	// JobQueued: in the stream, not held by any consumer of the group (not yet
	// read, or released by a consumer that shut down).
	JobQueued JobState = "queued"
	// JobRunning: held by a consumer of the group (read into its prefetch
	// ring, in its handler, or waiting after a failed attempt for its retry).
	JobRunning JobState = "running"
	// JobSucceeded: the handler returned a response (Result holds it unless
	// the consumers discard results).
	JobSucceeded JobState = "succeeded"
	// JobFailed: completed with an error (Error holds it).
	JobFailed JobState = "failed"
	// JobDeadLettered: failed for good and moved to the dead-letter stream
	// (Error says why).
	JobDeadLettered JobState = "dead-lettered"
	// JobCanceled: Admin.Cancel cancelled it: scheduled, queued (it never
	// ran) or running (its handler's context was cancelled, and whatever it
	// returned was not recorded). Error holds the stored message. Its callers
	// get ErrCanceled until the record expires (AdminOptions.ResultTTL).
	JobCanceled JobState = "canceled"
	// JobWaiting: a flow's parent waiting for its children (ProduceFlow);
	// Children shows theirs.
	JobWaiting JobState = "waiting"
	// JobLost: the record says in flight, but its stream entry is gone and no
	// consumer holds it (the stream was deleted or trimmed by hand), or it
	// says scheduled and the schedule does not hold it (deleted by hand). Producing
	// the id attaches to nothing until the record expires; Forget it.
	JobLost JobState = "lost"
)

// JobInfo describes one request id, as Admin.Job found it.
type JobInfo struct {
	// ID is the request id.
	ID string `json:"id"`
	// State is where the request stands.
	State JobState `json:"state"`
	// Shard is the shard the id belongs to (0 for an unsharded queue).
	Shard int `json:"shard"`
	// EntryID is the stream entry of a request in flight ("" once completed).
	EntryID string `json:"entry_id,omitempty"`
	// Enqueued is when the entry of a request in flight was appended (its
	// stream id's time); zero once completed.
	Enqueued time.Time `json:"enqueued,omitzero"`
	// Due is when a scheduled request is appended to the stream (the Redis
	// server's clock); zero in every other state.
	Due time.Time `json:"due,omitzero"`
	// Consumer is the consumer holding a running request.
	Consumer string `json:"consumer,omitempty"`
	// Deliveries is how many times a handler started on the request in
	// flight so far (streamq's own count); for a scheduled retry, the starts
	// before it.
	Deliveries int `json:"deliveries"`
	// Idle is, for a running request, the time since its consumer last read
	// or renewed it (leases are renewed every MinIdle/3): a value well past
	// MinIdle means the consumer is gone and another one will claim it.
	// streamq records no handler start time, so how long the handler has run
	// is not known; Enqueued bounds it.
	Idle time.Duration `json:"idle_ns"`
	// Result is the stored response of a succeeded request, as the codec
	// encoded it; nil when the consumers discard results. In JSON it is
	// base64 ("result"), and its text is added as "result_text" when it is
	// valid UTF-8 (see MarshalJSON).
	Result []byte `json:"result,omitempty"`
	// Error is the stored error of a failed or dead-lettered request, the
	// message stored with a canceled one, or a waiting retry's last error.
	Error string `json:"error,omitempty"`
	// TTL is how long the record lives on: -1 when it has no expiry.
	TTL time.Duration `json:"ttl_ns"`
	// Progress is the last value the request's handler reported
	// (Message.Progress), as its codec encoded it; nil when none is stored.
	Progress []byte `json:"progress,omitempty"`
	// Children are, for a flow's parent (ProduceFlow) whose flow hash
	// lives, its children's outcomes so far, in order; a child without one
	// yet has Err ErrChildPending. Admin.Job of a child's id
	// shows where it stands. Nil for any other request.
	Children []ChildResult `json:"children,omitempty"`
	// Priority is the priority level of a scheduled, retrying, queued or
	// running request (see Priority); PriorityNormal, omitted in JSON, for
	// the default level and for a request in any other state.
	Priority PriorityLevel `json:"priority,omitempty"`
	// Mode is the flow-control mode the id is under (see Throttle, Debounce
	// and Replace): "throttle" while a Throttle window of the id is open
	// (ModeUntil is its end: a produce after it runs the id again);
	// "debounce" while a Debounce wait runs (Due is when the id runs unless
	// produced again, ModeUntil the latest it runs, its first produce +
	// maxWait); "replace" when a Replace produce left its payload to the
	// waiting request, or a follow-up run waits behind the queued or running
	// one (Replacement). Empty otherwise.
	Mode string `json:"mode,omitempty"`
	// ModeUntil is, for Mode "throttle", when the open window ends and, for
	// "debounce", the latest time the id runs (the Redis server's clock);
	// zero otherwise.
	ModeUntil time.Time `json:"mode_until,omitzero"`
	// Replacement is the payload (as the codec encoded it) of the follow-up
	// run a Replace produce left behind the queued or running request: it
	// is appended when that run ends. Nil when none waits. In JSON it is
	// base64, and its text is added as "replacement_text" when it is valid
	// UTF-8.
	Replacement []byte `json:"replacement,omitempty"`
	// Payload is the request's encoded payload while it is in flight: the
	// stream entry's (queued, running) or the one a scheduled request or a
	// waiting retry keeps; nil once completed (the entry is gone; a dead
	// letter keeps it, see Admin.DeadLetter) and when a Fetcher supplies it.
	// Base64 in JSON.
	Payload []byte `json:"payload,omitempty"`
	// Finished is when a completed request's outcome was recorded, known
	// while the list of completed requests holds it
	// (ConsumerOptions.Retention); zero otherwise.
	Finished time.Time `json:"finished,omitzero"`
	// Errors are the errors of the request's failed attempts that were
	// retried, newest first, when the consumers keep them
	// (Retention.Errors); nil otherwise. The last failure of a failed or
	// dead-lettered request is Error, not here.
	Errors []AttemptError `json:"errors,omitempty"`
}

// AttemptError is one failed attempt of a request that was retried
// (JobInfo.Errors).
type AttemptError struct {
	// At is when the retry was scheduled (the Redis server's clock).
	At time.Time `json:"at"`
	// Start is the attempt's start number (1 for the first).
	Start int `json:"start"`
	// Error is the attempt's error message (its first 1024 bytes).
	Error string `json:"error"`
}

// parseAttemptError parses an entry of a request's error list: "<ms>
// <start> <error>".
func parseAttemptError(s string) (AttemptError, bool) {
	ms, rest, ok1 := strings.Cut(s, " ")
	start, msg, ok2 := strings.Cut(rest, " ")
	at, err1 := strconv.ParseInt(ms, 10, 64)
	n, err2 := strconv.Atoi(start)
	if !ok1 || !ok2 || err1 != nil || err2 != nil {
		return AttemptError{}, false
	}
	return AttemptError{At: time.UnixMilli(at), Start: n, Error: msg}, true
}

// Job looks up a request id: whether it is scheduled (until when), a retry
// waiting for its back-off (until when, after how many starts, why),
// queued, running (on which consumer, after how many starts), finished (with its stored result or
// error) or canceled, and how long Redis keeps its record. It returns ErrNotFound when
// Redis holds no record of the id: never produced, expired (ResultTTL,
// InflightTTL), or forgotten. The in-flight part is read for the Admin's
// group (AdminOptions.Group; default the answering group).
func (a *Admin) Job(ctx context.Context, id string) (JobInfo, error) {
	mustContext(ctx, "Admin.Job")
	return callBounded(ctx, func(ctx context.Context) (JobInfo, error) { return a.job(ctx, id) })
}

// job is the body of Job, run by callBounded.
func (a *Admin) job(ctx context.Context, id string) (JobInfo, error) {
	info := JobInfo{ID: id}
	if err := validateID(id); err != nil {
		return info, err
	}
	shards, err := a.existingShards(ctx)
	if err != nil {
		return info, err
	}
	t, err := a.target(ctx)
	if err != nil {
		return info, err
	}
	info.Shard = keys.ShardOf(id, len(shards))
	k := shards[info.Shard]
	high, low := k.AtLevel(levelNames[levelHigh]), k.AtLevel(levelNames[levelLow])
	res, err := scripts.Job.Run(ctx, a.client, []string{k.Record(id), k.Stream, k.Starts(t.group), k.Schedule, k.ScheduleData, k.Retry,
		high.Stream, low.Stream, k.Mode(id), k.Completed, k.Errors(id), high.Starts(t.group), low.Starts(t.group)}, t.group, id).Slice()
	if err != nil {
		return info, fmt.Errorf("streamq: look up %q in %s: %w", id, a.queue, err)
	}
	if len(res) != 14 {
		return info, fmt.Errorf("streamq: look up %q in %s: unexpected reply %v", id, a.queue, res)
	}
	rec, ok := res[0].(string)
	if !ok {
		return info, fmt.Errorf("%w: no record of request %q in queue %s (never produced, expired, or forgotten)", ErrNotFound, id, a.queue)
	}
	ttl, _ := res[1].(int64)
	info.TTL = time.Duration(ttl) * time.Millisecond
	if ttl < 0 {
		info.TTL = -1
	}
	if lvl, ok := res[7].(string); ok {
		info.Priority = levelNamed(lvl)
	}
	info.Mode, info.ModeUntil, info.Replacement = jobMode(res[8], res[9], res[10])
	if p, ok := res[11].(string); ok {
		info.Payload = []byte(p)
	}
	if list, ok := res[13].([]any); ok {
		for _, e := range list {
			if ae, ok := parseAttemptError(asString(e)); ok {
				info.Errors = append(info.Errors, ae)
			}
		}
	}
	if done, ok := res[12].(string); ok {
		if us, err := strconv.ParseFloat(done, 64); err == nil {
			info.Finished = time.UnixMilli(int64(us) / 1000)
		}
	}
	code, value := rec[:1], recordEntryID(rec)
	switch code {
	case "R":
		info.State, info.Result = JobSucceeded, []byte(value)
	case "N":
		info.State = JobSucceeded
	case "E":
		info.State, info.Error = JobFailed, value
	case "L":
		info.State, info.Error = JobDeadLettered, value
	case "C":
		info.State, info.Error = JobCanceled, value
	case "P":
		if value == "&" {
			info.State = JobWaiting
			break
		}
		if value == "%" {
			info.State = JobQueued // waiting for its key's turn (Key)
			break
		}
		if due, ok := strings.CutPrefix(value, "@"); ok {
			// Scheduled: a delayed request or a retry waiting for its back-off.
			info.State = JobScheduled
			if ms, err := strconv.ParseInt(due, 10, 64); err == nil {
				info.Due = time.UnixMilli(ms)
			}
			if s, ok := res[5].(string); ok {
				info.Deliveries, _ = strconv.Atoi(s)
			}
			switch present, _ := res[2].(int64); present {
			case 0:
				info.State = JobLost
			case 2:
				info.State = JobRetrying
				info.Error, _ = res[6].(string)
			}
			break
		}
		info.EntryID = value
		if ms, _, ok := strings.Cut(value, "-"); ok {
			if n, err := strconv.ParseInt(ms, 10, 64); err == nil {
				info.Enqueued = time.UnixMilli(n)
			}
		}
		if s, ok := res[5].(string); ok {
			info.Deliveries, _ = strconv.Atoi(s)
		}
		present, _ := res[2].(int64)
		switch holder, _ := res[3].(string); {
		case holder != "":
			idle, _ := res[4].(int64)
			info.State, info.Consumer, info.Idle = JobRunning, holder, time.Duration(idle)*time.Millisecond
		case present == 1:
			info.State = JobQueued
		default:
			info.State = JobLost
		}
	default:
		return info, fmt.Errorf("%w: the record of %q in %s starts with %q, which streamq never writes", ErrWrongType, id, a.queue, code)
	}
	// The progress value and a flow's children: one more round trip.
	pipe := a.client.Pipeline()
	progCmd := pipe.Get(ctx, k.Progress(id))
	flowCmd := pipe.HGetAll(ctx, k.Flow(id))
	_, _ = pipe.Exec(ctx)
	if v, err := progCmd.Result(); err == nil {
		if _, val, ok := parseStoredProgress(v); ok {
			info.Progress = []byte(val)
		}
	}
	if h, err := flowCmd.Result(); err == nil && len(h) > 0 {
		info.Children, _ = parseFlowChildren(h, k.Flow(id))
	}
	return info, nil
}

// jobMode decodes job.lua's flow-control part: the mode letter, its time
// (Unix ms) and the follow-up run's stream fields (length-prefixed).
func jobMode(m, at, follow any) (string, time.Time, []byte) {
	var mode string
	switch s, _ := m.(string); s {
	case "t":
		mode = "throttle"
	case "d":
		mode = "debounce"
	case "r":
		mode = "replace"
	}
	var until time.Time
	if s, ok := at.(string); ok {
		if ms, err := strconv.ParseInt(s, 10, 64); err == nil {
			until = time.UnixMilli(ms)
		}
	}
	var payload []byte
	if s, ok := follow.(string); ok {
		rest := s
		for rest != "" {
			name, r, ok := cutLengthPrefixed(rest)
			if !ok {
				break
			}
			value, r, ok := cutLengthPrefixed(r)
			if !ok {
				break
			}
			if name == keys.FieldPayload {
				payload = []byte(value)
				if payload == nil {
					payload = []byte{}
				}
				break
			}
			rest = r
		}
	}
	return mode, until, payload
}

// recordEntryID returns what follows a record's first byte, without the
// follow-up run a Replace may keep behind an entry ("P<entry id>+..."): for
// an in-flight record, its entry id (or "@<due>", "&").
func recordEntryID(rec string) string {
	v := rec[1:]
	if rec[0] == keys.RecordInflight {
		if i := strings.IndexByte(v, '+'); i >= 0 {
			v = v[:i]
		}
	}
	return v
}

// ErrJobRunning is returned by Forget when a consumer holds the request and
// force was not given.
var ErrJobRunning = errors.New("streamq: the request is running")

// Forget makes Redis forget a request id, so that producing the id again runs
// it again (an open Throttle window of the id ends too, also when Forget
// finds no record). A finished request's record (result or error) is deleted. A
// queued request is removed from the stream too, and a scheduled one from the
// schedule: it will not run (a caller waiting for it is not told; Cancel
// tells callers). A running
// request is refused with ErrJobRunning (naming the consumer) unless force is
// set; forced, its entry is also acknowledged for the Admin's group, so no
// consumer runs it again, but a handler running now is not stopped and, if it
// finishes, records its outcome again (call Forget once more after it). The
// id's dead letter, if any, stays in the dead-letter stream. It returns
// ErrNotFound when Redis holds no record of the id.
//
// When ctx ends before Redis answers, Forget returns ctx's error at once
// (see Admin) and the id may or may not be forgotten: call it again.
func (a *Admin) Forget(ctx context.Context, id string, force bool) error {
	mustContext(ctx, "Admin.Forget")
	return callBoundedErr(ctx, func(ctx context.Context) error { return a.forget(ctx, id, force) })
}

// forget is the body of Forget, run by callBounded.
func (a *Admin) forget(ctx context.Context, id string, force bool) error {
	if err := validateID(id); err != nil {
		return err
	}
	shards, err := a.existingShards(ctx)
	if err != nil {
		return err
	}
	t, err := a.target(ctx)
	if err != nil {
		return err
	}
	k := shards[keys.ShardOf(id, len(shards))]
	f := "0"
	if force {
		f = "1"
	}
	high, low := k.AtLevel(levelNames[levelHigh]), k.AtLevel(levelNames[levelLow])
	res, err := scripts.Forget.Run(ctx, a.client, []string{k.Record(id), k.Stream, k.Starts(t.group), k.Schedule, k.ScheduleData, k.Retry,
		high.Stream, low.Stream, k.Progress(id), k.Errors(id), high.Starts(t.group), low.Starts(t.group), k.Mode(id)}, t.group, f, id, publishCommand(isCluster(a.client))).StringSlice()
	if err != nil {
		return fmt.Errorf("streamq: forget %q in %s: %w", id, a.queue, err)
	}
	switch {
	case len(res) > 0 && res[0] == "missing":
		return fmt.Errorf("%w: no record of request %q in queue %s (never produced, expired, or forgotten)", ErrNotFound, id, a.queue)
	case len(res) > 1 && res[0] == "held":
		return fmt.Errorf("%w: consumer %s holds %q; wait for it to finish, or force (its handler is not stopped)", ErrJobRunning, res[1], id)
	}
	return nil
}

// existingShards is shards, failing with ErrNotFound when the queue does not
// exist: no shard count recorded (every producer and consumer records one),
// and no stream or dead-letter stream under its unsharded names.
func (a *Admin) existingShards(ctx context.Context) ([]keys.Keys, error) {
	shards, err := a.shards(ctx)
	if err != nil {
		return nil, err
	}
	n, err := a.client.Exists(ctx, keys.Meta(a.queue)).Result()
	if err != nil {
		return nil, fmt.Errorf("streamq: read the shard count of %s: %w", a.queue, err)
	}
	if n == 0 && len(shards) == 1 {
		// An unsharded queue has no meta key: it exists once anything of it
		// does. Its keys share one hash tag, so one EXISTS asks for all.
		k := shards[0]
		n, err = a.client.Exists(ctx, k.Stream, k.DeadLetter, k.Schedule, keys.Paused(a.queue), keys.Periodic(a.queue)).Result()
		if err != nil {
			return nil, fmt.Errorf("streamq: look for queue %s: %w", a.queue, err)
		}
	}
	if n == 0 {
		return nil, fmt.Errorf("%w: queue %q does not exist in this Redis (no producer or consumer used it; check the name, or list the queues)", ErrNotFound, a.queue)
	}
	return shards, nil
}

// Cancel cancels a request that has no outcome yet, and returns nil once it
// is cancelled: from then on its outcome is ErrCanceled, whatever its
// handler returns. What it does by the state the request is in (see
// JobState):
//
//   - scheduled (produced with At or After) or retrying (waiting for its
//     back-off): removed from the schedule; it never runs again.
//   - queued (in the stream, read by no consumer): its entry is deleted;
//     no handler starts it, and no start is counted.
//   - running (held by a consumer of the answering group: in its prefetch
//     ring, in its handler, or with its outcome on the way to Redis): its
//     entry is acknowledged and deleted, so neither a retry nor a claim
//     after that consumer's crash runs it again, and a notice is pushed to
//     the consumer, which drops the entry if its handler has not started or
//     cancels the handler's context (context.Cause: ErrCanceled). The
//     handler's result, error or staged writes (Message.Tx) are not
//     recorded: the request's outcome is already ErrCanceled. Cancel does
//     not wait for the handler to return.
//   - waiting (a flow's parent waiting for its children, ProduceFlow): its
//     children that are scheduled, queued or waiting are cancelled with it
//     (running children finish; what is cancelled counts once each in
//     Stats.Canceled).
//   - lost (JobLost: the record says in flight, but its entry is gone): the
//     record gets the outcome ErrCanceled, so callers stop waiting.
//   - canceled already: nil, and nothing is written, counted or announced
//     (so is a resend of this call after a lost reply).
//   - finished (succeeded, failed or dead-lettered): ErrFinished; the
//     stored outcome stands.
//   - no record (never produced, or its outcome expired): ErrNotFound.
//
// The decision is one atomic step in Redis against the request's record,
// so under any race with the request's completion exactly one of the two
// wins: either Cancel returns nil and every caller gets ErrCanceled, or it
// returns ErrFinished and every caller gets the handler's outcome.
// Callers (Promise.Wait, Dedup, Send's callbacks) get ErrCanceled through
// the stored outcome (kept AdminOptions.ResultTTL) and a notice, at once,
// also while a cancelled handler is still returning; producing the id
// again meanwhile returns that outcome. A cancelled child of a flow counts
// as a failed child for its parent. Each cancellation counts once in
// Stats.Canceled. A cancelled entry is deleted from the stream for every
// group: a fan-out group that has not read it does not run it, and one that
// holds it loses it at its next lease renewal (its handler's context ends
// with cause ErrLeaseLost, and its outcome is dropped).
//
// With AdminOptions.Group naming a fan-out group, Cancel drops that group's
// retry of the id waiting in the retry set instead (counted in
// Stats.Canceled): the group does not run the request again, and the
// request's record, its callers and the answering group's retry are left
// alone. A fan-out group keeps no record, so Cancel returns ErrNotScheduled
// when the group has no retry of the id waiting, also when an earlier call
// cancelled it. A nil ctx panics.
//
// When ctx ends before Redis answers, Cancel returns ctx's error at once
// (see Admin) and the request may or may not be cancelled, as when a reply
// is lost: call Cancel again (nil when it was) or look with Job.
func (a *Admin) Cancel(ctx context.Context, id string) error {
	mustContext(ctx, "Admin.Cancel")
	return callBoundedErr(ctx, func(ctx context.Context) error { return a.cancelJob(ctx, id) })
}

// cancelJob is the body of Cancel, run by callBounded.
func (a *Admin) cancelJob(ctx context.Context, id string) error {
	if err := validateID(id); err != nil {
		return err
	}
	shards, err := a.shards(ctx)
	if err != nil {
		return err
	}
	k := shards[keys.ShardOf(id, len(shards))]
	t, err := a.target(ctx)
	if err != nil {
		return err
	}
	if t.fanout {
		n, err := scripts.CancelRetry.Run(ctx, a.client, []string{k.Retry, k.ScheduleData, k.Counts}, fanoutMember(t.group, id)).Int64()
		if err != nil {
			return fmt.Errorf("streamq: cancel group %s's retry of %q: %w", t.group, id, err)
		}
		if n == 0 {
			return fmt.Errorf("%w: group %s of %s has no retry of request %q waiting (never failed there, already run, or cancelled)", ErrNotScheduled, t.group, a.queue, id)
		}
		return nil
	}
	answering, err := a.client.Get(ctx, keys.AnsweringGroup(a.queue)).Result()
	if err != nil && !errors.Is(err, redis.Nil) {
		return fmt.Errorf("streamq: cancel %q: read the answering group: %w", id, err)
	}
	msg := "canceled by Admin.Cancel at " + time.Now().UTC().Format(time.RFC3339Nano)
	res, err := a.cancel(ctx, k, id, answering, "", msg, cancelAny)
	if err != nil {
		return err
	}
	code, _ := res[0].(int64)
	switch code {
	case 0:
		return fmt.Errorf("%w: request %q of %s has no record (never produced, or its outcome expired)", ErrNotFound, id, a.queue)
	case 1:
		rec, _ := res[1].(string)
		state := "finished"
		if len(rec) > 0 {
			state = "finished (" + describeRecord(rec[0]) + ")"
		}
		return fmt.Errorf("%w: request %q of %s is %s; its outcome stands", ErrFinished, id, a.queue, state)
	}
	return a.cancelChildren(ctx, k.Flow(id), msg, 0)
}

// The modes of cancel.lua (its ARGV[7]): what else than a scheduled or
// waiting request it cancels.
const (
	cancelScheduled = ""  // only scheduled, retrying or waiting requests
	cancelUnheld    = "q" // also queued entries no consumer holds (a flow's children)
	cancelAny       = "a" // also entries in the stream, held or not (Admin.Cancel)
)

// cancel runs cancel.lua for id in shard k; parent is the flow hash the
// caller takes for the request's parent, or "". The script reads the
// parent in the step that cancels: when it is another one (the request
// moved since the caller looked), nothing was written, and cancel runs the
// script again naming it (a parent never changes, so once is enough).
func (a *Admin) cancel(ctx context.Context, k keys.Keys, id, group, parent, msg, mode string) ([]any, error) {
	high, low := k.AtLevel(levelNames[levelHigh]), k.AtLevel(levelNames[levelLow])
	starts := [3]string{k.Stream, k.Stream, k.Stream} // no group: no counts to drop
	if group != "" {
		starts = [3]string{k.Starts(group), high.Starts(group), low.Starts(group)}
	}
	var waitKey, waitJob string // a keyed job waiting for its key's turn (code 4)
	for attempt, looked := 0, 0; ; attempt++ {
		keyList := []string{k.Record(id), k.Schedule, k.ScheduleData, k.Counts, k.Retry, k.Stream, k.Flow(id), k.Progress(id),
			starts[0], high.Stream, low.Stream, starts[1], starts[2]}
		if rec, stream, ok := keys.FlowParent(parent); ok {
			keyList = append(keyList, parent, rec, stream)
		}
		if a.beforeCancel != nil {
			a.beforeCancel()
		}
		res, err := scripts.Cancel.Run(ctx, a.client, keyList,
			id, a.opts.ResultTTL.Milliseconds(), k.Channel, publishCommand(isCluster(a.client)), msg, group, mode, parent, k.Wake,
			waitKey, waitJob).Slice()
		if err != nil {
			if errors.Is(err, redis.Nil) {
				return nil, fmt.Errorf("%w: request %q of %s", ErrNotFound, id, a.queue)
			}
			return nil, fmt.Errorf("streamq: cancel %q: %w", id, err)
		}
		if code, _ := res[0].(int64); code == 4 && len(res) == 1 {
			// Waiting for its key's turn: its stream fields (and so its
			// parent) are in its key's list, read here in pages. A job that
			// left the list meanwhile was appended: the next run finds it
			// in the stream.
			if looked++; looked > 3 {
				return nil, fmt.Errorf("streamq: cancel %q: the request kept moving in its key's list while cancelling; try again", id)
			}
			if waitKey, waitJob, err = a.waitingKeyedJob(ctx, k, k.Record(id)); err != nil {
				return nil, fmt.Errorf("streamq: cancel %q: %w", id, err)
			}
			if waitJob == "" && looked > 1 {
				waitJob = "-" // in no list twice: cancelled without a parent
			}
			attempt--
			continue
		}
		if code, _ := res[0].(int64); code == 3 && len(res) == 2 && attempt == 0 {
			parent, _ = res[1].(string)
			continue
		}
		if code, _ := res[0].(int64); code == 3 {
			return nil, fmt.Errorf("streamq: cancel %q: the request's parent changed twice while cancelling (%v)", id, res)
		}
		return res, nil
	}
}

// waitingKeyedJob finds the job of record rec waiting in a key's list of
// shard k (fair.lua: every key with waiting jobs is in keys:ready,
// keys:parked or keys:timed), reading each list in pages so that no call
// blocks Redis for long. It returns the key and the job's element, or "" and
// "" when no list holds it (it was appended, or its turn dropped it).
func (a *Admin) waitingKeyedJob(ctx context.Context, k keys.Keys, rec string) (string, string, error) {
	ready, err := a.client.LRange(ctx, k.KeysReady(), 0, -1).Result()
	if err != nil {
		return "", "", fmt.Errorf("read the keys with waiting jobs: %w", err)
	}
	parked, err := a.client.SMembers(ctx, k.KeysParked()).Result()
	if err != nil {
		return "", "", fmt.Errorf("read the keys with waiting jobs: %w", err)
	}
	timed, err := a.client.ZRange(ctx, k.KeysTimed(), 0, -1).Result()
	if err != nil {
		return "", "", fmt.Errorf("read the keys with waiting jobs: %w", err)
	}
	const page = 500
	seen := map[string]bool{}
	for _, key := range slices.Concat(ready, parked, timed) {
		if seen[key] {
			continue
		}
		seen[key] = true
		for start := int64(0); ; start += page {
			els, err := a.client.LRange(ctx, k.KeyQueue(key), start, start+page-1).Result()
			if err != nil {
				return "", "", fmt.Errorf("read the waiting jobs of key %q: %w", key, err)
			}
			for _, el := range els {
				if waitingJobRecord(el) == rec {
					return key, el, nil
				}
			}
			if len(els) < page {
				break
			}
		}
	}
	return "", "", nil
}

// waitingJobRecord returns the record key of a waiting keyed job's element
// (its first string; see fair.lua's fairEnc): a MessagePack array of
// strings where the server has cmsgpack, length-prefixed strings
// ("<len>:<s>"...) otherwise. It returns "" for anything else.
func waitingJobRecord(el string) string {
	if el == "" {
		return ""
	}
	if c := el[0]; c >= '0' && c <= '9' {
		n, rest, ok := strings.Cut(el, ":")
		size, err := strconv.Atoi(n)
		if !ok || err != nil || size > len(rest) {
			return ""
		}
		return rest[:size]
	}
	// The array's header: fixarray, array 16 or array 32.
	i := 0
	switch c := el[0]; {
	case c >= 0x90 && c <= 0x9f:
		i = 1
	case c == 0xdc:
		i = 3
	case c == 0xdd:
		i = 5
	default:
		return ""
	}
	// The first string's header: fixstr, str 8, str 16 or str 32.
	if i >= len(el) {
		return ""
	}
	size, head := 0, 0
	switch c := el[i]; {
	case c >= 0xa0 && c <= 0xbf:
		size, head = int(c&0x1f), 1
	case c == 0xd9 && i+2 <= len(el):
		size, head = int(el[i+1]), 2
	case c == 0xda && i+3 <= len(el):
		size, head = int(el[i+1])<<8|int(el[i+2]), 3
	case c == 0xdb && i+5 <= len(el):
		size, head = int(el[i+1])<<24|int(el[i+2])<<16|int(el[i+3])<<8|int(el[i+4]), 5
	default:
		return ""
	}
	if start := i + head; size <= len(el)-start {
		return el[start : start+size]
	}
	return ""
}

// cancelChildren cancels the children of a cancelled flow parent (flow is
// its flow hash) that have no outcome yet and are scheduled, queued or
// waiting for children of their own (recursively); running children finish.
// A flow hash that is gone (not a flow) cancels nothing.
func (a *Admin) cancelChildren(ctx context.Context, flow, msg string, depth int) error {
	h, err := a.client.HGetAll(ctx, flow).Result()
	if err != nil {
		return fmt.Errorf("streamq: read the children of %s: %w", flow, err)
	}
	if len(h) == 0 || depth > MaxFlowChildren {
		return nil
	}
	order, ok := splitLengthPrefixed(h["o"])
	if !ok {
		return nil
	}
	for i := 0; i+2 < len(order); i += 3 {
		if h["k:"+order[i]] != "" {
			continue // has its outcome
		}
		queue, id := order[i+1], order[i+2]
		n, err := queueShards(ctx, a.client, queue)
		if err != nil {
			return err
		}
		ks, err := keys.Shards(queue, n)
		if err != nil {
			return err
		}
		ck := ks[keys.ShardOf(id, n)]
		group, err := a.client.Get(ctx, keys.AnsweringGroup(queue)).Result()
		if err != nil && !errors.Is(err, redis.Nil) {
			return fmt.Errorf("streamq: cancel child %q: read the answering group: %w", id, err)
		}
		// The parent (flow) is cancelled: the child's outcome counts there
		// and releases nothing.
		res, err := a.cancel(ctx, ck, id, group, flow, msg, cancelUnheld)
		if err != nil {
			return err
		}
		if code, _ := res[0].(int64); code == 2 {
			// A nested parent's children too. Not only when the script says
			// it replaced "P&": a call go-redis resent after a lost reply
			// finds the parent cancelled already, and its children must
			// still be cancelled. A child that is no parent has no flow
			// hash: one HGETALL that finds nothing.
			if err := a.cancelChildren(ctx, ck.Flow(id), msg, depth+1); err != nil {
				return err
			}
		}
	}
	return nil
}

// runNowMarkerTTL is how long RunNow remembers the entry it promoted a job
// to, so that a call sent again (after a lost reply) succeeds.
const runNowMarkerTTL = 10 * time.Minute

// RunNow appends a scheduled job (produced with At or After) or a waiting
// retry to the stream at once, as its promotion at its due time would: the
// request keeps its record (callers waiting on the id get its result), its
// start count (MaxDeliveries counts on) and its stream fields. It addresses
// the Admin's group's retry (AdminOptions.Group; a fan-out group's retry has
// no record). A call sent again (after a lost reply) succeeds and does
// nothing while the entry the first call appended is still in the stream
// (queued or running; remembered for 10 minutes); a job that failed again
// and waits for its retry once more is run again. It returns ErrNotScheduled when the
// job is not waiting in the schedule (queued, running, completed or
// cancelled) and ErrNotFound when the request has no record. A nil ctx
// panics.
//
// When ctx ends before Redis answers, RunNow returns ctx's error at once
// (see Admin) and the job may or may not have been appended: call it again
// (a resend does nothing while the entry it appended is in the stream).
func (a *Admin) RunNow(ctx context.Context, id string) error {
	mustContext(ctx, "Admin.RunNow")
	return callBoundedErr(ctx, func(ctx context.Context) error { return a.runNow(ctx, id) })
}

// runNow is the body of RunNow, run by callBounded.
func (a *Admin) runNow(ctx context.Context, id string) error {
	if err := validateID(id); err != nil {
		return err
	}
	shards, err := a.shards(ctx)
	if err != nil {
		return err
	}
	t, err := a.target(ctx)
	if err != nil {
		return err
	}
	k := shards[keys.ShardOf(id, len(shards))]
	member, rec := "r"+id, k.Record(id)
	if t.fanout {
		member, rec = fanoutMember(t.group, id), k.Stream
	}
	res, err := scripts.Promote.Run(ctx, a.client,
		[]string{k.Stream, k.Schedule, k.ScheduleData, k.Retry, k.RunNowMarker(member), rec,
			k.LevelStream(levelNames[levelHigh]), k.LevelStream(levelNames[levelLow])},
		1, startsTTL.Milliseconds(), member, runNowMarkerTTL.Milliseconds(), k.Wake, publishCommand(isCluster(a.client))).Slice()
	if err != nil {
		return fmt.Errorf("streamq: run %q of %s now: %w", id, a.queue, err)
	}
	if len(res) != 2 {
		return fmt.Errorf("streamq: run %q of %s now: unexpected reply %v", id, a.queue, res)
	}
	switch code, _ := res[0].(int64); code {
	case 1:
		return nil
	case 2:
		r, _ := res[1].(string)
		state := "completed"
		if len(r) > 0 {
			state = "completed (" + describeRecord(r[0]) + ")"
		}
		return fmt.Errorf("%w: request %q of %s is %s; its schedule entry was dropped", ErrNotScheduled, id, a.queue, state)
	}
	r, ok := res[1].(string)
	switch {
	case !ok && !t.fanout:
		return fmt.Errorf("%w: request %q of %s has no record (never produced, or its outcome expired)", ErrNotFound, id, a.queue)
	case len(r) > 0 && r[0] == keys.RecordInflight && !strings.HasPrefix(r, "P@"):
		return fmt.Errorf("%w: request %q of %s is already in the stream as entry %s (queued or running)", ErrNotScheduled, id, a.queue, recordEntryID(r))
	case len(r) > 0 && r[0] != keys.RecordInflight:
		return fmt.Errorf("%w: request %q of %s is completed (%s)", ErrNotScheduled, id, a.queue, describeRecord(r[0]))
	}
	return fmt.Errorf("%w: request %q of %s is not waiting in the schedule", ErrNotScheduled, id, a.queue)
}
