package streamqdash

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"html/template"
	"net/http"
	"net/url"
	"regexp"
	"slices"
	"strings"
	"time"

	"github.com/streamq/streamq"
)

// tab is one of the queue page's job lists.
type tab struct {
	Name  string           // the tab= value
	Label string           // what the tab says
	State streamq.JobState // what Admin.Jobs lists
}

// tabs are the queue page's job lists, in the order the page shows them.
var tabs = []tab{
	{"scheduled", "Scheduled", streamq.JobScheduled},
	{"retrying", "Retrying", streamq.JobRetrying},
	{"queued", "Queued", streamq.JobQueued},
	{"running", "Running", streamq.JobRunning},
	{"dead", "Dead letters", streamq.JobDeadLettered},
	{"completed", "Completed", streamq.JobSucceeded},
}

// completedTab is the tab of the recently completed jobs: Admin.Completed,
// not Admin.Jobs (its State is only a marker).
const completedTab = "completed"

// defaultTab is the tab a queue page opens with: the dead letters, which an
// operator comes for most often (and which the page showed before it had tabs).
const defaultTab = "dead"

func findTab(name string) (tab, bool) {
	if name == "" {
		name = defaultTab
	}
	for _, t := range tabs {
		if t.Name == name {
			return t, true
		}
	}
	return tab{}, false
}

// listQuery is what a queue page lists: the tab, its filters and its page,
// from the request's query (the page, api/queue and the actions' way back
// share it).
type listQuery struct {
	Queue  string
	Group  string // dead letters of this fan-out group ("" for the answering one)
	Tab    tab
	Cursor string
	ID     string // only this request id
	Error  string // retrying and dead: only errors containing it
}

func parseListQuery(v url.Values) (listQuery, error) {
	q := listQuery{Queue: v.Get("q"), Group: v.Get("group"), Cursor: v.Get("cursor"),
		ID: strings.TrimSpace(v.Get("id")), Error: strings.TrimSpace(v.Get("error"))}
	if q.Queue == "" {
		return q, fmt.Errorf("%w: which queue? (q=)", errBadRequest)
	}
	t, ok := findTab(v.Get("tab"))
	if !ok {
		return q, fmt.Errorf("%w: unknown tab %q (scheduled, retrying, queued, running, dead or completed)", errBadRequest, v.Get("tab"))
	}
	q.Tab = t
	if !q.FiltersErrors() {
		q.Error = ""
	}
	return q, nil
}

// FiltersErrors reports whether the tab lists jobs with errors to filter on.
func (q listQuery) FiltersErrors() bool {
	return q.Tab.State == streamq.JobRetrying || q.Tab.State == streamq.JobDeadLettered
}

// values returns the query as URL parameters; with keepCursor, the page too.
func (q listQuery) values(keepCursor bool) url.Values {
	v := url.Values{"q": {q.Queue}}
	set := func(k, s string) {
		if s != "" {
			v.Set(k, s)
		}
	}
	set("group", q.Group)
	if q.Tab.Name != defaultTab {
		v.Set("tab", q.Tab.Name)
	}
	set("id", q.ID)
	set("error", q.Error)
	if keepCursor {
		set("cursor", q.Cursor)
	}
	return v
}

// Link returns the queue page's URL for this query on another tab, filters
// dropped ("" keeps the tab), or on another page.
func (q listQuery) TabLink(name string) template.URL {
	v := url.Values{"q": {q.Queue}}
	if q.Group != "" {
		v.Set("group", q.Group)
	}
	if name != defaultTab {
		v.Set("tab", name)
	}
	return template.URL("queue?" + v.Encode())
}

// PageLink returns the queue page's URL of this list at cursor.
func (q listQuery) PageLink(cursor string) template.URL {
	v := q.values(false)
	if cursor != "" {
		v.Set("cursor", cursor)
	}
	return template.URL("queue?" + v.Encode())
}

// jobList is one page of a tab, as the page and api/queue show it.
type jobList struct {
	listQuery
	Tabs     []tab
	Page     streamq.JobsPage
	ReadOnly bool
	CSRF     string
	PageSize int
}

// Actions returns the actions of the tab's rows ("" for none): cancel and
// run on waiting jobs, cancel on queued and running ones, requeue and purge
// on dead letters.
func (l jobList) Actions() []string {
	if l.ReadOnly {
		return nil
	}
	switch l.Tab.State {
	case streamq.JobScheduled, streamq.JobRetrying:
		return []string{"run", "cancel"}
	case streamq.JobQueued, streamq.JobRunning:
		return []string{"cancel"}
	case streamq.JobDeadLettered:
		return []string{"requeue", "purge"}
	}
	return nil
}

// readJobs reads one page of the tab.
func (h *Handler) readJobs(ctx context.Context, a *streamq.Admin, q listQuery) (streamq.JobsPage, error) {
	if q.Tab.Name == completedTab {
		return h.readCompleted(ctx, a, q)
	}
	p, err := a.Jobs(ctx, streamq.JobsQuery{State: q.Tab.State, Limit: h.opts.PageSize, Cursor: q.Cursor, ID: q.ID, ErrorContains: q.Error})
	if err != nil && (errors.Is(err, streamq.ErrInvalidOptions) || errors.Is(err, streamq.ErrInvalidCursor)) {
		err = fmt.Errorf("%w: %w", errBadRequest, err)
	}
	return p, err
}

// queueRead is one consistent read of a queue page: the counts and the
// visible page of its tab, read in one request, so the cards and the table
// the page shows always come from the same moment (before, the cards
// refreshed and the table did not: after a Requeue a card said 1 dead letter
// and the table 0).
type queueRead struct {
	Stats   streamq.Stats
	Summary QueueSummary
	List    jobList
}

func (h *Handler) readQueue(ctx context.Context, q listQuery) (*streamq.Admin, queueRead, error) {
	var out queueRead
	a, err := h.admin(ctx, q.Queue, q.Group)
	if err != nil {
		return nil, out, err
	}
	// The page first, then the counts: a job that moves between the two
	// reads shows in the counts of the later one, and the next poll agrees.
	page, err := h.readJobs(ctx, a, q)
	if err != nil {
		return nil, out, err
	}
	s, err := a.Stats(ctx)
	if err != nil {
		return nil, out, err
	}
	if q.Group != "" && !slices.ContainsFunc(s.Groups, func(g streamq.GroupStats) bool { return g.Name == q.Group }) {
		return nil, out, fmt.Errorf("%w: queue %s has no consumer group %q", streamq.ErrNotFound, q.Queue, q.Group)
	}
	out.Stats, out.Summary = s, summarize(q.Queue, s)
	if q.Group != "" {
		for _, g := range s.Groups {
			if g.Name == q.Group {
				out.Summary.Tabs["dead"] = g.DeadLetters // the group's, which the tab lists
			}
		}
	}
	if page.Jobs == nil {
		page.Jobs = []streamq.JobSummary{}
	}
	// The caller sets List.CSRF: one token per response (a browser without
	// the cookie gets one cookie, and every form of the page its token).
	out.List = jobList{listQuery: q, Tabs: tabs, Page: page, ReadOnly: h.opts.ReadOnly, PageSize: h.opts.PageSize}
	return a, out, nil
}

// queueResponse is the body of GET api/queue: what one poll of a queue page
// refreshes, from one read.
type queueResponse struct {
	// Time is when it was read, Unix milliseconds.
	Time int64 `json:"time"`
	// Queue holds the counts of the cards.
	Queue QueueSummary `json:"queue"`
	// Tab is the tab listed; Page its jobs.
	Tab  string           `json:"tab"`
	Page streamq.JobsPage `json:"page"`
	// HTML is the tab's list as the page shows it (the table and its
	// pager), rendered by the same template as the page.
	HTML string `json:"html"`
	// Digest identifies HTML without its relative times: the page keeps
	// its list while the digest stays the same.
	Digest string `json:"digest"`
}

// relSpan matches a relative time of the list ("in 3m"), which changes
// every second while the list does not.
var relSpan = regexp.MustCompile(`<span class="rel"[^>]*>[^<]*</span>`)

// renderList renders a tab's list and its digest.
func (h *Handler) renderList(l jobList) (template.HTML, string, error) {
	var b strings.Builder
	if err := h.pages.ExecuteTemplate(&b, "jobs", l); err != nil {
		return "", "", err
	}
	sum := sha256.Sum256([]byte(relSpan.ReplaceAllString(b.String(), "")))
	return template.HTML(b.String()), hex.EncodeToString(sum[:12]), nil
}

func (h *Handler) apiQueue(w http.ResponseWriter, r *http.Request) {
	q, err := parseListQuery(r.URL.Query())
	if err != nil {
		h.fail(w, r, err)
		return
	}
	ctx, cancel := context.WithTimeout(r.Context(), h.opts.Timeout)
	defer cancel()
	_, read, err := h.readQueue(ctx, q)
	if err != nil {
		h.fail(w, r, err)
		return
	}
	if !h.opts.ReadOnly {
		read.List.CSRF = h.csrf.existing(r)
	}
	list, digest, err := h.renderList(read.List)
	if err != nil {
		h.fail(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, queueResponse{Time: time.Now().UnixMilli(), Queue: read.Summary, Tab: q.Tab.Name,
		Page: read.List.Page, HTML: string(list), Digest: digest})
}

// relTime says when t is from now: "in 3m", "2m ago".
func relTime(t time.Time) string {
	if t.IsZero() {
		return "-"
	}
	d := time.Until(t)
	if d >= 0 {
		return "in " + coarse(d)
	}
	return coarse(-d) + " ago"
}

// coarse shortens d to its two largest units: 42s, 3m 5s, 2h 10m, 3d 4h.
func coarse(d time.Duration) string {
	s := int64(d.Round(time.Second) / time.Second)
	switch {
	case s < 60:
		return fmt.Sprintf("%ds", s)
	case s < 3600:
		return two(s/60, "m", s%60, "s")
	case s < 86400:
		return two(s/3600, "h", s%3600/60, "m")
	default:
		return two(s/86400, "d", s%86400/3600, "h")
	}
}

func two(a int64, au string, b int64, bu string) string {
	if b == 0 {
		return fmt.Sprintf("%d%s", a, au)
	}
	return fmt.Sprintf("%d%s %d%s", a, au, b, bu)
}

// Back is the list's query, for the "back" field of its forms.
func (q listQuery) Back() string { return q.values(true).Encode() }

// Noun names the tab's jobs in a sentence.
func (q listQuery) Noun() string {
	switch q.Tab.State {
	case streamq.JobScheduled:
		return "scheduled jobs"
	case streamq.JobRetrying:
		return "retries waiting"
	case streamq.JobQueued:
		return "queued jobs"
	case streamq.JobRunning:
		return "running jobs"
	case streamq.JobSucceeded:
		return "completed jobs"
	}
	return "dead letters"
}

// readCompleted reads one page of the Completed tab (Admin.Completed) as a
// JobsPage: each job's State is its outcome and At when it completed. With
// an id searched, the one job when the list holds it (Admin.Job tells).
func (h *Handler) readCompleted(ctx context.Context, a *streamq.Admin, q listQuery) (streamq.JobsPage, error) {
	var out streamq.JobsPage
	if q.ID != "" {
		out.Total = -1
		j, err := a.Job(ctx, q.ID)
		switch {
		case errors.Is(err, streamq.ErrNotFound):
			return out, nil
		case errors.Is(err, streamq.ErrInvalidID):
			return out, fmt.Errorf("%w: %w", errBadRequest, err)
		case err != nil:
			return out, err
		}
		if !j.Finished.IsZero() {
			out.Jobs = []streamq.JobSummary{{ID: j.ID, State: j.State, Shard: j.Shard, At: j.Finished, LastError: j.Error}}
		}
		return out, nil
	}
	p, err := a.Completed(ctx, q.Cursor, h.opts.PageSize)
	if err != nil {
		if errors.Is(err, streamq.ErrInvalidOptions) || errors.Is(err, streamq.ErrInvalidCursor) {
			err = fmt.Errorf("%w: %w", errBadRequest, err)
		}
		return out, err
	}
	out.Total, out.Next = p.Total, p.Next
	for _, j := range p.Jobs {
		out.Jobs = append(out.Jobs, streamq.JobSummary{ID: j.ID, EntryID: j.EntryID, State: j.State, Shard: j.Shard, At: j.At})
	}
	return out, nil
}
