package streamqtest

import (
	"bytes"
	"context"
	"errors"
	"strconv"
	"strings"

	"github.com/redis/go-redis/v9"

	"github.com/streamq/streamq"
	"github.com/streamq/streamq/internal/keys"
)

// RequireOptions adds checks to RequireProduced. The zero value (or nil)
// checks only that the id was produced.
type RequireOptions struct {
	// Payload, when not nil, is the request the job must carry, compared
	// after encoding with Codec ([]byte values are compared as they are, as
	// producers send them). Only a request waiting to run (queued, running,
	// or scheduled) still has its payload in Redis: for a completed one the
	// check fails, saying so. No assertion is made if left nil.
	Payload any

	// Codec encodes Payload. Defaults to streamq.JSONCodec.
	Codec streamq.Codec

	// State, when not empty, is the state the job must be in.
	// No assertion is made if left empty.
	State streamq.JobState
}

// RequireProduced fails the test unless Redis holds a record of request id in
// queue, in any state (waiting, running, succeeded, failed or dead-lettered),
// and returns what streamq.Admin.Job reports about it. With opts it also
// checks the payload and the state.
func RequireProduced(ctx context.Context, t TB, client redis.UniversalClient, queue, id string, opts *RequireOptions) streamq.JobInfo {
	mustContext(ctx, "RequireProduced")
	t.Helper()
	admin, err := streamq.NewAdmin(client, queue, nil)
	if err != nil {
		fatalf(t, "RequireProduced %q in %s: %v", id, queue, err)
		return streamq.JobInfo{}
	}
	info, err := lookUp(ctx, client, admin, queue, id)
	if errors.Is(err, streamq.ErrNotFound) {
		fatalf(t, "RequireProduced: request %q was not produced to queue %s (%v)", id, queue, err)
		return info
	}
	if err != nil {
		fatalf(t, "RequireProduced %q in %s: %v", id, queue, err)
		return info
	}
	if opts == nil {
		return info
	}
	if opts.State != "" && info.State != opts.State {
		fatalf(t, "RequireProduced: request %q in %s is %s, want %s", id, queue, info.State, opts.State)
		return info
	}
	if opts.Payload == nil {
		return info
	}
	want, ok := opts.Payload.([]byte)
	if !ok {
		codec := opts.Codec
		if codec == nil {
			codec = streamq.JSONCodec{}
		}
		if want, err = codec.Marshal(opts.Payload); err != nil {
			fatalf(t, "RequireProduced: encode the expected payload: %v", err)
			return info
		}
	}
	got, found, err := storedPayload(ctx, client, admin, queue, id, info)
	switch {
	case err != nil:
		fatalf(t, "RequireProduced %q in %s: read its payload: %v", id, queue, err)
	case !found:
		fatalf(t, "RequireProduced: request %q in %s is %s: its payload is no longer stored, so it cannot be compared", id, queue, info.State)
	case !bytes.Equal(got, want):
		fatalf(t, "RequireProduced: request %q in %s carries payload %s, want %s", id, queue, quote(got), quote(want))
	}
	return info
}

// RequireNotProduced fails the test if Redis holds a record of request id in
// queue, in any state.
func RequireNotProduced(ctx context.Context, t TB, client redis.UniversalClient, queue, id string) {
	mustContext(ctx, "RequireNotProduced")
	t.Helper()
	admin, err := streamq.NewAdmin(client, queue, nil)
	if err != nil {
		fatalf(t, "RequireNotProduced %q in %s: %v", id, queue, err)
		return
	}
	info, err := lookUp(ctx, client, admin, queue, id)
	switch {
	case errors.Is(err, streamq.ErrNotFound):
	case err != nil:
		fatalf(t, "RequireNotProduced %q in %s: %v", id, queue, err)
	default:
		fatalf(t, "RequireNotProduced: request %q was produced to queue %s: it is %s", id, queue, info.State)
	}
}

// RequireDeadLettered fails the test unless the dead-letter stream of queue
// (of its answering group) holds request id, and returns its latest dead
// letter. It reads up to 10,000 dead letters.
func RequireDeadLettered(ctx context.Context, t TB, client redis.UniversalClient, queue, id string) streamq.DeadLetter {
	mustContext(ctx, "RequireDeadLettered")
	t.Helper()
	admin, err := streamq.NewAdmin(client, queue, nil)
	if err != nil {
		fatalf(t, "RequireDeadLettered %q in %s: %v", id, queue, err)
		return streamq.DeadLetter{}
	}
	dls, err := admin.DeadLetters(ctx, "", 10000)
	if err != nil {
		fatalf(t, "RequireDeadLettered %q in %s: %v", id, queue, err)
		return streamq.DeadLetter{}
	}
	var found *streamq.DeadLetter
	for i := range dls {
		if dls[i].ID == id {
			found = &dls[i]
		}
	}
	if found == nil {
		fatalf(t, "RequireDeadLettered: request %q of queue %s is not among its %d dead letters", id, queue, len(dls))
		return streamq.DeadLetter{}
	}
	return *found
}

// lookUp is Admin.Job, answering itself for a request waiting in the
// schedule: JobRetrying for a retry waiting for its back-off (a member of
// the retry set), JobScheduled for a delayed request.
func lookUp(ctx context.Context, client redis.UniversalClient, admin *streamq.Admin, queue, id string) (streamq.JobInfo, error) {
	ks, err := admin.Keys(ctx)
	if err != nil {
		return streamq.JobInfo{ID: id}, err
	}
	shards, err := keys.Shards(queue, len(ks))
	if err != nil {
		return streamq.JobInfo{ID: id}, err
	}
	shard := keys.ShardOf(id, len(shards))
	n, err := client.HExists(ctx, shards[shard].ScheduleData, "r"+id).Result()
	if err != nil {
		return streamq.JobInfo{ID: id}, err
	}
	if n {
		state := streamq.JobScheduled
		_, err := client.ZScore(ctx, shards[shard].Retry, "r"+id).Result()
		switch {
		case err == nil:
			state = streamq.JobRetrying
		case !errors.Is(err, redis.Nil):
			return streamq.JobInfo{ID: id}, err
		}
		return streamq.JobInfo{ID: id, State: state, Shard: shard}, nil
	}
	return admin.Job(ctx, id)
}

// storedPayload reads the payload of a request waiting to run: from its
// stream entry, or from the schedule for a delayed job or a waiting retry.
func storedPayload(ctx context.Context, client redis.UniversalClient, admin *streamq.Admin, queue, id string, info streamq.JobInfo) ([]byte, bool, error) {
	ks, err := admin.Keys(ctx)
	if err != nil {
		return nil, false, err
	}
	shards, err := keys.Shards(queue, len(ks))
	if err != nil {
		return nil, false, err
	}
	k := shards[info.Shard]
	if info.State != streamq.JobScheduled && info.State != streamq.JobRetrying && info.EntryID != "" && !strings.HasPrefix(info.EntryID, "@") {
		// The entry is on the stream of its priority level: the default's or
		// another's, the one whose entry carries the id.
		for _, stream := range []string{k.Stream, k.LevelStream("high"), k.LevelStream("low")} {
			msgs, err := client.XRangeN(ctx, stream, info.EntryID, info.EntryID, 1).Result()
			if err != nil {
				return nil, false, err
			}
			if len(msgs) == 0 || msgs[0].Values[keys.FieldID] != id {
				continue
			}
			p, ok := msgs[0].Values[keys.FieldPayload].(string)
			return []byte(p), ok, nil
		}
		return nil, false, nil
	}
	// A delayed request or a retry of the answering group: its stream fields
	// wait in the schedule's data, as length-prefixed strings: record key,
	// start-count key, start count, and the fields (names and values, each
	// length-prefixed in turn), then what Admin.Jobs shows.
	data, err := client.HGet(ctx, k.ScheduleData, "r"+id).Result()
	if errors.Is(err, redis.Nil) {
		return nil, false, nil
	}
	if err != nil {
		return nil, false, err
	}
	parts, ok := splitLengthPrefixed(data)
	if !ok || len(parts) < 4 {
		return nil, false, nil
	}
	fields, ok := splitLengthPrefixed(parts[3])
	if !ok {
		return nil, false, nil
	}
	for i := 0; i+1 < len(fields); i += 2 {
		if fields[i] == keys.FieldPayload {
			return []byte(fields[i+1]), true, nil
		}
	}
	return nil, false, nil
}

// splitLengthPrefixed splits "<len>:<s><len>:<s>..." into its strings.
func splitLengthPrefixed(s string) ([]string, bool) {
	var out []string
	for s != "" {
		n, rest, ok := strings.Cut(s, ":")
		if !ok {
			return nil, false
		}
		l, err := strconv.Atoi(n)
		if err != nil || l < 0 || l > len(rest) {
			return nil, false
		}
		out = append(out, rest[:l])
		s = rest[l:]
	}
	return out, true
}
