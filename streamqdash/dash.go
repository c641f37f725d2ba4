// Package streamqdash is a web dashboard for streamq queues: an http.Handler
// that a program mounts under any path, next to its own pages.
//
// It shows every queue with its backlog, pending entries, lag, dead letters,
// consumers and a chart of the jobs processed and failed per minute over the
// last 24 hours (Admin.History, kept in Redis); for one queue, a tab per job
// state (scheduled, retrying, queued, running, dead letters: Admin.Jobs,
// paged both ways, searchable by id, filtered by error) with run now and
// cancel, requeue and purge per row and for a selection, its consumer
// groups and consumers; and one request id's state. The cards and the open
// tab refresh together from one read. Everything it reads and changes goes
// through streamq.Admin.
//
// Mount it with http.StripPrefix:
//
//	dash, err := streamqdash.New(client, nil)
//	mux.Handle("/ops/queues/", http.StripPrefix("/ops/queues", dash))
//
// Its pages and assets (HTML, CSS and a small script, embedded in the binary)
// use relative links only, so any prefix works, also behind a proxy that
// strips one of its own.
//
// Security: the dashboard has no login of its own. Anyone who reaches it can
// read errors and, unless Options.ReadOnly, cancel, run, requeue and delete
// jobs and pause queues: treat access to it as access to Redis and
// put it behind the host's authentication middleware (see the example), and
// answer only the host names it is meant to be reached by (a page whose DNS
// name was rebound to the server's address is otherwise same-origin with it;
// cmd/streamq-web checks the Host header).
// Changes are POST requests only; they are refused from other origins (Fetch
// metadata and Origin headers, http.CrossOriginProtection) and when they do
// not carry a token bound to a cookie (see DESIGN.md).
//
// It is a module of its own (go get github.com/streamq/streamq/streamqdash);
// cmd/streamq-web serves it on its own. Cost: no goroutine, no state in Redis;
// each open page reads Admin.Stats of the queues it shows every PollInterval
// (2s), a queue page also one page of its open tab (Admin.Jobs, bounded
// whatever the queue's size). The module's README.md has the details.
package streamqdash

import (
	"context"
	"crypto/rand"
	"embed"
	"errors"
	"fmt"
	"html/template"
	"io/fs"
	"log/slog"
	"net/http"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/streamq/streamq"
)

//go:embed assets
var assets embed.FS

// Options configures a Handler. The zero value (or nil) uses the defaults.
type Options struct {
	// Queues lists the queues to show. Default nil: every queue found in
	// the Redis (streamq.Queues, a SCAN), looked up again at most every
	// DiscoverInterval.
	Queues []string
	// DiscoverInterval is how long a list of discovered queues is used
	// before SCAN runs again. Default 30s. Ignored when Queues is set.
	DiscoverInterval time.Duration
	// ReadOnly hides every button and refuses every change (POST) with 403.
	// Default false.
	ReadOnly bool
	// Timeout bounds the Redis work of one page or API request. Default 5s.
	Timeout time.Duration
	// ActionTimeout bounds "requeue all" and "purge all" of a searched list
	// (they work until done or until this has passed, and then say that
	// some remain) and an action on a selection of several jobs. Default
	// 30s.
	ActionTimeout time.Duration
	// PageSize is how many jobs one page of a tab shows. Default 50; at
	// most 1000.
	PageSize int
	// PollInterval is how often the pages refresh their counts and lists
	// (the chart every fifth time). Default 2s; at least 500ms.
	PollInterval time.Duration
	// StaleAfter is AdminOptions.StaleAfter: a consumer without a heartbeat
	// for this long counts as stale. Default streamq.DefaultStaleAfter.
	StaleAfter time.Duration
	// CSRFKey signs the tokens of forms. Default: 32 random bytes per New,
	// so a token is valid only for the process that issued it; give every
	// instance behind one load balancer the same key (at least 16 bytes).
	CSRFKey []byte
	// Logger receives errors of requests. Default slog.Default().
	Logger *slog.Logger
}

// Defaults of Options.
const (
	DefaultDiscoverInterval = 30 * time.Second
	DefaultTimeout          = 5 * time.Second
	DefaultActionTimeout    = 30 * time.Second
	DefaultPageSize         = 50
	DefaultPollInterval     = 2 * time.Second
)

// ErrInvalidOptions is returned by New for options out of range.
var ErrInvalidOptions = errors.New("streamqdash: invalid options")

// Handler serves the dashboard. It starts no goroutine and holds no
// connection of its own: each request reads Redis through the client under
// Options.Timeout. It is safe for concurrent use.
type Handler struct {
	client redis.UniversalClient
	opts   Options
	mux    *http.ServeMux
	pages  *template.Template
	csrf   csrf
	static http.Handler

	mu         sync.Mutex // guards discovered and at
	discovered []string
	at         time.Time
}

// New returns a dashboard reading queues through client. opts may be nil.
func New(client redis.UniversalClient, opts *Options) (*Handler, error) {
	if client == nil {
		return nil, fmt.Errorf("%w: client is nil", ErrInvalidOptions)
	}
	var o Options
	if opts != nil {
		o = *opts
	}
	dur := func(name string, v *time.Duration, def, least time.Duration) error {
		switch {
		case *v == 0:
			*v = def
		case *v < least:
			return fmt.Errorf("%w: %s is %v; it must be at least %v (0 for the default %v)", ErrInvalidOptions, name, *v, least, def)
		}
		return nil
	}
	for _, d := range []struct {
		name       string
		v          *time.Duration
		def, least time.Duration
	}{
		{"DiscoverInterval", &o.DiscoverInterval, DefaultDiscoverInterval, time.Millisecond},
		{"Timeout", &o.Timeout, DefaultTimeout, time.Millisecond},
		{"ActionTimeout", &o.ActionTimeout, DefaultActionTimeout, time.Millisecond},
		{"PollInterval", &o.PollInterval, DefaultPollInterval, 500 * time.Millisecond},
		{"StaleAfter", &o.StaleAfter, streamq.DefaultStaleAfter, time.Millisecond},
	} {
		if err := dur(d.name, d.v, d.def, d.least); err != nil {
			return nil, err
		}
	}
	switch {
	case o.PageSize == 0:
		o.PageSize = DefaultPageSize
	case o.PageSize < 1 || o.PageSize > 1000:
		return nil, fmt.Errorf("%w: PageSize is %d; it must be 1 to 1000 (0 for the default %d)", ErrInvalidOptions, o.PageSize, DefaultPageSize)
	}
	for _, q := range o.Queues {
		if _, err := streamq.NewAdmin(client, q, nil); err != nil {
			return nil, fmt.Errorf("%w: Queues: %v", ErrInvalidOptions, err)
		}
	}
	o.Queues = slices.Clone(o.Queues)
	switch {
	case o.CSRFKey == nil:
		o.CSRFKey = make([]byte, 32)
		_, _ = rand.Read(o.CSRFKey)
	case len(o.CSRFKey) < 16:
		return nil, fmt.Errorf("%w: CSRFKey has %d bytes; it needs at least 16 (nil for a random key)", ErrInvalidOptions, len(o.CSRFKey))
	default:
		o.CSRFKey = slices.Clone(o.CSRFKey)
	}
	if o.Logger == nil {
		o.Logger = slog.Default()
	}
	pages, err := template.New("").Funcs(funcs).ParseFS(assets, "assets/*.html")
	if err != nil {
		return nil, fmt.Errorf("streamqdash: templates: %w", err)
	}
	static, err := fs.Sub(assets, "assets")
	if err != nil {
		return nil, err
	}
	h := &Handler{client: client, opts: o, pages: pages, csrf: csrf{key: o.CSRFKey}}
	fileServer := http.FileServerFS(static)
	h.static = http.StripPrefix("/static", http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Cache-Control", "public, max-age=300")
		fileServer.ServeHTTP(w, r)
	}))
	mux := http.NewServeMux()
	mux.HandleFunc("GET /{$}", h.overview)
	mux.HandleFunc("GET /queue", h.queue)
	mux.HandleFunc("GET /job", h.job)
	mux.HandleFunc("GET /deadletter", h.deadLetter)
	mux.HandleFunc("GET /api/stats", h.apiStats)
	mux.HandleFunc("GET /api/queue", h.apiQueue)
	mux.HandleFunc("GET /api/history", h.apiHistory)
	mux.HandleFunc("POST /action", h.action)
	mux.HandleFunc("GET /static/app.js", h.static.ServeHTTP)
	mux.HandleFunc("GET /static/style.css", h.static.ServeHTTP)
	h.mux = mux
	return h, nil
}

// ServeHTTP serves the dashboard's pages under the path it was mounted at
// (strip that prefix first, with http.StripPrefix).
func (h *Handler) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	w.Header().Set("Content-Security-Policy", "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'; form-action 'self'; base-uri 'none'")
	w.Header().Set("X-Content-Type-Options", "nosniff")
	w.Header().Set("Referrer-Policy", "same-origin")
	if r.URL.Path == "" {
		// Mounted at "/ops" and asked for "/ops": the relative links need
		// the trailing slash.
		w.Header().Set("Location", lastSegment(r)+"/")
		w.WriteHeader(http.StatusMovedPermanently)
		return
	}
	h.mux.ServeHTTP(w, r)
}

// lastSegment returns the last segment of the path the client asked for
// (before any prefix was stripped), for a relative redirect to its "/".
func lastSegment(r *http.Request) string {
	p := r.URL.EscapedPath()
	if r.RequestURI != "" {
		p = r.RequestURI
		if i := indexAny(p, "?#"); i >= 0 {
			p = p[:i]
		}
	}
	for i := len(p) - 1; i >= 0; i-- {
		if p[i] == '/' {
			return "./" + p[i+1:]
		}
	}
	return "./" + p
}

func indexAny(s, chars string) int {
	for i := range len(s) {
		for j := range len(chars) {
			if s[i] == chars[j] {
				return i
			}
		}
	}
	return -1
}

// queues returns the queues to show.
func (h *Handler) queues(ctx context.Context) ([]string, error) {
	if h.opts.Queues != nil {
		return h.opts.Queues, nil
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.discovered != nil && time.Since(h.at) < h.opts.DiscoverInterval {
		return h.discovered, nil
	}
	qs, err := streamq.Queues(ctx, h.client)
	if err != nil {
		return nil, err
	}
	h.discovered, h.at = qs, time.Now()
	return qs, nil
}

// forgetQueues drops the discovered list, so that the next request scans
// again (after a queue was not found).
func (h *Handler) forgetQueues() {
	h.mu.Lock()
	h.discovered = nil
	h.mu.Unlock()
}

// admin returns an Admin of queue whose dead-letter operations address group
// ("" for the answering group); the name must be one the dashboard shows.
func (h *Handler) admin(ctx context.Context, queue, group string) (*streamq.Admin, error) {
	qs, err := h.queues(ctx)
	if err != nil {
		return nil, err
	}
	if !slices.Contains(qs, queue) {
		if h.opts.Queues == nil {
			h.forgetQueues()
			if qs, err = h.queues(ctx); err != nil {
				return nil, err
			}
		}
		if !slices.Contains(qs, queue) {
			return nil, fmt.Errorf("%w: queue %q is not shown here", streamq.ErrNotFound, queue)
		}
	}
	a, err := streamq.NewAdmin(h.client, queue, &streamq.AdminOptions{Group: group, StaleAfter: h.opts.StaleAfter})
	if err != nil {
		return nil, fmt.Errorf("%w: %v", errBadRequest, err)
	}
	return a, nil
}

// fail writes an error page (or JSON for the API) with a status from err.
func (h *Handler) fail(w http.ResponseWriter, r *http.Request, err error) {
	status := http.StatusBadGateway
	switch {
	case errors.Is(err, streamq.ErrInvalidDeadLetterID), errors.Is(err, streamq.ErrInvalidID):
		status = http.StatusBadRequest
	case errors.Is(err, streamq.ErrNotFound):
		status = http.StatusNotFound
	case errors.Is(err, errBadRequest), errors.Is(err, streamq.ErrInvalidOptions):
		status = http.StatusBadRequest
	case errors.Is(err, context.DeadlineExceeded):
		status = http.StatusGatewayTimeout
	}
	if status >= 500 {
		h.opts.Logger.Error("streamqdash: request failed", "path", r.URL.Path, "err", err)
	}
	if strings.HasPrefix(r.URL.Path, "/api/") {
		writeJSON(w, status, map[string]string{"error": err.Error()})
		return
	}
	w.Header().Set("Content-Type", "text/html; charset=utf-8")
	w.WriteHeader(status)
	_ = h.pages.ExecuteTemplate(w, "error.html", map[string]any{
		"Title": http.StatusText(status), "Status": status, "Error": err.Error(), "Poll": 0,
	})
}

var errBadRequest = errors.New("bad request")
