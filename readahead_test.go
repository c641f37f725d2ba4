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

func TestRingTargetBoundsReservations(t *testing.T) {
	ctx := context.Background()
	r := newRing(10, 1)
	r.setTarget(3)
	n, err := r.reserve(ctx, 10)
	require.NoError(t, err)
	require.Equal(t, 3, n)
	require.True(t, r.binding())

	got := make(chan int)
	go func() { n, _ := r.reserve(ctx, 10); got <- n }()
	select {
	case n := <-got:
		t.Fatalf("reserved %d places beyond the target", n)
	case <-time.After(20 * time.Millisecond):
	}
	r.setTarget(5) // a raised target wakes the waiting feeder
	require.Equal(t, 2, <-got)
	r.give(5)
	require.False(t, r.binding())
}

// TestRingReadsSeveralAtOnceUnderLoad: while slots wait in the ring, a
// feeder waits until half the target is free and then reads that much in one
// call, instead of one read per completion that frees a place or two. Once no
// slot waits (a worker may be idle) it reads whatever room there is, so long
// handlers holding most places never keep an idle worker from the backlog.
// Before, each freed place was read on its own.
func TestRingReadsSeveralAtOnceUnderLoad(t *testing.T) {
	r := newRing(100, 1)
	r.setTarget(10)
	n, err := r.reserve(context.Background(), 100)
	require.NoError(t, err)
	require.Equal(t, 10, n)
	for range n {
		r.push(&slot{})
	}
	for range 4 { // four workers take a slot each; six wait
		_, _, ok := r.take()
		require.True(t, ok)
	}

	r.give(2) // two outcomes recorded: 8 out, 2 free within the target
	short, cancel := context.WithTimeout(context.Background(), 30*time.Millisecond)
	defer cancel()
	n, err = r.reserve(short, 100)
	require.ErrorIs(t, err, context.DeadlineExceeded, "reserved %d places with 8 of 10 out and 6 slots waiting", n)

	r.give(3) // 5 out, 5 free: half the target
	n, err = r.reserve(context.Background(), 100)
	require.NoError(t, err)
	require.Equal(t, 5, n)
	r.give(5) // nothing read after all

	// Long handlers hold 5 places and 3 more go out: 2 are free, too few
	// while slots wait; the workers take the last of them: the feeder reads
	// at once.
	n, err = r.reserve(context.Background(), 3)
	require.NoError(t, err)
	require.Equal(t, 3, n)
	got := make(chan int, 1)
	go func() {
		n, _ := r.reserve(context.Background(), 100)
		got <- n
	}()
	for r.queuedSlots() > 0 {
		_, ok := r.tryTake()
		require.True(t, ok)
	}
	require.Equal(t, 2, <-got, "the room left once no slot waits")
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

// TestRingReserveWaitsWithoutSpinning: a feeder held back by the target
// waits for a signal; it must not wake itself (it did, spinning a core).
func TestRingReserveWaitsWithoutSpinning(t *testing.T) {
	r := newRing(10, 1)
	r.setTarget(2)
	n, err := r.reserve(context.Background(), 10)
	require.NoError(t, err)
	require.Equal(t, 2, n)
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	_, err = r.reserve(ctx, 10) // free places, but the target binds
	require.ErrorIs(t, err, context.DeadlineExceeded)
	r.mu.Lock()
	wake := r.wake
	r.mu.Unlock()
	require.NotNil(t, wake, "the feeder waited on no signal")
	select {
	case <-wake:
		t.Fatal("a waiting feeder signalled itself")
	default:
	}
}

// TestRingSharesTheTargetBetweenShards: with a target smaller than the
// shards' reads, one reservation takes at most target/shards, so every
// shard's feeder gets a place while the others hold theirs (as a feeder
// blocked reading an empty shard does), and the cut counts as binding.
func TestRingSharesTheTargetBetweenShards(t *testing.T) {
	const shards = 6
	r := newRing(128, shards)
	r.setTarget(10)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	for i := range shards {
		n, err := r.reserve(ctx, 21)
		require.NoError(t, err, "feeder %d got no place while the others hold theirs", i)
		require.Equal(t, 1, n, "feeder %d took more than its share", i)
	}
	require.True(t, r.binding(), "a reservation cut to its share binds")

	// One shard alone may not exceed the target either.
	one := newRing(128, 1)
	one.setTarget(10)
	n, err := one.reserve(ctx, 21)
	require.NoError(t, err)
	require.Equal(t, 10, n)
}
