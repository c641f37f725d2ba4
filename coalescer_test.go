package streamq

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func TestCoalescerSendsAtOnceAndBatchesWhatWaits(t *testing.T) {
	var mu sync.Mutex
	var batches [][]int
	release := make(chan struct{})
	started := make(chan struct{})
	sent := make(chan struct{}, 100)
	c := newCoalescer(1, 100, 1<<20, 0, func(int) int { return 1 }, func(b []int) {
		mu.Lock()
		first := len(batches) == 0 && b[0] == 0
		mu.Unlock()
		if first {
			close(started)
			<-release // hold the send so that later items gather
		}
		mu.Lock()
		batches = append(batches, append([]int(nil), b...))
		mu.Unlock()
		sent <- struct{}{}
	})
	require.True(t, c.add(0)) // goes alone: nothing else is waiting
	<-started
	for i := 1; i <= 10; i++ {
		require.True(t, c.add(i))
	}
	close(release)
	<-sent
	<-sent
	c.close()
	require.Equal(t, [][]int{{0}, {1, 2, 3, 4, 5, 6, 7, 8, 9, 10}}, batches)
}

func TestCoalescerRespectsLimits(t *testing.T) {
	var batches [][]int
	c := newCoalescer(1, 3, 10, 0, func(v int) int { return v }, func(b []int) {
		batches = append(batches, append([]int(nil), b...))
	})
	// Items may gather before the sender runs: close waits for all sends.
	for _, v := range []int{1, 1, 1, 1, 6, 6, 2} {
		require.True(t, c.add(v))
	}
	c.close()
	total := 0
	for _, b := range batches {
		require.LessOrEqual(t, len(b), 3, "item limit")
		sum := 0
		for _, v := range b {
			sum += v
		}
		require.LessOrEqual(t, sum, 10, "byte limit")
		total += len(b)
	}
	require.Equal(t, 7, total, "every item sent once, none split or dropped")
}

func TestCoalescerLingerWaitsForMore(t *testing.T) {
	got := make(chan []int, 10)
	c := newCoalescer(1, 100, 1<<20, 200*time.Millisecond, func(int) int { return 1 }, func(b []int) {
		got <- append([]int(nil), b...)
	})
	require.True(t, c.add(1))
	require.True(t, c.add(2)) // arrives within the linger
	require.Equal(t, []int{1, 2}, <-got)
	c.close()
}

func TestByteBudgetBlocksAndRespectsContext(t *testing.T) {
	b := newByteBudget(10)
	require.NoError(t, b.acquire(context.Background(), nil, 8))
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
	defer cancel()
	require.ErrorIs(t, b.acquire(ctx, nil, 5), context.DeadlineExceeded)
	done := make(chan error, 1)
	go func() { done <- b.acquire(context.Background(), nil, 5) }()
	b.release(8)
	require.NoError(t, <-done)
}

func TestParseNotice(t *testing.T) {
	var got [][2]string
	require.NoError(t, parseNotice("2:a12:Rx5:id:b:1:N", func(id, rec string) {
		got = append(got, [2]string{id, rec})
	}))
	require.Equal(t, [][2]string{{"a1", "Rx"}, {"id:b:", "N"}}, got)
	for _, bad := range []string{"x", "3:ab", "1:a", "1:a9:R", "-1:a"} {
		require.Error(t, parseNotice(bad, func(string, string) {}), bad)
	}
}

func TestRetryDelay(t *testing.T) {
	for d := 1; d <= 10; d++ {
		got := retryDelay(time.Second, d, 30*time.Second)
		want := min(time.Second<<(d-1), 30*time.Second)
		require.LessOrEqual(t, got, want)
		require.GreaterOrEqual(t, got, want/2)
	}
}

// TestCoalescerCloseWhileLingering: close lets every sender take what waits,
// so a sender that was lingering may find nothing left when it wakes.
func TestCoalescerCloseWhileLingering(t *testing.T) {
	var mu sync.Mutex
	var sent []int
	c := newCoalescer(2, 100, 1<<20, time.Second, func(int) int { return 1 }, func(b []int) {
		mu.Lock()
		sent = append(sent, b...)
		mu.Unlock()
	})
	require.True(t, c.add(1)) // a sender lingers with it for a second
	require.Eventually(t, func() bool {
		c.mu.Lock()
		defer c.mu.Unlock()
		return c.busy == 1 // the lingering sender counts as busy
	}, 5*time.Second, time.Millisecond)
	c.close() // the other sender takes the item; the lingering one wakes to nothing
	require.Equal(t, []int{1}, sent)
	require.False(t, c.add(2), "closed")
}
