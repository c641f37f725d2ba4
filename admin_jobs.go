package streamq

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

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
	// JobCanceled: Admin.Cancel cancelled it while it waited in the
	// schedule; it never ran (Error holds the stored message). Its callers
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
	// yet has Err "the child has no outcome yet". Admin.Job of a child's id
	// shows where it stands. Nil for any other request.
	Children []ChildResult `json:"children,omitempty"`
	// Priority is the priority level of a scheduled, retrying, queued or
	// running request (see Priority); PriorityNormal, omitted in JSON, for
	// the default level and for a request in any other state.
	Priority PriorityLevel `json:"priority,omitempty"`
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
	res, err := scripts.Job.Run(ctx, a.client, []string{k.Record(id), k.Stream, k.Starts(t.group), k.Schedule, k.ScheduleData, k.Retry,
		k.LevelStream(levelNames[levelHigh]), k.LevelStream(levelNames[levelLow])}, t.group, id).Slice()
	if err != nil {
		return info, fmt.Errorf("streamq: look up %q in %s: %w", id, a.queue, err)
	}
	if len(res) != 8 {
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
	code, value := rec[:1], rec[1:]
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

// ErrJobRunning is returned by Forget when a consumer holds the request and
// force was not given.
var ErrJobRunning = errors.New("streamq: the request is running")

// Forget makes Redis forget a request id, so that producing the id again runs
// it again. A finished request's record (result or error) is deleted. A
// queued request is removed from the stream too, and a scheduled one from the
// schedule: it will not run (a caller waiting for it is not told; Cancel
// tells callers). A running
// request is refused with ErrJobRunning (naming the consumer) unless force is
// set; forced, its entry is also acknowledged for the Admin's group, so no
// consumer runs it again, but a handler running now is not stopped and, if it
// finishes, records its outcome again (call Forget once more after it). The
// id's dead letter, if any, stays in the dead-letter stream. It returns
// ErrNotFound when Redis holds no record of the id.
func (a *Admin) Forget(ctx context.Context, id string, force bool) error {
	mustContext(ctx, "Admin.Forget")
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
	res, err := scripts.Forget.Run(ctx, a.client, []string{k.Record(id), k.Stream, k.Starts(t.group), k.Schedule, k.ScheduleData, k.Retry,
		k.LevelStream(levelNames[levelHigh]), k.LevelStream(levelNames[levelLow])}, t.group, f, id).StringSlice()
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

// DeadLetter returns one dead letter of the Admin's group by its DeadLetterID,
// or ErrNotFound.
func (a *Admin) DeadLetter(ctx context.Context, deadLetterID string) (DeadLetter, error) {
	mustContext(ctx, "Admin.DeadLetter")
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
