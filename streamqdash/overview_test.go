package streamqdash

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/streamq/streamq"
	"github.com/streamq/streamq/internal/redistest"
)

// TestOverviewLatencyAndFanoutDeadLetters: the overview (page and
// api/stats) shows how long the oldest unread job has waited, and the dead
// letters of the fan-out groups next to the answering group's; the queue
// page's tabs count the answering group's jobs, and its dead-letter tab of
// the fan-out group that group's.
func TestOverviewLatencyAndFanoutDeadLetters(t *testing.T) {
	srv := redistest.Start(t)
	client := srv.Client(t)
	ctx := context.Background()
	log := slog.New(slog.DiscardHandler)
	run := func(c *streamq.Consumer[string, string]) func() {
		rctx, cancel := context.WithCancel(ctx)
		done := make(chan error, 1)
		go func() { done <- c.Run(rctx) }()
		return func() { cancel(); require.NoError(t, <-done) }
	}
	// The answering group exists (a consumer ran), then stops.
	answer, err := streamq.NewConsumer(client, "mail", func(ctx context.Context, m *streamq.Message[string]) (string, error) {
		return "sent", nil
	}, &streamq.ConsumerOptions{Name: "mailer", ReadBlock: 20 * time.Millisecond, Logger: log})
	require.NoError(t, err)
	admin, err := streamq.NewAdmin(client, "mail", nil)
	require.NoError(t, err)
	stop := run(answer)
	require.Eventually(t, func() bool {
		s, err := admin.Stats(ctx)
		return err == nil && len(s.Groups) == 1 && s.Groups[0].Answering
	}, 10*time.Second, 10*time.Millisecond)
	stop()
	// A fan-out group that dead-letters every job.
	audit, err := streamq.NewConsumer(client, "mail", func(ctx context.Context, m *streamq.Message[string]) (string, error) {
		return "", streamq.Permanent(errors.New("audit store down"))
	}, &streamq.ConsumerOptions{Name: "auditor", Group: "audit", Fanout: true, ReadBlock: 20 * time.Millisecond, Logger: log})
	require.NoError(t, err)
	stop = run(audit)
	defer stop()
	p, err := streamq.NewProducer[any, string](client, "mail", &streamq.ProducerOptions{Logger: log})
	require.NoError(t, err)
	defer p.Close()
	for _, id := range []string{"m-1", "m-2"} {
		require.NoError(t, p.Enqueue(ctx, id, "hello"))
	}
	require.Eventually(t, func() bool {
		s, err := admin.Stats(ctx)
		if err != nil {
			return false
		}
		for _, g := range s.Groups {
			if g.Name == "audit" && g.DeadLetters == 2 {
				return true
			}
		}
		return false
	}, 10*time.Second, 10*time.Millisecond)

	h, err := New(client, &Options{Logger: log})
	require.NoError(t, err)
	b := newBrowser(t, mount(t, h))
	// Some time passes while the jobs wait for the answering group.
	require.Eventually(t, func() bool {
		code, body, _ := b.get("api/stats")
		require.Equal(t, http.StatusOK, code)
		var st statsResponse
		require.NoError(t, json.Unmarshal([]byte(body), &st))
		require.Len(t, st.Queues, 1)
		q := st.Queues[0]
		require.EqualValues(t, 2, q.FanoutDeadLetters)
		require.EqualValues(t, 0, q.DeadLetters)
		require.EqualValues(t, 2, q.Tabs["queued"], "the answering group's lag")
		return q.Latency >= 1000
	}, 10*time.Second, 50*time.Millisecond)
	code, body, _ := b.get("")
	require.Equal(t, http.StatusOK, code)
	require.Regexp(t, `<td data-f="latency">\d+s</td>`, body)
	require.Contains(t, body, `data-f="fanout_dead_letters">2</a>`)

	code, body, _ = b.get("queue?q=mail&tab=queued")
	require.Equal(t, http.StatusOK, code)
	require.Contains(t, body, `id="count-queued" data-f="tab_queued">2<`)
	require.Contains(t, body, `id="count-dead" data-f="tab_dead">0<`)
	require.Contains(t, body, `href="queue?q=mail&amp;group=audit">2</a>`, "the group's dead letters link to its list")
	code, body, _ = b.get("queue?q=mail&group=audit")
	require.Equal(t, http.StatusOK, code)
	require.Contains(t, body, `id="count-dead" data-f="tab_dead">2<`)
	require.Equal(t, 2, strings.Count(body, `<tr data-id="m-`), "the group's two dead letters listed")

	// The job page of a queued job: its payload indented.
	require.NoError(t, p.Enqueue(ctx, "m-3", map[string]any{"to": "a@example.com", "n": 1}))
	code, body, _ = b.get("job?q=mail&id=m-3")
	require.Equal(t, http.StatusOK, code)
	require.Contains(t, body, `id="job-state">queued<`)
	require.Contains(t, body, "{\n  &#34;n&#34;: 1,\n  &#34;to&#34;: &#34;a@example.com&#34;\n}")
}

// TestJobPageFlowChildren: the page of a flow's parent waiting for its
// children lists them with their outcomes, each id linking to its own page
// when its queue is shown; a child's page shows its payload.
func TestJobPageFlowChildren(t *testing.T) {
	srv := redistest.Start(t)
	client := srv.Client(t)
	ctx := context.Background()
	log := slog.New(slog.DiscardHandler)
	p, err := streamq.NewProducer[string, string](client, "reports", &streamq.ProducerOptions{Logger: log})
	require.NoError(t, err)
	defer p.Close()
	_, err = p.ProduceFlow(ctx, "report-1", "summary", []streamq.Child{
		streamq.RawChild("parts", "part-1", []byte(`{"page":1}`)),
		streamq.RawChild("parts", "part-2", []byte(`{"page":2}`)),
	}, nil)
	require.NoError(t, err)
	// Queue "parts" is shown once a producer or consumer of its own used it.
	parts, err := streamq.NewProducer[string, string](client, "parts", &streamq.ProducerOptions{Logger: log})
	require.NoError(t, err)
	defer parts.Close()
	require.NoError(t, parts.Enqueue(ctx, "other", "x"))
	h, err := New(client, &Options{Logger: log})
	require.NoError(t, err)
	b := newBrowser(t, mount(t, h))
	code, body, _ := b.get("job?q=reports&id=report-1")
	require.Equal(t, http.StatusOK, code, body)
	require.Contains(t, body, `id="job-state">waiting<`)
	require.Contains(t, body, `<a class="id" href="job?q=parts&amp;id=part-1"`)
	require.Contains(t, body, `<a class="id" href="job?q=parts&amp;id=part-2"`)
	require.Contains(t, body, "the child has no outcome yet")
	require.NotContains(t, body, "not kept once completed", "a waiting parent is not completed")
	code, body, _ = b.get("job?q=parts&id=part-2")
	require.Equal(t, http.StatusOK, code, body)
	require.Contains(t, body, `id="job-state">queued<`)
	require.Contains(t, body, "{\n  &#34;page&#34;: 2\n}")
}

// TestJobPageErrorHistory: a request retried by consumers that keep
// Retention.Errors shows the errors of its earlier attempts, newest first.
func TestJobPageErrorHistory(t *testing.T) {
	srv := redistest.Start(t)
	client := srv.Client(t)
	ctx := context.Background()
	log := slog.New(slog.DiscardHandler)
	p, err := streamq.NewProducer[string, string](client, "sync", &streamq.ProducerOptions{Logger: log})
	require.NoError(t, err)
	defer p.Close()
	require.NoError(t, p.Enqueue(ctx, "sync-1", "x"))
	c, err := streamq.NewConsumer(client, "sync", func(ctx context.Context, m *streamq.Message[string]) (string, error) {
		return "", fmt.Errorf("upstream 503 on start %d", m.Deliveries)
	}, &streamq.ConsumerOptions{Name: "syncer", ReadBlock: 20 * time.Millisecond, MaxDeliveries: 3, RetryBackoff: time.Millisecond,
		RetryBackoffMax: time.Millisecond, Retention: &streamq.Retention{Errors: 10}, Logger: log})
	require.NoError(t, err)
	rctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- c.Run(rctx) }()
	admin, err := streamq.NewAdmin(client, "sync", nil)
	require.NoError(t, err)
	require.Eventually(t, func() bool {
		j, err := admin.Job(ctx, "sync-1")
		return err == nil && j.State == streamq.JobDeadLettered
	}, 10*time.Second, 10*time.Millisecond)
	cancel()
	require.NoError(t, <-done)
	h, err := New(client, &Options{Logger: log})
	require.NoError(t, err)
	b := newBrowser(t, mount(t, h))
	code, body, _ := b.get("job?q=sync&id=sync-1")
	require.Equal(t, http.StatusOK, code, body)
	require.Contains(t, body, `id="job-error">upstream 503 on start 3<`)
	i2 := strings.Index(body, "upstream 503 on start 2")
	i1 := strings.Index(body, "upstream 503 on start 1")
	require.True(t, i2 > 0 && i1 > i2, "the earlier errors, newest first")
	require.NotContains(t, body, "no-error-history")
}
