package streamq

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func TestReadAheadStartsLowGrowsWhenStarvedAndDecays(t *testing.T) {
	a := newReadAhead(1, 128, false)
	require.Equal(t, 4, a.current(), "floor: 2×Workers+2")

	// Starved takes grow the target by half, up to Prefetch.
	var got []int
	for range 12 {
		n, _ := a.took(true)
		got = append(got, n)
	}
	require.Equal(t, []int{6, 9, 13, 19, 28, 42, 63, 94, 128, 128, 128, 128}, got)

	// 4×target quiet takes lower it by one; never below the floor.
	for range 4*128 - 1 {
		_, changed := a.took(false)
		require.False(t, changed)
	}
	n, changed := a.took(false)
	require.True(t, changed)
	require.Equal(t, 127, n)
	for range 1_000_000 {
		a.took(false)
	}
	require.Equal(t, 4, a.current())

	require.Equal(t, 3, newReadAhead(10, 3, false).current(), "the floor is at most Prefetch")
	require.Equal(t, 64, newReadAhead(1, 64, true).current(), "holdPrefetch starts at Prefetch")
}

// TestFairnessSlowJobsAreSharedByALateConsumer: with the defaults (Workers
// 1, Prefetch 128), a consumer started while another works through a backlog
// of slow jobs gets a fair part of it. Before the read-ahead adapted, the first
// consumer took the whole backlog into its ring and the second ran nothing.
func TestFairnessSlowJobsAreSharedByALateConsumer(t *testing.T) {
	t.Parallel()
	client := realRedis(t)
	q := queueName(t)
	const n, work = 60, 50 * time.Millisecond
	p := newStringProducer(t, client, q)
	prs := produceAll(t, p, seqIDs("slow", n))

	var mu sync.Mutex
	ran := map[string]string{}
	var started atomic.Int64
	firstStarted := make(chan struct{})
	handler := func(name string) Handler[string, string] {
		return func(ctx context.Context, m *Message[string]) (string, error) {
			if started.Add(1) == 1 {
				close(firstStarted)
			}
			time.Sleep(work) // the job's work
			mu.Lock()
			ran[m.ID] = name
			mu.Unlock()
			return name, nil
		}
	}
	begin := time.Now()
	a, err := NewConsumer(client, q, handler("A"), &ConsumerOptions{Name: "A", Logger: testLogger(t)})
	require.NoError(t, err)
	runConsumer(t, a)
	<-firstStarted
	time.Sleep(200 * time.Millisecond) // B arrives while A works
	b, err := NewConsumer(client, q, handler("B"), &ConsumerOptions{Name: "B", Logger: testLogger(t)})
	require.NoError(t, err)
	runConsumer(t, b)

	for _, pr := range prs {
		_, err := pr.Wait(waitCtx(t, 60*time.Second))
		require.NoError(t, err)
	}
	took := time.Since(begin)
	mu.Lock()
	defer mu.Unlock()
	require.Len(t, ran, n)
	byB := 0
	for _, who := range ran {
		if who == "B" {
			byB++
		}
	}
	ideal := 200*time.Millisecond + (n*work-200*time.Millisecond)/2
	t.Logf("A ran %d, B ran %d; %v for about %v ideal (%.2fx)", n-byB, byB, took.Round(time.Millisecond), ideal, took.Seconds()/ideal.Seconds())
	// A holds about 2×Workers+2 entries ahead, so B, once running, shares
	// the rest; a generous bound, as B's start can be slow on a loaded machine.
	require.GreaterOrEqual(t, byB, 10, "the late consumer got too little of the backlog")
}
