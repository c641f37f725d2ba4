package streamq

import (
	"context"
	"encoding/base64"
	"errors"
	"fmt"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/streamq/streamq/internal/keys"
	"github.com/streamq/streamq/internal/scripts"
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
	// Priority is the job's priority level (Priority): the level stream a
	// queued or running job is in, or the level a scheduled job or retry
	// keeps in its fields, or the level a dead letter records (the stream it
	// was dead-lettered from; DeadLetter.Priority). PriorityNormal (the
	// default) is omitted in JSON.
	Priority PriorityLevel `json:"priority,omitempty"`
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
	// Payload is the job's encoded request, cut to its first 4096 bytes
	// (Admin.DeadLetter returns a dead letter's whole payload). In JSON it
	// is base64.
	Payload []byte `json:"payload,omitempty"`
}

// ErrInvalidCursor is returned by Admin.Jobs for a cursor it did not issue,
// or one issued for another state.
var ErrInvalidCursor = errors.New("streamq: invalid cursor")

const (
	// defaultJobsLimit is JobsQuery.Limit's default.
	defaultJobsLimit = 50
	// maxJobsLimit is the largest JobsQuery.Limit.
	maxJobsLimit = 1000
)

// jobsScanWindow is the most members or entries one filtered Admin.Jobs page
// scans per shard (JobsQuery.ErrorContains, or ID for dead letters); a page
// that found fewer matches continues from where it stopped. A variable for
// the tests.
var jobsScanWindow = 5000

// jobsScanBytes bounds the bytes of stream entries (payloads included) one
// Admin.Jobs page reads per stream for queued jobs and dead letters, so that
// a page over large payloads holds Redis for a bounded time (jobs.lua reads
// whole entries: Redis has no way to read some fields only); a page that
// reached it continues from where it stopped, as after the scan window.
const jobsScanBytes = 4 << 20

// jobsCursor is what a JobsPage cursor holds: the sort key of the job to
// continue after (Next) or before (Prev). A cursor without a key starts at
// the first (Next) or the last (Prev) job.
type jobsCursor struct {
	state  JobState
	back   bool   // before the key (a Prev cursor)
	hasKey bool   // false: from the first (Next) or last (Prev) job
	num    int64  // the due time (sorted sets), or the source (streams: see pageItem.src)
	str    string // the member (sorted sets), or the entry id (streams)
}

func (c jobsCursor) encode() string {
	dir, k := "n", "-"
	if c.back {
		dir = "p"
	}
	if c.hasKey {
		k = "k"
	}
	raw := string(c.state) + "|" + dir + k + "|" + strconv.FormatInt(c.num, 10) + "|" + c.str
	return base64.RawURLEncoding.EncodeToString([]byte(raw))
}

func decodeJobsCursor(s string, state JobState) (jobsCursor, error) {
	bad := func(why string) (jobsCursor, error) {
		return jobsCursor{}, fmt.Errorf("%w: %q is not a cursor of %s jobs (%s); use a JobsPage.Next or Prev as given", ErrInvalidCursor, s, state, why)
	}
	raw, err := base64.RawURLEncoding.DecodeString(s)
	if err != nil {
		return bad("not base64")
	}
	parts := strings.SplitN(string(raw), "|", 4)
	if len(parts) != 4 || len(parts[1]) != 2 {
		return bad("malformed")
	}
	if JobState(parts[0]) != state {
		return bad("issued for " + parts[0] + " jobs")
	}
	c := jobsCursor{state: state, back: parts[1][0] == 'p', hasKey: parts[1][1] == 'k', str: parts[3]}
	if c.num, err = strconv.ParseInt(parts[2], 10, 64); err != nil {
		return bad("malformed")
	}
	if c.hasKey && !zsetState(state) && (!fullStreamID(c.str) || c.num < 0) {
		return bad("malformed")
	}
	return c, nil
}

// zsetState reports whether the state's jobs wait in a sorted set.
func zsetState(s JobState) bool { return s == JobScheduled || s == JobRetrying }

// pageItem is a job read for a page, with its sort key.
type pageItem struct {
	sum    JobSummary
	score  int64  // sorted sets: the due time
	member string // sorted sets: the member
	ms     uint64 // streams: the entry id
	seq    uint64
	// src is the stream read (streams): the shard for dead letters; for
	// queued and running jobs level*shards+shard (levels as in levelNames),
	// so that the default level's sources are the shards.
	src int
}

// shardPart is one source's reply to jobs.lua (see pageItem.src).
type shardPart struct {
	total    int64
	behind   bool // jobs lie on the other side of the cursor
	more     bool // jobs lie beyond the frontier
	frontier pageItem
	items    []pageItem
}

// Jobs lists one page of the jobs in one state, read from every shard in one
// pipelined round trip (after reading the shard count and the answering
// group: three round trips in all, whatever the queue's size; an ID search
// of a queued or running job is Admin.Job's). The orders:
//   - JobScheduled and JobRetrying: soonest due first (then by member);
//   - JobQueued: oldest entry first (by entry id, over every priority
//     level's stream: not the order consumers take them in, which favours
//     the higher levels);
//   - JobRunning: by entry id, oldest first (not by idle time: Redis lists
//     pending entries by id);
//   - JobDeadLettered: newest first.
//
// Queued and running jobs are read from each shard's stream of every
// priority level (JobSummary.Priority), a level without a stream reading
// nothing. With several shards or levels, the streams' pages are merged by
// that order (entries of one millisecond by their sequence, then by level
// and shard). The cursor holds the
// sort key of the page's edge, so jobs added or removed meanwhile neither
// shift nor repeat the pages that follow.
//
// A filter (ErrorContains; ID of a dead letter, which has no index by id)
// scans at most 5,000 jobs per shard and page, and a page of queued jobs or
// dead letters reads at most 4 MiB of entries (payloads included) per
// stream: a page may then hold fewer than Limit jobs, or none, with a Next
// cursor that continues the scan from where it stopped (Next is "" only
// once the scan reached the end). ID of a
// scheduled job or retry is one lookup in the id's shard; of a queued or
// running one, its record's (Admin.Job). The retry and dead-letter lists
// cover the Admin's group (AdminOptions.Group) for an ID search; otherwise
// JobRetrying lists every group's retries (Group names a fan-out group's).
//
// Total counts the state's jobs in the queue, not the filter's matches: the
// sets' and dead-letter streams' lengths, the group's pending entries, and
// Redis's lag for queued entries (-1 when Redis does not know it); it is -1
// for an ID search. ErrorContains applies to JobRetrying and JobDeadLettered
// only (ErrInvalidOptions otherwise); a cursor of another state, or one Jobs
// did not issue, is ErrInvalidCursor. An unknown queue has empty pages.
func (a *Admin) Jobs(ctx context.Context, q JobsQuery) (JobsPage, error) {
	mustContext(ctx, "Admin.Jobs")
	return callBounded(ctx, func(ctx context.Context) (JobsPage, error) { return a.jobs(ctx, q) })
}

// jobs is the body of Jobs, run by callBounded.
func (a *Admin) jobs(ctx context.Context, q JobsQuery) (JobsPage, error) {
	page := JobsPage{Jobs: []JobSummary{}, Total: -1}
	switch q.State {
	case JobScheduled, JobRetrying, JobQueued, JobRunning, JobDeadLettered:
	default:
		return page, optionError("JobsQuery.State is %q; it must be one of scheduled, retrying, queued, running or dead-lettered", q.State)
	}
	switch {
	case q.Limit == 0:
		q.Limit = defaultJobsLimit
	case q.Limit < 0 || q.Limit > maxJobsLimit:
		return page, optionError("JobsQuery.Limit is %d; it must be 1..%d (0 for %d)", q.Limit, maxJobsLimit, defaultJobsLimit)
	}
	if q.ErrorContains != "" && q.State != JobRetrying && q.State != JobDeadLettered {
		return page, optionError("JobsQuery.ErrorContains applies to retrying and dead-lettered jobs only, not %s", q.State)
	}
	if q.ID != "" {
		if err := validateID(q.ID); err != nil {
			return page, err
		}
	}
	cur := jobsCursor{state: q.State}
	if q.Cursor != "" {
		var err error
		if cur, err = decodeJobsCursor(q.Cursor, q.State); err != nil {
			return page, err
		}
	}
	shards, err := a.shards(ctx)
	if err != nil {
		return page, err
	}
	t, err := a.target(ctx)
	if err != nil {
		return page, err
	}
	if q.ID != "" && (q.State == JobQueued || q.State == JobRunning) {
		return a.jobByID(ctx, q, shards)
	}
	// The sources read: the shards, and for queued and running jobs each
	// shard's stream of every priority level (pageItem.src).
	sources := len(shards)
	if q.State == JobQueued || q.State == JobRunning {
		sources = numLevels * len(shards)
	}
	if cur.hasKey && !zsetState(q.State) && int(cur.num) >= sources {
		return page, fmt.Errorf("%w: the cursor names stream %d of a queue with %d shards", ErrInvalidCursor, cur.num, len(shards))
	}
	which := make([]int, 0, sources)
	if q.ID != "" {
		which = append(which, keys.ShardOf(q.ID, len(shards)))
	} else {
		for i := range sources {
			which = append(which, i)
		}
	}
	// up: the scan goes in the natural order (due time, entry id).
	up := (q.State != JobDeadLettered) != cur.back
	filtered := q.ErrorContains != "" || (q.ID != "" && q.State == JobDeadLettered)
	want := q.Limit + 1
	window := want
	if filtered {
		window = jobsScanWindow
	}
	parts, err := a.readParts(ctx, q, t, shards, which, cur, up, want, window)
	if err != nil {
		return page, err
	}
	page.Total = 0
	if q.ID != "" {
		page.Total = -1 // one shard was read
	}
	for _, p := range parts {
		if p.total < 0 || page.Total < 0 || q.ID != "" {
			page.Total = -1
		} else {
			page.Total += p.total
		}
	}
	if q.ID != "" && zsetState(q.State) {
		for _, p := range parts {
			for _, it := range p.items {
				page.Jobs = append(page.Jobs, it.sum)
			}
		}
		return page, nil
	}
	a.mergeParts(&page, q, cur, parts, up)
	return page, nil
}

// travelLess reports whether x comes before y in the scan's direction.
func travelLess(x, y *pageItem, zset, up bool) bool {
	var less, greater bool
	if zset {
		less = x.score < y.score || (x.score == y.score && x.member < y.member)
		greater = x.score > y.score || (x.score == y.score && x.member > y.member)
	} else {
		kx := [3]uint64{x.ms, x.seq, uint64(x.src)}
		ky := [3]uint64{y.ms, y.seq, uint64(y.src)}
		for i := range kx {
			if kx[i] != ky[i] {
				less, greater = kx[i] < ky[i], kx[i] > ky[i]
				break
			}
		}
	}
	if up {
		return less
	}
	return greater
}

// mergeParts merges the shards' parts into the page and sets its cursors.
// Jobs beyond the nearest frontier of a shard that has more were not read
// from that shard, so only the jobs up to it are certain.
func (a *Admin) mergeParts(page *JobsPage, q JobsQuery, cur jobsCursor, parts []shardPart, up bool) {
	zset := zsetState(q.State)
	var frontier *pageItem
	behind := false
	for i := range parts {
		p := &parts[i]
		behind = behind || p.behind
		if p.more && (frontier == nil || travelLess(&p.frontier, frontier, zset, up)) {
			frontier = &p.frontier
		}
	}
	var cands []pageItem
	for _, p := range parts {
		for _, it := range p.items {
			if frontier == nil || !travelLess(frontier, &it, zset, up) {
				cands = append(cands, it)
			}
		}
	}
	sort.Slice(cands, func(i, j int) bool { return travelLess(&cands[i], &cands[j], zset, up) })
	n := min(len(cands), q.Limit)
	var edge *pageItem // where the next page in this direction starts after
	switch {
	case len(cands) > q.Limit:
		edge = &cands[n-1]
	case frontier != nil:
		edge = frontier
	}
	got := cands[:n]
	key := func(it *pageItem) jobsCursor {
		c := jobsCursor{state: q.State, hasKey: true}
		if zset {
			c.num, c.str = it.score, it.member
		} else {
			c.num, c.str = int64(it.src), fmt.Sprintf("%d-%d", it.ms, it.seq)
		}
		return c
	}
	// ahead: the cursor going on in the scan's direction; back: the other.
	var ahead, backward string
	if edge != nil {
		c := key(edge)
		c.back = cur.back
		ahead = c.encode()
	}
	if behind {
		// Back from the page's first job; on an empty page, from where the
		// scan stopped (every job it passed did not match), or from the far
		// end when it reached the end.
		c := jobsCursor{state: q.State}
		switch {
		case len(got) > 0:
			c = key(&got[0])
		case frontier != nil:
			c = key(frontier)
		}
		c.back = !cur.back
		backward = c.encode()
	}
	if cur.back {
		for i, j := 0, len(got)-1; i < j; i, j = i+1, j-1 {
			got[i], got[j] = got[j], got[i]
		}
		page.Prev, page.Next = ahead, backward
	} else {
		page.Next, page.Prev = ahead, backward
	}
	for _, it := range got {
		page.Jobs = append(page.Jobs, it.sum)
	}
}

// readParts sends one jobs.lua call per source in which (a shard, or for
// queued and running jobs a shard's level stream: pageItem.src), pipelined,
// and parses the replies.
func (a *Admin) readParts(ctx context.Context, q JobsQuery, t deadTarget, shards []keys.Keys, which []int, cur jobsCursor, up bool, want, window int) ([]shardPart, error) {
	type call struct {
		keys []string
		args []any
		cmd  *redis.Cmd
	}
	calls := make([]call, len(which))
	upArg := "0"
	if up {
		upArg = "1"
	}
	only := ""
	if q.ID != "" && zsetState(q.State) {
		only = "r" + q.ID
		if t.fanout && q.State == JobRetrying {
			only = fanoutMember(t.group, q.ID)
		}
	}
	for i, src := range which {
		shard, level := src%len(shards), src/len(shards)
		k := shards[shard].AtLevel(levelNames[level])
		var c call
		switch q.State {
		case JobScheduled, JobRetrying:
			set := k.Schedule
			if q.State == JobRetrying {
				set = k.Retry
			}
			hasKey := "0"
			if cur.hasKey {
				hasKey = "1"
			}
			c.keys = []string{set, k.ScheduleData}
			c.args = []any{"z", upArg, hasKey, cur.num, cur.str, want, window, q.ErrorContains, only}
		default:
			from, excl := "", "0"
			if cur.hasKey {
				from = cur.str
				// Entries of one id sort by source: this source's entry with
				// the cursor's id lies after the cursor when the source is
				// later.
				after := src > int(cur.num)
				before := src < int(cur.num)
				if (up && !after) || (!up && !before) {
					excl = "1"
				}
			}
			mode, group, id := "s", "", ""
			switch q.State {
			case JobQueued:
				group = t.group
			case JobRunning:
				mode, group = "p", t.group
			case JobDeadLettered:
				id = q.ID
			}
			stream := k.Stream
			if q.State == JobDeadLettered {
				stream = t.deadLetterKey(k)
			}
			c.keys = []string{stream, k.Starts(group)}
			c.args = []any{mode, upArg, from, excl, "", want, window, q.ErrorContains, id, group, jobsScanBytes}
		}
		calls[i] = c
	}
	pipe := a.client.Pipeline()
	for i := range calls {
		calls[i].cmd = scripts.Jobs.EvalSha(ctx, pipe, calls[i].keys, calls[i].args...)
	}
	_, _ = pipe.Exec(ctx) // each reply's error is read below
	// A server that lacks the script (restarted, SCRIPT FLUSH, or a cluster
	// node that never ran it): those calls once more with the source.
	var again redis.Pipeliner
	for i := range calls {
		if isNoScript(calls[i].cmd) {
			if again == nil {
				again = a.client.Pipeline()
			}
			calls[i].cmd = scripts.Jobs.Eval(ctx, again, calls[i].keys, calls[i].args...)
		}
	}
	if again != nil {
		_, _ = again.Exec(ctx)
	}
	parts := make([]shardPart, len(which))
	for i, c := range calls {
		res, err := c.cmd.Slice()
		if err != nil {
			return nil, fmt.Errorf("streamq: list %s jobs of %s: %w", q.State, a.queue, err)
		}
		if parts[i], err = a.parsePart(q.State, which[i], len(shards), res); err != nil {
			return nil, err
		}
	}
	return parts, nil
}

// fanoutMember is the schedule member of a fan-out group's retry.
func fanoutMember(group, id string) string {
	return "g" + strconv.Itoa(len(group)) + ":" + group + id
}

// splitMember returns the request id and group ("" for every group) of a
// schedule member.
func splitMember(m string) (id, group string) {
	switch {
	case strings.HasPrefix(m, "r"):
		return m[1:], ""
	case strings.HasPrefix(m, "g"):
		n, rest, ok := strings.Cut(m[1:], ":")
		l, err := strconv.Atoi(n)
		if ok && err == nil && l >= 0 && l <= len(rest) {
			return rest[l:], rest[:l]
		}
	}
	return m, ""
}

// parseStreamID splits a complete stream id.
func parseStreamID(id string) (ms, seq uint64) {
	a, b, _ := strings.Cut(id, "-")
	ms, _ = strconv.ParseUint(a, 10, 64)
	seq, _ = strconv.ParseUint(b, 10, 64)
	return ms, seq
}

func asString(v any) string {
	switch x := v.(type) {
	case string:
		return x
	case int64:
		return strconv.FormatInt(x, 10)
	}
	return ""
}

func asInt(v any) int64 {
	switch x := v.(type) {
	case int64:
		return x
	case string:
		n, _ := strconv.ParseInt(x, 10, 64)
		return n
	}
	return 0
}

// payloadBytes returns a payload reply, nil when empty.
func payloadBytes(v any) []byte {
	if s := asString(v); s != "" {
		return []byte(s)
	}
	return nil
}

// parsePart parses one source's jobs.lua reply (see pageItem.src).
func (a *Admin) parsePart(state JobState, src, nShards int, res []any) (shardPart, error) {
	var p shardPart
	shard, level := src%nShards, src/nShards
	if len(res) < 5 {
		return p, fmt.Errorf("streamq: list %s jobs of %s: unexpected reply %v", state, a.queue, res)
	}
	p.total = asInt(res[0])
	p.behind = asInt(res[1]) == 1
	p.more = asInt(res[2]) == 1
	if zsetState(state) {
		p.frontier.score, p.frontier.member = asInt(res[3]), asString(res[4])
	} else {
		p.frontier.ms, p.frontier.seq = parseStreamID(asString(res[3]))
		p.frontier.sum.Shard = shard
		p.frontier.src = src
	}
	for _, raw := range res[5:] {
		row, ok := raw.([]any)
		if !ok {
			return p, fmt.Errorf("streamq: list %s jobs of %s: unexpected row %v", state, a.queue, raw)
		}
		it := pageItem{sum: JobSummary{State: state, Shard: shard, Priority: levelValue[level]}, src: src}
		s := &it.sum
		switch state {
		case JobScheduled, JobRetrying:
			if len(row) < 5 {
				return p, fmt.Errorf("streamq: list %s jobs of %s: unexpected row %v", state, a.queue, row)
			}
			it.member = asString(row[0])
			it.score = asInt(row[1])
			s.ID, s.Group = splitMember(it.member)
			s.Due = time.UnixMilli(it.score)
			s.Deliveries = int(asInt(row[2]))
			s.LastError = asString(row[3])
			if ms := asInt(row[4]); ms > 0 {
				s.ProducedAt = time.UnixMilli(ms)
			}
			if len(row) > 5 {
				s.Payload = payloadBytes(row[5])
			}
			if len(row) > 6 {
				s.Priority = levelNamed(asString(row[6]))
			}
		case JobRunning:
			if len(row) < 6 {
				return p, fmt.Errorf("streamq: list %s jobs of %s: unexpected row %v", state, a.queue, row)
			}
			s.EntryID = asString(row[0])
			it.ms, it.seq = parseStreamID(s.EntryID)
			s.Consumer = asString(row[1])
			s.Idle = time.Duration(asInt(row[2])) * time.Millisecond
			s.ID = asString(row[4])
			s.Deliveries = int(asInt(row[5]))
			s.ProducedAt = time.UnixMilli(int64(it.ms))
			if len(row) > 6 {
				s.Payload = payloadBytes(row[6])
			}
		default:
			if len(row) < 2 {
				return p, fmt.Errorf("streamq: list %s jobs of %s: unexpected row %v", state, a.queue, row)
			}
			eid := asString(row[0])
			it.ms, it.seq = parseStreamID(eid)
			fields, _ := row[1].([]any)
			f := make(map[string]string, len(fields)/2)
			for j := 0; j+1 < len(fields); j += 2 {
				f[asString(fields[j])] = asString(fields[j+1])
			}
			s.ID = f["id"]
			if p, ok := f["p"]; ok {
				s.Payload = []byte(p)
			}
			if state == JobQueued {
				s.EntryID = eid
				s.Group = f["g"]
				s.ProducedAt = time.UnixMilli(int64(it.ms))
				s.Deliveries, _ = strconv.Atoi(f[keys.FieldStarts])
				break
			}
			s.DeadLetterID = eid
			if nShards > 1 {
				s.DeadLetterID = strconv.Itoa(shard) + "/" + eid
			}
			s.EntryID = f["entry"]
			s.LastError = f["error"]
			s.Consumer = f["consumer"]
			s.Deliveries, _ = strconv.Atoi(f["deliveries"])
			s.Priority = levelNamed(f[keys.FieldPriority])
			if ms, err := strconv.ParseInt(f["at"], 10, 64); err == nil {
				s.At = time.UnixMilli(ms)
			}
		}
		p.items = append(p.items, it)
	}
	return p, nil
}

// levelNamed returns the level of a "pr" field's value; PriorityNormal for
// "" or an unknown name.
func levelNamed(name string) PriorityLevel {
	for l, n := range levelNames {
		if n != "" && n == name {
			return levelValue[l]
		}
	}
	return PriorityNormal
}

// jobByID answers an ID search of queued or running jobs from the id's
// record (Admin.Job): a page of that job, or an empty one.
func (a *Admin) jobByID(ctx context.Context, q JobsQuery, shards []keys.Keys) (JobsPage, error) {
	page := JobsPage{Jobs: []JobSummary{}, Total: -1}
	info, err := a.job(ctx, q.ID)
	if errors.Is(err, ErrNotFound) {
		return page, nil
	}
	if err != nil {
		return page, err
	}
	if info.State != q.State {
		return page, nil
	}
	sum := JobSummary{
		ID: info.ID, State: info.State, Shard: info.Shard, EntryID: info.EntryID, Priority: info.Priority,
		ProducedAt: info.Enqueued, Deliveries: info.Deliveries, Consumer: info.Consumer, Idle: info.Idle,
	}
	// The payload, as the list gives it: its first jobsPayloadCap bytes.
	k := shards[info.Shard].AtLevel(levelNames[levelOf[info.Priority]])
	if payload, err := scripts.EntryPayload.Run(ctx, a.client, []string{k.Stream}, info.EntryID, jobsPayloadCap).Text(); err == nil {
		sum.Payload = payloadBytes(payload)
	} else if !errors.Is(err, redis.Nil) {
		return page, fmt.Errorf("streamq: read the payload of %q in %s: %w", q.ID, a.queue, err)
	}
	page.Jobs = append(page.Jobs, sum)
	return page, nil
}

// jobsPayloadCap is the most payload bytes a JobSummary holds (jobs.lua's
// cap).
const jobsPayloadCap = 4096
