package streamqdash

import (
	"bytes"
	"context"
	"errors"
	"flag"
	"fmt"
	"image/png"
	"log/slog"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/chromedp/cdproto/cdp"
	cdplog "github.com/chromedp/cdproto/log"
	cdppage "github.com/chromedp/cdproto/page"
	"github.com/chromedp/cdproto/runtime"
	"github.com/chromedp/chromedp"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/streamq/streamq"
	"github.com/streamq/streamq/internal/redistest"
)

var update = flag.Bool("update", false, "rewrite the screenshots under ../docs/images with the browser tests' ones")

// chromiumPath finds a Chromium on PATH. Without one the test fails when CI
// is set and is skipped otherwise.
func chromiumPath(t *testing.T) string {
	for _, name := range []string{"chromium", "chromium-browser", "headless_shell", "google-chrome"} {
		if p, err := exec.LookPath(name); err == nil {
			return p
		}
	}
	const hint = "install it with 'make chromium' (apt-get install chromium)"
	if os.Getenv("CI") != "" {
		t.Fatalf("no chromium on PATH (CI is set, so this is an error): %s", hint)
	}
	t.Skipf("no chromium on PATH, skipping the browser test: %s", hint)
	return ""
}

// consoleErrors collects what the page reports as errors: console.error,
// uncaught exceptions, and log entries of level error (failed loads, CSP
// violations).
type consoleErrors struct {
	mu   sync.Mutex
	msgs []string
}

func (c *consoleErrors) add(format string, args ...any) {
	c.mu.Lock()
	c.msgs = append(c.msgs, fmt.Sprintf(format, args...))
	c.mu.Unlock()
}

func (c *consoleErrors) list() []string {
	c.mu.Lock()
	defer c.mu.Unlock()
	return append([]string(nil), c.msgs...)
}

// chrome is one headless Chromium tab with the helpers the tests use.
type chrome struct {
	t    *testing.T
	ctx  context.Context // the browser's: no time limit of its own
	errs *consoleErrors
}

// newChrome starts a headless Chromium (closed at the end of the test) that
// accepts every confirm() dialog and collects the page's errors.
func newChrome(t *testing.T) *chrome {
	path := chromiumPath(t)
	opts := append(chromedp.DefaultExecAllocatorOptions[:],
		chromedp.ExecPath(path), chromedp.DisableGPU, chromedp.WindowSize(1400, 1000),
		chromedp.Flag("no-first-run", true), chromedp.Flag("disable-dev-shm-usage", true))
	if os.Geteuid() == 0 {
		opts = append(opts, chromedp.NoSandbox)
	}
	allocCtx, cancelAlloc := chromedp.NewExecAllocator(context.Background(), opts...)
	t.Cleanup(cancelAlloc)
	c := &chrome{t: t, errs: &consoleErrors{}}
	var bctx context.Context
	var cancelBrowser context.CancelFunc
	bctx, cancelBrowser = chromedp.NewContext(allocCtx, chromedp.WithListener(func(ev any) {
		switch ev := ev.(type) {
		case *cdppage.EventJavascriptDialogOpening:
			// The confirm() of a destructive button: accept it (from
			// another goroutine: the listener must not block).
			go func() {
				_, _ = chromedp.Call(bctx, cdppage.HandleJavaScriptDialog, cdppage.HandleJavaScriptDialogParams{Accept: true})
			}()
		case *runtime.EventConsoleAPICalled:
			if ev.Type == runtime.ConsoleAPICalledTypeError || ev.Type == runtime.ConsoleAPICalledTypeAssert {
				var parts []string
				for _, a := range ev.Args {
					parts = append(parts, string(a.Value))
				}
				c.errs.add("console.%s: %s", ev.Type, strings.Join(parts, " "))
			}
		case *runtime.EventExceptionThrown:
			d := ev.ExceptionDetails
			desc := ""
			if d.Exception != nil {
				desc = d.Exception.Description
			}
			c.errs.add("exception: %s %s (%s:%d)", d.Text, desc, d.URL, d.LineNumber)
		case *cdplog.EventEntryAdded:
			if ev.Entry.Level == cdplog.EntryLevelError {
				c.errs.add("log %s: %s (%s)", ev.Entry.Source, ev.Entry.Text, ev.Entry.URL)
			}
		}
	}))
	t.Cleanup(cancelBrowser)
	c.ctx = bctx
	// The first call starts the browser, which lives as long as the context
	// of that call: bctx, not one with a time limit.
	_, err := chromedp.Call(bctx, cdplog.Enable, cdp.Empty{}) // log entries: failed loads, CSP violations
	require.NoError(t, err, "start the browser")
	// The page's viewport: 1400x1000 CSS pixels, whatever the window's
	// frame takes (the fold the pages are checked against).
	require.NoError(t, chromedp.Do(bctx, chromedp.EmulateViewport(1400, 1000)), "set the viewport")
	return c
}

// step runs actions with a time limit of their own.
func (c *chrome) step(what string, timeout time.Duration, actions ...chromedp.Action[chromedp.Void]) {
	c.t.Helper()
	sctx, cancel := context.WithTimeout(c.ctx, timeout)
	defer cancel()
	require.NoError(c.t, chromedp.Do(sctx, actions...), what)
}

// text returns the text of the element with this id.
func (c *chrome) text(id string) string {
	c.t.Helper()
	sctx, cancel := context.WithTimeout(c.ctx, 15*time.Second)
	defer cancel()
	v, err := chromedp.Run(sctx, chromedp.Text(chromedp.ID(id)))
	require.NoError(c.t, err, "text of #%s", id)
	return v
}

// eval returns the value of a JavaScript expression.
func (c *chrome) eval(expr string) string {
	c.t.Helper()
	sctx, cancel := context.WithTimeout(c.ctx, 15*time.Second)
	defer cancel()
	v, err := chromedp.Run(sctx, chromedp.Evaluate[any](expr))
	require.NoError(c.t, err, "evaluate %s", expr)
	return fmt.Sprint(v)
}

// until waits until a JavaScript expression is true. It evaluates it every
// 50ms and takes an error for "not yet": a click may start a navigation
// that destroys the page the expression ran in.
func until(expr string) chromedp.Action[chromedp.Void] {
	check := chromedp.Evaluate[bool](expr)
	return func(ctx context.Context, t *chromedp.Target) (chromedp.Void, error) {
		tick := time.NewTicker(50 * time.Millisecond)
		defer tick.Stop()
		var last error
		for {
			ok, err := check(ctx, t)
			if err == nil && ok {
				return chromedp.Void{}, nil
			}
			if err != nil {
				last = err
			}
			select {
			case <-ctx.Done():
				return chromedp.Void{}, fmt.Errorf("waiting for %s: %w (last error: %v)", expr, ctx.Err(), last)
			case <-tick.C:
			}
		}
	}
}

// screenshot takes a PNG of the whole page; with -update it is written to
// ../docs/images/name (the READMEs show it), else to a temporary directory.
func (c *chrome) screenshot(name string) {
	c.t.Helper()
	sctx, cancel := context.WithTimeout(c.ctx, 30*time.Second)
	defer cancel()
	shot, err := chromedp.Run(sctx, chromedp.FullScreenshot(100))
	require.NoError(c.t, err, "screenshot")
	_, err = png.Decode(bytes.NewReader(shot))
	require.NoError(c.t, err, "a PNG")
	out := filepath.Join(c.t.TempDir(), name)
	if *update {
		out = filepath.Join("..", "docs", "images", name)
		require.NoError(c.t, os.MkdirAll(filepath.Dir(out), 0o755))
	}
	require.NoError(c.t, os.WriteFile(out, shot, 0o644))
	c.t.Logf("screenshot (%d bytes) in %s", len(shot), out)
}

// noErrors checks that the pages logged no error.
func (c *chrome) noErrors() {
	c.t.Helper()
	require.Empty(c.t, c.errs.list(), "the pages logged errors")
}

// rows counts the rows of the list on the page.
const rows = `document.querySelectorAll("#list tbody tr").length`

// longID is a request id far wider than its column.
const longID = "invoice-2026-12-02-customer-8f3a9c1e-7b2d-4e5f-9a6b-0c1d2e3f4a5b"

// states is queue "orders" with jobs in every state, made by seedStates.
type states struct {
	release func() // lets the running handlers return
}

// seedStates adds to fill's queue "orders" (3 dead letters): scheduled jobs
// (sched-1..3 due in 1, 2 and 3 hours, and longID), retries waiting for an
// hour-long back-off (flaky-1, flaky-2: "payment gateway timeout"), two
// running jobs (slow-1, slow-2, in the handlers of consumer "worker-slow",
// which holds no more) and three queued ones behind them (queued-1..3).
func seedStates(t *testing.T, client *redis.Client) states {
	t.Helper()
	ctx := context.Background()
	log := slog.New(slog.DiscardHandler)
	admin, err := streamq.NewAdmin(client, "orders", nil)
	require.NoError(t, err)
	p, err := streamq.NewProducer[string, string](client, "orders", &streamq.ProducerOptions{Logger: log})
	require.NoError(t, err)
	defer p.Close()
	for i, id := range []string{"sched-1", "sched-2", "sched-3", longID} {
		_, err := p.Produce(ctx, id, "order "+id, streamq.After(time.Duration(i+1)*time.Hour))
		require.NoError(t, err)
	}

	waitState := func(id string, want streamq.JobState) {
		t.Helper()
		require.Eventually(t, func() bool {
			j, err := admin.Job(ctx, id)
			return err == nil && j.State == want
		}, 20*time.Second, 10*time.Millisecond, "%s never %s", id, want)
	}
	run := func(c *streamq.Consumer[string, string]) func() {
		rctx, cancel := context.WithCancel(ctx)
		done := make(chan error, 1)
		go func() { done <- c.Run(rctx) }()
		var once sync.Once
		stop := func() { once.Do(func() { cancel(); require.NoError(t, <-done) }) }
		t.Cleanup(stop)
		return stop
	}

	// Retries: the handler fails, the back-off is an hour.
	flaky, err := streamq.NewConsumer(client, "orders", func(ctx context.Context, m *streamq.Message[string]) (string, error) {
		return "", errors.New("payment gateway timeout")
	}, &streamq.ConsumerOptions{Name: "worker-r", ReadBlock: 50 * time.Millisecond, RetryBackoff: time.Hour, RetryBackoffMax: time.Hour, Logger: log})
	require.NoError(t, err)
	stopFlaky := run(flaky)
	for _, id := range []string{"flaky-1", "flaky-2"} {
		require.NoError(t, p.Enqueue(ctx, id, "order "+id))
		waitState(id, streamq.JobRetrying)
	}
	stopFlaky()

	// Running: one worker, a ring of two, both in handlers that wait.
	release := make(chan struct{})
	slow, err := streamq.NewConsumer(client, "orders", func(ctx context.Context, m *streamq.Message[string]) (string, error) {
		select {
		case <-release:
		case <-ctx.Done():
		}
		return "done " + m.Payload, nil
	}, &streamq.ConsumerOptions{Name: "worker-slow", Workers: 2, Prefetch: 2, ReadBlock: 50 * time.Millisecond, Logger: log})
	require.NoError(t, err)
	stopSlow := run(slow)
	for _, id := range []string{"slow-1", "slow-2"} {
		require.NoError(t, p.Enqueue(ctx, id, "order "+id))
		waitState(id, streamq.JobRunning)
	}
	for _, id := range []string{"queued-1", "queued-2", "queued-3"} {
		require.NoError(t, p.Enqueue(ctx, id, "order "+id))
	}
	var once sync.Once
	return states{release: func() {
		once.Do(func() { close(release); stopSlow() })
	}}
}

// TestBrowserTabs opens each tab of the queue page in a headless Chromium:
// each lists the jobs seedStates left in that state, with relative and
// absolute times, ids that do not wrap, and (on scheduled, retrying and
// dead) a checkbox and buttons per row. It takes one screenshot per tab
// (docs/images/dashboard-<tab>.png, and docs/images/dashboard.png of the default tab) and
// checks that the chart has its axes and labels.
func TestBrowserTabs(t *testing.T) {
	c := newChrome(t)
	srv := redistest.Start(t)
	client := srv.Client(t)
	fill(t, client)
	began := time.Now()
	st := seedStates(t, client)
	defer st.release()
	t.Logf("seeded in %v", time.Since(began).Round(time.Millisecond))
	h, err := New(client, &Options{PollInterval: 500 * time.Millisecond, Logger: slog.New(slog.DiscardHandler)})
	require.NoError(t, err)
	base := mount(t, h)

	for _, tc := range []struct {
		tab     string
		ids     []string // request ids listed, in order
		action  string   // the class of a button of each row ("" for none)
		buttons int      // buttons per row
		when    int      // cells with a relative time per row
	}{
		{"scheduled", []string{"sched-1", "sched-2", "sched-3", longID}, "run", 2, 2},
		{"retrying", []string{"flaky-1", "flaky-2"}, "cancel", 2, 1},
		{"queued", []string{"queued-1", "queued-2", "queued-3"}, "cancel", 1, 1},
		{"running", []string{"slow-1", "slow-2"}, "cancel", 1, 0},
		{"dead", []string{"bad-3", "bad-2", "bad-1"}, "requeue", 2, 1},
		{"completed", []string{"bad-3", "ok-3", "bad-2", "ok-2", "bad-1", "ok-1"}, "", 0, 1},
	} {
		c.step("open the "+tc.tab+" tab", 15*time.Second,
			chromedp.Navigate(base+"queue?q=orders&tab="+tc.tab),
			chromedp.WaitVisible(chromedp.ID("list")),
			until(rows+` === `+strconv.Itoa(len(tc.ids))))
		got := c.eval(`Array.from(document.querySelectorAll("#list tbody tr")).map(function (r) { return r.getAttribute("data-id"); }).join(",")`)
		if tc.tab == "retrying" { // soonest first, and back-offs have jitter
			ids := strings.Split(got, ",")
			slices.Sort(ids)
			got = strings.Join(ids, ",")
		}
		require.Equal(t, strings.Join(tc.ids, ","), got, "tab %s", tc.tab)
		require.Equal(t, "true", c.eval(`document.getElementById("tab-`+tc.tab+`").classList.contains("active")`))
		// Every tab says how many jobs it lists (from the Stats read of the cards).
		for _, other := range []struct {
			tab string
			n   int
		}{{"scheduled", 4}, {"retrying", 2}, {"queued", 3}, {"running", 2}, {"dead", 3}, {"completed", 6}} {
			require.Equal(t, strconv.Itoa(other.n), c.text("count-"+other.tab), "the count on tab %s", other.tab)
		}
		// At 1400x1000 the list starts above the fold, its first rows in view
		// (the chart and the cards do not push it down).
		inView := min(len(tc.ids), 3)
		require.Equal(t, "true", c.eval(`(function () {
			var r = document.querySelectorAll("#list tbody tr")[`+strconv.Itoa(inView-1)+`].getBoundingClientRect();
			return window.innerWidth === 1400 && window.innerHeight === 1000 && r.bottom <= window.innerHeight;
		})()`), "tab %s: its first %d rows are above the fold at 1400x1000 (list at %s px)", tc.tab, inView,
			c.eval(`[window.innerWidth, window.innerHeight, document.getElementById("list").getBoundingClientRect().top, document.querySelectorAll("#list tbody tr")[`+strconv.Itoa(inView-1)+`].getBoundingClientRect().bottom, document.getElementById("chart").getBoundingClientRect().top, document.getElementById("chart").getBoundingClientRect().height].join(" ")`))
		buttons := c.eval(`document.querySelectorAll("#list tbody button").length`)
		boxes := c.eval(`document.querySelectorAll("#list tbody input[type=checkbox]").length`)
		if tc.action != "" {
			require.Equal(t, strconv.Itoa(tc.buttons*len(tc.ids)), buttons, "%d buttons per row on %s", tc.buttons, tc.tab)
			require.Equal(t, strconv.Itoa(len(tc.ids)), boxes, "a checkbox per row on %s", tc.tab)
			require.Equal(t, strconv.Itoa(len(tc.ids)), c.eval(`document.querySelectorAll("#list tbody button.`+tc.action+`").length`))
		} else {
			require.Equal(t, "0", buttons, "no actions on %s", tc.tab)
			require.Equal(t, "0", boxes)
		}
		// Times: relative ("in 1h", "3s ago") with the absolute UTC time
		// under it and in the title.
		require.Equal(t, strconv.Itoa(tc.when*len(tc.ids)), c.eval(`Array.from(document.querySelectorAll("#list td.when")).filter(function (td) {
			return /^(in \d+[smhd]|\d+[smhd]( \d+[smh])? ago)/.test(td.textContent) && / UTC$/.test(td.title) && / UTC$/.test(td.querySelector("small").textContent);
		}).length`), "times on %s", tc.tab)
		// The list refreshes in place from api/queue.
		before := c.eval(`document.getElementById("jobs").getAttribute("data-time")`)
		c.step("the "+tc.tab+" list refreshes", 15*time.Second,
			until(`(document.getElementById("jobs").getAttribute("data-time") || "") !== "`+before+`" && document.getElementById("jobs").getAttribute("data-time") !== null`))
		require.Equal(t, strconv.Itoa(len(tc.ids)), c.eval(rows), "after a refresh")
		if tc.tab == "scheduled" {
			// The long id does not wrap: one line, cut with an ellipsis, whole
			// in its title.
			cell := `document.querySelector('#list tr[data-id="` + longID + `"] a.id')`
			require.Equal(t, "1", c.eval(cell+`.getClientRects().length`), "the id is on one line")
			require.Equal(t, "true", c.eval(cell+`.scrollWidth > `+cell+`.clientWidth`), "cut, not wrapped")
			require.Equal(t, longID, c.eval(cell+`.title`))
			require.Equal(t, "true", c.eval(`document.querySelector('#list tr[data-id="`+longID+`"]').getBoundingClientRect().height < 60`), "the row is not stretched by the id")
		}
		c.step("the chart is drawn", 15*time.Second, until(`+document.getElementById("chart").getAttribute("data-points") > 0`))
		if tc.tab == "scheduled" {
			// The chart: 24 hours, a time axis with a label every 3 hours, a
			// unit, the count scale.
			labels := c.eval(`Array.from(document.querySelectorAll("#chart text.xlabel")).map(function (t) { return t.textContent; }).join(",")`)
			require.Regexp(t, `^(\d\d:00,){7,8}\d\d:00$`, labels, "a label every 3 hours over 24 hours")
			require.Equal(t, "5", c.eval(`document.querySelectorAll("#chart text.ylabel").length`))
			require.Contains(t, c.eval(`document.getElementById("chart").textContent`), "jobs / minute")
			require.Contains(t, c.eval(`document.getElementById("chart").textContent`), "time (UTC)")
			require.Equal(t, "1440", c.eval(`document.getElementById("chart").getAttribute("data-points")`), "one point per minute for 24 hours")
			require.Equal(t, "8", c.eval(`document.getElementById("hist-processed").textContent`), "3 succeeded, 3 dead-lettered, 2 retries")
			require.Equal(t, "5", c.eval(`document.getElementById("hist-failed").textContent`), "3 dead-lettered, 2 retries")
			// The last hour, labelled every 10 minutes; the choice is kept
			// for the next pages.
			c.step("show the last hour", 15*time.Second, chromedp.Click(chromedp.CSS(`#spans button[data-span="60"]`)),
				until(`document.getElementById("chart").getAttribute("data-points") === "60"`))
			labels = c.eval(`Array.from(document.querySelectorAll("#chart text.xlabel")).map(function (t) { return t.textContent; }).join(",")`)
			require.Regexp(t, `^(\d\d:\d0,){5,6}\d\d:\d0$`, labels, "a label every 10 minutes over an hour")
		} else {
			require.Equal(t, "60", c.eval(`document.getElementById("chart").getAttribute("data-points")`), "the span chosen on the first tab")
		}
		c.screenshot("dashboard-" + tc.tab + ".png")
		t.Logf("tab %s checked after %v", tc.tab, time.Since(began).Round(time.Millisecond))
		if tc.tab == defaultTab {
			c.screenshot("dashboard.png")
		}
	}

	// The job page of a completed job (its result, when it finished) and of
	// a scheduled one (its payload, indented when JSON; when it is due).
	c.step("open a completed job", 15*time.Second, chromedp.Navigate(base+"job?q=orders&id=ok-2"), chromedp.WaitVisible(chromedp.ID("job-state")))
	require.Equal(t, "succeeded", c.text("job-state"))
	require.Equal(t, `"receipt for order ok-2"`, c.text("job-result"))
	require.Regexp(t, `^\d+s ago`, c.text("job-finished"))
	c.step("open a scheduled job", 15*time.Second, chromedp.Navigate(base+"job?q=orders&id=sched-2"), chromedp.WaitVisible(chromedp.ID("job-payload")))
	require.Equal(t, "scheduled", c.text("job-state"))
	require.Equal(t, `"order sched-2"`, c.text("job-payload"))
	require.Regexp(t, `^in (1h 59m|2h)`, c.text("job-due"))
	c.step("open a retrying job", 15*time.Second, chromedp.Navigate(base+"job?q=orders&id=flaky-1"), chromedp.WaitVisible(chromedp.ID("job-payload")))
	require.Equal(t, "retrying", c.text("job-state"))
	require.Equal(t, "payment gateway timeout", c.text("job-error"))
	require.Equal(t, "1", c.text("job-starts"))
	c.screenshot("dashboard-job.png")
	c.step("its tab", 15*time.Second, chromedp.Click(chromedp.ID("job-tab")), until(`location.search.indexOf("tab=retrying") > 0 && `+rows+` === 1`))

	// Paging both ways: a page of 2 on the scheduled tab.
	small, err := New(client, &Options{PageSize: 2, PollInterval: 500 * time.Millisecond, Logger: slog.New(slog.DiscardHandler)})
	require.NoError(t, err)
	sbase := mount(t, small)
	c.step("first page", 15*time.Second, chromedp.Navigate(sbase+"queue?q=orders&tab=scheduled"), until(rows+` === 2`))
	require.Equal(t, "false", c.eval(`!!document.getElementById("prev-page")`))
	c.step("next page", 15*time.Second, chromedp.Click(chromedp.ID("next-page")),
		until(`location.search.indexOf("cursor=") > 0 && `+rows+` === 2`))
	require.Equal(t, "sched-3,"+longID, c.eval(`Array.from(document.querySelectorAll("#list tbody tr")).map(function (r) { return r.getAttribute("data-id"); }).join(",")`))
	require.Equal(t, "false", c.eval(`!!document.getElementById("next-page")`), "the last page")
	c.step("previous page", 15*time.Second, chromedp.Click(chromedp.ID("prev-page")),
		until(`!!document.querySelector('#list tr[data-id="sched-1"]')`))
	require.Equal(t, "sched-1,sched-2", c.eval(`Array.from(document.querySelectorAll("#list tbody tr")).map(function (r) { return r.getAttribute("data-id"); }).join(",")`))

	// Search by id, and the error filter.
	c.step("search an id", 15*time.Second, chromedp.Navigate(base+"queue?q=orders&tab=retrying"), chromedp.WaitVisible(chromedp.ID("filter-id")),
		chromedp.SendKeys(chromedp.ID("filter-id"), "flaky-2"), chromedp.Click(chromedp.ID("search")),
		until(`location.search.indexOf("id=flaky-2") > 0 && `+rows+` === 1`))
	require.Equal(t, "flaky-2", c.eval(`document.querySelector("#list tbody tr").getAttribute("data-id")`))
	c.step("filter by error", 15*time.Second, chromedp.Navigate(base+"queue?q=orders&tab=dead&error=declined"), until(rows+` === 3`))
	c.step("filter by error, none", 15*time.Second, chromedp.Navigate(base+"queue?q=orders&tab=dead&error=timeout"), chromedp.WaitVisible(chromedp.ID("no-jobs")))
	c.noErrors()
}

// TestBrowserActions presses each action in a headless Chromium and checks
// Redis and the page after it: Run now and Cancel on a scheduled job, Cancel
// on a waiting retry, Requeue and Purge on a dead letter, and Cancel, Run
// now and Purge on a selection; the cards and the list agree after each.
// And an action done elsewhere (Admin.Requeue) shows in the card and the
// list at the next poll, together (the bug: the card refreshed, the
// table did not).
func TestBrowserActions(t *testing.T) {
	c := newChrome(t)
	srv := redistest.Start(t)
	client := srv.Client(t)
	fill(t, client)
	st := seedStates(t, client)
	defer st.release()
	ctx := context.Background()
	admin, err := streamq.NewAdmin(client, "orders", nil)
	require.NoError(t, err)
	h, err := New(client, &Options{PollInterval: 500 * time.Millisecond, Logger: slog.New(slog.DiscardHandler)})
	require.NoError(t, err)
	base := mount(t, h)
	state := func(id string) streamq.JobState {
		t.Helper()
		j, err := admin.Job(ctx, id)
		require.NoError(t, err, id)
		return j.State
	}
	row := func(id string) string { return `#list tr[data-id="` + id + `"]` }
	agree := func(what string) {
		t.Helper()
		s, err := admin.Stats(ctx)
		require.NoError(t, err)
		c.step(what+": the cards say what Redis says", 15*time.Second,
			until(`document.getElementById("q-dead").textContent === "`+fmt.Sprint(s.DeadLetters)+`" && document.getElementById("q-scheduled").textContent === "`+fmt.Sprint(s.Scheduled)+`"`))
		require.Equal(t, c.eval(`document.getElementById("list-total").textContent`), c.eval(`String(`+rows+`)`), "%s: the list's total is its rows (one page)", what)
	}

	// Run now on a scheduled job: it is in the stream at once.
	c.step("open scheduled", 15*time.Second, chromedp.Navigate(base+"queue?q=orders&tab=scheduled"), until(rows+` === 4`))
	c.step("press Run now", 15*time.Second, chromedp.Click(chromedp.CSS(row("sched-3")+` button.run`)),
		chromedp.WaitVisible(chromedp.ID("flash")), until(rows+` === 3`))
	require.Equal(t, "Moved 1 job(s) to the queue to run now.", c.text("flash"))
	require.Equal(t, streamq.JobQueued, state("sched-3"), "sched-3 runs now")
	require.Contains(t, c.eval(`location.search`), "tab=scheduled", "back on the same tab")
	agree("run now")

	// Cancel on a scheduled job (after the confirm dialog).
	c.step("press Cancel", 15*time.Second, chromedp.Click(chromedp.CSS(row("sched-2")+` button.cancel`)),
		until(`!document.querySelector('`+row("sched-2")+`')`), chromedp.WaitVisible(chromedp.ID("flash")))
	require.Equal(t, "Cancelled 1 job(s).", c.text("flash"))
	require.Equal(t, streamq.JobCanceled, state("sched-2"))
	require.Equal(t, "1", c.text("q-canceled"))
	agree("cancel")

	// A selection: sched-1 and the long id, cancelled together.
	c.step("select two", 15*time.Second,
		chromedp.Click(chromedp.CSS(row("sched-1")+` input[type=checkbox]`)),
		chromedp.Click(chromedp.CSS(row(longID)+` input[type=checkbox]`)),
		until(`document.getElementById("sel-count").textContent === "2" && !document.getElementById("sel-cancel").disabled`))
	// A job scheduled meanwhile shows at the next poll; the list is
	// replaced and keeps the selection.
	p, err := streamq.NewProducer[string, string](client, "orders", &streamq.ProducerOptions{Logger: slog.New(slog.DiscardHandler)})
	require.NoError(t, err)
	_, err = p.Produce(ctx, "sched-4", "x", streamq.After(5*time.Hour))
	require.NoError(t, err)
	c.step("the new job is listed", 15*time.Second, until(`!!document.querySelector('`+row("sched-4")+`')`))
	require.Equal(t, "2", c.eval(`document.querySelectorAll("#list tbody input:checked").length`), "the selection survives the refresh")
	require.Equal(t, "2", c.text("sel-count"))
	c.step("cancel the selection", 15*time.Second, chromedp.Click(chromedp.ID("sel-cancel")),
		until(`!!document.getElementById("flash") && `+rows+` === 1`))
	require.Equal(t, "Cancelled 2 job(s).", c.text("flash"))
	require.Equal(t, streamq.JobCanceled, state("sched-1"))
	require.Equal(t, streamq.JobCanceled, state(longID))
	require.Equal(t, streamq.JobScheduled, state("sched-4"), "not selected")
	agree("cancel a selection")

	// Retries: Cancel one, Run the other now with a selection (select all).
	c.step("open retrying", 15*time.Second, chromedp.Navigate(base+"queue?q=orders&tab=retrying"), until(rows+` === 2`))
	c.step("cancel a retry", 15*time.Second, chromedp.Click(chromedp.CSS(row("flaky-1")+` button.cancel`)),
		until(`!document.querySelector('`+row("flaky-1")+`')`))
	require.Equal(t, streamq.JobCanceled, state("flaky-1"))
	c.step("select all, run now", 15*time.Second, chromedp.Click(chromedp.ID("sel-all")),
		until(`document.getElementById("sel-count").textContent === "1"`),
		chromedp.Click(chromedp.ID("sel-run")), chromedp.WaitVisible(chromedp.ID("no-jobs")))
	require.Equal(t, "Moved 1 job(s) to the queue to run now.", c.text("flash"))
	require.NotEqual(t, streamq.JobRetrying, state("flaky-2"))
	agree("run a retry now")

	// Cancel on a queued job (deleted from the stream) and on a running
	// one (its handler's context is cancelled; the consumer then reads the
	// next queued job, so the running list changes on its own).
	c.step("open queued", 15*time.Second, chromedp.Navigate(base+"queue?q=orders&tab=queued"),
		until(`!!document.querySelector('`+row("queued-1")+`')`))
	c.step("cancel a queued job", 15*time.Second, chromedp.Click(chromedp.CSS(row("queued-1")+` button.cancel`)),
		until(`!document.querySelector('`+row("queued-1")+`')`), chromedp.WaitVisible(chromedp.ID("flash")))
	require.Equal(t, "Cancelled 1 job(s).", c.text("flash"))
	require.Equal(t, streamq.JobCanceled, state("queued-1"))
	c.step("open running", 15*time.Second, chromedp.Navigate(base+"queue?q=orders&tab=running"),
		until(`!!document.querySelector('`+row("slow-1")+`')`))
	c.step("cancel a running job", 15*time.Second, chromedp.Click(chromedp.CSS(row("slow-1")+` button.cancel`)),
		until(`!document.querySelector('`+row("slow-1")+`')`), chromedp.WaitVisible(chromedp.ID("flash")))
	require.Equal(t, "Cancelled 1 job(s).", c.text("flash"))
	require.Equal(t, streamq.JobCanceled, state("slow-1"))

	// Dead letters: Requeue one, Purge one, Purge a selection.
	c.step("open dead", 15*time.Second, chromedp.Navigate(base+"queue?q=orders&tab=dead"), until(rows+` === 3`))
	require.Equal(t, "3", c.text("q-dead"))
	c.step("requeue bad-1", 15*time.Second, chromedp.Click(chromedp.CSS(row("bad-1")+` button.requeue`)),
		chromedp.WaitVisible(chromedp.ID("flash")), until(rows+` === 2`))
	require.Equal(t, "Requeued 1 dead letter.", c.text("flash"))
	require.Equal(t, streamq.JobQueued, state("bad-1"))
	require.Equal(t, "2", c.text("q-dead"))
	agree("requeue")
	c.step("purge bad-2", 15*time.Second, chromedp.Click(chromedp.CSS(row("bad-2")+` button.purge`)),
		until(rows+` === 1`))
	require.Equal(t, "Deleted 1 dead letter(s).", c.text("flash"))
	agree("purge")

	// Done elsewhere: an Admin.Requeue shows in the card and the list at
	// the next poll, both at once.
	dls, err := admin.DeadLetters(ctx, "", 10)
	require.NoError(t, err)
	require.Len(t, dls, 1)
	_, err = admin.Requeue(ctx, dls[0].DeadLetterID)
	require.NoError(t, err)
	c.step("card and list refresh together", 15*time.Second,
		until(`document.getElementById("q-dead").textContent === "0" && !!document.getElementById("no-jobs") && document.getElementById("list-total").textContent === "0"`))

	// A selection of dead letters: two made again, purged together.
	_, err = admin.PurgeDeadLetters(ctx) // none left; make two more
	require.NoError(t, err)
	st.release() // worker-slow stops; worker-3 runs what is queued
	log := slog.New(slog.DiscardHandler)
	bad, err := streamq.NewConsumer(client, "orders", func(ctx context.Context, m *streamq.Message[string]) (string, error) {
		if strings.HasPrefix(m.ID, "again-") {
			return "", streamq.Permanent(errors.New("card declined again"))
		}
		return "ok", nil // what worker-slow left in the stream
	}, &streamq.ConsumerOptions{Name: "worker-3", ReadBlock: 50 * time.Millisecond, Logger: log})
	require.NoError(t, err)
	rctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- bad.Run(rctx) }()
	for _, id := range []string{"again-1", "again-2"} {
		require.NoError(t, p.Enqueue(ctx, id, "x"))
	}
	require.NoError(t, p.Close())
	c.step("two new dead letters listed", 20*time.Second, until(rows+` === 2 && document.getElementById("q-dead").textContent === "2"`))
	cancel()
	require.NoError(t, <-done)
	c.step("select all, purge", 15*time.Second, chromedp.Click(chromedp.ID("sel-all")),
		until(`document.getElementById("sel-count").textContent === "2"`),
		chromedp.Click(chromedp.ID("sel-purge")), chromedp.WaitVisible(chromedp.ID("flash")), chromedp.WaitVisible(chromedp.ID("no-jobs")))
	require.Equal(t, "Deleted 2 dead letter(s).", c.text("flash"))
	s, err := admin.Stats(ctx)
	require.NoError(t, err)
	require.Zero(t, s.DeadLetters)
	agree("purge a selection")
	c.noErrors()
}

// TestBrowserReadOnly: with ReadOnly the tabs list the jobs without a
// button, checkbox or form token, and the server refuses an action forged
// with a token of a writable dashboard sharing the key (403, nothing done).
func TestBrowserReadOnly(t *testing.T) {
	c := newChrome(t)
	srv := redistest.Start(t)
	client := srv.Client(t)
	fill(t, client)
	st := seedStates(t, client)
	defer st.release()
	key := []byte("0123456789abcdef0123456789abcdef")
	ro, err := New(client, &Options{ReadOnly: true, CSRFKey: key, PollInterval: 500 * time.Millisecond, Logger: slog.New(slog.DiscardHandler)})
	require.NoError(t, err)
	base := mount(t, ro)
	for _, tab := range []string{"scheduled", "retrying", "queued", "running", "dead"} {
		c.step("open "+tab, 15*time.Second, chromedp.Navigate(base+"queue?q=orders&tab="+tab),
			chromedp.WaitVisible(chromedp.ID("list")))
		require.NotEqual(t, "0", c.eval(rows), tab)
		require.Equal(t, "0", c.eval(`document.querySelectorAll("main button:not(#search):not([data-span]), main form[method=post], input[type=checkbox], input[name=csrf]").length`), "no action on %s", tab)
		require.Equal(t, "read-only", c.eval(`document.querySelector("header .badge").textContent`))
	}
	// The list still refreshes.
	before := c.eval(`document.getElementById("jobs").getAttribute("data-time")`)
	c.step("refresh", 15*time.Second, until(`document.getElementById("jobs").getAttribute("data-time") !== "`+before+`"`))
	require.Equal(t, "0", c.eval(`document.querySelectorAll("#list button").length`))

	// A forged action: a token from a writable dashboard with the same key.
	rw, err := New(client, &Options{CSRFKey: key, Logger: slog.New(slog.DiscardHandler)})
	require.NoError(t, err)
	b := newBrowser(t, mount(t, rw))
	token := b.token("orders")
	b.base = base
	for _, form := range []url.Values{
		{"q": {"orders"}, "op": {"cancel"}, "id": {"sched-1"}, "csrf": {token}},
		{"q": {"orders"}, "op": {"run"}, "id": {"sched-1"}, "csrf": {token}},
		{"q": {"orders"}, "op": {"purge-all"}, "csrf": {token}},
	} {
		code, body, _ := b.post(form, nil)
		require.Equal(t, http.StatusForbidden, code, "%v: %s", form, body)
	}
	admin, err := streamq.NewAdmin(client, "orders", nil)
	require.NoError(t, err)
	j, err := admin.Job(context.Background(), "sched-1")
	require.NoError(t, err)
	require.Equal(t, streamq.JobScheduled, j.State, "nothing done")
	s, err := admin.Stats(context.Background())
	require.NoError(t, err)
	require.EqualValues(t, 3, s.DeadLetters)
	c.noErrors()
}

// TestBrowser drives the overview and the chart in a headless Chromium: the
// queue page's cards show the counts Admin.Stats returns; while a consumer
// completes jobs the overview shows a rate, and the chart shows them in its
// current minute, also after a reload (it reads the history Redis keeps);
// the job page shows a cancelled request; the pages log no error.
func TestBrowser(t *testing.T) {
	c := newChrome(t)
	srv := redistest.Start(t)
	client := srv.Client(t)
	fill(t, client)
	ctx := context.Background()
	admin, err := streamq.NewAdmin(client, "orders", nil)
	require.NoError(t, err)
	h, err := New(client, &Options{PollInterval: 500 * time.Millisecond, Logger: slog.New(slog.DiscardHandler)})
	require.NoError(t, err)
	base := mount(t, h)

	s, err := admin.Stats(ctx)
	require.NoError(t, err)
	want := summarize("orders", s)
	c.step("open the queue page", 15*time.Second,
		chromedp.Navigate(base+"queue?q=orders"),
		chromedp.WaitVisible(chromedp.ID("counts")), until(rows+` === 3`))
	require.Equal(t,
		[]string{fmt.Sprint(want.Length), fmt.Sprint(want.DeadLetters), fmt.Sprint(want.Pending), fmt.Sprint(want.Consumers), fmt.Sprint(want.Scheduled), fmt.Sprint(want.Canceled)},
		[]string{c.text("q-length"), c.text("q-dead"), c.text("q-pending"), c.text("q-consumers"), c.text("q-scheduled"), c.text("q-canceled")})
	require.Equal(t, "3", c.text("q-dead"))
	// fill's six outcomes are in the chart's history.
	c.step("the chart counts fill's jobs", 15*time.Second,
		until(`document.getElementById("hist-processed").textContent === "6" && document.getElementById("hist-failed").textContent === "3"`))

	// A consumer comes back, and requests keep coming.
	log := slog.New(slog.DiscardHandler)
	cons, err := streamq.NewConsumer(client, "orders", func(ctx context.Context, m *streamq.Message[string]) (string, error) {
		return "done " + m.Payload, nil
	}, &streamq.ConsumerOptions{Name: "worker-2", ReadBlock: 50 * time.Millisecond, ClaimInterval: 100 * time.Millisecond, Logger: log})
	require.NoError(t, err)
	runCtx, stopConsumer := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- cons.Run(runCtx) }()
	defer func() {
		stopConsumer()
		require.NoError(t, <-done)
	}()
	p, err := streamq.NewProducer[string, string](client, "orders", &streamq.ProducerOptions{Logger: log})
	require.NoError(t, err)
	defer p.Close()
	load := make(chan struct{})
	loadDone := make(chan struct{})
	go func() {
		defer close(loadDone)
		tick := time.NewTicker(20 * time.Millisecond)
		defer tick.Stop()
		for i := 0; ; i++ {
			select {
			case <-load:
				return
			case <-tick.C:
			}
			if err := p.Enqueue(ctx, "load-"+strconv.Itoa(i), "x"); err != nil {
				t.Errorf("enqueue: %v", err)
				return
			}
		}
	}()
	defer func() { close(load); <-loadDone }()

	c.step("the live consumer counted", 15*time.Second, until(`document.getElementById("q-consumers").textContent === "1"`))
	// The overview lists the queue with its rate.
	c.step("open the overview", 15*time.Second,
		chromedp.Navigate(base),
		chromedp.WaitVisible(chromedp.CSS(`#queues tr[data-q="orders"]`)),
		until(`parseFloat(document.querySelector('#queues tr[data-q="orders"] [data-f="rate_ok"]').textContent) > 0`))
	// The chart, after a reload, shows the jobs processed meanwhile: it
	// reads Redis, not what the page saw.
	c.step("reload: the chart has the new jobs", 20*time.Second,
		chromedp.Reload(), until(`+document.getElementById("hist-processed").textContent > 20`))
	require.Equal(t, "1440", c.eval(`document.getElementById("chart").getAttribute("data-points")`))
	// The last point of the processed line is above the axis.
	require.Equal(t, "true", c.eval(`(function () {
		var pts = document.getElementById("chart-processed").getAttribute("points").trim().split(" ");
		var last = pts[pts.length - 1].split(",");
		var prev = pts[pts.length - 2].split(",");
		var base = +document.querySelector("#chart line.axis").getAttribute("y1");
		return Math.min(+last[1], +prev[1]) < base;
	})()`))

	// A cancellation shows in the overview at its next refresh, and the job
	// page shows a cancelled request's state.
	_, err = p.Produce(ctx, "later-1", "x", streamq.After(time.Hour))
	require.NoError(t, err)
	require.NoError(t, admin.Cancel(ctx, "later-1"))
	c.step("the overview counts the cancelled request", 15*time.Second,
		until(`document.querySelector('#queues tr[data-q="orders"] [data-f="canceled"]').textContent === "1"`))
	c.step("show the last hour", 15*time.Second, chromedp.Click(chromedp.CSS(`#spans button[data-span="60"]`)),
		until(`document.getElementById("chart").getAttribute("data-points") === "60"`))
	// The overview's latency and fan-out dead letters cells refresh too.
	require.Regexp(t, `^(–|<1s|\d+s)$`, c.eval(`document.querySelector('#queues tr[data-q="orders"] [data-f="latency"]').textContent`))
	require.Equal(t, "0", c.eval(`document.querySelector('#queues tr[data-q="orders"] [data-f="fanout_dead_letters"]').textContent`))
	c.screenshot("dashboard-overview.png")
	c.step("open the job page of a cancelled request", 15*time.Second,
		chromedp.Navigate(base+"job?q=orders&id=later-1"),
		chromedp.WaitVisible(chromedp.ID("job-state")))
	require.Equal(t, "canceled", c.text("job-state"))
	c.noErrors()
}
