package streamqdash

import (
	"bytes"
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"html/template"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"
	"unicode/utf8"

	"github.com/streamq/streamq"
)

// QueueSummary is one queue's line of the overview and of GET api/stats:
// Admin.Stats summed over the consumer groups.
type QueueSummary struct {
	// Name is the queue's name.
	Name string `json:"name"`
	// Length is the number of entries in the stream (Stats.Length).
	Length int64 `json:"length"`
	// Scheduled is the number of delayed jobs and retries waiting.
	Scheduled int64 `json:"scheduled"`
	// DeadLetters is the number of dead letters of the answering group.
	DeadLetters int64 `json:"dead_letters"`
	// Canceled is the number of requests Admin.Cancel cancelled since the
	// queue was created (Stats.Canceled).
	Canceled int64 `json:"canceled"`
	// Pending is the entries read and not acknowledged, over the groups.
	Pending int64 `json:"pending"`
	// Lag is the entries not yet read, over the groups; -1 when unknown.
	Lag int64 `json:"lag"`
	// Consumers and Stale count live and stale consumers over the groups.
	Consumers int64 `json:"consumers"`
	Stale     int64 `json:"stale_consumers"`
	// Succeeded and Failed are the outcome totals the consumers report in
	// their heartbeats: sample them twice for a rate.
	Succeeded int64 `json:"succeeded"`
	Failed    int64 `json:"failed"`
	// Paused reports whether the queue is paused.
	Paused bool `json:"paused"`
	// Levels splits Length and Pending by priority level, highest first
	// (Stats.Levels); omitted while the queue has only the default level.
	Levels []streamq.LevelStats `json:"levels,omitempty"`
	// Latency is the age of the oldest job not yet read by a group
	// (GroupStats.OldestQueuedAge, the largest over the groups), in
	// milliseconds; 0 when nothing waits.
	Latency int64 `json:"latency_ms"`
	// FanoutDeadLetters sums the dead letters of the fan-out groups (each
	// has its own dead-letter stream; GroupStats.DeadLetters).
	FanoutDeadLetters int64 `json:"fanout_dead_letters"`
	// Tabs are the counts of the queue page's tabs, by tab name: scheduled
	// and retrying (Stats.Scheduled split by Stats.Retrying), queued (the
	// answering group's lag, -1 when unknown), running (its pending
	// entries), dead (its dead letters, or the fan-out group's shown) and
	// completed (Stats.Completed). All come from the one Stats read.
	Tabs map[string]int64 `json:"tabs,omitempty"`
	// Error is why the queue's statistics could not be read ("" when they were).
	Error string `json:"error,omitempty"`
}

func summarize(name string, s streamq.Stats) QueueSummary {
	q := QueueSummary{Name: name, Length: s.Length, Scheduled: s.Scheduled, DeadLetters: s.DeadLetters, Canceled: s.Canceled, Paused: s.Paused, Levels: s.Levels}
	// The answering group's figures make the tabs' counts (the tabs list
	// its jobs); with no group marked answering, the only group, or the
	// sums.
	answering := -1
	for i, g := range s.Groups {
		if g.Answering || (len(s.Groups) == 1) {
			answering = i
		}
	}
	q.Tabs = map[string]int64{
		"scheduled": s.Scheduled - s.Retrying,
		"retrying":  s.Retrying,
		"dead":      s.DeadLetters,
		"completed": s.Completed,
	}
	for i, g := range s.Groups {
		q.Latency = max(q.Latency, g.OldestQueuedAge.Milliseconds())
		if i != answering && !g.Answering {
			q.FanoutDeadLetters += g.DeadLetters
		}
		if answering < 0 || i == answering {
			q.Tabs["running"] += g.Pending
			if g.Lag < 0 || q.Tabs["queued"] < 0 {
				q.Tabs["queued"] = -1
			} else {
				q.Tabs["queued"] += g.Lag
			}
		}
	}
	if len(s.Groups) == 0 {
		q.Tabs["queued"] = s.Length
	}
	for _, g := range s.Groups {
		q.Pending += g.Pending
		q.Consumers += g.Consumers
		q.Stale += g.StaleConsumers
		q.Succeeded += g.Succeeded
		q.Failed += g.Failed
		if g.Lag < 0 || q.Lag < 0 {
			q.Lag = -1
		} else {
			q.Lag += g.Lag
		}
	}
	return q
}

// summaryWorkers bounds how many queues' Stats one overview reads at once.
const summaryWorkers = 8

// summaries reads the stats of the queues (all shown ones when only is ""),
// several at once, in the order of the list.
func (h *Handler) summaries(ctx context.Context, only string) ([]QueueSummary, error) {
	names, err := h.queues(ctx)
	if err != nil {
		return nil, err
	}
	if only != "" {
		if _, err := h.admin(ctx, only, ""); err != nil {
			return nil, err
		}
		names = []string{only}
	}
	out := make([]QueueSummary, len(names))
	errs := make([]error, len(names))
	sem := make(chan struct{}, summaryWorkers)
	var wg sync.WaitGroup
	for i, name := range names {
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer func() { <-sem; wg.Done() }()
			a, err := streamq.NewAdmin(h.client, name, &streamq.AdminOptions{StaleAfter: h.opts.StaleAfter})
			if err != nil {
				errs[i] = err
				return
			}
			s, err := a.Stats(ctx)
			if err != nil {
				errs[i] = err
				return
			}
			out[i] = summarize(name, s)
		}()
	}
	wg.Wait()
	kept := out[:0]
	for i, q := range out {
		switch err := errs[i]; {
		case err == nil:
			kept = append(kept, q)
		case only != "":
			return nil, err
		case errors.Is(err, streamq.ErrNotFound):
			// deleted since discovered
		default:
			kept = append(kept, QueueSummary{Name: names[i], Error: err.Error()})
		}
	}
	return kept, nil
}

// page is what every page template gets.
type page struct {
	Title    string
	ReadOnly bool
	Poll     int64 // milliseconds; 0: no polling
	CSRF     string
}

func (h *Handler) page(w http.ResponseWriter, r *http.Request, title string) page {
	p := page{Title: title, ReadOnly: h.opts.ReadOnly, Poll: h.opts.PollInterval.Milliseconds()}
	if !h.opts.ReadOnly {
		p.CSRF = h.csrf.token(w, r)
	}
	return p
}

func (h *Handler) render(w http.ResponseWriter, name string, data any) {
	h.renderStatus(w, http.StatusOK, name, data)
}

func (h *Handler) renderStatus(w http.ResponseWriter, status int, name string, data any) {
	var b strings.Builder
	if err := h.pages.ExecuteTemplate(&b, name, data); err != nil {
		h.opts.Logger.Error("streamqdash: render", "page", name, "err", err)
		http.Error(w, "streamqdash: cannot render the page", http.StatusInternalServerError)
		return
	}
	w.Header().Set("Content-Type", "text/html; charset=utf-8")
	w.Header().Set("Cache-Control", "no-store")
	w.WriteHeader(status)
	_, _ = w.Write([]byte(b.String()))
}

func (h *Handler) overview(w http.ResponseWriter, r *http.Request) {
	ctx, cancel := context.WithTimeout(r.Context(), h.opts.Timeout)
	defer cancel()
	qs, err := h.summaries(ctx, "")
	if err != nil {
		h.fail(w, r, err)
		return
	}
	h.render(w, "overview.html", struct {
		page
		Queues []QueueSummary
	}{h.page(w, r, "Queues"), qs})
}

func (h *Handler) queue(w http.ResponseWriter, r *http.Request) {
	q, err := parseListQuery(r.URL.Query())
	if err != nil {
		h.fail(w, r, err)
		return
	}
	ctx, cancel := context.WithTimeout(r.Context(), h.opts.Timeout)
	defer cancel()
	a, read, err := h.readQueue(ctx, q)
	if err != nil {
		h.fail(w, r, err)
		return
	}
	cs, err := a.Consumers(ctx)
	if err != nil {
		h.fail(w, r, err)
		return
	}
	// Fair queuing by key: the keys with the most waiting jobs, or the key
	// searched for (?key=).
	var keys []streamq.KeyStat
	search := r.URL.Query().Get("key")
	if search != "" {
		k, err := a.KeyStats(ctx, search)
		if err != nil {
			h.fail(w, r, err)
			return
		}
		keys = []streamq.KeyStat{k}
	} else if keys, err = a.TopKeys(ctx, topKeys); err != nil {
		h.fail(w, r, err)
		return
	}
	pg := h.page(w, r, "Queue "+q.Queue)
	read.List.CSRF = pg.CSRF
	list, digest, err := h.renderList(read.List)
	if err != nil {
		h.fail(w, r, err)
		return
	}
	h.render(w, "queue.html", struct {
		page
		Queue     string
		Summary   QueueSummary
		Stats     streamq.Stats
		Consumers []streamq.ConsumerInfo
		List      jobList
		ListHTML  template.HTML // List rendered by the "jobs" template
		Digest    string
		Done      string
		Group     string // whose dead letters: "" for the answering group
		Keys      []streamq.KeyStat
		KeySearch string
	}{pg, q.Queue, read.Summary, read.Stats, cs, read.List, list, digest, doneMessage(r.URL.Query()), q.Group, keys, search})
}

// topKeys is how many keys the queue page lists (fair queuing by key).
const topKeys = 10

// doneMessage says what the action before a redirect did (fixed texts
// filled with numbers, never text from the URL).
func doneMessage(v url.Values) string {
	n, _ := strconv.ParseInt(v.Get("n"), 10, 64)
	left, _ := strconv.ParseInt(v.Get("left"), 10, 64)
	switch v.Get("done") {
	case "requeue":
		return "Requeued 1 dead letter."
	case "requeue-sel":
		return fmt.Sprintf("Requeued %d dead letter(s).", n) + notDone(v, "in flight again (queued, running or scheduled): look them up; requeue once finished, or purge")
	case "cancel":
		return fmt.Sprintf("Cancelled %d job(s).", n) + notDone(v, "already finished (their outcome stands)")
	case "run":
		return fmt.Sprintf("Moved %d job(s) to the queue to run now.", n) + notDone(v, "already queued, running or completed")
	case "purge":
		return fmt.Sprintf("Deleted %d dead letter(s).", n)
	case "requeue-all":
		msg := fmt.Sprintf("Requeued %d dead letters.", n)
		if skipped, _ := strconv.ParseInt(v.Get("skipped"), 10, 64); skipped > 0 {
			its := "its request id is"
			if skipped > 1 {
				its = "their request ids are"
			}
			msg = fmt.Sprintf("Requeued %d dead letters; %d not requeued: %s in flight again (look it up; requeue once it finished, or purge).", n, skipped, its)
		}
		if left > 0 {
			msg += " The time limit was reached before every dead letter was visited: press again for the rest."
		}
		return msg
	case "purge-all":
		msg := fmt.Sprintf("Deleted %d dead letters.", n)
		if left > 0 {
			msg += " The time limit was reached before every matching dead letter was visited: press again for the rest."
		}
		return msg
	case "pause":
		return "Paused: consumers start no handler until resumed."
	case "resume":
		return "Resumed."
	case "pause-key":
		return "Paused the key: its waiting jobs stay out of the stream until resumed."
	case "resume-key":
		return "Resumed the key."
	case "gone":
		return "That dead letter was gone already."
	case "inflight":
		return "That dead letter was not requeued: its request id is in flight again (queued, running or scheduled). Look it up; requeue the dead letter once it finished, or purge it."
	}
	return ""
}

// notDone says how many jobs of a selection were gone or skipped (why).
func notDone(v url.Values, why string) string {
	out := ""
	if gone, _ := strconv.ParseInt(v.Get("gone"), 10, 64); gone > 0 {
		out += fmt.Sprintf(" %d not found (gone meanwhile).", gone)
	}
	if skipped, _ := strconv.ParseInt(v.Get("skipped"), 10, 64); skipped > 0 {
		out += fmt.Sprintf(" %d skipped: %s.", skipped, why)
	}
	return out
}

// jobChild is one child of a flow's parent on the job page.
type jobChild struct {
	Queue, ID string
	Shown     bool   // its queue is one the dashboard shows: its id links to its page
	Outcome   string // "succeeded", "no outcome yet", or the error
	OK        bool
	Result    string
}

// jobPage is what the job page shows of a request (Admin.Job).
type jobPage struct {
	page
	Queues    []string
	Queue, ID string
	Job       *streamq.JobInfo
	Tab       template.URL // the queue page's tab listing the job, searched by its id
	Payload   text
	Result    text
	Progress  text
	Children  []jobChild
	NotFound  string
}

// text is a stored value as the job page shows it: JSON indented, other
// UTF-8 as it is, anything else as base64.
type text struct {
	Body string
	Kind string // "json", "text", "base64", or "" when there is none
}

// showValue makes a text of a stored value, cut to limit bytes.
func showValue(b []byte, limit int) text {
	switch {
	case b == nil:
		return text{}
	case json.Valid(b):
		var out bytes.Buffer
		if json.Indent(&out, b, "", "  ") == nil {
			return text{Body: cut(out.String(), limit), Kind: "json"}
		}
	case !utf8.Valid(b):
		return text{Body: cut(base64.StdEncoding.EncodeToString(b), limit), Kind: "base64"}
	}
	return text{Body: cut(string(b), limit), Kind: "text"}
}

// cut shortens s to about limit bytes (on a rune boundary), saying so.
func cut(s string, limit int) string {
	if len(s) <= limit {
		return s
	}
	i := limit
	for i > 0 && !utf8.RuneStart(s[i]) {
		i--
	}
	return s[:i] + fmt.Sprintf("\n… (%d more bytes)", len(s)-i)
}

// jobValueLimit bounds the bytes of a payload, result or progress value the
// job page shows.
const jobValueLimit = 64 << 10

// tabOf is the queue page's tab that lists a request in this state ("" for
// none: completed ones show in Completed only when the list keeps them).
func tabOf(s streamq.JobState) string {
	switch s {
	case streamq.JobScheduled:
		return "scheduled"
	case streamq.JobRetrying:
		return "retrying"
	case streamq.JobQueued:
		return "queued"
	case streamq.JobRunning:
		return "running"
	case streamq.JobDeadLettered:
		return "dead"
	case streamq.JobSucceeded, streamq.JobFailed:
		return completedTab
	}
	return ""
}

func (h *Handler) job(w http.ResponseWriter, r *http.Request) {
	name, id := r.FormValue("q"), r.FormValue("id")
	ctx, cancel := context.WithTimeout(r.Context(), h.opts.Timeout)
	defer cancel()
	qs, err := h.queues(ctx)
	if err != nil {
		h.fail(w, r, err)
		return
	}
	title := "Job lookup"
	if id != "" {
		title = "Job " + id
	}
	data := jobPage{page: h.page(w, r, title), Queues: qs, Queue: name, ID: id}
	data.Poll = 0
	status := http.StatusOK
	if name != "" && id != "" {
		a, err := h.admin(ctx, name, "")
		if err != nil {
			h.fail(w, r, err)
			return
		}
		j, err := a.Job(ctx, id)
		switch {
		case errors.Is(err, streamq.ErrNotFound):
			data.NotFound, status = err.Error(), http.StatusNotFound
		case err != nil:
			h.fail(w, r, err)
			return
		default:
			data.Job = &j
			data.Payload = showValue(j.Payload, jobValueLimit)
			data.Result = showValue(j.Result, jobValueLimit)
			data.Progress = showValue(j.Progress, jobValueLimit)
			if t := tabOf(j.State); t != "" {
				v := url.Values{"q": {name}, "id": {id}}
				if t != defaultTab {
					v.Set("tab", t)
				}
				data.Tab = template.URL("queue?" + v.Encode())
			}
			for _, c := range j.Children {
				jc := jobChild{Queue: c.Queue, ID: c.ID, Shown: slices.Contains(qs, c.Queue), OK: c.Err == nil}
				switch {
				case c.Err == nil:
					jc.Outcome = "succeeded"
					jc.Result = showValue(c.Result, 200).Body
				default:
					jc.Outcome = c.Err.Error()
				}
				data.Children = append(data.Children, jc)
			}
		}
	}
	h.renderStatus(w, status, "job.html", data)
}

// deadLetter shows one dead letter with its payload (Admin.DeadLetter).
func (h *Handler) deadLetter(w http.ResponseWriter, r *http.Request) {
	name, id, group := r.FormValue("q"), r.FormValue("id"), r.FormValue("group")
	ctx, cancel := context.WithTimeout(r.Context(), h.opts.Timeout)
	defer cancel()
	a, err := h.admin(ctx, name, group)
	if err != nil {
		h.fail(w, r, err)
		return
	}
	d, err := a.DeadLetter(ctx, id)
	if err != nil {
		h.fail(w, r, err)
		return
	}
	data := struct {
		page
		Queue, Group string
		Back         template.URL
		DL           streamq.DeadLetter
		Payload      string
		Binary       bool
	}{page: h.page(w, r, "Dead letter "+id), Queue: name, Group: group, DL: d, Payload: string(d.Payload)}
	data.Poll = 0
	data.Back = listQuery{Queue: name, Group: group}.TabLink(defaultTab)
	if !utf8.Valid(d.Payload) {
		data.Payload, data.Binary = base64.StdEncoding.EncodeToString(d.Payload), true
	}
	h.render(w, "deadletter.html", data)
}

// statsResponse is the body of GET api/stats.
type statsResponse struct {
	// Time is when the counts were read, Unix milliseconds.
	Time   int64          `json:"time"`
	Queues []QueueSummary `json:"queues"`
}

func (h *Handler) apiStats(w http.ResponseWriter, r *http.Request) {
	ctx, cancel := context.WithTimeout(r.Context(), h.opts.Timeout)
	defer cancel()
	qs, err := h.summaries(ctx, r.FormValue("q"))
	if err != nil {
		h.fail(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, statsResponse{Time: time.Now().UnixMilli(), Queues: qs})
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Cache-Control", "no-store")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(v)
}

var crossOrigin = http.NewCrossOriginProtection()

// maxSelection bounds how many jobs one action of a selection takes.
const maxSelection = 1000

// action performs one change (POST action) and redirects back to the queue
// page it came from (the form's "back": the list's query, parsed again).
func (h *Handler) action(w http.ResponseWriter, r *http.Request) {
	if h.opts.ReadOnly {
		http.Error(w, "streamqdash: read-only dashboard", http.StatusForbidden)
		return
	}
	if err := crossOrigin.Check(r); err != nil {
		http.Error(w, "streamqdash: refused a change from another origin", http.StatusForbidden)
		return
	}
	r.Body = http.MaxBytesReader(w, r.Body, 256<<10)
	if !h.csrf.check(r) {
		http.Error(w, "streamqdash: missing or stale form token; reload the page and try again", http.StatusForbidden)
		return
	}
	name, op := r.PostFormValue("q"), r.PostFormValue("op")
	group := r.PostFormValue("group")
	var ids []string
	for _, id := range r.PostForm["id"] {
		if id != "" && !slices.Contains(ids, id) {
			ids = append(ids, id)
		}
	}
	// Jobs of the Scheduled and Retrying tabs name their group each (a
	// fan-out group's retry, or "" for the answering group's request):
	// "job" fields, whose values are jobRef's. An "id" is of the form's group.
	var jobs []jobTarget
	for _, id := range ids {
		jobs = append(jobs, jobTarget{group, id})
	}
	for _, ref := range r.PostForm["job"] {
		j, err := parseJobRef(ref)
		if err != nil {
			h.fail(w, r, err)
			return
		}
		if !slices.Contains(jobs, j) {
			jobs = append(jobs, j)
		}
	}
	if op != "cancel" && op != "run" && len(r.PostForm["job"]) > 0 {
		h.fail(w, r, fmt.Errorf("%w: %s takes dead letter ids (id=), not jobs", errBadRequest, op))
		return
	}
	timeout := h.opts.Timeout
	if op == "requeue-all" || op == "purge-all" || len(ids) > 1 || len(jobs) > 1 {
		timeout = h.opts.ActionTimeout
	}
	ctx, cancel := context.WithTimeout(r.Context(), timeout)
	defer cancel()
	a, err := h.admin(ctx, name, group)
	if err != nil {
		h.fail(w, r, err)
		return
	}
	perJob := op == "requeue" || op == "purge" || op == "cancel" || op == "run"
	switch {
	case perJob && len(jobs) == 0:
		h.fail(w, r, fmt.Errorf("%w: %s needs the ids of the jobs (id=); none was selected", errBadRequest, op))
		return
	case !perJob && len(jobs) > 0:
		h.fail(w, r, fmt.Errorf("%w: %s takes no id", errBadRequest, op))
		return
	case len(jobs) > maxSelection:
		h.fail(w, r, fmt.Errorf("%w: at most %d jobs per action, not %d", errBadRequest, maxSelection, len(jobs)))
		return
	}
	// The way back: the list the form was on, parsed and encoded again (no
	// text of the form goes into the URL unchecked). Its filter is what
	// "requeue all" and "purge all" act on.
	back := url.Values{"q": {name}}
	var filter streamq.DeadLetterFilter
	if bq, err := url.ParseQuery(r.PostFormValue("back")); err == nil {
		bq.Set("q", name)
		if len(r.PostForm["job"]) == 0 {
			bq.Set("group", group) // the group acted on, "" (dropped) for the answering one
		}
		if lq, err := parseListQuery(bq); err == nil {
			back = lq.values(true)
			if lq.Tab.State == streamq.JobDeadLettered {
				filter = streamq.DeadLetterFilter{ID: lq.ID, ErrorContains: lq.Error}
			}
		}
	} else if group != "" {
		back.Set("group", group)
	}
	back.Set("done", op)
	count := func(n, gone, skipped int) {
		back.Set("n", strconv.Itoa(n))
		if gone > 0 {
			back.Set("gone", strconv.Itoa(gone))
		}
		if skipped > 0 {
			back.Set("skipped", strconv.Itoa(skipped))
		}
	}
	switch op {
	case "requeue":
		if len(ids) == 1 {
			switch _, err = a.Requeue(ctx, ids[0]); {
			case errors.Is(err, streamq.ErrInvalidDeadLetterID):
				err = fmt.Errorf("%w: %w", errBadRequest, err)
			case errors.Is(err, streamq.ErrNotFound):
				back.Set("done", "gone")
				err = nil
			case errors.Is(err, streamq.ErrRequeueInFlight):
				back.Set("done", "inflight")
				err = nil
			}
			break
		}
		var n, gone, skipped int
		for _, id := range ids {
			switch _, err = a.Requeue(ctx, id); {
			case err == nil:
				n++
			case errors.Is(err, streamq.ErrNotFound):
				gone, err = gone+1, nil
			case errors.Is(err, streamq.ErrRequeueInFlight):
				skipped, err = skipped+1, nil
			case errors.Is(err, streamq.ErrInvalidDeadLetterID):
				err = fmt.Errorf("%w: %w", errBadRequest, err)
			}
			if err != nil {
				break
			}
		}
		count(n, gone, skipped)
		back.Set("done", "requeue-sel")
	case "purge":
		var n int64
		if n, err = a.PurgeDeadLetters(ctx, ids...); errors.Is(err, streamq.ErrInvalidDeadLetterID) {
			err = fmt.Errorf("%w: %w", errBadRequest, err)
		}
		back.Set("n", strconv.FormatInt(n, 10))
	case "cancel", "run":
		var n, gone, skipped int
		admins := map[string]*streamq.Admin{group: a}
		for _, j := range jobs {
			ja, ok := admins[j.Group]
			if !ok {
				if ja, err = h.admin(ctx, name, j.Group); err != nil {
					break
				}
				admins[j.Group] = ja
			}
			if op == "cancel" {
				err = ja.Cancel(ctx, j.ID)
			} else {
				err = ja.RunNow(ctx, j.ID)
			}
			switch {
			case err == nil:
				n++
			case errors.Is(err, streamq.ErrNotFound):
				gone, err = gone+1, nil
			case errors.Is(err, streamq.ErrNotScheduled), errors.Is(err, streamq.ErrFinished):
				skipped, err = skipped+1, nil
			case errors.Is(err, streamq.ErrInvalidID):
				err = fmt.Errorf("%w: %w", errBadRequest, err)
			}
			if err != nil {
				break
			}
		}
		count(n, gone, skipped)
	case "requeue-all":
		// The dead letters of this moment that the list's filter selects:
		// one that fails again meanwhile is not requeued a second time.
		var res streamq.RequeueAllResult
		res, err = a.RequeueAll(ctx, filter)
		back.Set("n", strconv.FormatInt(res.Requeued, 10))
		back.Set("skipped", strconv.Itoa(len(res.Skipped)))
		if !res.Done && err == nil {
			back.Set("left", "1")
		}
		back.Del("cursor")
	case "purge-all":
		var n int64
		if filter == (streamq.DeadLetterFilter{}) {
			n, err = a.PurgeDeadLetters(ctx)
		} else {
			n, err = a.PurgeMatching(ctx, filter)
			if errors.Is(err, context.DeadlineExceeded) {
				back.Set("left", "1")
				err = nil
			}
		}
		back.Set("n", strconv.FormatInt(n, 10))
		back.Del("cursor")
	case "pause":
		err = a.Pause(ctx)
	case "resume":
		err = a.Resume(ctx)
	case "pause-key":
		err = a.PauseKey(ctx, r.PostFormValue("key"))
	case "resume-key":
		err = a.ResumeKey(ctx, r.PostFormValue("key"))
	default:
		err = fmt.Errorf("%w: unknown action %q", errBadRequest, op)
	}
	if err != nil {
		h.fail(w, r, err)
		return
	}
	// Relative, so that it resolves under whatever prefix the client used.
	w.Header().Set("Location", "queue?"+back.Encode())
	w.WriteHeader(http.StatusSeeOther)
}

// jobTarget is a scheduled job or retry an action acts on: its group ("" for
// the answering group) and request id.
type jobTarget struct {
	Group, ID string
}

// jobRef encodes a job of the Scheduled or Retrying tab for the "job" field
// of a form: its group and id (any bytes) as URL parameters.
func jobRef(j streamq.JobSummary) string {
	v := url.Values{"id": {j.ID}}
	if j.Group != "" {
		v.Set("group", j.Group)
	}
	return v.Encode()
}

// parseJobRef decodes a jobRef.
func parseJobRef(ref string) (jobTarget, error) {
	v, err := url.ParseQuery(ref)
	if err != nil || v.Get("id") == "" {
		return jobTarget{}, fmt.Errorf("%w: job %q is not one the page gave", errBadRequest, ref)
	}
	return jobTarget{Group: v.Get("group"), ID: v.Get("id")}, nil
}

var funcs = template.FuncMap{
	"since": func(t time.Time) string {
		if t.IsZero() {
			return "-"
		}
		return fmtDur(time.Since(t)) + " ago"
	},
	"until": func(t time.Time) string { return "in " + fmtDur(time.Until(t)) },
	"utc":   func(t time.Time) string { return t.UTC().Format("2006-01-02 15:04:05Z") },
	"dur":   fmtDur,
	"short": func(s string, n int) string {
		if utf8.RuneCountInString(s) <= n {
			return s
		}
		return string([]rune(s)[:n-1]) + "…"
	},
	"lag": func(n int64) string {
		if n < 0 {
			return "unknown"
		}
		return strconv.FormatInt(n, 10)
	},
	"add": func(a, b int) int { return a + b },
	// count is a tab's count: "?" when unknown (-1).
	"count": func(n int64) string {
		if n < 0 {
			return "?"
		}
		return strconv.FormatInt(n, 10)
	},
	// latency is the age of the oldest job waiting to be read (ms), as
	// app.js writes it.
	"latency": func(ms int64) string {
		switch {
		case ms <= 0:
			return "–"
		case ms < 1000:
			return "<1s"
		}
		return coarse(time.Duration(ms) * time.Millisecond)
	},
	"rel": relTime,
	"ms": func(t time.Time) int64 {
		if t.IsZero() {
			return 0
		}
		return t.UnixMilli()
	},
	"agoMs": func(d time.Duration) int64 { return time.Now().Add(-d).UnixMilli() },
	"utf8":  func(b []byte) bool { return utf8.Valid(b) },
	// payload is a job's payload as text: itself when UTF-8, else base64.
	"payload": func(b []byte) string {
		if utf8.Valid(b) {
			return string(b)
		}
		return base64.StdEncoding.EncodeToString(b)
	},
	"dur2": coarse,
	"utcTitle": func(t time.Time) string {
		if t.IsZero() {
			return ""
		}
		return t.UTC().Format("2006-01-02 15:04:05 UTC")
	},
	"hasAction": func(actions []string, a string) bool { return slices.Contains(actions, a) },
	"jobRef":    jobRef,
}

func fmtDur(d time.Duration) string {
	switch {
	case d <= 0:
		return "0s"
	case d < time.Second:
		return d.Round(time.Millisecond).String()
	default:
		return d.Round(time.Second).String()
	}
}
