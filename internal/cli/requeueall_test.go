package cli

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/streamq/streamq"
	"github.com/streamq/streamq/internal/redistest"
)

// TestCLIRequeueAllOnceWithALiveConsumer: "dlq requeue --all" with a live
// consumer and a 2-delivery poison request requeues each dead letter once.
// Before, it paged on after the last id seen until a page came back empty,
// so the poison, dead-lettered again under a new id meanwhile, was requeued
// again and again.
func TestCLIRequeueAllOnceWithALiveConsumer(t *testing.T) {
	srv := redistest.Start(t)
	client := srv.Client(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var mu sync.Mutex
	starts := map[string]int{}
	c, err := streamq.NewConsumer(client, "poison", func(ctx context.Context, m *streamq.Message[string]) (string, error) {
		mu.Lock()
		starts[m.ID]++
		mu.Unlock()
		return "", errors.New("poison")
	}, &streamq.ConsumerOptions{Name: "w", MaxDeliveries: 2, RetryBackoff: time.Millisecond, RetryBackoffMax: time.Millisecond,
		ReadBlock: 20 * time.Millisecond, Logger: slog.New(slog.DiscardHandler)})
	require.NoError(t, err)
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	defer func() { cancel(); <-done }()
	p, err := streamq.NewProducer[string, string](client, "poison", &streamq.ProducerOptions{Logger: slog.New(slog.DiscardHandler)})
	require.NoError(t, err)
	defer p.Close()
	// Enough dead letters that the requeue takes longer than a poison
	// request takes to fail twice again.
	const n = 300
	for i := range n {
		require.NoError(t, p.Enqueue(ctx, fmt.Sprintf("p-%d", i), "x"))
	}
	a := mustAdmin(t, client, "poison")
	settled := func() {
		t.Helper()
		deadline := time.Now().Add(20 * time.Second)
		for {
			s, err := a.Stats(ctx)
			require.NoError(t, err)
			pending := int64(0)
			for _, g := range s.Groups {
				pending += g.Pending
			}
			if s.DeadLetters == n && s.Scheduled == 0 && s.Length == 0 && pending == 0 {
				return
			}
			require.True(t, time.Now().Before(deadline), "the queue did not settle: %+v", s)
			time.Sleep(10 * time.Millisecond)
		}
	}
	settled()
	s := &session{t: t, url: "redis://" + srv.Addr() + "/0"}
	stdout, stderr, code := s.run("dlq", "requeue", "poison", "--all", "--yes")
	require.Equal(t, 0, code, "stdout:\n%s\nstderr:\n%s", stdout, stderr)
	require.Equal(t, fmt.Sprintf("requeued %d dead letters\n", n), stdout)
	settled()
	mu.Lock()
	defer mu.Unlock()
	for i := range n {
		id := fmt.Sprintf("p-%d", i)
		require.Equal(t, 4, starts[id], "%s: two starts, requeued once, two more", id)
	}
}

// TestRedactURL: the password is hidden whole, also when it holds "@".
func TestRedactURL(t *testing.T) {
	for in, want := range map[string]string{
		"redis://user:secret@host:6379/0":    "redis://user:xxxxx@host:6379/0",
		"redis://user:p@ss@word@host:6379/0": "redis://user:xxxxx@host:6379/0",
		"rediss://:p@ss@host:6379":           "rediss://:xxxxx@host:6379",
		"redis://host:6379/0":                "redis://host:6379/0",
		"redis://user@host:6379/0":           "redis://user@host:6379/0",
		"redis://u:p@ss@h:1/0?addr=h2:2":     "redis://u:xxxxx@h:1/0?addr=h2:2",
		"not a url":                          "not a url",
	} {
		got := redactURL(in)
		require.Equal(t, want, got, "%s", in)
		require.False(t, strings.Contains(got, "ss@") || strings.Contains(got, "secret"), "%s leaks: %s", in, got)
	}
}
