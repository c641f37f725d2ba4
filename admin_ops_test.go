package streamq

import (
	"context"
	"errors"
	"fmt"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/streamq/streamq/internal/crashtest"
)

// TestAdminJobLifecycle follows ids through every state Job reports, and
// Forget: refused while running, forced, and an id forgotten runs again.
func TestAdminJobLifecycle(t *testing.T) {
	t.Parallel()
	client := realRedis(t)
	ctx := context.Background()
	q := queueName(t)
	admin, err := NewAdmin(client, q, nil)
	require.NoError(t, err)
	_, err = admin.Job(ctx, "x")
	require.ErrorIs(t, err, ErrNotFound, "unknown queue")
	_, err = admin.Stats(ctx)
	require.ErrorIs(t, err, ErrNotFound, "unknown queue")
	_, err = admin.Consumers(ctx)
	require.ErrorIs(t, err, ErrNotFound, "unknown queue")

	p := newStringProducer(t, client, q)
	for _, id := range []string{"ok", "bad", "hold", "queued"} {
		require.NoError(t, p.Enqueue(ctx, id, "payload-"+id))
	}
	j, err := admin.Job(ctx, "ok")
	require.NoError(t, err)
	require.Equal(t, JobQueued, j.State)
	require.NotEmpty(t, j.EntryID)
	require.WithinDuration(t, time.Now(), j.Enqueued, time.Minute)
	require.Greater(t, j.TTL, time.Duration(0))
	_, err = admin.Job(ctx, "never")
	require.ErrorIs(t, err, ErrNotFound)

	runs := map[string]int{}
	held := make(chan struct{}, 1)
	release := make(chan struct{})
	c, err := NewConsumer(client, q, func(ctx context.Context, m *Message[string]) (string, error) {
		runs[m.ID]++ // one worker: no race
		switch m.ID {
		case "bad":
			return "", Permanent(errors.New("refused for good"))
		case "hold":
			held <- struct{}{}
			select {
			case <-release:
			case <-ctx.Done():
			}
		case "queued":
			t.Error("a forgotten queued request ran")
		}
		return "done-" + m.Payload, nil
	}, &ConsumerOptions{Name: "worker-1", Workers: 1, Prefetch: 1, ReadBlock: 50 * time.Millisecond, Logger: testLogger(t)})
	require.NoError(t, err)
	// Forget a queued request: it is removed and never runs.
	require.NoError(t, admin.Forget(ctx, "queued", false))
	_, err = admin.Job(ctx, "queued")
	require.ErrorIs(t, err, ErrNotFound)

	stop := runConsumer(t, c)
	<-held
	j, err = admin.Job(ctx, "hold")
	require.NoError(t, err)
	require.Equal(t, JobRunning, j.State)
	require.Equal(t, "worker-1", j.Consumer)
	require.Equal(t, 1, j.Deliveries)
	err = admin.Forget(ctx, "hold", false)
	require.ErrorIs(t, err, ErrJobRunning)
	require.ErrorContains(t, err, "worker-1")

	eventually(t, 10*time.Second, func() bool {
		j, err = admin.Job(ctx, "ok")
		return err == nil && j.State == JobSucceeded
	}, "ok succeeded: %+v %v", j, err)
	require.Equal(t, `"done-payload-ok"`, string(j.Result))
	require.Greater(t, j.TTL, time.Duration(0))
	require.LessOrEqual(t, j.TTL, DefaultResultTTL)
	eventually(t, 10*time.Second, func() bool {
		j, err = admin.Job(ctx, "bad")
		return err == nil && j.State == JobDeadLettered
	}, "bad dead-lettered: %+v %v", j, err)
	dls, err := admin.DeadLetters(ctx, "", 10)
	require.NoError(t, err)
	require.Len(t, dls, 1)
	dl, err := admin.DeadLetter(ctx, dls[0].DeadLetterID)
	require.NoError(t, err)
	require.Equal(t, dls[0], dl)
	_, err = admin.DeadLetter(ctx, "0-1")
	require.ErrorIs(t, err, ErrNotFound)
	require.Contains(t, j.Error, "refused for good")

	// Forget a finished id: producing it again runs it again.
	require.NoError(t, admin.Forget(ctx, "ok", false))
	_, err = admin.Job(ctx, "ok")
	require.ErrorIs(t, err, ErrNotFound)
	close(release)
	pr, err := p.Produce(ctx, "ok", "again")
	require.NoError(t, err)
	got, err := pr.Wait(waitCtx(t, 20*time.Second))
	require.NoError(t, err)
	require.Equal(t, "done-again", got)
	var st Stats
	eventually(t, 10*time.Second, func() bool {
		st, err = admin.Stats(ctx)
		return err == nil && st.Groups[0].Succeeded == 3 && st.Groups[0].Failed == 1
	}, "heartbeat totals: 3 succeeded (ok twice, hold), 1 failed (bad): %+v %v", st, err)
	stop()
	require.Equal(t, 2, runs["ok"], "ran again after Forget")
	require.Zero(t, runs["queued"])
	require.NoError(t, admin.Forget(ctx, "ok", false))
	require.ErrorIs(t, admin.Forget(ctx, "ok", false), ErrNotFound)
}

// TestAdminForgetForced: forced, Forget removes a running request's record
// and its entry from the group's pending list.
func TestAdminForgetForced(t *testing.T) {
	t.Parallel()
	client := realRedis(t)
	ctx := context.Background()
	q := queueName(t)
	p := newStringProducer(t, client, q)
	require.NoError(t, p.Enqueue(ctx, "stuck", "x"))
	held := make(chan struct{})
	c, err := NewConsumer(client, q, func(ctx context.Context, m *Message[string]) (string, error) {
		close(held)
		<-ctx.Done()
		return "", ctx.Err()
	}, &ConsumerOptions{Name: "w", ReadBlock: 50 * time.Millisecond, ShutdownTimeout: time.Second, Logger: testLogger(t)})
	require.NoError(t, err)
	runConsumer(t, c)
	<-held
	admin, err := NewAdmin(client, q, nil)
	require.NoError(t, err)
	require.NoError(t, admin.Forget(ctx, "stuck", true))
	_, err = admin.Job(ctx, "stuck")
	require.ErrorIs(t, err, ErrNotFound)
	stream, _, _, _ := firstShardKeys(t, admin)
	require.Zero(t, client.XLen(ctx, stream).Val(), "entry deleted")
	pend, err := client.XPending(ctx, stream, DefaultGroup).Result()
	require.NoError(t, err)
	require.Zero(t, pend.Count, "entry acknowledged")
}

// TestAdminQueuesAndConsumers: Queues finds queues by their meta key;
// Consumers lists each consumer with its pending count and liveness.
func TestAdminQueuesAndConsumers(t *testing.T) {
	t.Parallel()
	client := realRedis(t)
	ctx := context.Background()
	q1, q2 := queueName(t), queueName(t)
	newStringProducer(t, client, q1)
	p2, err := NewProducer[string, string](client, q2, &ProducerOptions{Shards: 3, Logger: testLogger(t)})
	require.NoError(t, err)
	t.Cleanup(func() { _ = p2.Close() })
	require.NoError(t, p2.Enqueue(ctx, "a", "x")) // records the meta key
	_, err = newStringProducer(t, client, q1).Produce(ctx, "b", "y")
	require.NoError(t, err)
	qs, err := Queues(ctx, client)
	require.NoError(t, err)
	require.Contains(t, qs, q1)
	require.Contains(t, qs, q2)

	c, err := NewConsumer(client, q2, func(ctx context.Context, m *Message[string]) (string, error) { return "", nil },
		&ConsumerOptions{Name: "alive", Shards: 3, ReadBlock: 50 * time.Millisecond, ClaimInterval: 50 * time.Millisecond, Logger: testLogger(t)})
	require.NoError(t, err)
	stop := runConsumer(t, c)
	admin, err := NewAdmin(client, q2, &AdminOptions{StaleAfter: 5 * time.Second})
	require.NoError(t, err)
	var cs []ConsumerInfo
	eventually(t, 10*time.Second, func() bool {
		j, err := admin.Job(ctx, "a")
		return err == nil && j.State == JobSucceeded
	}, "a ran")
	eventually(t, 10*time.Second, func() bool {
		cs, err = admin.Consumers(ctx)
		return err == nil && len(cs) == 1 && cs[0].Live && !cs[0].LastSeen.IsZero() && cs[0].Succeeded == 1
	}, "consumer listed live: %+v %v", cs, err)
	require.Equal(t, ConsumerInfo{Group: DefaultGroup, Name: "alive", Pending: 0, Idle: cs[0].Idle, LastSeen: cs[0].LastSeen, Succeeded: 1, Live: true}, cs[0])
	stop()
	cs, err = admin.Consumers(ctx)
	require.NoError(t, err)
	require.Len(t, cs, 1, "Redis still lists the consumer")
	require.True(t, cs[0].Stopped, "a clean stop says so: %+v", cs[0])
	require.False(t, cs[0].Live)
	require.EqualValues(t, 1, cs[0].Succeeded)
	s, err := admin.Stats(ctx)
	require.NoError(t, err)
	require.Zero(t, s.Groups[0].Consumers)
	require.Zero(t, s.Groups[0].StaleConsumers, "a clean stop is not stale")
}

// TestAdminStatsCountsLiveConsumers is the case: 6 consumer processes,
// 5 SIGKILLed, 1 kept running: Stats counts 1 live consumer (Redis lists 6).
func TestAdminStatsCountsLiveConsumers(t *testing.T) {
	t.Parallel()
	client := realRedis(t)
	ctx := context.Background()
	q := queueName(t)
	p := newStringProducer(t, client, q)
	ids := seqIDs("job", 60)
	prs := produceAll(t, p, ids)
	const staleAfter = 2 * time.Second
	admin, err := NewAdmin(client, q, &AdminOptions{StaleAfter: staleAfter})
	require.NoError(t, err)
	var children []*crashtest.Proc
	for i := range 6 {
		children = append(children, crashtest.Start(t, "TestCrashHelperProcess", crashConfig{
			Addr: sharedAddr(t), Queue: q, Mode: "work", Name: fmt.Sprintf("c%d", i),
			Workers: 2, Prefetch: 4, MinIdle: time.Second, MaxDeliveries: 5,
		}))
	}
	var s Stats
	eventually(t, 30*time.Second, func() bool {
		s, err = admin.Stats(ctx)
		return err == nil && len(s.Groups) == 1 && s.Groups[0].Consumers == 6
	}, "6 live consumers: %+v %v", s, err)
	for _, c := range children[:5] {
		c.Kill()
		require.True(t, c.KilledBy(syscall.SIGKILL))
	}
	killed := time.Now()
	eventually(t, 30*time.Second, func() bool {
		s, err = admin.Stats(ctx)
		return err == nil && s.Groups[0].Consumers == 1
	}, "1 live consumer after 5 were killed: %+v %v", s, err)
	t.Logf("after SIGKILL of 5 of 6 consumers: Stats.Groups[0].Consumers=%d StaleConsumers=%d (%v after the kill, StaleAfter %v)",
		s.Groups[0].Consumers, s.Groups[0].StaleConsumers, time.Since(killed).Round(time.Millisecond), staleAfter)
	require.EqualValues(t, 5, s.Groups[0].StaleConsumers)
	require.GreaterOrEqual(t, time.Since(killed), staleAfter-time.Second, "the killed ones counted live until stale")
	cs, err := admin.Consumers(ctx)
	require.NoError(t, err)
	require.Len(t, cs, 6)
	for _, c := range cs {
		require.Equal(t, c.Name == "c5", c.Live, "%+v", c)
	}
	requireResults(t, client, q, ids, prs, time.Now().Add(60*time.Second))
}
