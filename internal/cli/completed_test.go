package cli

import (
	"context"
	"encoding/json"
	"errors"
	"log/slog"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/streamq/streamq"
	"github.com/streamq/streamq/internal/redistest"
)

// TestCLICompleted: jobs ls --state completed lists the requests the
// consumers' Retention keeps, newest first with their outcome, pages with
// --cursor, prints Admin.Completed's page as JSON, and says how to get a
// list when there is none; job prints when a listed request finished.
func TestCLICompleted(t *testing.T) {
	srv := redistest.Start(t)
	client := srv.Client(t)
	ctx := context.Background()
	log := slog.New(slog.DiscardHandler)
	p, err := streamq.NewProducer[string, string](client, "mail", &streamq.ProducerOptions{Logger: log})
	require.NoError(t, err)
	defer p.Close()
	c, err := streamq.NewConsumer(client, "mail", func(ctx context.Context, m *streamq.Message[string]) (string, error) {
		if m.ID == "m-2" {
			return "", streamq.Permanent(errors.New("mailbox full"))
		}
		if m.ID == "m-0" && m.Deliveries == 1 {
			return "", errors.New("greylisted")
		}
		return "sent", nil
	}, &streamq.ConsumerOptions{Name: "mailer", ReadBlock: 20 * time.Millisecond, RetryBackoff: time.Millisecond, RetryBackoffMax: time.Millisecond,
		Retention: &streamq.Retention{MaxCount: 100, Errors: 5}, Logger: log})
	require.NoError(t, err)
	rctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- c.Run(rctx) }()
	for _, id := range []string{"m-0", "m-1", "m-2", "m-3"} {
		pr, err := p.Produce(ctx, id, "hello")
		require.NoError(t, err)
		_, _ = pr.Wait(ctx) // one at a time: the list's order is theirs
	}
	cancel()
	require.NoError(t, <-done)

	s := &session{t: t, url: "redis://" + srv.Addr() + "/0"}
	s.golden("jobs-ls-completed", 0, "jobs", "ls", "mail", "--state", "completed")
	out := s.golden("jobs-ls-completed-page-1", 0, "jobs", "ls", "mail", "--state", "completed", "--limit", "2")
	require.Contains(t, out, "next page: --cursor c")
	stdout, _, code := s.run("jobs", "ls", "mail", "--state", "completed", "--limit", "2", "--json")
	require.Zero(t, code)
	var page streamq.CompletedPage
	require.NoError(t, json.Unmarshal([]byte(stdout), &page))
	require.Len(t, page.Jobs, 2)
	require.Equal(t, []string{"m-3", "m-2"}, []string{page.Jobs[0].ID, page.Jobs[1].ID})
	require.Equal(t, streamq.JobDeadLettered, page.Jobs[1].State)
	stdout, _, code = s.run("jobs", "ls", "mail", "--state", "completed", "--limit", "2", "--cursor", page.Next)
	require.Zero(t, code)
	require.Contains(t, stdout, "m-1")
	require.NotContains(t, stdout, "m-2")
	s.golden("jobs-ls-completed-id", ExitUsage, "jobs", "ls", "mail", "--state", "completed", "--id", "m-1")
	s.golden("job-completed", 0, "job", "mail", "m-1")
	s.golden("job-completed-retried", 0, "job", "mail", "m-0")

	// A queue whose consumers keep no list.
	q, err := streamq.NewProducer[string, string](client, "plain", &streamq.ProducerOptions{Logger: log})
	require.NoError(t, err)
	defer q.Close()
	require.NoError(t, q.Enqueue(ctx, "x", "y"))
	s.golden("jobs-ls-completed-none", 0, "jobs", "ls", "plain", "--state", "completed")
}
