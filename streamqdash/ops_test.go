package streamqdash

import (
	"context"
	"errors"
	"fmt"
	"html"
	"log/slog"
	"net/http"
	"net/url"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/streamq/streamq"
	"github.com/streamq/streamq/internal/redistest"
)

// runConsumer runs c until the test ends.
func runConsumer(t *testing.T, c *streamq.Consumer[string, string]) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	t.Cleanup(func() { cancel(); require.NoError(t, <-done) })
}

// settle waits until queue holds want dead letters and nothing queued,
// running or waiting.
func settle(t *testing.T, a *streamq.Admin, want int64) {
	t.Helper()
	require.Eventually(t, func() bool {
		s, err := a.Stats(context.Background())
		if err != nil || s.DeadLetters != want || s.Scheduled != 0 || s.Length != 0 {
			return false
		}
		for _, g := range s.Groups {
			if g.Pending != 0 {
				return false
			}
		}
		return true
	}, 30*time.Second, 10*time.Millisecond, "the queue settles with %d dead letters", want)
}

// TestRequeueAllOnceWithALiveConsumer: "Requeue all" with a live consumer
// and 2-delivery poison requests requeues each dead letter once. Before, it
// paged on after the last id seen until a page came back empty, and
// requeued the poison again each time it was dead-lettered again.
func TestRequeueAllOnceWithALiveConsumer(t *testing.T) {
	srv := redistest.Start(t)
	client := srv.Client(t)
	ctx := context.Background()
	log := slog.New(slog.DiscardHandler)
	var mu sync.Mutex
	starts := map[string]int{}
	c, err := streamq.NewConsumer(client, "poison", func(ctx context.Context, m *streamq.Message[string]) (string, error) {
		mu.Lock()
		starts[m.ID]++
		mu.Unlock()
		return "", errors.New("poison")
	}, &streamq.ConsumerOptions{Name: "w", MaxDeliveries: 2, RetryBackoff: time.Millisecond, RetryBackoffMax: time.Millisecond,
		ReadBlock: 20 * time.Millisecond, Logger: log})
	require.NoError(t, err)
	runConsumer(t, c)
	p, err := streamq.NewProducer[string, string](client, "poison", &streamq.ProducerOptions{Logger: log})
	require.NoError(t, err)
	defer p.Close()
	const n = 300
	for i := range n {
		require.NoError(t, p.Enqueue(ctx, fmt.Sprintf("p-%d", i), "x"))
	}
	a, err := streamq.NewAdmin(client, "poison", nil)
	require.NoError(t, err)
	settle(t, a, n)
	h, err := New(client, &Options{Logger: log})
	require.NoError(t, err)
	b := newBrowser(t, mount(t, h))
	code, body, hdr := b.post(url.Values{"q": {"poison"}, "op": {"requeue-all"}, "csrf": {b.token("poison")}}, nil)
	require.Equal(t, http.StatusSeeOther, code, body)
	loc, err := url.Parse(hdr.Get("Location"))
	require.NoError(t, err)
	require.Equal(t, fmt.Sprint(n), loc.Query().Get("n"))
	settle(t, a, n)
	mu.Lock()
	defer mu.Unlock()
	for i := range n {
		id := fmt.Sprintf("p-%d", i)
		require.Equal(t, 4, starts[id], "%s: two starts, requeued once, two more", id)
	}
}

// TestRequeueAllWithAShortActionTimeout: an ActionTimeout of 1s or less
// still requeues. Before, "Requeue all" kept a fixed second in reserve and
// did nothing.
func TestRequeueAllWithAShortActionTimeout(t *testing.T) {
	srv := redistest.Start(t)
	client := srv.Client(t)
	fill(t, client)
	h, err := New(client, &Options{ActionTimeout: time.Second, Logger: slog.New(slog.DiscardHandler)})
	require.NoError(t, err)
	b := newBrowser(t, mount(t, h))
	code, body, hdr := b.post(url.Values{"q": {"orders"}, "op": {"requeue-all"}, "csrf": {b.token("orders")}}, nil)
	require.Equal(t, http.StatusSeeOther, code, body)
	loc, err := url.Parse(hdr.Get("Location"))
	require.NoError(t, err)
	require.Equal(t, "3", loc.Query().Get("n"))
	require.EqualValues(t, 3, client.XLen(context.Background(), "streamq:{orders}:stream").Val())
}

// TestAllActionsHonourTheFilter: "Requeue all" and "Purge all" on a
// filtered list act on the dead letters the filter selects, and the page
// says so on the buttons. Before, they acted on every dead letter.
func TestAllActionsHonourTheFilter(t *testing.T) {
	srv := redistest.Start(t)
	client := srv.Client(t)
	ctx := context.Background()
	fill(t, client)
	h, err := New(client, &Options{Logger: slog.New(slog.DiscardHandler)})
	require.NoError(t, err)
	b := newBrowser(t, mount(t, h))
	code, body, _ := b.get("queue?q=orders&id=bad-2")
	require.Equal(t, http.StatusOK, code)
	require.Contains(t, body, "Requeue all matching")
	require.Contains(t, body, "Purge all matching")
	token := csrfField.FindStringSubmatch(body)[1]
	code, body, hdr := b.post(url.Values{"q": {"orders"}, "op": {"requeue-all"}, "back": {"q=orders&id=bad-2"}, "csrf": {token}}, nil)
	require.Equal(t, http.StatusSeeOther, code, body)
	require.Contains(t, hdr.Get("Location"), "n=1")
	msgs, err := client.XRange(ctx, "streamq:{orders}:stream", "-", "+").Result()
	require.NoError(t, err)
	require.Len(t, msgs, 1)
	require.Equal(t, "bad-2", msgs[0].Values["id"])
	code, body, hdr = b.post(url.Values{"q": {"orders"}, "op": {"purge-all"}, "back": {"q=orders&id=bad-1"}, "csrf": {token}}, nil)
	require.Equal(t, http.StatusSeeOther, code, body)
	require.Contains(t, hdr.Get("Location"), "n=1")
	a, err := streamq.NewAdmin(client, "orders", nil)
	require.NoError(t, err)
	dls, err := a.DeadLetters(ctx, "", 10)
	require.NoError(t, err)
	require.Len(t, dls, 1)
	require.Equal(t, "bad-3", dls[0].ID)
}

var (
	rowRe    = regexp.MustCompile(`(?s)<tr data-id="([^"]*)">(.*?)</tr>`)
	hiddenRe = regexp.MustCompile(`<input type="hidden" name="([^"]+)" value="([^"]*)">`)
)

// rowForm returns the fields of the action form of the Retrying tab's row
// whose text contains match.
func rowForm(t *testing.T, body, match string) url.Values {
	t.Helper()
	for _, m := range rowRe.FindAllStringSubmatch(body, -1) {
		if !strings.Contains(m[2], match) {
			continue
		}
		v := url.Values{}
		for _, f := range hiddenRe.FindAllStringSubmatch(m[2], -1) {
			v.Add(html.UnescapeString(f[1]), html.UnescapeString(f[2]))
		}
		return v
	}
	t.Fatalf("no row with %q", match)
	return nil
}

// TestRetryRowActsOnItsGroup: the Retrying tab lists the answering group's
// and a fan-out group's retry of one id; Cancel and Run now on the fan-out
// group's row act on that group's retry. Before, the row posted no group and
// the answering group's retry was cancelled.
func TestRetryRowActsOnItsGroup(t *testing.T) {
	srv := redistest.Start(t)
	client := srv.Client(t)
	ctx := context.Background()
	log := slog.New(slog.DiscardHandler)
	auditStarts := make(chan int, 8)
	audit, err := streamq.NewConsumer(client, "events", func(ctx context.Context, m *streamq.Message[string]) (string, error) {
		auditStarts <- m.Deliveries
		return "", streamq.RetryAfter(errors.New("audit busy"), time.Hour)
	}, &streamq.ConsumerOptions{Name: "audit-1", Group: "audit", Fanout: true, ReadBlock: 50 * time.Millisecond, Logger: log})
	require.NoError(t, err)
	runConsumer(t, audit)
	require.Eventually(t, func() bool { return client.Exists(ctx, "streamq:{events}:stream").Val() == 1 }, 10*time.Second, 10*time.Millisecond)
	main, err := streamq.NewConsumer(client, "events", func(ctx context.Context, m *streamq.Message[string]) (string, error) {
		return "", streamq.RetryAfter(errors.New("main busy"), time.Hour)
	}, &streamq.ConsumerOptions{Name: "main-1", ReadBlock: 50 * time.Millisecond, Logger: log})
	require.NoError(t, err)
	runConsumer(t, main)
	p, err := streamq.NewProducer[string, string](client, "events", &streamq.ProducerOptions{Logger: log})
	require.NoError(t, err)
	defer p.Close()
	require.NoError(t, p.Enqueue(ctx, "f-1", "x"))
	require.NoError(t, p.Enqueue(ctx, "f-2", "y"))
	answering, err := streamq.NewAdmin(client, "events", nil)
	require.NoError(t, err)
	retries := func() []streamq.JobSummary {
		page, err := answering.Jobs(ctx, streamq.JobsQuery{State: streamq.JobRetrying})
		require.NoError(t, err)
		return page.Jobs
	}
	require.Eventually(t, func() bool { return len(retries()) == 4 }, 20*time.Second, 10*time.Millisecond)
	<-auditStarts
	<-auditStarts

	h, err := New(client, &Options{Logger: log})
	require.NoError(t, err)
	b := newBrowser(t, mount(t, h))
	code, body, _ := b.get("queue?q=events&tab=retrying")
	require.Equal(t, http.StatusOK, code)
	post := func(op, id string) {
		t.Helper()
		var form url.Values
		for _, m := range rowRe.FindAllStringSubmatch(body, -1) {
			if m[1] == id && strings.Contains(m[2], "audit busy") {
				form = rowForm(t, m[0], "audit busy")
			}
		}
		require.NotNil(t, form, "no audit row of %s", id)
		form.Set("op", op)
		code, body, hdr := b.post(form, nil)
		require.Equal(t, http.StatusSeeOther, code, body)
		require.Contains(t, hdr.Get("Location"), "n=1", "%s of audit's %s", op, id)
	}
	post("cancel", "f-1")
	info, err := answering.Job(ctx, "f-1")
	require.NoError(t, err)
	require.Equal(t, streamq.JobRetrying, info.State, "the answering group's retry of f-1 is untouched")
	var groups []string
	for _, j := range retries() {
		if j.ID == "f-1" {
			groups = append(groups, j.Group)
		}
	}
	require.Equal(t, []string{""}, groups, "only audit's retry of f-1 is gone")

	post("run", "f-2")
	select {
	case n := <-auditStarts:
		require.Equal(t, 2, n)
	case <-time.After(10 * time.Second):
		t.Fatal("audit's retry of f-2 did not run")
	}
	info, err = answering.Job(ctx, "f-2")
	require.NoError(t, err)
	require.Equal(t, streamq.JobRetrying, info.State, "the answering group's retry of f-2 still waits")
}
