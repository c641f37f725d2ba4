package cli

import (
	"context"
	"encoding/json"
	"errors"
	"log/slog"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/streamq/streamq"
	"github.com/streamq/streamq/internal/redistest"
)

// jobsSetup adds to deadLetterSetup's queue "orders" (3 dead letters) a retry
// waiting an hour (flaky-1, "payment gateway timeout"), two scheduled jobs
// (sched-1 and sched-2, due in 1 and 2 hours), a running job (slow-1, in the
// handler of consumer "worker-slow", which holds no more) and two queued
// ones behind it (queued-1, queued-2). The returned func lets slow-1 finish
// and stops the consumer (also at cleanup).
func jobsSetup(t *testing.T, client *redis.Client) func() {
	t.Helper()
	deadLetterSetup(t, client)
	ctx := context.Background()
	log := slog.New(slog.DiscardHandler)
	admin := mustAdmin(t, client, "orders")
	p, err := streamq.NewProducer[string, string](client, "orders", &streamq.ProducerOptions{Logger: log})
	require.NoError(t, err)
	defer p.Close()
	waitState := func(id string, want streamq.JobState) {
		t.Helper()
		require.Eventually(t, func() bool {
			j, err := admin.Job(ctx, id)
			return err == nil && j.State == want
		}, 20*time.Second, 10*time.Millisecond, "%s never %s", id, want)
	}
	start := func(c *streamq.Consumer[string, string]) func() {
		rctx, cancel := context.WithCancel(ctx)
		done := make(chan error, 1)
		go func() { done <- c.Run(rctx) }()
		var once sync.Once
		stop := func() { once.Do(func() { cancel(); require.NoError(t, <-done) }) }
		t.Cleanup(stop)
		return stop
	}

	flaky, err := streamq.NewConsumer(client, "orders", func(ctx context.Context, m *streamq.Message[string]) (string, error) {
		return "", errors.New("payment gateway timeout")
	}, &streamq.ConsumerOptions{Name: "worker-r", ReadBlock: 50 * time.Millisecond, RetryBackoff: time.Hour, RetryBackoffMax: time.Hour, Logger: log})
	require.NoError(t, err)
	stop := start(flaky)
	require.NoError(t, p.Enqueue(ctx, "flaky-1", "order flaky-1"))
	waitState("flaky-1", streamq.JobRetrying)
	stop()

	for i, id := range []string{"sched-1", "sched-2"} {
		_, err := p.Produce(ctx, id, "order "+id, streamq.After(time.Duration(i+1)*time.Hour))
		require.NoError(t, err)
	}

	release := make(chan struct{})
	slow, err := streamq.NewConsumer(client, "orders", func(ctx context.Context, m *streamq.Message[string]) (string, error) {
		select {
		case <-release:
		case <-ctx.Done():
		}
		return "done", nil
	}, &streamq.ConsumerOptions{Name: "worker-slow", Workers: 1, Prefetch: 1, ReadBlock: 50 * time.Millisecond, Logger: log})
	require.NoError(t, err)
	stop = start(slow)
	require.NoError(t, p.Enqueue(ctx, "slow-1", "order slow-1"))
	waitState("slow-1", streamq.JobRunning)
	require.NoError(t, p.Enqueue(ctx, "queued-1", "order queued-1"))
	require.NoError(t, p.Enqueue(ctx, "queued-2", "order queued-2"))
	var once sync.Once
	finish := func() { once.Do(func() { close(release); stop() }) }
	t.Cleanup(finish)
	return finish
}

// TestCLIJobs: jobs ls lists each state, pages both ways, filters by id and
// error, and prints the library's JobsPage as JSON; jobs cancel and jobs run
// act on waiting jobs and say why they refuse others; history sums the
// outcomes. Exit codes as everywhere: 2 for a wrong command line, 3 for an
// unknown id or queue, 1 for a refusal.
func TestCLIJobs(t *testing.T) {
	srv := redistest.Start(t)
	client := srv.Client(t)
	finish := jobsSetup(t, client)
	defer finish()
	s := &session{t: t, url: "redis://" + srv.Addr() + "/0"}
	ctx := context.Background()
	admin := mustAdmin(t, client, "orders")

	s.golden("jobs-help", 0, "jobs", "--help")
	s.golden("jobs-ls-help", 0, "jobs", "ls", "--help")
	s.golden("jobs-ls-scheduled", 0, "jobs", "ls", "orders", "--state", "scheduled")
	s.golden("jobs-ls-retrying", 0, "jobs", "ls", "orders", "--state", "retrying")
	s.golden("jobs-ls-queued", 0, "jobs", "ls", "orders", "--state", "queued")
	s.golden("jobs-ls-running", 0, "jobs", "ls", "orders", "--state", "running")
	s.golden("jobs-ls-dead", 0, "jobs", "ls", "orders", "--state", "dead")
	s.golden("jobs-ls-dead-id", 0, "jobs", "ls", "orders", "--state", "dead", "--id", "bad-2")
	s.golden("jobs-ls-dead-error", 0, "jobs", "ls", "orders", "--state", "dead", "--error", "timeout")
	s.golden("jobs-ls-retrying-json", 0, "jobs", "ls", "orders", "--state", "retrying", "--json")
	s.golden("jobs-ls-no-state", ExitUsage, "jobs", "ls", "orders")
	s.golden("jobs-ls-bad-state", ExitUsage, "jobs", "ls", "orders", "--state", "pending")
	s.golden("jobs-ls-error-queued", ExitUsage, "jobs", "ls", "orders", "--state", "queued", "--error", "x")
	s.golden("jobs-ls-unknown-queue", ExitNotFound, "jobs", "ls", "ordrs", "--state", "dead")
	s.golden("jobs-ls-bad-cursor", ExitUsage, "jobs", "ls", "orders", "--state", "dead", "--cursor", "bogus")
	s.golden("job-retrying", 0, "job", "orders", "flaky-1")

	// Paging both ways, one dead letter a page: newest first.
	cursor := regexp.MustCompile(`next page: --cursor (\S+?)\)?$`)
	out := s.golden("jobs-ls-page-1", 0, "jobs", "ls", "orders", "--state", "dead", "--limit", "1")
	var seen []string
	var pages []string
	for range 3 {
		var p streamq.JobsPage
		args := []string{"jobs", "ls", "orders", "--state", "dead", "--limit", "1", "--json"}
		if len(pages) > 0 {
			args = append(args, "--cursor", pages[len(pages)-1])
		}
		stdout, stderr, code := s.run(args...)
		require.Equal(t, 0, code, stderr)
		require.NoError(t, json.Unmarshal([]byte(stdout), &p), "jobs ls --json into streamq.JobsPage")
		require.Len(t, p.Jobs, 1)
		require.EqualValues(t, 3, p.Total)
		seen = append(seen, p.Jobs[0].ID)
		require.Equal(t, len(pages) > 0, p.Prev != "", "a previous page after the first")
		if len(pages) < 2 {
			require.NotEmpty(t, p.Next)
		} else {
			require.Empty(t, p.Next, "the last page")
			// Back one page.
			stdout, _, code = s.run("jobs", "ls", "orders", "--state", "dead", "--limit", "1", "--json", "--cursor", p.Prev)
			require.Equal(t, 0, code)
			var back streamq.JobsPage
			require.NoError(t, json.Unmarshal([]byte(stdout), &back))
			require.Equal(t, "bad-2", back.Jobs[0].ID)
		}
		pages = append(pages, p.Next)
	}
	require.Equal(t, []string{"bad-3", "bad-2", "bad-1"}, seen)
	m := cursor.FindStringSubmatch(strings.TrimSpace(out))
	require.NotNil(t, m, "the table names the next page's cursor: %s", out)
	s.golden("jobs-ls-page-2", 0, "jobs", "ls", "orders", "--state", "dead", "--limit", "1", "--cursor", m[1])

	// Cancel and run now.
	s.golden("jobs-run", 0, "jobs", "run", "orders", "sched-2")
	j, err := admin.Job(ctx, "sched-2")
	require.NoError(t, err)
	require.Equal(t, streamq.JobQueued, j.State)
	s.golden("jobs-cancel", 0, "jobs", "cancel", "orders", "sched-1", "flaky-1")
	for _, id := range []string{"sched-1", "flaky-1"} {
		j, err = admin.Job(ctx, id)
		require.NoError(t, err)
		require.Equal(t, streamq.JobCanceled, j.State, id)
	}
	s.golden("jobs-cancel-queued", 0, "cancel", "orders", "queued-1")
	j, err = admin.Job(ctx, "queued-1")
	require.NoError(t, err)
	require.Equal(t, streamq.JobCanceled, j.State, "queued-1")
	s.golden("jobs-cancel-finished", ExitError, "cancel", "orders", "ok-1")
	s.golden("jobs-run-unknown", ExitNotFound, "jobs", "run", "orders", "never-produced")
	s.golden("jobs-cancel-missing-id", ExitUsage, "jobs", "cancel", "orders")
	s.golden("jobs-ls-scheduled-empty", 0, "jobs", "ls", "orders", "--state", "scheduled")

	// History: the minutes sum to what happened (the six outcomes of
	// deadLetterSetup, flaky-1's retry).
	stdout, stderr, code := s.run("history", "orders", "--json", "--span", "30m")
	require.Equal(t, 0, code, stderr)
	var pts []streamq.HistoryPoint
	require.NoError(t, json.Unmarshal([]byte(stdout), &pts), "history --json into []streamq.HistoryPoint")
	require.Len(t, pts, 30)
	var processed, failed int64
	for _, p := range pts {
		processed += p.Processed
		failed += p.Failed
	}
	require.EqualValues(t, 7, processed, "3 succeeded, 3 dead-lettered, 1 retry")
	require.EqualValues(t, 4, failed, "3 dead-lettered, 1 retry")
	stdout, _, code = s.run("history", "orders")
	require.Equal(t, 0, code)
	require.Regexp(t, `(?m)^MINUTE \(UTC\)\s+PROCESSED\s+FAILED$`, stdout)
	require.Regexp(t, `(?m)^last 1h: 7 processed, 4 failed \([12] of 60 minutes had any\)$`, stdout)
	s.golden("history-bad-span", ExitUsage, "history", "orders", "--span", "48h")
	s.golden("history-unknown-queue", ExitNotFound, "history", "ordrs")
}

// TestCLIJobsPriority: jobs ls lists the jobs of every priority level and
// adds a PRIORITY column when a job on the page has a level other than
// normal (the other goldens show that a page of normal jobs has none); the
// JSON names a non-default level and omits the default.
func TestCLIJobsPriority(t *testing.T) {
	srv := redistest.Start(t)
	client := srv.Client(t)
	ctx := context.Background()
	p, err := streamq.NewProducer[string, string](client, "rush", &streamq.ProducerOptions{Logger: slog.New(slog.DiscardHandler)})
	require.NoError(t, err)
	defer p.Close()
	require.NoError(t, p.Enqueue(ctx, "plain-1", "x"))
	_, err = p.Produce(ctx, "urgent-1", "x", streamq.Priority(streamq.PriorityHigh))
	require.NoError(t, err)
	_, err = p.Produce(ctx, "bulk-1", "x", streamq.Priority(streamq.PriorityLow))
	require.NoError(t, err)
	_, err = p.Produce(ctx, "bulk-later", "x", streamq.Priority(streamq.PriorityLow), streamq.After(time.Hour))
	require.NoError(t, err)
	s := &session{t: t, url: "redis://" + srv.Addr() + "/0"}
	s.golden("jobs-ls-queued-priority", 0, "jobs", "ls", "rush", "--state", "queued")
	s.golden("jobs-ls-scheduled-priority", 0, "jobs", "ls", "rush", "--state", "scheduled")
	stdout, stderr, code := s.run("jobs", "ls", "rush", "--state", "queued", "--json")
	require.Equal(t, 0, code, stderr)
	var page struct {
		Jobs []map[string]any `json:"jobs"`
	}
	require.NoError(t, json.Unmarshal([]byte(stdout), &page))
	levels := map[string]any{}
	for _, j := range page.Jobs {
		levels[j["id"].(string)] = j["priority"]
	}
	require.Equal(t, map[string]any{"plain-1": nil, "urgent-1": "high", "bulk-1": "low"}, levels)
}
