// Package keys builds every Redis key and channel name of a queue in one place.
//
// All names of one queue share the hash tag "{<queue>}", so every script and
// transaction that touches one queue stays in one Redis Cluster slot.
package keys

import (
	"errors"
	"fmt"
	"strconv"
	"strings"
)

// MaxQueueNameLen is the longest queue name accepted.
const MaxQueueNameLen = 128

// Keys holds the names of one queue.
type Keys struct {
	// Queue is the user's queue name.
	Queue string
	// Stream is the stream holding the queue's entries.
	Stream string
	// DeadLetter is the stream holding dead-lettered entries.
	DeadLetter string
	// Channel is the pub/sub channel that carries completion notices.
	Channel string
	// Schedule is the sorted set of delayed jobs waiting for their time:
	// member "r<request id>", score the due time in Unix milliseconds of the
	// server's clock. (Before Retry existed, retries waited here too; such
	// members still promote.)
	Schedule string
	// Retry is the sorted set of retries waiting for their back-off, like
	// Schedule: member "r<request id>" (a retry of the answering group) or
	// "g<len(group)>:<group><request id>" (a retry of one fan-out group).
	Retry string
	// ScheduleData is the hash holding, per Schedule or Retry member, what
	// promotion needs to append the job: its record key, start-count key,
	// start count and stream fields, then what Admin.Jobs shows: a retry's
	// last error, a delayed job's production time (see
	// internal/scripts/promote.lua).
	ScheduleData string
	// Wake is the pub/sub channel on which a job scheduled ahead of every
	// other one wakes the consumers' promoters.
	Wake string
	// Fanout is present once a fan-out consumer group may read the stream:
	// completions then leave entries to the trim instead of deleting them.
	Fanout string
	// Counts is the hash of the shard's running totals, which never expire:
	// field "canceled" counts the requests Admin.Cancel cancelled (see
	// internal/scripts/cancel.lua). A hash rather than one string per total,
	// so a total added later needs no new command in a least-privilege ACL.
	Counts string
	// Completed is the sorted set of the shard's recently completed requests,
	// kept only when the consumers set ConsumerOptions.Retention: member the
	// outcome's code ('R', 'E', 'L'), then 'i' and the request id (or 'e'
	// and the entry id of an entry without one); score the completion time
	// in Unix microseconds, made unique per shard (see complete.lua).
	Completed string

	base         string // up to and including the hash tag and its ':'
	recordPrefix string
	startsPrefix string
}

// New returns the names of queue, or an error when the name cannot be used.
func New(queue string) (Keys, error) {
	if err := ValidateQueue(queue); err != nil {
		return Keys{}, err
	}
	k := build(queue)
	k.Queue = queue
	return k, nil
}

// build returns the names of a queue whose name was validated.
func build(queue string) Keys { return buildTagged("streamq:{" + queue + "}:") }

// buildTagged returns the names under base, which holds the hash tag.
func buildTagged(base string) Keys {
	return Keys{
		Stream:       base + "stream",
		DeadLetter:   base + "dead",
		Channel:      base + "done",
		Schedule:     base + "schedule",
		ScheduleData: base + "schedule:data",
		Retry:        base + "retry",
		Wake:         base + "wake",
		Fanout:       base + "fanout",
		Counts:       base + "counts",
		Completed:    base + "completed",
		base:         base,
		recordPrefix: base + "id:",
		startsPrefix: base + "starts:",
	}
}

// The keys of fair queuing by key (see internal/scripts/fair.lua), each
// absent while empty: KeyQueue(k) lists key k's waiting jobs; KeysReady the
// keys with waiting jobs that may append, in turn order; KeysParked those at
// their limit or paused; KeySlots maps each appended keyed entry to its key;
// KeysRunning counts each key's slots; KeysConfig holds the window, the
// default limit and the per-key settings.
func (k Keys) KeyQueue(key string) string { return k.base + "keys:q:" + key }

// KeysReady is the list of keys that may append, in turn order.
func (k Keys) KeysReady() string { return k.base + "keys:ready" }

// KeysParked is the set of keys with waiting jobs that may not append now.
func (k Keys) KeysParked() string { return k.base + "keys:parked" }

// KeySlots is the hash entry id -> key of the appended keyed entries.
func (k Keys) KeySlots() string { return k.base + "keys:slots" }

// KeysTimed is the sorted set of keys with waiting jobs that their rate
// limit holds back, scored by the Unix ms at which the next may append.
func (k Keys) KeysTimed() string { return k.base + "keys:timed" }

// KeysRunning is the hash key -> slots.
func (k Keys) KeysRunning() string { return k.base + "keys:running" }

// KeysConfig is the hash of the shard's fair-queuing settings.
func (k Keys) KeysConfig() string { return k.base + "keys:cfg" }

// LevelStream returns the stream of priority level name ("high", "low") of
// the queue: the Stream name followed by ":" and the level's name. The
// default level's entries are in Stream itself, so a queue that never uses
// priorities has no other stream. Every level of a shard shares the shard's
// hash tag, its records, schedule and dead letters.
func (k Keys) LevelStream(name string) string { return k.Stream + ":" + name }

// AtLevel returns k with Stream set to the stream of level name ("" keeps
// the default level's stream) and Starts naming that stream's start counts;
// every other name is the shard's.
//
// Start counts are kept per stream because entry ids are: a high and a
// normal entry appended in the same millisecond have the same id, and one
// hash for both would let a start of one count for the other and the
// completion of one delete the other's count.
func (k Keys) AtLevel(name string) Keys {
	if name != "" {
		k.Stream = k.LevelStream(name)
		k.startsPrefix = k.Stream + ":starts:"
	}
	return k
}

// History returns the key of the hash counting the completions of the hour
// that starts at Unix time hour*3600 s: field the minute of the hour
// ("0".."59"), value processed + failed<<32 (see complete.lua). It expires
// about 25 hours after its last minute's first completion.
func (k Keys) History(hour int64) string { return k.base + "hist:" + strconv.FormatInt(hour, 10) }

// GroupHistory returns the key of the history hash of a fan-out consumer
// group for the hour: the History name followed by ":" and the group's
// name. The answering group's completions count in History itself, so a job
// that several groups process counts once in each group's history.
func (k Keys) GroupHistory(group string, hour int64) string { return k.History(hour) + ":" + group }

// Errors returns the key of the list of request id's retried attempts'
// errors, newest first ("<ms> <start> <error>"), kept only when the
// consumers set Retention.Errors (retry.lua); it expires with the record.
func (k Keys) Errors(id string) string { return k.base + "errors:" + id }

// RunNowMarker returns the key that remembers, for a while, the entry a
// schedule member was promoted to by Admin.RunNow, so a resend succeeds.
func (k Keys) RunNowMarker(member string) string { return k.base + "runnow:" + member }

// Record returns the key of the record (dedup marker, then result) of a request id.
func (k Keys) Record(id string) string { return k.recordPrefix + id }

// Mode returns the key of a request id's flow-control state: for Throttle,
// the open window (value: its end in Unix ms of the server's clock; it
// expires with the window).
func (k Keys) Mode(id string) string { return k.base + "mode:" + id }

// Flow returns the key of the hash of the flow whose parent is request id:
// its pending child count, its policy, the parent's stream fields, and each
// child's outcome (see internal/scripts/flow.lua).
func (k Keys) Flow(id string) string { return k.base + "flow:" + id }

// Progress returns the key holding the last progress value a handler
// reported for request id ("<seq>:<value>").
func (k Keys) Progress(id string) string { return k.base + "progress:" + id }

// FlowParent returns, for a key built by Flow, the parent's record and
// stream keys (same queue, same shard), and false for any other string.
func FlowParent(flow string) (record, stream string, ok bool) {
	if !strings.HasPrefix(flow, "streamq:") {
		return "", "", false
	}
	end := strings.Index(flow, "}:")
	if end < 0 || !strings.Contains(flow[:end], "{") {
		return "", "", false
	}
	base := flow[:end+2]
	id, ok := strings.CutPrefix(flow[end+2:], "flow:")
	if !ok || id == "" {
		return "", "", false
	}
	k := buildTagged(base)
	return k.Record(id), k.Stream, true
}

// RequeueMarker returns the key that remembers, for a while, which entry the
// dead letter id of the dead-letter stream deadLetter was requeued as. The id
// (a stream id, without ':') comes first, so each pair has its own key.
func (k Keys) RequeueMarker(deadLetter, id string) string {
	return k.base + "requeued:" + id + ":" + deadLetter
}

// GroupDeadLetter returns the dead-letter stream of a fan-out consumer group:
// the DeadLetter name followed by ":" and the group's name. The answering
// group's dead letters are in DeadLetter itself.
func (k Keys) GroupDeadLetter(group string) string { return k.DeadLetter + ":" + group }

// Starts returns the key of the hash that counts, per entry id, the handler
// starts of the entries of Stream for consumer group group:
// "streamq:{Q}:starts:<group>" for the default level's stream,
// "<level stream>:starts:<group>" for a priority level's (see AtLevel).
func (k Keys) Starts(group string) string { return k.startsPrefix + group }

// RecordPattern returns a SCAN pattern that matches every record key of the queue.
func (k Keys) RecordPattern() string {
	return globEscaper.Replace(k.recordPrefix) + "*"
}

// globEscaper escapes the characters that are special in Redis glob patterns
// (SCAN MATCH, ACL key and channel patterns).
var globEscaper = strings.NewReplacer(`\`, `\\`, "[", `\[`, "]", `\]`, "*", `\*`, "?", `\?`)

// ValidateQueue reports why queue cannot be used as a queue name, or nil.
func ValidateQueue(queue string) error {
	switch {
	case queue == "":
		return errors.New("queue name is empty")
	case len(queue) > MaxQueueNameLen:
		return fmt.Errorf("queue name is %d bytes, the limit is %d", len(queue), MaxQueueNameLen)
	case strings.ContainsAny(queue, "{}"):
		return fmt.Errorf("queue name %q contains '{' or '}', which would break its hash tag", queue)
	}
	return nil
}
