package cli

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"strings"
	"time"

	"github.com/streamq/streamq"
)

// jobStates are the states 'jobs ls --state' lists, by their flag value.
var jobStates = map[string]streamq.JobState{
	"scheduled": streamq.JobScheduled,
	"retrying":  streamq.JobRetrying,
	"queued":    streamq.JobQueued,
	"running":   streamq.JobRunning,
	"dead":      streamq.JobDeadLettered,
}

const jobStateNames = "scheduled, retrying, queued, running, dead or completed"

// completedState is --state completed: Admin.Completed, not Admin.Jobs.
const completedState = "completed"

func jobsFlags(fs *flag.FlagSet, o *opts) {
	groupFlag(fs, o)
	fs.StringVar(&o.state, "state", "", "which jobs: "+jobStateNames+" (required)")
	fs.Int64Var(&o.limit, "limit", 20, "jobs per page (at most 1000)")
	fs.StringVar(&o.cursor, "cursor", "", "the page to show: a cursor printed by the previous page (next or previous)")
	fs.StringVar(&o.id, "id", "", "only this request id")
	fs.StringVar(&o.errorContains, "error", "", "retrying and dead: only jobs whose last error contains this text")
}

func jobsList(ctx context.Context, r *runner) error {
	if err := r.need(1, "<queue>"); err != nil {
		return err
	}
	if r.o.state == completedState {
		return completedList(ctx, r)
	}
	state, ok := jobStates[r.o.state]
	switch {
	case r.o.state == "":
		return usagef("say which jobs: --state %s", jobStateNames)
	case !ok:
		return usagef("--state %q: it is one of %s", r.o.state, jobStateNames)
	case r.o.limit < 1 || r.o.limit > 1000:
		return usagef("--limit must be 1 to 1000")
	case r.o.errorContains != "" && state != streamq.JobRetrying && state != streamq.JobDeadLettered:
		return usagef("--error filters retrying and dead jobs only")
	}
	a, err := r.admin(r.args[0])
	if err != nil {
		return err
	}
	ctx, cancel := r.withTimeout(ctx)
	defer cancel()
	if _, err := a.Stats(ctx); err != nil { // ErrNotFound for an unknown queue
		return err
	}
	p, err := a.Jobs(ctx, streamq.JobsQuery{State: state, Limit: int(r.o.limit), Cursor: r.o.cursor, ID: r.o.id, ErrorContains: r.o.errorContains})
	if errors.Is(err, streamq.ErrInvalidOptions) || errors.Is(err, streamq.ErrInvalidCursor) {
		return usagef("%v", err)
	}
	if err != nil {
		return err
	}
	if r.o.json {
		if p.Jobs == nil {
			p.Jobs = []streamq.JobSummary{}
		}
		for i := range p.Jobs {
			j := &p.Jobs[i]
			j.ProducedAt, j.Due, j.At = j.ProducedAt.UTC(), j.Due.UTC(), j.At.UTC()
		}
		return r.printJSON(p)
	}
	switch {
	case len(p.Jobs) == 0 && p.Next != "":
		// A filtered page scans a bounded number of jobs per shard.
		fmt.Fprintf(r.stdout, "no match among the %s jobs scanned so far; the scan goes on with --cursor %s\n", r.o.state, p.Next)
		return nil
	case len(p.Jobs) == 0:
		fmt.Fprintf(r.stdout, "no %s jobs\n", r.o.state)
	default:
		if err := r.printJobs(state, p.Jobs); err != nil {
			return err
		}
	}
	var more []string
	if p.Total >= 0 {
		more = append(more, fmt.Sprintf("%d %s in all", p.Total, r.o.state))
	}
	if p.Prev != "" {
		more = append(more, "previous page: --cursor "+p.Prev)
	}
	if p.Next != "" {
		more = append(more, "next page: --cursor "+p.Next)
	}
	if len(p.Jobs) > 0 && len(more) > 0 {
		fmt.Fprintf(r.stdout, "(%s)\n", strings.Join(more, "; "))
	}
	return nil
}

// when prints t in UTC with how far it is from now.
func when(t time.Time) string {
	if t.IsZero() {
		return "-"
	}
	if d := time.Until(t); d >= 0 {
		return t.UTC().Format(time.RFC3339) + " (in " + fmtDuration(d) + ")"
	}
	return t.UTC().Format(time.RFC3339) + " (" + fmtDuration(time.Since(t)) + " ago)"
}

func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

func (r *runner) printJobs(state streamq.JobState, jobs []streamq.JobSummary) error {
	tw := r.table()
	// A PRIORITY column only when a job on the page has a level other
	// than normal.
	leveled := false
	for _, j := range jobs {
		leveled = leveled || j.Priority != streamq.PriorityNormal
	}
	head := func(h string) {
		if leveled {
			h += "\tPRIORITY"
		}
		fmt.Fprintln(tw, h)
	}
	end := func(j streamq.JobSummary) {
		if leveled {
			fmt.Fprintf(tw, "\t%s", j.Priority)
		}
		fmt.Fprintln(tw)
	}
	switch state {
	case streamq.JobScheduled:
		head("REQUEST ID\tDUE\tPRODUCED\tSHARD")
		for _, j := range jobs {
			fmt.Fprintf(tw, "%s\t%s\t%s\t%d", j.ID, when(j.Due), when(j.ProducedAt), j.Shard)
			end(j)
		}
	case streamq.JobRetrying:
		head("REQUEST ID\tNEXT RUN\tSTARTS\tGROUP\tLAST ERROR")
		for _, j := range jobs {
			fmt.Fprintf(tw, "%s\t%s\t%d\t%s\t%s", j.ID, when(j.Due), j.Deliveries, orDash(j.Group), oneLine(j.LastError, 60))
			end(j)
		}
	case streamq.JobQueued:
		head("REQUEST ID\tENTRY\tPRODUCED\tSHARD")
		for _, j := range jobs {
			fmt.Fprintf(tw, "%s\t%s\t%s\t%d", j.ID, j.EntryID, when(j.ProducedAt), j.Shard)
			end(j)
		}
	case streamq.JobRunning:
		head("REQUEST ID\tCONSUMER\tREAD OR RENEWED\tSTARTS\tENTRY")
		for _, j := range jobs {
			fmt.Fprintf(tw, "%s\t%s\t%s ago\t%d\t%s", j.ID, j.Consumer, fmtDuration(j.Idle), j.Deliveries, j.EntryID)
			end(j)
		}
	default:
		head("DEAD LETTER ID\tREQUEST ID\tSTARTS\tAT\tCONSUMER\tERROR")
		for _, j := range jobs {
			fmt.Fprintf(tw, "%s\t%s\t%d\t%s\t%s\t%s", j.DeadLetterID, orDash(j.ID), j.Deliveries, j.At.UTC().Format(time.RFC3339), orDash(j.Consumer), oneLine(j.LastError, 60))
			end(j)
		}
	}
	return tw.Flush()
}

// jobsAct runs cancel or run on each request id given, and fails (exit 3 when
// one was not found, else 1) after trying them all when one failed.
func jobsAct(ctx context.Context, r *runner, verb string, act func(*streamq.Admin, context.Context, string) error, done string) error {
	if len(r.args) < 2 {
		return usagef("missing <queue> <request-id>")
	}
	a, err := r.admin(r.args[0])
	if err != nil {
		return err
	}
	ctx, cancel := r.withTimeout(ctx)
	defer cancel()
	if _, err := a.Stats(ctx); err != nil { // ErrNotFound for an unknown queue
		return err
	}
	var failed []error
	for _, id := range r.args[1:] {
		err := act(a, ctx, id)
		switch {
		case err == nil:
			fmt.Fprintf(r.stdout, "%s %s\n", id, done)
		case errors.Is(err, streamq.ErrNotScheduled), errors.Is(err, streamq.ErrFinished):
			failed = append(failed, wrapped{fmt.Sprintf("%s not %s (see 'streamq job %s %s')", id, verb, r.args[0], id), err})
		default:
			failed = append(failed, wrapped{fmt.Sprintf("%s not %s", id, verb), err})
		}
	}
	switch len(failed) {
	case 0:
		return nil
	case 1:
		return failed[0]
	}
	return errors.Join(failed...)
}

func jobsCancel(ctx context.Context, r *runner) error {
	return jobsAct(ctx, r, "cancelled", (*streamq.Admin).Cancel, "cancelled: its outcome is ErrCanceled, and it will not run (again)")
}

func jobsRun(ctx context.Context, r *runner) error {
	return jobsAct(ctx, r, "run now", (*streamq.Admin).RunNow, "moved to the queue: it runs next (starts and dedup kept)")
}

// history prints the jobs processed and failed per minute (Admin.History).
func history(ctx context.Context, r *runner) error {
	if err := r.need(1, "<queue>"); err != nil {
		return err
	}
	if r.o.span <= 0 || r.o.span > 24*time.Hour || r.o.span%time.Minute != 0 {
		return usagef("--span must be whole minutes, from 1m to 24h")
	}
	a, err := r.admin(r.args[0])
	if err != nil {
		return err
	}
	ctx, cancel := r.withTimeout(ctx)
	defer cancel()
	if _, err := a.Stats(ctx); err != nil { // ErrNotFound for an unknown queue
		return err
	}
	pts, err := a.History(ctx, r.o.span)
	if err != nil {
		return err
	}
	if r.o.json {
		if pts == nil {
			pts = []streamq.HistoryPoint{}
		}
		for i := range pts {
			pts[i].Minute = pts[i].Minute.UTC()
		}
		return r.printJSON(pts)
	}
	var processed, failed int64
	tw := r.table()
	rows := 0
	for _, p := range pts {
		processed += p.Processed
		failed += p.Failed
		if p.Processed == 0 && p.Failed == 0 {
			continue
		}
		if rows == 0 {
			fmt.Fprintln(tw, "MINUTE (UTC)\tPROCESSED\tFAILED")
		}
		rows++
		fmt.Fprintf(tw, "%s\t%d\t%d\n", p.Minute.UTC().Format("2006-01-02 15:04"), p.Processed, p.Failed)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	fmt.Fprintf(r.stdout, "last %s: %d processed, %d failed (%d of %d minutes had any)\n", fmtSpan(r.o.span), processed, failed, rows, len(pts))
	return nil
}

func fmtSpan(d time.Duration) string {
	if d%time.Hour == 0 {
		return fmt.Sprintf("%dh", d/time.Hour)
	}
	return fmt.Sprintf("%dm", d/time.Minute)
}

// wrapped is err with what failed in front, and err's own "streamq: "
// prefix dropped (Main adds one).
type wrapped struct {
	what string
	err  error
}

func (w wrapped) Error() string {
	return w.what + ": " + strings.TrimPrefix(w.err.Error(), "streamq: ")
}

func (w wrapped) Unwrap() error { return w.err }

// completedList prints a page of the recently completed requests
// (Admin.Completed): jobs ls --state completed.
func completedList(ctx context.Context, r *runner) error {
	switch {
	case r.o.limit < 1 || r.o.limit > 1000:
		return usagef("--limit must be 1 to 1000")
	case r.o.id != "" || r.o.errorContains != "":
		return usagef("--state completed takes neither --id nor --error (streamq job <queue> <request-id> shows one request)")
	}
	a, err := r.admin(r.args[0])
	if err != nil {
		return err
	}
	ctx, cancel := r.withTimeout(ctx)
	defer cancel()
	p, err := a.Completed(ctx, r.o.cursor, int(r.o.limit))
	if errors.Is(err, streamq.ErrInvalidOptions) || errors.Is(err, streamq.ErrInvalidCursor) {
		return usagef("%v", err)
	}
	if err != nil {
		return err
	}
	if r.o.json {
		if p.Jobs == nil {
			p.Jobs = []streamq.CompletedJob{}
		}
		for i := range p.Jobs {
			p.Jobs[i].At = p.Jobs[i].At.UTC()
		}
		return r.printJSON(p)
	}
	if len(p.Jobs) == 0 {
		fmt.Fprintln(r.stdout, "no completed jobs listed (the consumers keep a list only with ConsumerOptions.Retention)")
		return nil
	}
	tw := r.table()
	fmt.Fprintln(tw, "REQUEST ID\tOUTCOME\tCOMPLETED\tSHARD")
	for _, j := range p.Jobs {
		id := j.ID
		if id == "" {
			id = "(entry " + j.EntryID + ")"
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%d\n", id, j.State, when(j.At), j.Shard)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	more := fmt.Sprintf("%d listed in all", p.Total)
	if p.Next != "" {
		more += "; next page: --cursor " + p.Next
	}
	fmt.Fprintf(r.stdout, "(%s)\n", more)
	return nil
}
