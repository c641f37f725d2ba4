package streamqdash

import (
	"bytes"
	"context"
	"flag"
	"fmt"
	"image/png"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/chromedp/cdproto/cdp"
	cdplog "github.com/chromedp/cdproto/log"
	"github.com/chromedp/cdproto/runtime"
	"github.com/chromedp/chromedp"
	"github.com/stretchr/testify/require"

	"github.com/streamq/streamq"
	"github.com/streamq/streamq/internal/redistest"
)

var update = flag.Bool("update", false, "rewrite docs/dashboard.png with the browser test's screenshot")

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

// TestBrowser drives the dashboard in a headless Chromium: the queue page
// shows the counts Admin.Stats returns; pressing Requeue on a dead letter
// moves it back and the job runs; the chart draws processed per second
// while jobs complete; the page logs no error. It takes the screenshot in
// docs/dashboard.png (rewritten with -update).
func TestBrowser(t *testing.T) {
	chrome := chromiumPath(t)
	srv := redistest.Start(t)
	client := srv.Client(t)
	fill(t, client)
	ctx := context.Background()
	admin, err := streamq.NewAdmin(client, "orders", nil)
	require.NoError(t, err)
	h, err := New(client, &Options{PollInterval: 500 * time.Millisecond, Logger: slog.New(slog.DiscardHandler)})
	require.NoError(t, err)
	base := mount(t, h)

	opts := append(chromedp.DefaultExecAllocatorOptions[:],
		chromedp.ExecPath(chrome), chromedp.DisableGPU, chromedp.WindowSize(1280, 1100),
		chromedp.Flag("no-first-run", true), chromedp.Flag("disable-dev-shm-usage", true))
	if os.Geteuid() == 0 {
		opts = append(opts, chromedp.NoSandbox)
	}
	allocCtx, cancelAlloc := chromedp.NewExecAllocator(ctx, opts...)
	defer cancelAlloc()
	var errs consoleErrors
	bctx, cancelBrowser := chromedp.NewContext(allocCtx, chromedp.WithListener(func(ev any) {
		switch ev := ev.(type) {
		case *runtime.EventConsoleAPICalled:
			if ev.Type == runtime.ConsoleAPICalledTypeError || ev.Type == runtime.ConsoleAPICalledTypeAssert {
				var parts []string
				for _, a := range ev.Args {
					parts = append(parts, string(a.Value))
				}
				errs.add("console.%s: %s", ev.Type, strings.Join(parts, " "))
			}
		case *runtime.EventExceptionThrown:
			d := ev.ExceptionDetails
			desc := ""
			if d.Exception != nil {
				desc = d.Exception.Description
			}
			errs.add("exception: %s %s (%s:%d)", d.Text, desc, d.URL, d.LineNumber)
		case *cdplog.EventEntryAdded:
			if ev.Entry.Level == cdplog.EntryLevelError {
				errs.add("log %s: %s (%s)", ev.Entry.Source, ev.Entry.Text, ev.Entry.URL)
			}
		}
	}))
	defer cancelBrowser()
	// step runs actions with a time limit of their own.
	step := func(what string, timeout time.Duration, actions ...chromedp.Action[chromedp.Void]) {
		t.Helper()
		sctx, cancel := context.WithTimeout(bctx, timeout)
		defer cancel()
		require.NoError(t, chromedp.Do(sctx, actions...), what)
	}
	text := func(id string) string {
		t.Helper()
		sctx, cancel := context.WithTimeout(bctx, 15*time.Second)
		defer cancel()
		v, err := chromedp.Run(sctx, chromedp.Text(chromedp.ID(id)))
		require.NoError(t, err, "text of #%s", id)
		return v
	}
	poll := func(expr string) chromedp.Action[chromedp.Void] {
		return chromedp.Poll[chromedp.Void](expr, chromedp.WithPollingInterval(50*time.Millisecond), chromedp.WithPollingTimeout(0))
	}
	// The first call starts the browser, which lives as long as the context
	// of that call: bctx, not one with a time limit.
	_, err = chromedp.Call(bctx, cdplog.Enable, cdp.Empty{}) // log entries: failed loads, CSP violations
	require.NoError(t, err, "start the browser")

	// The queue page shows the counts Admin.Stats returns.
	s, err := admin.Stats(ctx)
	require.NoError(t, err)
	want := summarize("orders", s)
	step("open the queue page", 15*time.Second,
		chromedp.Navigate(base+"queue?q=orders"),
		chromedp.WaitVisible(chromedp.ID("counts")))
	require.Equal(t,
		[]string{fmt.Sprint(want.Length), fmt.Sprint(want.DeadLetters), fmt.Sprint(want.Pending), fmt.Sprint(want.Consumers), fmt.Sprint(want.Scheduled), fmt.Sprint(want.Canceled)},
		[]string{text("q-length"), text("q-dead"), text("q-pending"), text("q-consumers"), text("q-scheduled"), text("q-canceled")})
	require.Equal(t, "3", text("q-dead"))
	t.Logf("queue page: entries %d, dead letters %d, pending %d, live consumers %d, scheduled %d, canceled %d: as Admin.Stats says",
		want.Length, want.DeadLetters, want.Pending, want.Consumers, want.Scheduled, want.Canceled)
	step("list the dead letters", 15*time.Second, poll(`document.querySelectorAll("#dead tbody tr").length === 3`))

	// A consumer comes back, and requests keep coming: the chart has
	// something to draw.
	log := slog.New(slog.DiscardHandler)
	c, err := streamq.NewConsumer(client, "orders", func(ctx context.Context, m *streamq.Message[string]) (string, error) {
		return "done " + m.Payload, nil
	}, &streamq.ConsumerOptions{Name: "worker-2", ReadBlock: 50 * time.Millisecond, ClaimInterval: 100 * time.Millisecond, Logger: log})
	require.NoError(t, err)
	runCtx, stopConsumer := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- c.Run(runCtx) }()
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

	// Pressing Requeue on bad-1's dead letter moves it back; the job runs.
	dls, err := admin.DeadLetters(ctx, "", 10)
	require.NoError(t, err)
	require.Equal(t, "bad-1", dls[0].ID)
	step("press requeue", 15*time.Second,
		chromedp.Click(chromedp.CSS(`tr[data-dl="`+dls[0].DeadLetterID+`"] button.requeue`)),
		chromedp.WaitVisible(chromedp.ID("flash")))
	require.Equal(t, "Requeued 1 dead letter.", text("flash"))
	pressed := time.Now()
	deadline := time.Now().Add(20 * time.Second)
	for {
		j, err := admin.Job(ctx, "bad-1")
		require.NoError(t, err)
		if j.State == streamq.JobSucceeded {
			require.Equal(t, `"done order bad-1"`, string(j.Result))
			t.Logf("pressed Requeue on %s (bad-1): the job succeeded %v after the page confirmed it", dls[0].DeadLetterID, time.Since(pressed).Round(time.Millisecond))
			break
		}
		require.True(t, time.Now().Before(deadline), "the requeued job did not run: %+v", j)
		time.Sleep(20 * time.Millisecond)
	}
	s, err = admin.Stats(ctx)
	require.NoError(t, err)
	require.EqualValues(t, 2, s.DeadLetters)
	step("the page shows 2 dead letters", 15*time.Second,
		poll(`document.getElementById("q-dead").textContent === "2" && document.querySelectorAll("#dead tbody tr").length === 2`))

	// The chart updates: points accumulate and the rate of succeeded
	// requests is above zero.
	step("the chart draws", 30*time.Second,
		poll(`(function () {
			var n = +document.getElementById("chart").getAttribute("data-points");
			return n >= 6 && parseFloat(document.getElementById("rate-ok").textContent) > 0;
		})()`))
	sctx, cancel := context.WithTimeout(bctx, 15*time.Second)
	points, err := chromedp.Run(sctx, chromedp.AttributeValue(chromedp.ID("chart-ok"), "points"))
	cancel()
	require.NoError(t, err)
	require.GreaterOrEqual(t, strings.Count(points.Value, ","), 6, "points drawn: %q", points.Value)
	t.Logf("chart: %d points drawn, succeeded %s/s", strings.Count(points.Value, ","), text("rate-ok"))
	step("the live consumer counted", 15*time.Second, poll(`document.getElementById("q-consumers").textContent === "1"`))

	// The overview lists the queue with its rate.
	step("open the overview", 15*time.Second,
		chromedp.Navigate(base),
		chromedp.WaitVisible(chromedp.CSS(`#queues tr[data-q="orders"]`)),
		poll(`parseFloat(document.querySelector('#queues tr[data-q="orders"] [data-f="rate_ok"]').textContent) > 0`))

	// A cancellation shows in the overview at its next refresh, and the job
	// page shows a cancelled request's state (it answered 502).
	_, err = p.Produce(ctx, "later-1", "x", streamq.After(time.Hour))
	require.NoError(t, err)
	require.NoError(t, admin.Cancel(ctx, "later-1"))
	step("the overview counts the cancelled request", 15*time.Second,
		poll(`document.querySelector('#queues tr[data-q="orders"] [data-f="canceled"]').textContent === "1"`))
	step("open the job page of a cancelled request", 15*time.Second,
		chromedp.Navigate(base+"job?q=orders&id=later-1"),
		chromedp.WaitVisible(chromedp.ID("job-state")))
	require.Equal(t, "canceled", text("job-state"))

	// The screenshot of the queue page for the README.
	step("wait for the chart", 30*time.Second,
		chromedp.Navigate(base+"queue?q=orders"),
		chromedp.WaitVisible(chromedp.ID("counts")),
		poll(`+document.getElementById("chart").getAttribute("data-points") >= 12`))
	sctx, cancel = context.WithTimeout(bctx, 30*time.Second)
	shot, err := chromedp.Run(sctx, chromedp.CaptureScreenshot())
	cancel()
	require.NoError(t, err, "screenshot")
	_, err = png.Decode(bytes.NewReader(shot))
	require.NoError(t, err, "a PNG")
	out := filepath.Join(t.TempDir(), "dashboard.png")
	if *update {
		out = filepath.Join("..", "docs", "dashboard.png")
		require.NoError(t, os.MkdirAll(filepath.Dir(out), 0o755))
	}
	require.NoError(t, os.WriteFile(out, shot, 0o644))
	t.Logf("screenshot (%d bytes) in %s", len(shot), out)

	require.Empty(t, errs.list(), "the pages logged errors")
	t.Log("no console error, exception or error log entry")
}
