package streamq

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/streamq/streamq/internal/scripts"
)

func TestRateLimitOptions(t *testing.T) {
	c, _ := miniRedis(t)
	h := func(context.Context, *Message[string]) (string, error) { return "", nil }
	for _, bad := range []RateLimit{{N: 0, Per: time.Second}, {N: 1}, {N: 1, Per: -time.Second},
		{N: 2_000_000, Per: time.Second}, {N: 5, Per: time.Second, Burst: 6}, {N: 5, Per: time.Second, Burst: -1}} {
		_, err := NewConsumer(c, "q", h, &ConsumerOptions{RateLimit: &bad})
		require.ErrorIs(t, err, ErrInvalidOptions, "%+v", bad)
		t.Log(err)
	}
	rl := &RateLimit{N: 3, Per: time.Second}
	cons, err := NewConsumer(c, "q", h, &ConsumerOptions{RateLimit: rl})
	require.NoError(t, err)
	require.Equal(t, 1, cons.opts.RateLimit.Burst, "Burst defaults to 1")
	require.Zero(t, rl.Burst, "the caller's value is not changed")
	require.Equal(t, 333334*time.Microsecond, cons.opts.RateLimit.interval(), "rounded up: never above the rate")
}

// TestRateLimitScriptGCRA runs ratelimit.lua on miniredis's clock (TIME in a
// script follows SetTime): grants within the horizon, the burst, the wait.
func TestRateLimitScriptGCRA(t *testing.T) {
	c, m := miniRedis(t)
	ctx := context.Background()
	now := time.Unix(1_800_000_000, 0)
	m.SetTime(now)
	take := func(T, B, want int) []int64 {
		res, err := scripts.RateLimit.Run(ctx, c, []string{"streamq:{q}:rate:g"}, T, B, want, 100_000).Int64Slice()
		require.NoError(t, err)
		require.Equal(t, now.UnixMicro(), res[2])
		return res[:2]
	}
	// T = 5ms, burst 1, horizon 100ms: 21 tokens are usable within it.
	require.Equal(t, []int64{10, 0}, take(5000, 1, 10), "10 wanted: the first at once")
	require.Equal(t, []int64{11, 50_000}, take(5000, 1, 20), "the rest of the horizon, from 50ms on")
	require.Equal(t, []int64{0, 5000}, take(5000, 1, 5), "none within the horizon: wait 5ms")
	now = now.Add(5 * time.Millisecond)
	m.SetTime(now)
	require.Equal(t, []int64{1, 100_000}, take(5000, 1, 5))
	// After a quiet time the burst is usable at once.
	now = now.Add(time.Minute)
	m.SetTime(now)
	require.Equal(t, []int64{3, -10_000}, take(5000, 3, 3), "three at once: first offset -2T")
}

// TestRateLimitSharedByConsumers (real Redis): four consumers of one queue
// with a limit of 200 starts per second for 5 s. GCRA guarantees that in any
// 1 s window of the server's clock at most 200 + Burst tokens become usable;
// the test checks that on every grant, and measures the handler starts.
func TestRateLimitSharedByConsumers(t *testing.T) {
	t.Parallel()
	client := realRedis(t)
	ctx := context.Background()
	q := queueName(t)
	const rate, burst, jobs = 200, 5, 1600
	p, err := NewProducer[string, string](client, q, &ProducerOptions{Logger: testLogger(t)})
	require.NoError(t, err)
	defer p.Close()
	batch := make([]Job[string], 0, 400)
	for i := range jobs {
		batch = append(batch, Job[string]{ID: fmt.Sprintf("j-%d", i), Request: "x"})
		if len(batch) == cap(batch) {
			prs, err := p.ProduceBatch(ctx, batch)
			require.NoError(t, err)
			for _, pr := range prs {
				pr.Release()
			}
			batch = batch[:0]
		}
	}

	var mu sync.Mutex
	var usable []time.Time // server time from which each granted token may be used
	interval := time.Second / rate
	log := newStartLog()
	var stops []func()
	for i := range 4 {
		c, err := NewConsumer(client, q, log.handler(0), &ConsumerOptions{
			Name: fmt.Sprintf("c%d", i), Workers: 8, Logger: testLogger(t),
			RateLimit: &RateLimit{N: rate, Per: time.Second, Burst: burst}})
		require.NoError(t, err)
		c.onGrant = func(now time.Time, first time.Duration, n int) {
			mu.Lock()
			defer mu.Unlock()
			for i := range n {
				usable = append(usable, now.Add(max(0, first+time.Duration(i)*interval)))
			}
		}
		stops = append(stops, runConsumer(t, c))
	}
	eventually(t, 10*time.Second, func() bool { return log.count() > 0 }, "the first start")
	log.mu.Lock()
	var t0 time.Time
	for _, ts := range log.starts {
		if t0.IsZero() || ts[0].Before(t0) {
			t0 = ts[0]
		}
	}
	log.mu.Unlock()
	time.Sleep(time.Until(t0.Add(5*time.Second + 200*time.Millisecond)))
	for _, stop := range stops {
		stop()
	}
	n := log.between(t0, t0.Add(5*time.Second))
	avg := float64(n) / 5

	// Client-side: handler starts per sliding 1 s window (measured only:
	// the delay from grant to start varies with scheduling).
	var starts []time.Time
	log.mu.Lock()
	for _, ts := range log.starts {
		starts = append(starts, ts...)
	}
	log.mu.Unlock()
	maxStarts := maxInWindow(starts, time.Second)

	mu.Lock()
	grants := slices.Clone(usable)
	mu.Unlock()
	maxGrants := maxInWindow(grants, time.Second)
	t.Logf("rate limit %d/s burst %d, 4 consumers x 8 workers: %d starts in 5s = %.1f/s (%.1f%% of the limit); "+
		"max starts in any 1s window %d; max tokens usable in any 1s window of the server's clock %d (bound %d); %d tokens granted",
		rate, burst, n, avg, 100*avg/rate, maxStarts, maxGrants, rate+burst, len(grants))
	require.LessOrEqual(t, maxGrants, rate+burst, "GCRA: never above the limit plus the burst")
	require.Greater(t, avg, 0.8*rate, "the limit is used, not starved")
	require.LessOrEqual(t, n, 5*rate+burst+rate/10, "about the limit")
	for id, ts := range log.starts {
		require.Len(t, ts, 1, "%s started once: waiting cost no delivery", id)
		require.Equal(t, 1, log.deliv[id])
	}
}

// maxInWindow returns the most times in any closed window of length w.
func maxInWindow(ts []time.Time, w time.Duration) int {
	slices.SortFunc(ts, func(a, b time.Time) int { return a.Compare(b) })
	best, j := 0, 0
	for i := range ts {
		for ts[i].Sub(ts[j]) > w {
			j++
		}
		best = max(best, i-j+1)
	}
	return best
}
