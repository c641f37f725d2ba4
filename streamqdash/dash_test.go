package streamqdash

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"html"
	"io"
	"log/slog"
	"net/http"
	"net/http/cookiejar"
	"net/http/httptest"
	"net/url"
	"regexp"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/streamq/streamq"
	"github.com/streamq/streamq/internal/redistest"
)

// fill makes queue "orders" on client: ok-1..ok-3 succeed, bad-1..bad-3 are
// dead-lettered ("card declined") by consumer "worker-1", which then stops.
func fill(t testing.TB, client *redis.Client) {
	t.Helper()
	ctx := context.Background()
	log := slog.New(slog.DiscardHandler)
	p, err := streamq.NewProducer[string, string](client, "orders", &streamq.ProducerOptions{Logger: log})
	require.NoError(t, err)
	defer p.Close()
	c, err := streamq.NewConsumer(client, "orders", func(ctx context.Context, m *streamq.Message[string]) (string, error) {
		if strings.HasPrefix(m.ID, "bad") {
			return "", streamq.Permanent(errors.New("card declined"))
		}
		return "receipt for " + m.Payload, nil
	}, &streamq.ConsumerOptions{Name: "worker-1", ReadBlock: 50 * time.Millisecond, Retention: &streamq.Retention{MaxCount: 1000}, Logger: log})
	require.NoError(t, err)
	runCtx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- c.Run(runCtx) }()
	for _, id := range []string{"ok-1", "bad-1", "ok-2", "bad-2", "ok-3", "bad-3"} {
		pr, err := p.Produce(ctx, id, "order "+id)
		require.NoError(t, err)
		wctx, wcancel := context.WithTimeout(ctx, 20*time.Second)
		_, err = pr.Wait(wctx)
		wcancel()
		if strings.HasPrefix(id, "bad") {
			require.ErrorIs(t, err, streamq.ErrDeadLettered)
		} else {
			require.NoError(t, err)
		}
	}
	cancel()
	require.NoError(t, <-done)
}

// browser is an HTTP client with cookies that does not follow redirects.
type browser struct {
	t    testing.TB
	c    *http.Client
	base string // the dashboard's URL, ending in "/"
}

func newBrowser(t testing.TB, base string) *browser {
	jar, err := cookiejar.New(nil)
	require.NoError(t, err)
	return &browser{t: t, base: base, c: &http.Client{Jar: jar, Timeout: 30 * time.Second,
		CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}}
}

func (b *browser) get(path string) (int, string, http.Header) {
	b.t.Helper()
	resp, err := b.c.Get(b.base + path)
	require.NoError(b.t, err)
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	require.NoError(b.t, err)
	return resp.StatusCode, string(body), resp.Header
}

func (b *browser) post(form url.Values, header http.Header) (int, string, http.Header) {
	b.t.Helper()
	req, err := http.NewRequest(http.MethodPost, b.base+"action", strings.NewReader(form.Encode()))
	require.NoError(b.t, err)
	req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	for k, v := range header {
		req.Header[k] = v
	}
	resp, err := b.c.Do(req)
	require.NoError(b.t, err)
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	require.NoError(b.t, err)
	return resp.StatusCode, string(body), resp.Header
}

var csrfField = regexp.MustCompile(`name="csrf" value="([^"]+)"`)

// token reads the form token from the queue page (setting the cookie).
func (b *browser) token(queue string) string {
	b.t.Helper()
	code, body, _ := b.get("queue?q=" + queue)
	require.Equal(b.t, http.StatusOK, code, body)
	m := csrfField.FindStringSubmatch(body)
	require.NotNil(b.t, m, "no form token on the queue page")
	return m[1]
}

// mount serves h under /ops/queues/ as a host would.
func mount(t testing.TB, h http.Handler) string {
	mux := http.NewServeMux()
	mux.Handle("/ops/queues/", http.StripPrefix("/ops/queues", h))
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	return srv.URL + "/ops/queues/"
}

func TestPages(t *testing.T) {
	srv := redistest.Start(t)
	client := srv.Client(t)
	fill(t, client)
	ctx := context.Background()
	p, err := streamq.NewProducer[string, string](client, "orders", &streamq.ProducerOptions{Logger: slog.New(slog.DiscardHandler)})
	require.NoError(t, err)
	defer p.Close()
	_, err = p.Produce(ctx, "later-1", "x", streamq.After(time.Hour))
	require.NoError(t, err)
	h, err := New(client, &Options{Logger: slog.New(slog.DiscardHandler)})
	require.NoError(t, err)
	base := mount(t, h)
	b := newBrowser(t, base)

	// Asked without the trailing slash (mounted with a pattern that has
	// none): a relative redirect to it, which the relative links need.
	rec := httptest.NewRecorder()
	req := httptest.NewRequest(http.MethodGet, "/ops/queues", nil)
	http.StripPrefix("/ops/queues", h).ServeHTTP(rec, req)
	require.Equal(t, http.StatusMovedPermanently, rec.Code)
	require.Equal(t, "./queues/", rec.Header().Get("Location"))

	code, body, hdr := b.get("")
	require.Equal(t, http.StatusOK, code)
	require.Contains(t, body, `<a href="queue?q=orders">orders</a>`)
	require.Contains(t, hdr.Get("Content-Security-Policy"), "default-src 'self'")

	admin, err := streamq.NewAdmin(client, "orders", nil)
	require.NoError(t, err)
	s, err := admin.Stats(ctx)
	require.NoError(t, err)
	code, body, _ = b.get("api/stats")
	require.Equal(t, http.StatusOK, code, body)
	var st statsResponse
	require.NoError(t, json.Unmarshal([]byte(body), &st))
	require.Equal(t, []QueueSummary{summarize("orders", s)}, st.Queues)
	require.EqualValues(t, 3, st.Queues[0].DeadLetters)
	require.EqualValues(t, 3, st.Queues[0].Succeeded)

	code, body, _ = b.get("queue?q=orders")
	require.Equal(t, http.StatusOK, code)
	require.Contains(t, body, `id="q-dead" data-f="dead_letters">3<`)
	require.Contains(t, body, "worker-1")
	require.Equal(t, 3, strings.Count(body, `data-dl="`), "the dead tab opens first")
	require.Equal(t, 3, strings.Count(body, `class="requeue"`))
	require.Contains(t, body, `id="sel-requeue"`, "a selection action")
	require.Contains(t, body, `<td class="payload"><span class="mono" title="&#34;order bad-1&#34;">&#34;order bad-1&#34;</span></td>`)
	for _, tab := range []string{"scheduled", "retrying", "queued", "running", "dead"} {
		code, body, _ = b.get("queue?q=orders&tab=" + tab)
		require.Equal(t, http.StatusOK, code, "%s: %s", tab, body)
		require.Contains(t, body, `id="tab-`+tab+`" class="active"`)
	}
	code, body, _ = b.get("queue?q=orders&tab=scheduled")
	require.Contains(t, body, `data-id="later-1"`)
	require.Contains(t, body, `class="run"`)
	code, _, _ = b.get("queue?q=orders&tab=nope")
	require.Equal(t, http.StatusBadRequest, code)

	dls, err := admin.DeadLetters(ctx, "", 10)
	require.NoError(t, err)
	code, body, _ = b.get("deadletter?q=orders&id=" + url.QueryEscape(dls[0].DeadLetterID))
	require.Equal(t, http.StatusOK, code, body)
	require.Contains(t, body, `<pre id="payload">&#34;order bad-1&#34;</pre>`)
	require.Contains(t, body, "card declined")
	code, _, _ = b.get("deadletter?q=orders&id=1-1")
	require.Equal(t, http.StatusNotFound, code)

	code, body, _ = b.get("job?q=orders&id=bad-1")
	require.Equal(t, http.StatusOK, code)
	require.Contains(t, body, `id="job-state">dead-lettered<`)
	code, body, _ = b.get("job?q=orders&id=later-1")
	require.Equal(t, http.StatusOK, code)
	require.Contains(t, body, `id="job-state">scheduled<`)
	require.Contains(t, body, "<th>Due</th>")
	require.EqualValues(t, 1, st.Queues[0].Scheduled)
	code, body, _ = b.get("job?q=orders&id=ok-1")
	require.Equal(t, http.StatusOK, code)
	require.Contains(t, body, "receipt for order ok-1")
	require.NotContains(t, body, `id="job-mode"`)
	// A debounced request shows its mode and the latest it runs.
	_, err = p.Produce(ctx, "debounced-1", "x", streamq.Debounce(time.Hour, 2*time.Hour))
	require.NoError(t, err)
	code, body, _ = b.get("job?q=orders&id=debounced-1")
	require.Equal(t, http.StatusOK, code)
	require.Contains(t, body, `id="job-mode">debounce: runs at the latest `)
	// A cancelled request has a page of its own (it was a 502).
	_, err = p.Produce(ctx, "later-2", "x", streamq.After(time.Hour))
	require.NoError(t, err)
	require.NoError(t, admin.Cancel(ctx, "later-2"))
	code, body, _ = b.get("job?q=orders&id=later-2")
	require.Equal(t, http.StatusOK, code, body)
	require.Contains(t, body, `id="job-state">canceled<`)
	require.Contains(t, body, "canceled by Admin.Cancel")
	// The queue's cards and the overview count it.
	code, body, _ = b.get("queue?q=orders")
	require.Equal(t, http.StatusOK, code)
	require.Contains(t, body, `id="q-canceled" data-f="canceled">1<`)
	code, body, _ = b.get("")
	require.Equal(t, http.StatusOK, code)
	require.Contains(t, body, `<td data-f="canceled">1</td>`)
	code, body, _ = b.get("api/stats?q=orders")
	require.Equal(t, http.StatusOK, code, body)
	st = statsResponse{}
	require.NoError(t, json.Unmarshal([]byte(body), &st))
	require.EqualValues(t, 1, st.Queues[0].Canceled)
	code, body, hdr = b.get("job?q=orders&id=never")
	require.Equal(t, http.StatusNotFound, code)
	require.Contains(t, body, `id="not-found"`)
	require.Equal(t, "text/html; charset=utf-8", hdr.Get("Content-Type"))
	code, body, _ = b.get("queue?q=ordrs")
	require.Equal(t, http.StatusNotFound, code)
	require.Contains(t, body, "not shown here")
	code, _, _ = b.get("api/stats?q=ordrs")
	require.Equal(t, http.StatusNotFound, code)

	code, body, hdr = b.get("static/app.js")
	require.Equal(t, http.StatusOK, code)
	require.Contains(t, hdr.Get("Content-Type"), "javascript")
	require.Contains(t, body, "api/stats")
	code, _, _ = b.get("static/layout.html")
	require.Equal(t, http.StatusNotFound, code, "templates are not served")
}

func TestActions(t *testing.T) {
	srv := redistest.Start(t)
	client := srv.Client(t)
	fill(t, client)
	ctx := context.Background()
	h, err := New(client, &Options{Logger: slog.New(slog.DiscardHandler)})
	require.NoError(t, err)
	b := newBrowser(t, mount(t, h))
	admin, err := streamq.NewAdmin(client, "orders", nil)
	require.NoError(t, err)
	dls, err := admin.DeadLetters(ctx, "", 10)
	require.NoError(t, err)
	require.Len(t, dls, 3)

	form := url.Values{"q": {"orders"}, "op": {"requeue"}, "id": {dls[0].DeadLetterID}}
	code, _, _ := b.post(form, nil)
	require.Equal(t, http.StatusForbidden, code, "no token")
	form.Set("csrf", b.token("orders"))
	code, _, _ = b.post(form, http.Header{"Sec-Fetch-Site": {"cross-site"}})
	require.Equal(t, http.StatusForbidden, code, "another origin")
	code, _, _ = b.post(form, http.Header{"Origin": {"https://evil.example"}})
	require.Equal(t, http.StatusForbidden, code, "another origin")
	other := newBrowser(t, b.base)
	other.token("orders") // a cookie of its own
	code, _, _ = other.post(form, nil)
	require.Equal(t, http.StatusForbidden, code, "a token bound to another cookie")
	s, err := admin.Stats(ctx)
	require.NoError(t, err)
	require.EqualValues(t, 3, s.DeadLetters, "nothing refused was done")

	code, _, hdr := b.post(form, http.Header{"Sec-Fetch-Site": {"same-origin"}})
	require.Equal(t, http.StatusSeeOther, code)
	require.Equal(t, "queue?done=requeue&q=orders", hdr.Get("Location"))
	j, err := admin.Job(ctx, "bad-1")
	require.NoError(t, err)
	require.Equal(t, streamq.JobQueued, j.State)
	_, body, _ := b.get(hdr.Get("Location"))
	require.Contains(t, body, "Requeued 1 dead letter.")
	require.Contains(t, body, `id="q-dead" data-f="dead_letters">2<`)
	code, _, hdr = b.post(form, nil) // sent again: gone already
	require.Equal(t, http.StatusSeeOther, code)
	require.Contains(t, hdr.Get("Location"), "done=")

	form = url.Values{"q": {"orders"}, "op": {"purge"}, "id": {dls[1].DeadLetterID}, "csrf": {form.Get("csrf")}}
	code, _, hdr = b.post(form, nil)
	require.Equal(t, http.StatusSeeOther, code)
	require.Contains(t, hdr.Get("Location"), "n=1")
	form.Set("op", "pause")
	form.Del("id")
	code, _, _ = b.post(form, nil)
	require.Equal(t, http.StatusSeeOther, code)
	s, err = admin.Stats(ctx)
	require.NoError(t, err)
	require.True(t, s.Paused)
	require.EqualValues(t, 1, s.DeadLetters)
	form.Set("op", "resume")
	code, _, _ = b.post(form, nil)
	require.Equal(t, http.StatusSeeOther, code)
	form.Set("op", "requeue-all")
	code, _, hdr = b.post(form, nil)
	require.Equal(t, http.StatusSeeOther, code)
	require.Contains(t, hdr.Get("Location"), "n=1")
	form.Set("op", "purge-all")
	code, _, _ = b.post(form, nil)
	require.Equal(t, http.StatusSeeOther, code)
	form.Set("id", "1-1")
	code, _, _ = b.post(form, nil)
	require.Equal(t, http.StatusBadRequest, code, "purge-all with an id")
	form.Del("id")
	form.Set("op", "explode")
	code, _, _ = b.post(form, nil)
	require.Equal(t, http.StatusBadRequest, code)
	s, err = admin.Stats(ctx)
	require.NoError(t, err)
	require.False(t, s.Paused)
	require.Zero(t, s.DeadLetters)
	require.EqualValues(t, 2, s.Length, "bad-1 and bad-3 requeued")

	// Fair queuing by key: the queue page lists the keys with the most
	// waiting jobs, finds one key, and pauses and resumes a key.
	kp, err := streamq.NewProducer[string, string](client, "orders", &streamq.ProducerOptions{Logger: slog.New(slog.DiscardHandler)})
	require.NoError(t, err)
	require.NoError(t, admin.PauseKey(ctx, "tenant-a"))
	for _, id := range []string{"ka-1", "ka-2"} {
		_, err = kp.Produce(ctx, id, "x", streamq.Key("tenant-a"))
		require.NoError(t, err)
	}
	_, err = kp.Produce(ctx, "kb-1", "x", streamq.Key("tenant-b"))
	require.NoError(t, err)
	require.NoError(t, kp.Close())
	_, body, _ = b.get("queue?q=orders")
	require.Contains(t, body, `<tr><td>tenant-a</td><td>2</td><td>0</td>`)
	require.Contains(t, body, `<tr><td>tenant-b</td><td>0</td><td>1</td>`)
	_, body, _ = b.get("queue?q=orders&key=tenant-b")
	require.NotContains(t, body, `<tr><td>tenant-a</td>`)
	code, _, _ = b.post(url.Values{"q": {"orders"}, "op": {"resume-key"}, "key": {"tenant-a"}, "csrf": {form.Get("csrf")}}, nil)
	require.Equal(t, http.StatusSeeOther, code)
	ks, err := admin.KeyStats(ctx, "tenant-a")
	require.NoError(t, err)
	require.Equal(t, streamq.KeyStat{Key: "tenant-a", Running: 2, Weight: 1}, ks, "resumed: its jobs entered the stream")
	code, _, _ = b.post(url.Values{"q": {"orders"}, "op": {"pause-key"}, "key": {"tenant-a"}, "csrf": {form.Get("csrf")}}, nil)
	require.Equal(t, http.StatusSeeOther, code)
	ks, err = admin.KeyStats(ctx, "tenant-a")
	require.NoError(t, err)
	require.True(t, ks.Paused)
	require.NoError(t, admin.ResumeKey(ctx, "tenant-a"))
	for _, id := range []string{"ka-1", "ka-2", "kb-1"} {
		require.NoError(t, admin.Forget(ctx, id, true))
	}

	// Cancel and run now, one or a selection; the way back keeps the tab.
	p, err := streamq.NewProducer[string, string](client, "orders", &streamq.ProducerOptions{Logger: slog.New(slog.DiscardHandler)})
	require.NoError(t, err)
	for _, id := range []string{"later-1", "later-2", "later-3"} {
		_, err = p.Produce(ctx, id, "x", streamq.After(time.Hour))
		require.NoError(t, err)
	}
	require.NoError(t, p.Close())
	token := form.Get("csrf")
	code, _, hdr = b.post(url.Values{"q": {"orders"}, "op": {"run"}, "id": {"later-1"}, "csrf": {token}, "back": {"tab=scheduled&q=elsewhere&cursor=x"}}, nil)
	require.Equal(t, http.StatusSeeOther, code)
	require.Equal(t, "queue?cursor=x&done=run&n=1&q=orders&tab=scheduled", hdr.Get("Location"), "back to the list, its queue the form's")
	j, err = admin.Job(ctx, "later-1")
	require.NoError(t, err)
	require.Equal(t, streamq.JobQueued, j.State, "run now")
	code, _, hdr = b.post(url.Values{"q": {"orders"}, "op": {"cancel"}, "id": {"later-2", "later-3", "never", "later-1"}, "csrf": {token}}, nil)
	require.Equal(t, http.StatusSeeOther, code)
	require.Equal(t, "queue?done=cancel&gone=1&n=3&q=orders", hdr.Get("Location"), "later-1, queued, is cancelled too")
	_, body, _ = b.get(hdr.Get("Location"))
	require.Contains(t, body, "Cancelled 3 job(s). 1 not found (gone meanwhile).")
	for _, id := range []string{"later-2", "later-3", "later-1"} {
		j, err = admin.Job(ctx, id)
		require.NoError(t, err)
		require.Equal(t, streamq.JobCanceled, j.State, id)
	}
	code, _, _ = b.post(url.Values{"q": {"orders"}, "op": {"cancel"}, "csrf": {token}}, nil)
	require.Equal(t, http.StatusBadRequest, code, "cancel without a selection")
	code, _, _ = b.post(url.Values{"q": {"orders"}, "op": {"cancel"}, "id": {"later-2"}, "csrf": {token}}, http.Header{"Origin": {"https://evil.example"}})
	require.Equal(t, http.StatusForbidden, code, "another origin")
	code, _, _ = b.post(url.Values{"q": {"orders"}, "op": {"run"}, "id": {"later-2"}}, nil)
	require.Equal(t, http.StatusForbidden, code, "no token")

	// Read-only: no buttons, no changes.
	ro, err := New(client, &Options{ReadOnly: true, Logger: slog.New(slog.DiscardHandler)})
	require.NoError(t, err)
	rb := newBrowser(t, mount(t, ro))
	code, body, _ = rb.get("queue?q=orders")
	require.Equal(t, http.StatusOK, code)
	require.NotContains(t, body, `method="post"`)
	require.NotContains(t, body, `name="csrf"`)
	require.NotContains(t, body, `type="checkbox"`)
	require.Contains(t, body, "read-only")
	code, _, _ = rb.post(url.Values{"q": {"orders"}, "op": {"pause"}}, nil)
	require.Equal(t, http.StatusForbidden, code)
	code, _, _ = rb.post(url.Values{"q": {"orders"}, "op": {"cancel"}, "id": {"later-1"}}, nil)
	require.Equal(t, http.StatusForbidden, code)
}

// TestAPIQueue: one GET api/queue returns the counts of the cards and the
// visible page of the tab from one read, so they agree: after a Requeue
// both say 2 dead letters. (The page used to refresh its cards only: right
// after a Requeue a card said 1 dead letter and the table 0.)
func TestAPIQueue(t *testing.T) {
	srv := redistest.Start(t)
	client := srv.Client(t)
	fill(t, client)
	ctx := context.Background()
	h, err := New(client, &Options{Logger: slog.New(slog.DiscardHandler)})
	require.NoError(t, err)
	b := newBrowser(t, mount(t, h))
	admin, err := streamq.NewAdmin(client, "orders", nil)
	require.NoError(t, err)
	read := func(query string) queueResponse {
		t.Helper()
		code, body, hdr := b.get("api/queue?" + query)
		require.Equal(t, http.StatusOK, code, body)
		require.Equal(t, "application/json", hdr.Get("Content-Type"))
		require.Empty(t, hdr.Values("Set-Cookie"), "api/queue sets no cookie (it would be scoped to api/)")
		var r queueResponse
		require.NoError(t, json.Unmarshal([]byte(body), &r))
		return r
	}
	r := read("q=orders")
	require.Equal(t, "dead", r.Tab)
	require.EqualValues(t, 3, r.Queue.DeadLetters)
	require.EqualValues(t, 3, r.Page.Total)
	require.Len(t, r.Page.Jobs, 3)
	require.Equal(t, 3, strings.Count(r.HTML, `data-dl="`))
	dls, err := admin.DeadLetters(ctx, "", 10)
	require.NoError(t, err)
	_, err = admin.Requeue(ctx, dls[0].DeadLetterID)
	require.NoError(t, err)
	r = read("q=orders&tab=dead")
	require.EqualValues(t, 2, r.Queue.DeadLetters)
	require.EqualValues(t, 2, r.Page.Total)
	require.Equal(t, 2, strings.Count(r.HTML, `data-dl="`))
	// The page and a poll of an unchanged list agree on its digest, so the
	// page keeps its rows.
	_, page, _ := b.get("queue?q=orders&tab=dead") // the page sets the cookie of its directory
	r = read("q=orders&tab=dead")
	require.Contains(t, page, `data-digest="`+r.Digest+`"`)
	// A first visit (no cookie yet) gets one cookie, and every form of the
	// page its token. (The list's forms had a token of a second cookie.)
	fresh := newBrowser(t, b.base)
	code, page, hdr := fresh.get("queue?q=orders")
	require.Equal(t, http.StatusOK, code)
	require.Len(t, hdr.Values("Set-Cookie"), 1)
	tokens := map[string]bool{}
	for _, m := range csrfField.FindAllStringSubmatch(page, -1) {
		tokens[m[1]] = true
	}
	require.Len(t, tokens, 1, "one token on the page")
	r = read("q=orders&tab=queued")
	require.EqualValues(t, 1, r.Queue.Length)
	require.Len(t, r.Page.Jobs, 1)
	require.Equal(t, "bad-1", r.Page.Jobs[0].ID)
	r = read("q=orders&tab=dead&id=bad-3")
	require.Len(t, r.Page.Jobs, 1)
	require.Equal(t, "bad-3", r.Page.Jobs[0].ID)
	r = read("q=orders&tab=dead&error=nothing+like+it")
	require.Empty(t, r.Page.Jobs)
	require.Contains(t, r.HTML, `id="no-jobs"`)
	code, body, _ := b.get("api/queue?q=orders&tab=nope")
	require.Equal(t, http.StatusBadRequest, code)
	require.Contains(t, body, `"error"`)
	code, body, _ = b.get("api/queue?q=orders&tab=dead&cursor=bogus")
	require.Equal(t, http.StatusBadRequest, code, "a cursor Admin.Jobs did not issue")
	require.Contains(t, body, "invalid cursor")
	code, _, _ = b.get("api/queue?q=ordrs")
	require.Equal(t, http.StatusNotFound, code)

	// The chart's history: the six outcomes of fill in the last minutes.
	code, body, _ = b.get("api/history?q=orders")
	require.Equal(t, http.StatusOK, code, body)
	var hist historyResponse
	require.NoError(t, json.Unmarshal([]byte(body), &hist))
	require.Len(t, hist.Points, 24*60)
	var processed, failed int64
	for _, p := range hist.Points {
		processed += p.Processed
		failed += p.Failed
	}
	require.EqualValues(t, 6, processed)
	require.EqualValues(t, 3, failed)
	code, body, _ = b.get("api/history")
	require.Equal(t, http.StatusOK, code, body)
	var all historyResponse
	require.NoError(t, json.Unmarshal([]byte(body), &all))
	require.Equal(t, hist.Points, all.Points, "one queue: the sum is its history")
}

func TestRelTime(t *testing.T) {
	for d, want := range map[time.Duration]string{
		0: "0s", 42 * time.Second: "42s", 3 * time.Minute: "3m", 3*time.Minute + 5*time.Second: "3m 5s",
		2*time.Hour + 10*time.Minute: "2h 10m", 75 * time.Hour: "3d 3h",
	} {
		require.Equal(t, want, coarse(d), "%v", d)
	}
	require.Equal(t, "-", relTime(time.Time{}))
	require.Regexp(t, `^in (59m 5\ds|59m|1h)$`, relTime(time.Now().Add(time.Hour)))
	require.Equal(t, "2m ago", relTime(time.Now().Add(-2*time.Minute)))
}

func TestOptions(t *testing.T) {
	client := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1"})
	defer client.Close()
	for _, o := range []*Options{
		{PageSize: 1001}, {PageSize: -1}, {PollInterval: time.Millisecond}, {Timeout: -1},
		{CSRFKey: []byte("short")}, {Queues: []string{""}},
	} {
		_, err := New(client, o)
		require.ErrorIs(t, err, ErrInvalidOptions, "%+v", o)
	}
	_, err := New(nil, nil)
	require.ErrorIs(t, err, ErrInvalidOptions)
	h, err := New(client, nil)
	require.NoError(t, err)
	require.Equal(t, DefaultPageSize, h.opts.PageSize)
	require.Equal(t, DefaultPollInterval, h.opts.PollInterval)
}

// TestManyDeadLetters: with 100,000 dead letters the pages stay fast: the
// queue page reads one page of its tab (Admin.Jobs from a cursor), forward
// and back. Times are logged; the bound asserted is generous.
// tripCounter counts round trips to Redis: a command, or a pipeline.
type tripCounter struct{ n *atomic.Int64 }

func (c tripCounter) DialHook(next redis.DialHook) redis.DialHook { return next }

func (c tripCounter) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		c.n.Add(1)
		return next(ctx, cmd)
	}
}

func (c tripCounter) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		c.n.Add(1)
		return next(ctx, cmds)
	}
}

func TestManyDeadLetters(t *testing.T) {
	if testing.Short() {
		t.Skip("writes 100,000 dead letters")
	}
	srv := redistest.Start(t)
	client := srv.Client(t)
	fill(t, client)
	ctx := context.Background()
	admin, err := streamq.NewAdmin(client, "orders", nil)
	require.NoError(t, err)
	ks, err := admin.Keys(ctx)
	require.NoError(t, err)
	const total = 100000
	for i := 0; i < total; i += 10000 {
		pipe := client.Pipeline()
		for j := i; j < i+10000; j++ {
			pipe.XAdd(ctx, &redis.XAddArgs{Stream: ks[0].DeadLetter, Values: []any{
				"id", fmt.Sprintf("job-%06d", j), "entry", "1-1", "p", `{"order":` + fmt.Sprint(j) + `}`,
				"error", "card declined", "consumer", "worker-1", "deliveries", "3", "at", fmt.Sprint(time.Now().UnixMilli()),
			}})
		}
		_, err := pipe.Exec(ctx)
		require.NoError(t, err)
	}
	h, err := New(client, &Options{Logger: slog.New(slog.DiscardHandler)})
	require.NoError(t, err)
	b := newBrowser(t, mount(t, h))

	var trips atomic.Int64
	client.AddHook(tripCounter{&trips})
	roundTrips := map[string]int64{}
	timed := func(path string) (time.Duration, string) {
		best := time.Hour
		var body string
		for range 5 {
			trips.Store(0)
			start := time.Now()
			code, b, _ := b.get(path)
			best = min(best, time.Since(start))
			roundTrips[path] = trips.Load()
			require.Equal(t, http.StatusOK, code, b)
			body = b
		}
		return best, body
	}
	first, body := timed("queue?q=orders")
	require.Contains(t, body, fmt.Sprintf(`data-f="dead_letters">%d<`, total+3))
	require.Equal(t, DefaultPageSize, strings.Count(body, `class="requeue"`))
	require.Contains(t, body, `data-id="job-099999"`, "newest first")
	nextLink := regexp.MustCompile(`href="(queue\?[^"]+)" id="next-page"`)
	next := nextLink.FindStringSubmatch(body)
	require.NotNil(t, next, "a next-page link")
	second, body2 := timed(html.UnescapeString(next[1]))
	require.Contains(t, body2, fmt.Sprintf(`data-id="job-%06d"`, total-1-DefaultPageSize), "the next page starts after the first")
	require.NotContains(t, body2, `data-id="job-099999"`)
	prev := regexp.MustCompile(`href="(queue\?[^"]+)" id="prev-page"`).FindStringSubmatch(body2)
	require.NotNil(t, prev, "a previous-page link")
	middle, body3 := timed(html.UnescapeString(prev[1]))
	require.Contains(t, body3, `data-id="job-099999"`, "back on the first page")
	apiQueue, _ := timed("api/queue?q=orders")
	overview, _ := timed("")
	api, _ := timed("api/stats")
	t.Logf("with %d dead letters, best of 5: queue page 1 %v, page 2 %v, back to page 1 %v, api/queue %v, overview %v, api/stats %v",
		total+3, first, second, middle, apiQueue, overview, api)
	t.Logf("round trips to Redis: queue page %d, api/queue (one poll) %d, api/stats %d",
		roundTrips["queue?q=orders"], roundTrips["api/queue?q=orders"], roundTrips["api/stats"])
	for _, d := range []time.Duration{first, second, middle, apiQueue, overview, api} {
		require.Less(t, d, 2*time.Second)
	}
}

// TestFanoutGroupDeadLetters: the queue page shows, and acts on, the dead
// letters of a fan-out group when asked for it (group=).
func TestFanoutGroupDeadLetters(t *testing.T) {
	srv := redistest.Start(t)
	client := srv.Client(t)
	ctx := context.Background()
	log := slog.New(slog.DiscardHandler)
	run := func(c *streamq.Consumer[string, string]) {
		rctx, cancel := context.WithCancel(ctx)
		done := make(chan error, 1)
		go func() { done <- c.Run(rctx) }()
		t.Cleanup(func() { cancel(); require.NoError(t, <-done) })
	}
	answering, err := streamq.NewConsumer(client, "events", func(ctx context.Context, m *streamq.Message[string]) (string, error) {
		return "ok", nil
	}, &streamq.ConsumerOptions{Name: "main-1", ReadBlock: 50 * time.Millisecond, Logger: log})
	require.NoError(t, err)
	audit, err := streamq.NewConsumer(client, "events", func(ctx context.Context, m *streamq.Message[string]) (string, error) {
		return "", streamq.Permanent(errors.New("audit store refused it"))
	}, &streamq.ConsumerOptions{Name: "audit-1", Group: "audit", Fanout: true, ReadBlock: 50 * time.Millisecond, Logger: log})
	require.NoError(t, err)
	run(answering)
	run(audit)
	p, err := streamq.NewProducer[string, string](client, "events", &streamq.ProducerOptions{Logger: log})
	require.NoError(t, err)
	defer p.Close()
	require.NoError(t, p.Enqueue(ctx, "e-1", "x"))
	require.NoError(t, p.Enqueue(ctx, "e-2", "y"))
	auditAdmin, err := streamq.NewAdmin(client, "events", &streamq.AdminOptions{Group: "audit"})
	require.NoError(t, err)
	require.Eventually(t, func() bool {
		dls, err := auditAdmin.DeadLetters(ctx, "", 10)
		return err == nil && len(dls) == 2
	}, 20*time.Second, 10*time.Millisecond)

	h, err := New(client, &Options{Logger: log})
	require.NoError(t, err)
	b := newBrowser(t, mount(t, h))
	code, body, _ := b.get("queue?q=events")
	require.Equal(t, http.StatusOK, code)
	require.Contains(t, body, `id="no-jobs"`, "the answering group has none")
	require.Contains(t, body, `<select name="group" id="group">`, "a group selector")
	require.Contains(t, body, `<option>audit</option>`)
	code, body, _ = b.get("queue?q=events&group=audit")
	require.Equal(t, http.StatusOK, code)
	require.Equal(t, 2, strings.Count(body, `data-dl="`))
	require.Contains(t, body, "audit store refused it")
	require.Contains(t, body, `<input type="hidden" name="group" value="audit">`)
	code, _, _ = b.get("queue?q=events&group=nope")
	require.Equal(t, http.StatusNotFound, code)

	dls, err := auditAdmin.DeadLetters(ctx, "", 10)
	require.NoError(t, err)
	token := csrfField.FindStringSubmatch(body)[1]
	code, _, hdr := b.post(url.Values{"q": {"events"}, "group": {"audit"}, "op": {"purge"}, "id": {dls[0].DeadLetterID}, "csrf": {token}}, nil)
	require.Equal(t, http.StatusSeeOther, code)
	require.Equal(t, "queue?done=purge&group=audit&n=1&q=events", hdr.Get("Location"))
	left, err := auditAdmin.DeadLetters(ctx, "", 10)
	require.NoError(t, err)
	require.Len(t, left, 1)
	require.Equal(t, dls[1].DeadLetterID, left[0].DeadLetterID)
}

// TestManyQueues: the overview reads the queues' stats several at once and
// lists them in order.
func TestManyQueues(t *testing.T) {
	srv := redistest.Start(t)
	client := srv.Client(t)
	ctx := context.Background()
	var want []string
	for i := range 20 {
		q := fmt.Sprintf("q%02d", i)
		want = append(want, q)
		p, err := streamq.NewProducer[string, string](client, q, &streamq.ProducerOptions{Logger: slog.New(slog.DiscardHandler)})
		require.NoError(t, err)
		for j := range i + 1 { // the first write records the queue
			require.NoError(t, p.Enqueue(ctx, fmt.Sprint(j), "x"))
		}
		require.NoError(t, p.Close())
	}
	h, err := New(client, &Options{Logger: slog.New(slog.DiscardHandler)})
	require.NoError(t, err)
	b := newBrowser(t, mount(t, h))
	code, body, _ := b.get("api/stats")
	require.Equal(t, http.StatusOK, code, body)
	var st statsResponse
	require.NoError(t, json.Unmarshal([]byte(body), &st))
	require.Len(t, st.Queues, 20)
	for i, q := range st.Queues {
		require.Equal(t, want[i], q.Name)
		require.EqualValues(t, i+1, q.Length)
		require.Empty(t, q.Error)
	}
}

// TestRequeueInFlight: a dead letter whose request id was produced again
// (here for later, with RetryFailed) is not requeued: "Requeue" says so, and
// "Requeue all" requeues the others and reports it skipped. Before, both
// appended a second entry for the id.
func TestRequeueInFlight(t *testing.T) {
	srv := redistest.Start(t)
	client := srv.Client(t)
	fill(t, client)
	ctx := context.Background()
	p, err := streamq.NewProducer[string, string](client, "orders", &streamq.ProducerOptions{Logger: slog.New(slog.DiscardHandler)})
	require.NoError(t, err)
	defer p.Close()
	_, err = p.Produce(ctx, "bad-2", "order bad-2 again", streamq.RetryFailed(), streamq.After(time.Hour))
	require.NoError(t, err)
	h, err := New(client, &Options{Logger: slog.New(slog.DiscardHandler)})
	require.NoError(t, err)
	b := newBrowser(t, mount(t, h))
	admin, err := streamq.NewAdmin(client, "orders", nil)
	require.NoError(t, err)
	dls, err := admin.DeadLetters(ctx, "", 10)
	require.NoError(t, err)
	require.Equal(t, "bad-2", dls[1].ID)

	form := url.Values{"q": {"orders"}, "op": {"requeue"}, "id": {dls[1].DeadLetterID}, "csrf": {b.token("orders")}}
	code, body, hdr := b.post(form, nil)
	require.Equal(t, http.StatusSeeOther, code, body)
	require.Zero(t, client.XLen(ctx, "streamq:{orders}:stream").Val(), "Requeue appended an entry for an id in flight")
	require.Contains(t, hdr.Get("Location"), "done=inflight")
	_, body, _ = b.get(hdr.Get("Location"))
	require.Contains(t, body, "not requeued: its request id is in flight again")

	form = url.Values{"q": {"orders"}, "op": {"requeue-all"}, "csrf": {form.Get("csrf")}}
	code, body, hdr = b.post(form, nil)
	require.Equal(t, http.StatusSeeOther, code, body)
	var ids []string
	msgs, err := client.XRange(ctx, "streamq:{orders}:stream", "-", "+").Result()
	require.NoError(t, err)
	for _, m := range msgs {
		ids = append(ids, m.Values["id"].(string))
	}
	require.Equal(t, []string{"bad-1", "bad-3"}, ids, "one entry each, none for bad-2")
	loc, err := url.Parse(hdr.Get("Location"))
	require.NoError(t, err)
	require.Equal(t, "2", loc.Query().Get("n"))
	require.Equal(t, "1", loc.Query().Get("skipped"))
	_, body, _ = b.get(hdr.Get("Location"))
	require.Contains(t, body, "Requeued 2 dead letters; 1 not requeued: its request id is in flight again")
	s, err := admin.Stats(ctx)
	require.NoError(t, err)
	require.EqualValues(t, 1, s.DeadLetters, "the skipped one stays")
	require.EqualValues(t, 1, s.Scheduled)
}

// TestPriorityLevelsShown: the queue page shows a card per priority level
// (entries and pending) under the counts only when the queue uses levels,
// api/queue carries the levels, and the queued tab lists the jobs of every
// level with a badge naming the level of those not normal.
func TestPriorityLevelsShown(t *testing.T) {
	srv := redistest.Start(t)
	client := srv.Client(t)
	ctx := context.Background()
	p, err := streamq.NewProducer[string, string](client, "rush", &streamq.ProducerOptions{Logger: slog.New(slog.DiscardHandler)})
	require.NoError(t, err)
	defer p.Close()
	require.NoError(t, p.Enqueue(ctx, "plain-1", "x"))
	h, err := New(client, &Options{Logger: slog.New(slog.DiscardHandler)})
	require.NoError(t, err)
	b := newBrowser(t, mount(t, h))

	code, body, _ := b.get("queue?q=rush&tab=queued")
	require.Equal(t, http.StatusOK, code, body)
	require.NotContains(t, body, `id="levels"`, "no level cards while only the default level is used")
	require.NotContains(t, body, `class="badge prio"`)

	for id, l := range map[string]streamq.PriorityLevel{"urgent-1": streamq.PriorityHigh, "urgent-2": streamq.PriorityHigh, "bulk-1": streamq.PriorityLow} {
		_, err := p.Produce(ctx, id, "x", streamq.Priority(l))
		require.NoError(t, err)
	}
	code, body, _ = b.get("queue?q=rush&tab=queued")
	require.Equal(t, http.StatusOK, code, body)
	require.Contains(t, body, `id="levels"`)
	for _, c := range []struct{ level, n string }{{"high", "2"}, {"normal", "1"}, {"low", "1"}} {
		card := regexp.MustCompile(`<div id="level-` + c.level + `"><span class="n" data-f="level_` + c.level + `">(\d+)</span>`).FindStringSubmatch(body)
		require.NotNil(t, card, "a card for level %s", c.level)
		require.Equal(t, c.n, card[1], "level %s entries", c.level)
	}
	require.Less(t, strings.Index(body, `id="level-high"`), strings.Index(body, `id="level-low"`), "highest first")
	rows := regexp.MustCompile(`(?s)<tr data-id="([^"]+)".*?</tr>`).FindAllStringSubmatch(body, -1)
	badges := map[string]string{}
	for _, r := range rows {
		badge := regexp.MustCompile(`data-priority="(\w+)"`).FindStringSubmatch(r[0])
		if badge != nil {
			badges[r[1]] = badge[1]
		} else {
			badges[r[1]] = ""
		}
	}
	require.Equal(t, map[string]string{"plain-1": "", "urgent-1": "high", "urgent-2": "high", "bulk-1": "low"}, badges)

	code, body, _ = b.get("api/queue?q=rush&tab=queued")
	require.Equal(t, http.StatusOK, code, body)
	var r queueResponse
	require.NoError(t, json.Unmarshal([]byte(body), &r))
	require.Equal(t, []streamq.LevelStats{{Priority: streamq.PriorityHigh, Length: 2}, {Priority: streamq.PriorityNormal, Length: 1}, {Priority: streamq.PriorityLow, Length: 1}}, r.Queue.Levels)
	require.EqualValues(t, 4, r.Page.Total)
	require.Len(t, r.Page.Jobs, 4)
}
