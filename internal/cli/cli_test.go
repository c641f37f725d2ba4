package cli

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/streamq/streamq"
	"github.com/streamq/streamq/internal/redistest"
)

var update = flag.Bool("update", false, "rewrite the golden files under testdata")

// session runs command lines against one Redis and compares each with its
// golden file: the command, its stdout, its stderr and its exit code, with
// what changes from run to run (stream ids, times, durations) replaced.
type session struct {
	t   *testing.T
	url string
}

func (s *session) run(args ...string) (stdout, stderr string, code int) {
	var out, errOut bytes.Buffer
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	code = Main(ctx, args, &out, &errOut, func(k string) string {
		if k == "REDIS_URL" {
			return s.url
		}
		return ""
	})
	return out.String(), errOut.String(), code
}

// golden runs args, checks the exit code, and compares with testdata/<name>.golden.
func (s *session) golden(name string, wantCode int, args ...string) string {
	s.t.Helper()
	stdout, stderr, code := s.run(args...)
	require.Equal(s.t, wantCode, code, "exit code of %v\nstdout:\n%s\nstderr:\n%s", args, stdout, stderr)
	got := "$ streamq " + strings.Join(args, " ") + "\n" + stdout
	if stderr != "" {
		got += "[stderr]\n" + stderr
	}
	got += fmt.Sprintf("[exit %d]\n", code)
	got = normalize(got)
	path := filepath.Join("testdata", name+".golden")
	if *update {
		require.NoError(s.t, os.MkdirAll("testdata", 0o755))
		require.NoError(s.t, os.WriteFile(path, []byte(got), 0o644))
		return stdout
	}
	want, err := os.ReadFile(path)
	require.NoError(s.t, err, "no golden file: run go test ./internal/cli -run %s -update", s.t.Name())
	require.Equal(s.t, string(want), got, "output of %v differs from %s (go test -update rewrites it)", args, path)
	return stdout
}

var normalizers = []struct {
	re   *regexp.Regexp
	with string
}{
	{regexp.MustCompile(`\b\d{13}-\d+\b`), "<id>"},
	{regexp.MustCompile(`\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?(Z|[+-]\d\d:\d\d)`), "<time>"},
	{regexp.MustCompile(`"(\w+_ns)": -?\d+`), `"$1": <ns>`},
	{regexp.MustCompile(`\b\d{13}\b`), "<ms>"},
	{regexp.MustCompile(`\b\d+(\.\d+)?(µs|ms|s|m\d+s|h\d+m\d+s)\b`), "<dur>"},
	{regexp.MustCompile(`redis://127\.0\.0\.1:\d+`), "redis://<addr>"},
	// Cursors of jobs ls are opaque.
	{regexp.MustCompile(`--cursor [^;)\s]+`), "--cursor <cursor>"},
	{regexp.MustCompile(`"(next|prev)": "[^"]*"`), `"$1": "<cursor>"`},
	// tabwriter pads to the widest cell, which differs once values are
	// replaced: compare columns, not spaces.
	{regexp.MustCompile(`(\S) {2,}`), "$1  "},
	{regexp.MustCompile(` +\n`), "\n"},
}

func normalize(s string) string {
	for _, n := range normalizers {
		s = n.re.ReplaceAllString(s, n.with)
	}
	return s
}

// deadLetterSetup fills queue "orders" on srv: ok-1..ok-3 succeed, bad-1..bad-3
// are dead-lettered ("card declined"); the consumer "worker-1" is stopped
// afterwards. It also creates queue "emails" with a backlog of 2 and one
// request scheduled an hour ahead.
func deadLetterSetup(t *testing.T, client *redis.Client) {
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
	}, &streamq.ConsumerOptions{Name: "worker-1", ReadBlock: 50 * time.Millisecond, Logger: log})
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

	e, err := streamq.NewProducer[string, string](client, "emails", &streamq.ProducerOptions{Logger: log})
	require.NoError(t, err)
	defer e.Close()
	require.NoError(t, e.Enqueue(ctx, "welcome-1", "hi"))
	require.NoError(t, e.Enqueue(ctx, "welcome-2", "hi"))
	_, err = e.Produce(ctx, "welcome-later", "hi", streamq.After(time.Hour))
	require.NoError(t, err)
}

// TestCLISession is an operator's session against a queue with dead letters:
// list, show, requeue, job status, forget, purge, and the errors on the way.
func TestCLISession(t *testing.T) {
	srv := redistest.Start(t)
	client := srv.Client(t)
	deadLetterSetup(t, client)
	s := &session{t: t, url: "redis://" + srv.Addr() + "/0"}

	s.golden("help", 0, "--help")
	s.golden("queues", 0, "queues")
	s.golden("queues-json", 0, "queues", "--json")
	s.golden("stats", 0, "stats", "orders")
	s.golden("stats-json", 0, "stats", "orders", "--json")
	s.golden("stats-emails", 0, "stats", "emails")
	s.golden("consumers", 0, "consumers", "orders")
	s.golden("dlq-ls", 0, "dlq", "ls", "orders")
	s.golden("dlq-ls-page", 0, "dlq", "ls", "orders", "--limit", "2")
	s.golden("dlq-ls-json", 0, "dlq", "ls", "--json", "orders", "--limit", "1")
	// The CLI's JSON is the library's: it decodes into its types.
	out, _, code := s.run("dlq", "ls", "--json", "orders")
	require.Equal(t, 0, code)
	var listed []streamq.DeadLetter
	require.NoError(t, json.Unmarshal([]byte(out), &listed), "dlq ls --json into []streamq.DeadLetter")
	want, err := mustAdmin(t, client, "orders").DeadLetters(context.Background(), "", 10)
	require.NoError(t, err)
	require.Len(t, listed, len(want))
	for i := range want {
		require.True(t, want[i].At.Equal(listed[i].At))
		listed[i].At = want[i].At
	}
	require.Equal(t, want, listed)
	out, _, code = s.run("dlq", "show", "--json", "orders", want[0].DeadLetterID)
	require.Equal(t, 0, code)
	var shown streamq.DeadLetter
	require.NoError(t, json.Unmarshal([]byte(out), &shown), "dlq show --json into streamq.DeadLetter")
	require.Equal(t, want[0].Payload, shown.Payload)
	out, _, code = s.run("job", "--json", "orders", "ok-2")
	require.Equal(t, 0, code)
	var jobInfo streamq.JobInfo
	require.NoError(t, json.Unmarshal([]byte(out), &jobInfo), "job --json into streamq.JobInfo")
	require.Equal(t, `"receipt for order ok-2"`, string(jobInfo.Result))
	s.golden("job-succeeded-json", 0, "job", "orders", "ok-2", "--json")

	ctx := context.Background()
	admin, err := streamq.NewAdmin(client, "orders", nil)
	require.NoError(t, err)
	dls, err := admin.DeadLetters(ctx, "", 10)
	require.NoError(t, err)
	require.Len(t, dls, 3)
	s.golden("dlq-show", 0, "dlq", "show", "orders", dls[0].DeadLetterID)
	s.golden("dlq-requeue", 0, "dlq", "requeue", "orders", dls[0].DeadLetterID)
	s.golden("job-requeued", 0, "job", "orders", "bad-1")
	s.golden("job-succeeded", 0, "job", "orders", "ok-1")
	s.golden("job-dead-json", 0, "job", "orders", "bad-2", "--json")
	s.golden("forget-no-yes", ExitUsage, "forget", "orders", "ok-1")
	s.golden("forget", 0, "forget", "orders", "ok-1", "--yes")
	s.golden("job-forgotten", ExitNotFound, "job", "orders", "ok-1")
	s.golden("purge-no-yes", ExitUsage, "dlq", "purge", "orders", "--all")
	s.golden("purge-all", 0, "dlq", "purge", "orders", "--all", "--yes")
	s.golden("dlq-ls-empty", 0, "dlq", "ls", "orders")
	s.golden("trim", 0, "trim", "orders")

	s.golden("job-scheduled", 0, "job", "emails", "welcome-later")
	// A cancelled request is a state of its own, not a record of another kind.
	ep, err := streamq.NewProducer[string, string](client, "emails", &streamq.ProducerOptions{Logger: slog.New(slog.DiscardHandler)})
	require.NoError(t, err)
	_, err = ep.Produce(ctx, "welcome-canceled", "hi", streamq.After(time.Hour))
	require.NoError(t, err)
	require.NoError(t, ep.Close())
	require.NoError(t, mustAdmin(t, client, "emails").Cancel(ctx, "welcome-canceled"))
	s.golden("job-canceled", 0, "job", "emails", "welcome-canceled")
	// A debounced request: its mode and the latest it runs (times vary: no golden file).
	dp, err := streamq.NewProducer[string, string](client, "emails", &streamq.ProducerOptions{Logger: slog.New(slog.DiscardHandler)})
	require.NoError(t, err)
	_, err = dp.Produce(ctx, "welcome-debounced", "hi", streamq.Debounce(time.Hour, 2*time.Hour))
	require.NoError(t, err)
	require.NoError(t, dp.Close())
	out, _, code = s.run("job", "emails", "welcome-debounced")
	require.Equal(t, 0, code, out)
	require.Contains(t, out, "debounce (runs at due unless produced again; at the latest ")
	out, _, code = s.run("job", "--json", "emails", "welcome-debounced")
	require.Equal(t, 0, code, out)
	require.NoError(t, json.Unmarshal([]byte(out), &jobInfo))
	require.Equal(t, "debounce", jobInfo.Mode)
	require.False(t, jobInfo.ModeUntil.IsZero())
	require.NoError(t, mustAdmin(t, client, "emails").Forget(ctx, "welcome-debounced", false)) // the golden stats that follow
	s.golden("job-canceled-json", 0, "job", "emails", "welcome-canceled", "--json")
	s.golden("pause", 0, "pause", "emails")
	s.golden("stats-paused", 0, "stats", "emails")
	out, _, code = s.run("stats", "emails", "--json")
	require.Equal(t, 0, code)
	var counted streamq.Stats
	require.NoError(t, json.Unmarshal([]byte(out), &counted), "stats --json into streamq.Stats")
	require.EqualValues(t, 1, counted.Canceled, "welcome-canceled")
	s.golden("queues-paused", 0, "queues")
	st, err := mustAdmin(t, client, "emails").Stats(ctx)
	require.NoError(t, err)
	require.True(t, st.Paused)
	s.golden("resume", 0, "resume", "emails")
	st, err = mustAdmin(t, client, "emails").Stats(ctx)
	require.NoError(t, err)
	require.False(t, st.Paused)
	s.golden("pause-unknown-queue", ExitNotFound, "pause", "ordrs")

	// Fair queuing by key: a paused key's jobs wait and are listed first.
	require.NoError(t, mustAdmin(t, client, "emails").PauseKey(ctx, "tenant-a"))
	require.NoError(t, mustAdmin(t, client, "emails").SetKeyRate(ctx, "tenant-b", &streamq.RateLimit{N: 1, Per: time.Minute, Burst: 1}))
	kp, err := streamq.NewProducer[string, string](client, "emails", &streamq.ProducerOptions{Logger: slog.New(slog.DiscardHandler)})
	require.NoError(t, err)
	for i := range 3 {
		_, err = kp.Produce(ctx, fmt.Sprint("keyed-a", i), "hi", streamq.Key("tenant-a"))
		require.NoError(t, err)
	}
	_, err = kp.Produce(ctx, "keyed-b", "hi", streamq.Key("tenant-b"))
	require.NoError(t, err)
	require.NoError(t, kp.Close())
	s.golden("keys-ls", 0, "keys", "ls", "emails")
	s.golden("keys-ls-one-json", 0, "keys", "ls", "emails", "tenant-b", "--json")
	s.golden("keys-resume", 0, "keys", "resume", "emails", "tenant-a")
	s.golden("keys-ls-resumed", 0, "keys", "ls", "emails", "--limit", "1")
	s.golden("keys-pause-unknown-queue", ExitNotFound, "keys", "pause", "ordrs", "tenant-a")

	s.golden("stats-unknown-queue", ExitNotFound, "stats", "ordrs")
	s.golden("unknown-command", ExitUsage, "stat", "orders")
	s.golden("missing-subcommand", ExitUsage, "dlq")
	s.golden("missing-argument", ExitUsage, "job", "orders")
	s.golden("bad-flag", ExitUsage, "stats", "orders", "--wat")
	s.golden("requeue-help", 0, "dlq", "requeue", "--help")
	s.golden("unreachable", ExitError, "--redis", "redis://127.0.0.1:1/0", "--timeout", "2s", "queues")
	s.golden("bad-url", ExitUsage, "--redis", "http://user:secret@host", "queues")

	// The requeued dead letter runs once a consumer is back, and job says so.
	c, err := streamq.NewConsumer(client, "orders", func(ctx context.Context, m *streamq.Message[string]) (string, error) {
		return "second try of " + m.Payload, nil
	}, &streamq.ConsumerOptions{Name: "worker-2", ReadBlock: 50 * time.Millisecond, Logger: slog.New(slog.DiscardHandler)})
	require.NoError(t, err)
	runCtx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- c.Run(runCtx) }()
	require.Eventually(t, func() bool {
		j, err := admin.Job(ctx, "bad-1")
		return err == nil && j.State == streamq.JobSucceeded
	}, 20*time.Second, 10*time.Millisecond)
	s.golden("job-after-requeue", 0, "job", "orders", "bad-1")
	cancel()
	require.NoError(t, <-done)
}

// TestCLIStatsWatch: --watch refreshes and shows rates from the second
// refresh on; --count bounds it; the context ends it.
func TestCLIStatsWatch(t *testing.T) {
	srv := redistest.Start(t)
	client := srv.Client(t)
	deadLetterSetup(t, client)
	s := &session{t: t, url: "redis://" + srv.Addr() + "/0"}
	out := s.golden("stats-watch", 0, "stats", "orders", "--watch", "--interval", "20ms", "--count", "2")
	require.Equal(t, 2, strings.Count(out, "--- "))

	ctx, cancel := context.WithCancel(context.Background())
	var buf bytes.Buffer
	done := make(chan int, 1)
	go func() {
		done <- Main(ctx, []string{"--redis", s.url, "stats", "orders", "--watch", "--interval", "10ms"}, &buf, &buf, func(string) string { return "" })
	}()
	cancel()
	select {
	case code := <-done:
		require.Equal(t, ExitOK, code)
	case <-time.After(10 * time.Second):
		t.Fatal("stats --watch did not return after its context ended")
	}
}

// TestCLIBinary builds cmd/streamq and runs it, with REDIS_URL from the
// environment, as a user would.
func TestCLIBinary(t *testing.T) {
	srv := redistest.Start(t)
	client := srv.Client(t)
	deadLetterSetup(t, client)
	bin := filepath.Join(t.TempDir(), "streamq")
	gobin := filepath.Join(runtime.GOROOT(), "bin", "go")
	build := exec.Command(gobin, "build", "-o", bin, "github.com/streamq/streamq/cmd/streamq")
	out, err := build.CombinedOutput()
	require.NoError(t, err, "go build: %s", out)

	cmd := exec.Command(bin, "dlq", "ls", "orders", "--json")
	cmd.Env = append(os.Environ(), "REDIS_URL=redis://"+srv.Addr()+"/0")
	out, err = cmd.Output()
	require.NoError(t, err)
	require.Equal(t, 3, strings.Count(string(out), `"error": "card declined"`), "%s", out)

	cmd = exec.Command(bin, "job", "orders", "nope")
	cmd.Env = append(os.Environ(), "REDIS_URL=redis://"+srv.Addr()+"/0")
	err = cmd.Run()
	var exit *exec.ExitError
	require.ErrorAs(t, err, &exit)
	require.Equal(t, ExitNotFound, exit.ExitCode())

	out, err = exec.Command(bin, "version").Output()
	require.NoError(t, err)
	require.True(t, strings.HasPrefix(string(out), "streamq "), "%s", out)
}

func mustAdmin(t *testing.T, client *redis.Client, queue string) *streamq.Admin {
	t.Helper()
	a, err := streamq.NewAdmin(client, queue, nil)
	require.NoError(t, err)
	return a
}

// TestCLIRequeueInFlight: a dead letter whose request id was produced again
// (for later, with RetryFailed) is not requeued, alone or with --all; --all
// requeues the others and lists it. Before, both appended a second entry for
// the id.
func TestCLIRequeueInFlight(t *testing.T) {
	srv := redistest.Start(t)
	client := srv.Client(t)
	deadLetterSetup(t, client)
	s := &session{t: t, url: "redis://" + srv.Addr() + "/0"}
	ctx := context.Background()
	p, err := streamq.NewProducer[string, string](client, "orders", &streamq.ProducerOptions{Logger: slog.New(slog.DiscardHandler)})
	require.NoError(t, err)
	defer p.Close()
	_, err = p.Produce(ctx, "bad-2", "order bad-2 again", streamq.RetryFailed(), streamq.After(time.Hour))
	require.NoError(t, err)
	dls, err := mustAdmin(t, client, "orders").DeadLetters(ctx, "", 10)
	require.NoError(t, err)
	require.Equal(t, "bad-2", dls[1].ID)

	s.golden("dlq-requeue-inflight", ExitError, "dlq", "requeue", "orders", dls[1].DeadLetterID)
	require.Zero(t, client.XLen(ctx, "streamq:{orders}:stream").Val())
	ms, _, _ := strings.Cut(dls[0].DeadLetterID, "-")
	s.golden("dlq-requeue-no-seq", ExitUsage, "dlq", "requeue", "orders", ms)
	s.golden("dlq-requeue-all-inflight", ExitError, "dlq", "requeue", "orders", "--all", "--yes")
	var ids []string
	msgs, err := client.XRange(ctx, "streamq:{orders}:stream", "-", "+").Result()
	require.NoError(t, err)
	for _, m := range msgs {
		ids = append(ids, m.Values["id"].(string))
	}
	require.Equal(t, []string{"bad-1", "bad-3"}, ids, "one entry each, none for bad-2")
	s.golden("dlq-ls-inflight", 0, "dlq", "ls", "orders")
}

// TestCLIHelpEverywhere: every command, subcommand and command group prints
// its help on --help and -h and exits 0. Before, "dlq --help" exited 2 with
// "dlq needs a subcommand".
func TestCLIHelpEverywhere(t *testing.T) {
	s := &session{t: t, url: "redis://127.0.0.1:1/0"} // help needs no Redis
	s.golden("dlq-help", 0, "dlq", "--help")
	s.golden("dlq-h", 0, "dlq", "-h")
	s.golden("help-dlq", 0, "help", "dlq")
	for _, c := range commands {
		for _, flag := range []string{"--help", "-h"} {
			args := append(strings.Fields(c.name), flag)
			stdout, stderr, code := s.run(args...)
			require.Equal(t, ExitOK, code, "%v: %s", args, stderr)
			require.Empty(t, stderr, "%v", args)
			require.True(t, strings.HasPrefix(stdout, "Usage: streamq "+c.name), "%v: %s", args, stdout)
		}
	}
}

// TestCLIRedisDownShowsOneMessage: with Redis down, the binary prints its own
// message only. Before, go-redis's logger wrote four "pool.go" lines to
// stderr first.
func TestCLIRedisDownShowsOneMessage(t *testing.T) {
	bin := buildCLI(t)
	cmd := exec.Command(bin, "--redis", "redis://127.0.0.1:1/0", "--timeout", "2s", "queues")
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err := cmd.Run()
	var exit *exec.ExitError
	require.ErrorAs(t, err, &exit)
	require.Equal(t, ExitError, exit.ExitCode())
	require.Empty(t, stdout.String())
	require.Equal(t, "streamq: list queues: dial tcp 127.0.0.1:1: connect: connection refused\n", stderr.String())
}

// buildCLI builds cmd/streamq into a temporary directory.
func buildCLI(t *testing.T) string {
	t.Helper()
	bin := filepath.Join(t.TempDir(), "streamq")
	gobin := filepath.Join(runtime.GOROOT(), "bin", "go")
	out, err := exec.Command(gobin, "build", "-o", bin, "github.com/streamq/streamq/cmd/streamq").CombinedOutput()
	require.NoError(t, err, "go build: %s", out)
	return bin
}

// TestCLIJobShowsAFlow: a waiting flow parent lists its children, and a
// request's progress shows.
func TestCLIJobShowsAFlow(t *testing.T) {
	srv := redistest.Start(t)
	client := srv.Client(t)
	s := &session{t: t, url: "redis://" + srv.Addr() + "/0"}
	ctx := context.Background()
	reports := streamq.NewQueue[string, string]("reports")
	pages := streamq.NewQueue[string, string]("pages")
	p, err := reports.NewProducer(client, &streamq.ProducerOptions{Logger: slog.New(slog.DiscardHandler)})
	require.NoError(t, err)
	defer p.Close()
	_, err = p.ProduceFlow(ctx, "report-1", "r", []streamq.Child{
		streamq.ChildOf(pages, "page-1", "p1"), streamq.ChildOf(pages, "page-2", "p2"),
	}, nil)
	require.NoError(t, err)
	// A stored progress value, as a handler's Message.Progress leaves it.
	require.NoError(t, client.Set(ctx, "streamq:{pages}:progress:page-1", `3:{"percent":40}`, time.Hour).Err())
	s.golden("job-flow-waiting", 0, "job", "reports", "report-1")
	s.golden("job-progress", 0, "job", "pages", "page-1")
}

// TestCLIStatsByPriority: stats prints each level's depth once the queue
// uses priority levels.
func TestCLIStatsByPriority(t *testing.T) {
	srv := redistest.Start(t)
	client := srv.Client(t)
	ctx := context.Background()
	p, err := streamq.NewProducer[string, string](client, "urgent", nil)
	require.NoError(t, err)
	defer p.Close()
	for i, lvl := range []streamq.PriorityLevel{streamq.PriorityHigh, streamq.PriorityLow, streamq.PriorityLow} {
		err := p.Enqueue(ctx, fmt.Sprint(i), "x", streamq.Priority(lvl))
		require.NoError(t, err)
	}
	s := &session{t: t, url: "redis://" + srv.Addr() + "/0"}
	out, _, code := s.run("stats", "urgent")
	require.Equal(t, ExitOK, code)
	require.Contains(t, out, "by priority: high 1 (0 pending), normal 0 (0 pending), low 2 (0 pending)\n")
}

// TestCLIDeadLetterShowsItsPriority: "job" prints the level of a queued
// request, and "dlq show" that of a dead letter that had one (Requeue puts
// it back on that level); nothing for the default level.
func TestCLIDeadLetterShowsItsPriority(t *testing.T) {
	srv := redistest.Start(t)
	client := srv.Client(t)
	ctx := context.Background()
	p, err := streamq.NewProducer[string, string](client, "urgent", nil)
	require.NoError(t, err)
	defer p.Close()
	require.NoError(t, p.Enqueue(ctx, "hi", "x", streamq.Priority(streamq.PriorityHigh)))
	require.NoError(t, p.Enqueue(ctx, "plain", "x"))
	s := &session{t: t, url: "redis://" + srv.Addr() + "/0"}
	out, _, code := s.run("job", "urgent", "hi")
	require.Equal(t, ExitOK, code)
	require.Regexp(t, `(?m)^priority +high$`, out)
	out, _, code = s.run("job", "urgent", "plain")
	require.Equal(t, ExitOK, code)
	require.NotContains(t, out, "priority")
	c, err := streamq.NewConsumer(client, "urgent", func(ctx context.Context, m *streamq.Message[string]) (string, error) {
		return "", streamq.Permanent(errors.New("no"))
	}, nil)
	require.NoError(t, err)
	runCtx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- c.Run(runCtx) }()
	admin, err := streamq.NewAdmin(client, "urgent", nil)
	require.NoError(t, err)
	var dls []streamq.DeadLetter
	require.Eventually(t, func() bool {
		dls, err = admin.DeadLetters(ctx, "", 10)
		return err == nil && len(dls) == 2
	}, 10*time.Second, 10*time.Millisecond)
	stop()
	require.NoError(t, <-done)
	for _, d := range dls {
		out, _, code := s.run("dlq", "show", "urgent", d.DeadLetterID)
		require.Equal(t, ExitOK, code)
		if d.ID == "hi" {
			require.Regexp(t, `(?m)^priority +high$`, out)
		} else {
			require.NotContains(t, out, "priority")
		}
	}
}
