package streamq

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"
)

// TestPauseStateInStats: Pause and Resume set and clear the queue's pause
// key, Stats shows it, and both are idempotent (miniredis and Redis).
func TestPauseStateInStats(t *testing.T) {
	backends(t, func(t *testing.T, client *redis.Client) {
		ctx := context.Background()
		a, err := NewAdmin(client, queueName(t), nil)
		require.NoError(t, err)
		_, err = a.Stats(ctx)
		require.ErrorIs(t, err, ErrNotFound, "nothing of the queue exists yet")
		require.NoError(t, a.Pause(ctx))
		_, err = a.Stats(ctx)
		require.NoError(t, err, "a paused queue exists")
		require.NoError(t, a.Resume(ctx))
		p, err := NewProducer[string, string](client, a.queue, nil)
		require.NoError(t, err)
		defer p.Close()
		require.NoError(t, p.Enqueue(ctx, "one", "x"))
		s, err := a.Stats(ctx)
		require.NoError(t, err)
		require.False(t, s.Paused)
		require.True(t, s.PausedAt.IsZero())
		before := time.Now().Add(-time.Second)
		require.NoError(t, a.Pause(ctx))
		s, err = a.Stats(ctx)
		require.NoError(t, err)
		require.True(t, s.Paused)
		require.True(t, s.PausedAt.After(before), "PausedAt %v", s.PausedAt)
		first := s.PausedAt
		require.NoError(t, a.Pause(ctx), "pausing a paused queue changes nothing")
		s, err = a.Stats(ctx)
		require.NoError(t, err)
		require.Equal(t, first, s.PausedAt)
		require.NoError(t, a.Resume(ctx))
		require.NoError(t, a.Resume(ctx))
		s, err = a.Stats(ctx)
		require.NoError(t, err)
		require.False(t, s.Paused)
	})
}

// startLog records handler starts per request id, with their times.
type startLog struct {
	mu     sync.Mutex
	starts map[string][]time.Time
	deliv  map[string]int // Message.Deliveries at the last start
}

func newStartLog() *startLog {
	return &startLog{starts: map[string][]time.Time{}, deliv: map[string]int{}}
}

func (l *startLog) handler(hold time.Duration) Handler[string, string] {
	return func(ctx context.Context, m *Message[string]) (string, error) {
		l.mu.Lock()
		l.starts[m.ID] = append(l.starts[m.ID], time.Now())
		l.deliv[m.ID] = m.Deliveries
		l.mu.Unlock()
		if hold > 0 {
			select {
			case <-time.After(hold):
			case <-ctx.Done():
			}
		}
		return "ok:" + m.Payload, nil
	}
}

// between counts the starts in [from, to].
func (l *startLog) between(from, to time.Time) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	n := 0
	for _, ts := range l.starts {
		for _, at := range ts {
			if !at.Before(from) && !at.After(to) {
				n++
			}
		}
	}
	return n
}

func (l *startLog) count() int { return l.between(time.Time{}, time.Now().Add(time.Hour)) }

// TestPauseStopsStartsAndResumeDrains (real Redis): after Pause no consumer
// starts a handler (allowing the documented PauseCheckInterval plus a round
// trip), running handlers finish, producers keep accepting; a consumer started
// while paused starts nothing either; after Resume the backlog drains, each
// request started exactly once (waiting cost no delivery, and the held
// entries kept their lease past MinIdle).
func TestPauseStopsStartsAndResumeDrains(t *testing.T) {
	t.Parallel()
	client := realRedis(t)
	ctx := context.Background()
	q := queueName(t)
	admin, err := NewAdmin(client, q, nil)
	require.NoError(t, err)
	p, err := NewProducer[string, string](client, q, &ProducerOptions{Logger: testLogger(t)})
	require.NoError(t, err)
	defer p.Close()
	log := newStartLog()
	newC := func(name string) *Consumer[string, string] {
		c, err := NewConsumer(client, q, log.handler(20*time.Millisecond), &ConsumerOptions{
			Name: name, Workers: 4, MinIdle: 300 * time.Millisecond, Logger: testLogger(t)})
		require.NoError(t, err)
		return c
	}
	runConsumer(t, newC("a"))
	runConsumer(t, newC("b"))

	var promises []*Promise[string]
	produce := func(prefix string, n int) {
		for i := range n {
			pr, err := p.Produce(ctx, fmt.Sprintf("%s-%d", prefix, i), "x")
			require.NoError(t, err)
			promises = append(promises, pr)
		}
	}
	produce("before", 20)
	eventually(t, 10*time.Second, func() bool { return log.count() == 20 }, "the first jobs run")

	require.NoError(t, admin.Pause(ctx))
	paused := time.Now()
	quiet := paused.Add(PauseCheckInterval + 500*time.Millisecond)
	time.Sleep(time.Until(quiet)) // the documented bound: nothing to await
	produce("during", 100)        // producers keep accepting
	runConsumer(t, newC("late"))  // starts on a paused queue
	// Longer than MinIdle several times: held entries keep their lease.
	time.Sleep(2 * time.Second)
	s, err := admin.Stats(ctx)
	require.NoError(t, err)
	require.True(t, s.Paused)
	require.EqualValues(t, 100, s.Groups[0].Lag+s.Groups[0].Pending, "the requests wait: %+v", s.Groups[0])
	resumeAt := time.Now()
	graceStarts := log.between(paused, quiet)
	require.Zero(t, log.between(quiet, resumeAt), "no handler starts while paused")
	require.NoError(t, admin.Resume(ctx))
	for _, pr := range promises {
		got, err := pr.Wait(ctx)
		require.NoError(t, err)
		require.Equal(t, "ok:x", got)
	}
	var firstAfter time.Time
	log.mu.Lock()
	for id, ts := range log.starts {
		require.Len(t, ts, 1, "%s started once", id)
		require.Equal(t, 1, log.deliv[id], "%s: waiting cost no delivery", id)
		if ts[0].After(resumeAt) && (firstAfter.IsZero() || ts[0].Before(firstAfter)) {
			firstAfter = ts[0]
		}
	}
	log.mu.Unlock()
	t.Logf("starts in the first %v after Pause returned: %d; first start %v after Resume returned",
		quiet.Sub(paused), graceStarts, firstAfter.Sub(resumeAt))
}
