package cli

import (
	"context"
	"encoding/base64"
	"errors"
	"flag"
	"fmt"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/streamq/streamq"
)

// commands is the subcommand table, in the order --help lists them.
var commands []command

func init() {
	commands = []command{
		{name: "queues", summary: "list the queues in this Redis with their counts", read: true,
			help: `Lists every streamq queue in this Redis (found with SCAN, on every master of
a cluster), with its backlog, scheduled jobs, pending entries, dead letters,
live and stale consumers, and whether it is paused.`,
			flags: staleFlag, run: queues},
		{name: "stats", args: "<queue>", summary: "statistics of one queue (--watch to refresh)", read: true,
			help: `Shows a queue's backlog (LENGTH), scheduled jobs (delayed, or retries waiting
for their back-off), dead letters, requests cancelled (by Admin.Cancel,
since the queue was created), whether it is paused, and per consumer
group: live and stale consumers, entries read and not acknowledged
(PENDING), entries not yet read (LAG), the longest-idle pending entry, and
outcome totals. With --watch it refreshes every --interval, adding
succeeded/failed per second.`,
			flags: func(fs *flag.FlagSet, o *opts) {
				staleFlag(fs, o)
				fs.BoolVar(&o.watch, "watch", false, "refresh until interrupted (Ctrl-C)")
				fs.DurationVar(&o.interval, "interval", 2*time.Second, "refresh interval of --watch")
				fs.IntVar(&o.count, "count", 0, "with --watch, stop after this many refreshes (0: never)")
			}, run: stats},
		{name: "consumers", args: "<queue>", summary: "consumers with idle time, pending count, live or stale", read: true,
			help: `Lists each consumer of each group: entries it holds (PENDING), time since it
last read (IDLE), its last heartbeat, and whether it is live (heartbeat within
--stale-after), stopped (shut down cleanly), or stale (killed, hung, or cut
off: its entries are claimed by others after MinIdle, and Redis lists it
until pruned).`,
			flags: staleFlag, run: consumers},
		{name: "dlq ls", args: "<queue>", summary: "list dead letters, oldest first", read: true,
			help: `Lists dead letters (requests that failed for good), oldest first, --limit at a
time. To see the next page, pass the last DEAD LETTER ID shown as --after.`,
			flags: func(fs *flag.FlagSet, o *opts) {
				groupFlag(fs, o)
				fs.StringVar(&o.after, "after", "", "start after this dead letter id (paging)")
				fs.Int64Var(&o.limit, "limit", 20, "dead letters to show")
			}, run: dlqList},
		{name: "dlq show", args: "<queue> <dead-letter-id>", summary: "one dead letter with its payload", read: true,
			help:  `Shows one dead letter: request id, error, deliveries, consumer, time, payload.`,
			flags: groupFlag, run: dlqShow},
		{name: "dlq requeue", args: "<queue> (<dead-letter-id>... | --all)", summary: "run dead letters again",
			help: `Moves dead letters back to the queue as new entries with the same request id
and payload; callers producing the id from now on get the new outcome.
--all requeues every dead letter and needs --yes.

A dead letter whose request id is in flight again (produced again, and
queued, running or scheduled) is not requeued, since it would run twice:
requeueing it alone fails, and --all requeues the others, lists it and
exits 1. Dead letter ids are as 'dlq ls' shows them ("<ms>-<seq>", with
"<shard>/" in front on a sharded queue); an id without its "-<seq>" part
is refused (exit 2).`,
			flags: func(fs *flag.FlagSet, o *opts) {
				groupFlag(fs, o)
				fs.BoolVar(&o.all, "all", false, "requeue every dead letter")
				fs.BoolVar(&o.yes, "yes", false, "confirm --all")
			}, run: dlqRequeue},
		{name: "dlq purge", args: "<queue> (<dead-letter-id>... | --all)", summary: "delete dead letters (needs --yes)",
			help: `Deletes the given dead letters, or all of them with --all. Needs --yes.`,
			flags: func(fs *flag.FlagSet, o *opts) {
				groupFlag(fs, o)
				fs.BoolVar(&o.all, "all", false, "delete every dead letter")
				fs.BoolVar(&o.yes, "yes", false, "confirm the deletion")
			}, run: dlqPurge},
		{name: "job", args: "<queue> <request-id>", summary: "where one request id stands", read: true,
			help: `Shows a request id's state: scheduled (due when), retrying (a failed attempt
waiting for its back-off, due when), queued, running (on which consumer, after how many starts),
succeeded (with its stored result), failed or dead-lettered (with the error),
canceled (by Admin.Cancel while it waited in the schedule, with the stored
message), and how long Redis keeps its record. Exit code 3 when Redis holds no
record of the id (never produced, expired, or forgotten).`,
			flags: groupFlag, run: job},
		{name: "jobs ls", args: "<queue> --state <state>", summary: "list jobs in one state, a page at a time", read: true,
			help: `Lists the jobs of a queue in one state (--state):
  scheduled  delayed jobs waiting for their due time, soonest first
  retrying   failed attempts waiting for their back-off, soonest first,
             with the starts so far and the last error
  queued     in the stream, not yet read, oldest entry first across the
             priority levels (consumers take higher levels more often)
  running    held by a consumer (in its handler or read ahead), with the
             time since it read or renewed the entry
  dead       dead letters, newest first (--group for a fan-out group's)
  completed  recently completed requests, newest first, with their outcome:
             the list consumers keep with ConsumerOptions.Retention (empty
             without); --id is not taken ('streamq job' shows one)
--limit at a time; the line under the table gives the cursors of the next
and the previous page (--cursor). --id keeps one request id; --error keeps
retrying and dead jobs whose last error contains the text (a filtered page
scans a bounded number of jobs, so it may hold fewer matches than --limit:
follow its next cursor for more). Each page costs a bounded number of round
trips, whatever the queue's size. A cursor not printed by jobs ls exits 2.`,
			flags: jobsFlags, run: jobsList},
		{name: "cancel", args: "<queue> <request-id>...", summary: "cancel jobs: scheduled, queued or running",
			help: `Cancels jobs that have no outcome yet; their callers get ErrCanceled.
A scheduled job, or a retry waiting for its back-off, leaves the schedule; a
queued job is deleted from the stream before any handler starts it; a
running job's entry is removed and its consumer is told at once: a handler
not started yet is skipped, a running handler's context is cancelled
(cause ErrCanceled) and what it returns is not recorded. A job that already
finished (succeeded, failed or dead-lettered) keeps its outcome (exit 1);
an id Redis has no record of exits 3. Every id given is tried.
The same as 'streamq jobs cancel'.`,
			run: jobsCancel},
		{name: "jobs cancel", args: "<queue> <request-id>...", summary: "cancel jobs: scheduled, queued or running",
			help: `Cancels jobs that have no outcome yet; their callers get ErrCanceled.
A scheduled job, or a retry waiting for its back-off, leaves the schedule; a
queued job is deleted from the stream before any handler starts it; a
running job's entry is removed and its consumer is told at once: a handler
not started yet is skipped, a running handler's context is cancelled
(cause ErrCanceled) and what it returns is not recorded. A job that already
finished (succeeded, failed or dead-lettered) keeps its outcome (exit 1);
an id Redis has no record of exits 3. Every id given is tried.`,
			run: jobsCancel},
		{name: "jobs run", args: "<queue> <request-id>...", summary: "run scheduled jobs or waiting retries now",
			help: `Moves jobs waiting in the schedule (delayed, or a retry waiting for its
back-off) to the queue at once, keeping their request id (dedup) and their
count of starts. A job that is not waiting in the schedule exits 1; an id
Redis has no record of exits 3. Every id given is tried.`,
			run: jobsRun},
		{name: "history", args: "<queue>", summary: "jobs processed and failed per minute (last 24h at most)", read: true,
			help: `Shows the jobs processed and failed per minute over the last --span (at most
24h), as the consumers' completions count them in Redis (every replica):
the minutes with any, and the totals. --json prints every minute, oldest
first, zero-filled.`,
			flags: func(fs *flag.FlagSet, o *opts) {
				fs.DurationVar(&o.span, "span", time.Hour, "how far back, whole minutes up to 24h")
			}, run: history},
		{name: "forget", args: "<queue> <request-id>", summary: "make Redis forget an id so it can run again (needs --yes)",
			help: `Deletes a request id's record so that producing the id again runs it again. A
queued request is removed from the stream and a scheduled one from the
schedule (neither will run). A running one is
refused unless --force; forced, its handler is not stopped and, if it
finishes, records its outcome again. Needs --yes.`,
			flags: func(fs *flag.FlagSet, o *opts) {
				groupFlag(fs, o)
				fs.BoolVar(&o.force, "force", false, "forget even while a consumer runs it")
				fs.BoolVar(&o.yes, "yes", false, "confirm")
			}, run: forget},
		{name: "pause", args: "<queue>", summary: "stop consumers from starting handlers",
			help: `Pauses the queue: within about half a second no consumer of any group starts
a handler. Running handlers finish; producers keep adding requests, which
wait. The pause is kept in Redis, so it holds across consumer restarts until
'streamq resume'. Pausing a paused queue changes nothing.`,
			run: pause},
		{name: "resume", args: "<queue>", summary: "let consumers start handlers again",
			help: `Resumes a paused queue: consumers start handlers again within about half a
second and work off what waited. Resuming a queue that is not paused changes
nothing.`,
			run: resume},
		{name: "trim", args: "<queue>", summary: "trim acknowledged entries now",
			help: `Removes the stream entries every consumer group has acknowledged, as the
consumers' periodic trim does; never an entry a group still needs.`,
			run: trim},
		{name: "keys ls", args: "<queue> [<key>]", summary: "keys with the most waiting jobs, or one key (fair queuing)", read: true,
			help: `Lists the keys of a queue's keyed jobs (Key) with the most jobs waiting for
their turn, then the most in the stream or running, --limit of them; with a
key, that key only. A key with nothing waiting or running is stored nowhere
and not listed. RUNNING counts the key's slots (its jobs in the stream, read
ahead or running), at most LIMIT per shard (0: none).`,
			flags: func(fs *flag.FlagSet, o *opts) {
				fs.Int64Var(&o.limit, "limit", 20, "keys to show")
			}, run: keysList},
		{name: "keys pause", args: "<queue> <key>", summary: "stop one key's jobs from starting (fair queuing)",
			help: `Pauses one key: its waiting jobs stay outside the stream until 'streamq keys
resume', and new ones wait too; its jobs already in the stream or running go
on, and other keys are not affected.`,
			run: keysPause},
		{name: "keys resume", args: "<queue> <key>", summary: "let a paused key's jobs start again",
			run: keysResume},
		{name: "version", summary: "print the version", run: version},
	}
}

func staleFlag(fs *flag.FlagSet, o *opts) {
	fs.DurationVar(&o.staleAfter, "stale-after", streamq.DefaultStaleAfter, "a consumer without a heartbeat for this long is stale")
}

func groupFlag(fs *flag.FlagSet, o *opts) {
	fs.StringVar(&o.group, "group", "", "consumer group (default: the queue's answering group)")
}

// queueRow is one line of `queues`.
type queueRow struct {
	Queue       string `json:"queue"`
	Length      int64  `json:"length"`
	Scheduled   int64  `json:"scheduled"`
	Pending     int64  `json:"pending"`
	DeadLetters int64  `json:"dead_letters"`
	Consumers   int64  `json:"consumers"`
	Stale       int64  `json:"stale_consumers"`
	Paused      bool   `json:"paused"`
}

func queues(ctx context.Context, r *runner) error {
	if err := r.need(0, ""); err != nil {
		return err
	}
	ctx, cancel := r.withTimeout(ctx)
	defer cancel()
	names, err := streamq.Queues(ctx, r.client)
	if err != nil {
		return err
	}
	rows := []queueRow{}
	for _, q := range names {
		a, err := r.admin(q)
		if err != nil {
			return err
		}
		s, err := a.Stats(ctx)
		if errors.Is(err, streamq.ErrNotFound) {
			continue // deleted since the scan
		}
		if err != nil {
			return err
		}
		row := queueRow{Queue: q, Length: s.Length, Scheduled: s.Scheduled, DeadLetters: s.DeadLetters, Paused: s.Paused}
		for _, g := range s.Groups {
			row.Pending += g.Pending
			row.Consumers += g.Consumers
			row.Stale += g.StaleConsumers
		}
		rows = append(rows, row)
	}
	if r.o.json {
		return r.printJSON(rows)
	}
	if len(rows) == 0 {
		fmt.Fprintln(r.stdout, "no queues (none of this Redis's keys is a streamq queue's)")
		return nil
	}
	tw := r.table()
	fmt.Fprintln(tw, "QUEUE\tLENGTH\tSCHEDULED\tPENDING\tDEAD LETTERS\tCONSUMERS\tSTALE\tSTATE")
	for _, x := range rows {
		state := "-"
		if x.Paused {
			state = "paused"
		}
		fmt.Fprintf(tw, "%s\t%d\t%d\t%d\t%d\t%d\t%d\t%s\n", x.Queue, x.Length, x.Scheduled, x.Pending, x.DeadLetters, x.Consumers, x.Stale, state)
	}
	return tw.Flush()
}

func stats(ctx context.Context, r *runner) error {
	if err := r.need(1, "<queue>"); err != nil {
		return err
	}
	if r.o.interval <= 0 {
		return usagef("--interval must be positive")
	}
	a, err := r.admin(r.args[0])
	if err != nil {
		return err
	}
	get := func() (streamq.Stats, error) {
		c, cancel := r.withTimeout(ctx)
		defer cancel()
		return a.Stats(c)
	}
	s, err := get()
	if err != nil {
		if r.o.watch && ctx.Err() != nil {
			return nil // interrupted
		}
		return err
	}
	if !r.o.watch {
		if r.o.json {
			return r.printJSON(s)
		}
		return r.printStats(s, nil, 0)
	}
	t := time.NewTicker(r.o.interval)
	defer t.Stop()
	prev, at := s, time.Now()
	for n := 1; ; n++ {
		if r.o.json {
			if err := r.printJSON(s); err != nil {
				return err
			}
		} else {
			fmt.Fprintf(r.stdout, "--- %s\n", time.Now().UTC().Format(time.RFC3339))
			var elapsed time.Duration
			if n > 1 {
				elapsed = time.Since(at)
			}
			if err := r.printStats(s, &prev, elapsed); err != nil {
				return err
			}
		}
		if r.o.count > 0 && n >= r.o.count {
			return nil
		}
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
		next, err := get()
		if err != nil {
			if ctx.Err() != nil {
				return nil // interrupted
			}
			return err
		}
		prev, at, s = s, time.Now(), next
	}
}

// printStats prints s; with prev and elapsed > 0 also the rates since prev.
func (r *runner) printStats(s streamq.Stats, prev *streamq.Stats, elapsed time.Duration) error {
	fmt.Fprintf(r.stdout, "queue %s: %d entries, %d scheduled, %d dead letters, %d canceled\n", r.args[0], s.Length, s.Scheduled, s.DeadLetters, s.Canceled)
	if len(s.Levels) > 0 {
		parts := make([]string, len(s.Levels))
		for i, l := range s.Levels {
			parts[i] = fmt.Sprintf("%s %d (%d pending)", l.Priority, l.Length, l.Pending)
		}
		fmt.Fprintf(r.stdout, "by priority: %s\n", strings.Join(parts, ", "))
	}
	if s.Paused {
		since := ""
		if !s.PausedAt.IsZero() {
			since = " since " + s.PausedAt.UTC().Format(time.RFC3339)
		}
		fmt.Fprintf(r.stdout, "PAUSED%s: no handler starts until 'streamq resume %s'\n", since, r.args[0])
	}
	if len(s.Groups) == 0 {
		fmt.Fprintln(r.stdout, "no consumer group yet (no consumer has run)")
		return nil
	}
	tw := r.table()
	head := "GROUP\tCONSUMERS\tSTALE\tPENDING\tLAG\tOLDEST PENDING\tDEAD LETTERS\tSUCCEEDED\tFAILED"
	if elapsed > 0 {
		head += "\tSUCCEEDED/S\tFAILED/S"
	}
	fmt.Fprintln(tw, head)
	for _, g := range s.Groups {
		lag := fmt.Sprint(g.Lag)
		if g.Lag < 0 {
			lag = "unknown"
		}
		fmt.Fprintf(tw, "%s\t%d\t%d\t%d\t%s\t%s\t%d\t%d\t%d", g.Name, g.Consumers, g.StaleConsumers, g.Pending, lag,
			fmtDuration(g.OldestPendingAge), g.DeadLetters, g.Succeeded, g.Failed)
		if elapsed > 0 {
			var ps, pf int64
			for _, p := range prev.Groups {
				if p.Name == g.Name {
					ps, pf = p.Succeeded, p.Failed
				}
			}
			fmt.Fprintf(tw, "\t%.1f\t%.1f", rate(g.Succeeded-ps, elapsed), rate(g.Failed-pf, elapsed))
		}
		fmt.Fprintln(tw)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	for _, g := range s.Groups {
		if g.Consumers == 0 && (g.Lag != 0 || g.Pending > 0) && !s.Paused {
			fmt.Fprintf(r.stdout, "warning: group %s has work and no live consumer\n", g.Name)
		}
	}
	return nil
}

// rate is a per-second rate of a total's increase (a restart's drop counts 0).
func rate(delta int64, elapsed time.Duration) float64 {
	if delta < 0 || elapsed <= 0 {
		return 0
	}
	return float64(delta) / elapsed.Seconds()
}

func fmtDuration(d time.Duration) string {
	switch {
	case d <= 0:
		return "-"
	case d < time.Second:
		return d.Round(time.Millisecond).String()
	default:
		return d.Round(time.Second).String()
	}
}

func consumers(ctx context.Context, r *runner) error {
	a, ctx, cancel, err := r.onQueue(ctx, 1, "<queue>")
	if err != nil {
		return err
	}
	defer cancel()
	cs, err := a.Consumers(ctx)
	if err != nil {
		return err
	}
	if r.o.json {
		if cs == nil {
			cs = []streamq.ConsumerInfo{}
		}
		return r.printJSON(cs)
	}
	if len(cs) == 0 {
		fmt.Fprintln(r.stdout, "no consumers")
		return nil
	}
	tw := r.table()
	fmt.Fprintln(tw, "GROUP\tCONSUMER\tSTATE\tPENDING\tIDLE\tLAST HEARTBEAT\tSUCCEEDED\tFAILED")
	for _, c := range cs {
		state := "stale"
		switch {
		case c.Live:
			state = "live"
		case c.Stopped:
			state = "stopped"
		}
		seen := "-"
		if !c.LastSeen.IsZero() {
			seen = fmtDuration(time.Since(c.LastSeen)) + " ago"
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%d\t%s\t%s\t%d\t%d\n", c.Group, c.Name, state, c.Pending, fmtDuration(c.Idle), seen, c.Succeeded, c.Failed)
	}
	return tw.Flush()
}

// utc returns d with its time in UTC, as every time the command line prints.
func utc(d streamq.DeadLetter) streamq.DeadLetter {
	d.At = d.At.UTC()
	return d
}

func dlqList(ctx context.Context, r *runner) error {
	if err := r.need(1, "<queue>"); err != nil {
		return err
	}
	if r.o.limit < 1 {
		return usagef("--limit must be at least 1")
	}
	a, err := r.admin(r.args[0])
	if err != nil {
		return err
	}
	ctx, cancel := r.withTimeout(ctx)
	defer cancel()
	s, err := a.Stats(ctx) // ErrNotFound for an unknown queue
	if err != nil {
		return err
	}
	dls, err := a.DeadLetters(ctx, r.o.after, r.o.limit)
	if err != nil {
		return err
	}
	if r.o.json {
		out := make([]streamq.DeadLetter, len(dls))
		for i, d := range dls {
			out[i] = utc(d)
		}
		return r.printJSON(out)
	}
	if len(dls) == 0 {
		fmt.Fprintln(r.stdout, "no dead letters")
		return nil
	}
	tw := r.table()
	fmt.Fprintln(tw, "DEAD LETTER ID\tREQUEST ID\tDELIVERIES\tAT\tERROR")
	for _, d := range dls {
		fmt.Fprintf(tw, "%s\t%s\t%d\t%s\t%s\n", d.DeadLetterID, d.ID, d.Deliveries, d.At.UTC().Format(time.RFC3339), oneLine(d.Error, 60))
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	if int64(len(dls)) == r.o.limit && s.DeadLetters > r.o.limit {
		fmt.Fprintf(r.stdout, "(%d dead letters in all; next page: --after %s)\n", s.DeadLetters, dls[len(dls)-1].DeadLetterID)
	}
	return nil
}

// oneLine shortens s to one line of at most n runes.
func oneLine(s string, n int) string {
	s = strings.ReplaceAll(s, "\n", " ")
	if utf8.RuneCountInString(s) <= n {
		return s
	}
	return string([]rune(s)[:n-1]) + "…"
}

func dlqShow(ctx context.Context, r *runner) error {
	a, ctx, cancel, err := r.onQueue(ctx, 2, "<queue> <dead-letter-id>")
	if err != nil {
		return err
	}
	defer cancel()
	d, err := a.DeadLetter(ctx, r.args[1])
	if err != nil {
		return err
	}
	if r.o.json {
		return r.printJSON(utc(d))
	}
	tw := r.table()
	fmt.Fprintf(tw, "dead letter\t%s\nrequest id\t%s\nentry\t%s\nerror\t%s\ndeliveries\t%d\nconsumer\t%s\nat\t%s\n",
		d.DeadLetterID, d.ID, d.EntryID, d.Error, d.Deliveries, d.Consumer, d.At.UTC().Format(time.RFC3339))
	if d.Priority != streamq.PriorityNormal {
		fmt.Fprintf(tw, "priority\t%s\n", d.Priority) // Requeue puts it back on that level
	}
	if utf8.Valid(d.Payload) {
		fmt.Fprintf(tw, "payload\t%s\n", d.Payload)
	} else {
		fmt.Fprintf(tw, "payload (base64)\t%s\n", encodeBase64(d.Payload))
	}
	return tw.Flush()
}

func dlqRequeue(ctx context.Context, r *runner) error {
	ids, err := r.targets("requeue")
	if err != nil {
		return err
	}
	a, err := r.admin(r.args[0])
	if err != nil {
		return err
	}
	ctx, cancel := r.withTimeout(ctx)
	defer cancel()
	if r.o.all {
		if err := r.confirm("dlq requeue --all runs every dead letter again"); err != nil {
			return err
		}
		if _, err := a.Stats(ctx); err != nil {
			return err
		}
		// The dead letters of this moment: one that fails again while
		// this runs is not requeued a second time.
		res, err := a.RequeueAll(ctx, streamq.DeadLetterFilter{})
		if err != nil {
			return fmt.Errorf("after requeueing %d: %w", res.Requeued, err)
		}
		n, skipped := res.Requeued, res.Skipped
		if !res.Done {
			return fmt.Errorf("requeued %d dead letters, then the time limit (--timeout) ended it: run it again for the rest", n)
		}
		fmt.Fprintf(r.stdout, "requeued %d dead letters\n", n)
		if len(skipped) == 0 {
			return nil
		}
		fmt.Fprintf(r.stdout, "not requeued, their request ids are in flight again (queued, running or scheduled):\n")
		tw := r.table()
		fmt.Fprintln(tw, "DEAD LETTER ID\tREQUEST ID")
		for _, d := range skipped {
			fmt.Fprintf(tw, "%s\t%s\n", d.DeadLetterID, d.ID)
		}
		if err := tw.Flush(); err != nil {
			return err
		}
		return fmt.Errorf("%w: %d dead letter(s) not requeued; see 'streamq job' for each id, requeue them once it finished if they must run again, or purge them",
			streamq.ErrRequeueInFlight, len(skipped))
	}
	for _, id := range ids {
		entry, err := a.Requeue(ctx, id)
		if err != nil {
			return err
		}
		fmt.Fprintf(r.stdout, "requeued %s as entry %s\n", id, entry)
	}
	return nil
}

// targets returns the dead letter ids of a requeue or purge, checking that
// exactly one of ids and --all was given.
func (r *runner) targets(verb string) ([]string, error) {
	if len(r.args) == 0 {
		return nil, usagef("missing <queue>")
	}
	ids := r.args[1:]
	switch {
	case r.o.all && len(ids) > 0:
		return nil, usagef("give dead letter ids or --all, not both")
	case !r.o.all && len(ids) == 0:
		return nil, usagef("say which dead letters to %s: their ids (from 'dlq ls'), or --all", verb)
	}
	return ids, nil
}

func dlqPurge(ctx context.Context, r *runner) error {
	ids, err := r.targets("purge")
	if err != nil {
		return err
	}
	what := fmt.Sprintf("dlq purge deletes %d dead letters for good", len(ids))
	if r.o.all {
		what = "dlq purge --all deletes every dead letter for good"
	}
	if err := r.confirm(what); err != nil {
		return err
	}
	a, err := r.admin(r.args[0])
	if err != nil {
		return err
	}
	ctx, cancel := r.withTimeout(ctx)
	defer cancel()
	if _, err := a.Stats(ctx); err != nil {
		return err
	}
	n, err := a.PurgeDeadLetters(ctx, ids...)
	if err != nil {
		return err
	}
	fmt.Fprintf(r.stdout, "deleted %d dead letters\n", n)
	if !r.o.all && n < int64(len(ids)) {
		return fmt.Errorf("%w: %d of the %d dead letters did not exist", streamq.ErrNotFound, int64(len(ids))-n, len(ids))
	}
	return nil
}

func job(ctx context.Context, r *runner) error {
	a, ctx, cancel, err := r.onQueue(ctx, 2, "<queue> <request-id>")
	if err != nil {
		return err
	}
	defer cancel()
	j, err := a.Job(ctx, r.args[1])
	if err != nil {
		return err
	}
	if r.o.json {
		j.Enqueued, j.Due, j.ModeUntil, j.Finished = j.Enqueued.UTC(), j.Due.UTC(), j.ModeUntil.UTC(), j.Finished.UTC()
		for i := range j.Errors {
			j.Errors[i].At = j.Errors[i].At.UTC()
		}
		return r.printJSON(j)
	}
	tw := r.table()
	fmt.Fprintf(tw, "id\t%s\nstate\t%s\n", j.ID, j.State)
	if j.Priority != streamq.PriorityNormal {
		fmt.Fprintf(tw, "priority\t%s\n", j.Priority)
	}
	if j.EntryID != "" {
		fmt.Fprintf(tw, "entry\t%s (shard %d)\nenqueued\t%s (%s ago)\ndeliveries\t%d\n", j.EntryID, j.Shard,
			j.Enqueued.UTC().Format(time.RFC3339), fmtDuration(time.Since(j.Enqueued)), j.Deliveries)
	}
	if j.State == streamq.JobScheduled || j.State == streamq.JobRetrying || (j.State == streamq.JobLost && !j.Due.IsZero()) {
		fmt.Fprintf(tw, "due\t%s (in %s)\n", j.Due.UTC().Format(time.RFC3339), fmtDuration(time.Until(j.Due)))
		if j.Deliveries > 0 {
			fmt.Fprintf(tw, "deliveries\t%d (a retry)\n", j.Deliveries)
		}
	}
	if j.State == streamq.JobRunning {
		fmt.Fprintf(tw, "consumer\t%s\nlease renewed\t%s ago\n", j.Consumer, fmtDuration(j.Idle))
	}
	if j.Mode != "" { // Throttle, Debounce or Replace
		switch {
		case j.Mode == "throttle" && !j.ModeUntil.IsZero():
			fmt.Fprintf(tw, "mode\tthrottle (window open until %s, in %s)\n", j.ModeUntil.UTC().Format(time.RFC3339Nano), fmtDuration(time.Until(j.ModeUntil)))
		case j.Mode == "debounce" && !j.ModeUntil.IsZero():
			fmt.Fprintf(tw, "mode\tdebounce (runs at due unless produced again; at the latest %s, in %s)\n", j.ModeUntil.UTC().Format(time.RFC3339Nano), fmtDuration(time.Until(j.ModeUntil)))
		default:
			fmt.Fprintf(tw, "mode\t%s\n", j.Mode)
		}
	}
	switch {
	case j.Replacement != nil && utf8.Valid(j.Replacement):
		fmt.Fprintf(tw, "replacement\t%s (runs when this run ends)\n", j.Replacement)
	case j.Replacement != nil:
		fmt.Fprintf(tw, "replacement (base64)\t%s (runs when this run ends)\n", encodeBase64(j.Replacement))
	}
	if !j.Finished.IsZero() {
		fmt.Fprintf(tw, "finished\t%s\n", when(j.Finished))
	}
	switch {
	case len(j.Result) > 0 && utf8.Valid(j.Result):
		fmt.Fprintf(tw, "result\t%s\n", j.Result)
	case len(j.Result) > 0:
		fmt.Fprintf(tw, "result (base64)\t%s\n", encodeBase64(j.Result))
	}
	if j.Error != "" {
		label := "error"
		if j.State == streamq.JobCanceled {
			label = "message"
		}
		fmt.Fprintf(tw, "%s\t%s\n", label, j.Error)
	}
	for _, e := range j.Errors { // Retention.Errors: the retried attempts, newest first
		fmt.Fprintf(tw, "error of start %d\t%s (%s)\n", e.Start, oneLine(e.Error, 200), when(e.At))
	}
	switch {
	case len(j.Progress) > 0 && utf8.Valid(j.Progress):
		fmt.Fprintf(tw, "progress\t%s\n", j.Progress)
	case len(j.Progress) > 0:
		fmt.Fprintf(tw, "progress (base64)\t%s\n", encodeBase64(j.Progress))
	}
	for _, c := range j.Children { // a flow's parent: one line per child
		state := "done"
		if c.Err != nil {
			state = c.Err.Error()
		}
		fmt.Fprintf(tw, "child\t%s/%s: %s\n", c.Queue, c.ID, state)
	}
	ttl := "no expiry"
	if j.TTL >= 0 {
		ttl = "expires in " + fmtDuration(j.TTL)
	}
	fmt.Fprintf(tw, "record\t%s\n", ttl)
	return tw.Flush()
}

func forget(ctx context.Context, r *runner) error {
	if err := r.need(2, "<queue> <request-id>"); err != nil {
		return err
	}
	if err := r.confirm(fmt.Sprintf("forget deletes the record of %q", r.args[1])); err != nil {
		return err
	}
	a, err := r.admin(r.args[0])
	if err != nil {
		return err
	}
	ctx, cancel := r.withTimeout(ctx)
	defer cancel()
	if err := a.Forget(ctx, r.args[1], r.o.force); err != nil {
		if errors.Is(err, streamq.ErrJobRunning) {
			return fmt.Errorf("%w (--force forgets it anyway)", err)
		}
		return err
	}
	fmt.Fprintf(r.stdout, "forgot %s: producing it again runs it again\n", r.args[1])
	return nil
}

func trim(ctx context.Context, r *runner) error {
	a, ctx, cancel, err := r.onQueue(ctx, 1, "<queue>")
	if err != nil {
		return err
	}
	defer cancel()
	n, err := a.Trim(ctx)
	if err != nil {
		return err
	}
	fmt.Fprintf(r.stdout, "trimmed %d entries\n", n)
	return nil
}

func encodeBase64(b []byte) string { return base64.StdEncoding.EncodeToString(b) }

func pause(ctx context.Context, r *runner) error { return setPaused(ctx, r, true) }

func resume(ctx context.Context, r *runner) error { return setPaused(ctx, r, false) }

// setPaused pauses or resumes the queue named by the argument, which must exist.
func setPaused(ctx context.Context, r *runner, paused bool) error {
	a, ctx, cancel, err := r.onQueue(ctx, 1, "<queue>")
	if err != nil {
		return err
	}
	defer cancel()
	if _, err := a.Stats(ctx); err != nil { // ErrNotFound for a misspelled queue
		return err
	}
	if paused {
		if err := a.Pause(ctx); err != nil {
			return err
		}
		fmt.Fprintf(r.stdout, "paused %s: consumers start no handler from within %v ('streamq resume %s' undoes it)\n",
			r.args[0], streamq.PauseCheckInterval, r.args[0])
		return nil
	}
	if err := a.Resume(ctx); err != nil {
		return err
	}
	fmt.Fprintf(r.stdout, "resumed %s\n", r.args[0])
	return nil
}

// keysList lists the keys with the most waiting jobs, or one key.
func keysList(ctx context.Context, r *runner) error {
	if len(r.args) == 2 {
		r.args, r.o.id = r.args[:1], r.args[1]
	}
	a, ctx, cancel, err := r.onQueue(ctx, 1, "<queue> [<key>]")
	if err != nil {
		return err
	}
	defer cancel()
	if _, err := a.Stats(ctx); err != nil { // ErrNotFound for a misspelled queue
		return err
	}
	var list []streamq.KeyStat
	if r.o.id != "" {
		s, err := a.KeyStats(ctx, r.o.id)
		if err != nil {
			return err
		}
		list = []streamq.KeyStat{s}
	} else if list, err = a.TopKeys(ctx, int(r.o.limit)); err != nil {
		return err
	}
	if r.o.json {
		if list == nil {
			list = []streamq.KeyStat{}
		}
		return r.printJSON(list)
	}
	if len(list) == 0 {
		fmt.Fprintln(r.stdout, "no key has jobs waiting or running")
		return nil
	}
	tw := r.table()
	fmt.Fprintln(tw, "KEY\tWAITING\tRUNNING\tLIMIT\tWEIGHT\tRATE\tHELD\tPAUSED")
	for _, k := range list {
		fmt.Fprintf(tw, "%s\t%d\t%d\t%d\t%d\t%s\t%v\t%v\n", k.Key, k.Waiting, k.Running, k.Limit, k.Weight, keyRate(k.Rate), k.Held, k.Paused)
	}
	return tw.Flush()
}

// keyRate shows a key's rate limit: "-" for none, else "N/Per", then
// ",burst B" when B > 1.
func keyRate(l *streamq.RateLimit) string {
	if l == nil {
		return "-"
	}
	s := fmt.Sprintf("%d/%v", l.N, l.Per)
	if l.Burst > 1 {
		s += fmt.Sprintf(",burst %d", l.Burst)
	}
	return s
}

func keysPause(ctx context.Context, r *runner) error { return setKeyPaused(ctx, r, true) }

func keysResume(ctx context.Context, r *runner) error { return setKeyPaused(ctx, r, false) }

// setKeyPaused pauses or resumes one key of a queue that exists.
func setKeyPaused(ctx context.Context, r *runner, paused bool) error {
	a, ctx, cancel, err := r.onQueue(ctx, 2, "<queue> <key>")
	if err != nil {
		return err
	}
	defer cancel()
	if _, err := a.Stats(ctx); err != nil {
		return err
	}
	if paused {
		if err := a.PauseKey(ctx, r.args[1]); err != nil {
			return err
		}
		fmt.Fprintf(r.stdout, "paused key %s of %s ('streamq keys resume %s %s' undoes it)\n", r.args[1], r.args[0], r.args[0], r.args[1])
		return nil
	}
	if err := a.ResumeKey(ctx, r.args[1]); err != nil {
		return err
	}
	fmt.Fprintf(r.stdout, "resumed key %s of %s\n", r.args[1], r.args[0])
	return nil
}
