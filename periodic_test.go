package streamq

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/streamq/streamq/internal/keys"
)

func TestEveryIsAlignedToTheEpoch(t *testing.T) {
	s := Every(90 * time.Minute)
	day := time.Date(2026, 12, 1, 0, 0, 0, 0, time.UTC)
	require.Equal(t, day.Add(90*time.Minute), s.Next(day))
	require.Equal(t, day.Add(90*time.Minute), s.Next(day.Add(time.Minute)), "not relative to the time given")
	require.Equal(t, day.Add(3*time.Hour), s.Next(day.Add(90*time.Minute)), "strictly after")
	sec := Every(time.Second)
	at := time.Date(2026, 12, 1, 10, 0, 0, 400_000_000, time.UTC)
	require.Equal(t, at.Truncate(time.Second).Add(time.Second), sec.Next(at))
	require.Equal(t, at.Truncate(time.Second), sec.(every).latest(at))
	require.Panics(t, func() { Every(0) })
}

func TestCronSpecs(t *testing.T) {
	at := time.Date(2026, 12, 1, 10, 30, 0, 0, time.UTC)
	s, err := Cron("0 2 * * *")
	require.NoError(t, err)
	require.True(t, time.Date(2026, 12, 2, 2, 0, 0, 0, time.UTC).Equal(s.Next(at)), "UTC by default: %v", s.Next(at))
	s, err = Cron("@hourly")
	require.NoError(t, err)
	require.True(t, time.Date(2026, 12, 1, 11, 0, 0, 0, time.UTC).Equal(s.Next(at)))
	s, err = Cron("@every 1m30s")
	require.NoError(t, err)
	require.Equal(t, Every(90*time.Second), s, "@every is aligned like Every")
	if _, err := time.LoadLocation("Europe/Berlin"); err == nil {
		s, err = Cron("CRON_TZ=Europe/Berlin 0 2 * * *")
		require.NoError(t, err)
		require.True(t, time.Date(2026, 12, 2, 1, 0, 0, 0, time.UTC).Equal(s.Next(at)), "%v", s.Next(at))
	}
	for _, bad := range []string{"", "61 * * * *", "* * * *", "@every -1s", "@every soon", "@sometimes"} {
		_, err := Cron(bad)
		require.ErrorIs(t, err, ErrInvalidOptions, "%q", bad)
	}
}

func TestPeriodicRegisterValidates(t *testing.T) {
	c, _ := miniRedis(t)
	p, err := NewProducer[string, string](c, queueName(t), nil)
	require.NoError(t, err)
	defer p.Close()
	pd, err := NewPeriodic(p, nil)
	require.NoError(t, err)
	req := func(time.Time) (string, error) { return "x", nil }
	for _, bad := range []PeriodicJob[string]{
		{Schedule: Every(time.Second), Request: req},
		{Name: "a@b", Schedule: Every(time.Second), Request: req},
		{Name: strings.Repeat("n", 257), Schedule: Every(time.Second), Request: req},
		{Name: "a", Request: req},
		{Name: "a", Schedule: Every(time.Second)},
		{Name: "a", Schedule: Every(time.Second), Request: req, Missed: 7},
	} {
		require.ErrorIs(t, pd.Register(bad), ErrInvalidOptions)
	}
	require.NoError(t, pd.Register(PeriodicJob[string]{Name: "a", Schedule: Every(time.Second), Request: req}))
	require.ErrorIs(t, pd.Register(PeriodicJob[string]{Name: "a", Schedule: Every(time.Second), Request: req}), ErrInvalidOptions)
	require.Equal(t, "a@2026-12-01T02:00:00Z", PeriodicID("a", time.Date(2026, 12, 1, 3, 0, 0, 0, time.FixedZone("CET", 3600))))
	require.Equal(t, "a@2026-12-01T02:00:00.5Z", PeriodicID("a", time.Date(2026, 12, 1, 2, 0, 0, 500_000_000, time.UTC)))
}

// TestPeriodicReplicasRunEachSlotOnce (real Redis): three replicas register
// the same 1-second schedule and run for 10 s: about 10 slots run (one more
// or less at the edges), none twice, with no leader.
func TestPeriodicReplicasRunEachSlotOnce(t *testing.T) {
	t.Parallel()
	client := realRedis(t)
	q := queueName(t)
	log := newStartLog()
	c, err := NewConsumer(client, q, log.handler(0), &ConsumerOptions{Workers: 4, Logger: testLogger(t)})
	require.NoError(t, err)
	runConsumer(t, c)

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var built sync.Map // slot -> how many replicas built its request
	var wg sync.WaitGroup
	returned := make(chan time.Time, 3)
	start := time.Now()
	for i := range 3 {
		p, err := NewProducer[string, string](sameServer(client), q, &ProducerOptions{Logger: testLogger(t)})
		require.NoError(t, err)
		defer p.Close()
		pd, err := NewPeriodic(p, &PeriodicOptions{Logger: testLogger(t)})
		require.NoError(t, err)
		require.NoError(t, pd.Register(PeriodicJob[string]{Name: "tick", Schedule: Every(time.Second),
			Request: func(slot time.Time) (string, error) {
				n, _ := built.LoadOrStore(slot, new(atomic.Int64))
				n.(*atomic.Int64).Add(1)
				return fmt.Sprint(i), nil
			}}))
		wg.Go(func() {
			require.NoError(t, pd.Run(ctx))
			returned <- time.Now()
		})
	}
	time.Sleep(time.Until(start.Add(10 * time.Second)))
	cancel()
	stopped := time.Now()
	wg.Wait()
	var slowest time.Duration
	for range 3 {
		slowest = max(slowest, (<-returned).Sub(stopped))
	}
	admin, err := NewAdmin(client, q, nil)
	require.NoError(t, err)
	eventually(t, 10*time.Second, func() bool {
		s, err := admin.Stats(context.Background())
		return err == nil && len(s.Groups) == 1 && s.Length == 0 && s.Groups[0].Pending == 0
	}, "the queue drains")

	log.mu.Lock()
	defer log.mu.Unlock()
	seen := map[time.Time]bool{}
	for id, ts := range log.starts {
		require.Len(t, ts, 1, "%s ran once", id)
		name, at, ok := strings.Cut(id, "@")
		require.True(t, ok)
		require.Equal(t, "tick", name)
		slot, err := time.Parse(time.RFC3339Nano, at)
		require.NoError(t, err)
		require.Equal(t, slot, slot.Truncate(time.Second), "aligned slots")
		require.False(t, seen[slot])
		seen[slot] = true
	}
	var attempts int64
	built.Range(func(_, v any) bool { attempts += v.(*atomic.Int64).Load(); return true })
	t.Logf("3 replicas, Every(1s), 10s: %d slots ran, each once; the replicas built %d requests for them "+
		"(deduplication or the recorded last slot kept one each); Run returned %v after cancel at the slowest", len(seen), attempts, slowest)
	require.InDelta(t, 10, len(seen), 1, "10 slots, one more or less at the edges")
	require.Less(t, slowest, time.Second, "Run returns promptly after ctx ends")

	h, err := client.HGetAll(context.Background(), keys.Periodic(q)).Result()
	require.NoError(t, err)
	last, err := strconv.ParseInt(h["tick:last"], 10, 64)
	require.NoError(t, err)
	next, err := strconv.ParseInt(h["tick:next"], 10, 64)
	require.NoError(t, err)
	require.EqualValues(t, 1000, next-last, "last and next fire recorded: %v", h)
}

// TestPeriodicMissedSlots (miniredis): a job that last ran three hours ago
// gets its latest missed slot once with RunLatestMissed, however many
// replicas start; with SkipMissed it does not.
func TestPeriodicMissedSlots(t *testing.T) {
	client, _ := miniRedis(t)
	q := queueName(t)
	k, err := keys.New(q)
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	latest := time.Now().Truncate(time.Hour)
	if time.Until(latest.Add(time.Hour)) < 5*time.Second {
		t.Skip("too close to the hour: the slot would change under the test")
	}
	threeHoursAgo := latest.Add(-3 * time.Hour).UnixMilli()
	require.NoError(t, client.HSet(ctx, keys.Periodic(q), "catchup:last", threeHoursAgo, "skip:last", threeHoursAgo).Err())
	req := func(time.Time) (string, error) { return "x", nil }
	var wg sync.WaitGroup
	for range 2 {
		p, err := NewProducer[string, string](client, q, &ProducerOptions{Logger: testLogger(t)})
		require.NoError(t, err)
		defer p.Close()
		pd, err := NewPeriodic(p, &PeriodicOptions{Logger: testLogger(t)})
		require.NoError(t, err)
		require.NoError(t, pd.Register(PeriodicJob[string]{Name: "catchup", Schedule: Every(time.Hour), Request: req, Missed: RunLatestMissed}))
		require.NoError(t, pd.Register(PeriodicJob[string]{Name: "skip", Schedule: Every(time.Hour), Request: req}))
		wg.Go(func() { _ = pd.Run(ctx) })
	}
	eventually(t, 5*time.Second, func() bool {
		h := client.HGetAll(ctx, keys.Periodic(q)).Val()
		return h["catchup:last"] == strconv.FormatInt(latest.UnixMilli(), 10) && h["skip:next"] != "" && h["catchup:next"] != ""
	}, "the latest missed slot is recorded")
	cancel()
	wg.Wait()
	ctx = context.Background()
	require.EqualValues(t, 1, client.Exists(ctx, k.Record(PeriodicID("catchup", latest))).Val())
	require.EqualValues(t, 1, client.XLen(ctx, k.Stream).Val(), "one entry: the catch-up, once")
	require.EqualValues(t, 0, client.Exists(ctx, k.Record(PeriodicID("skip", latest))).Val())
	require.Equal(t, strconv.FormatInt(threeHoursAgo, 10), client.HGet(ctx, keys.Periodic(q), "skip:last").Val())
}
