package streamq

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

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

// TestRingPausedQueueHoldsNoReadAhead: in a ring of two queues, a queue
// paused while its slots fill the read-ahead target keeps them, but they
// stop counting against the target, so the other queue still reads, and
// the paused queue reads nothing more; the workers take only the other's.
// Before, the paused queue's slots (skipped by the workers) held the whole
// target and the other queue's feeder never got room again (its requests
// waited for the resume: seen in a MultiConsumer).
func TestRingPausedQueueHoldsNoReadAhead(t *testing.T) {
	r := newSharedRing(64, 2, 2)
	r.setTarget(6)
	ctx := context.Background()
	for got := 0; got < 6; {
		n, err := r.reserveClass(ctx, classOf(0, levelNormal), 6-got)
		require.NoError(t, err)
		for range n {
			r.push(&slot{queue: 0})
		}
		got += n
	}
	r.setPaused(0, true)
	wctx, cancel := context.WithTimeout(ctx, time.Second)
	defer cancel()
	n, err := r.reserveClass(wctx, classOf(1, levelNormal), 4)
	require.NoError(t, err, "the paused queue's slots held the read-ahead")
	require.Positive(t, n)
	short, cancel2 := context.WithTimeout(ctx, 50*time.Millisecond)
	defer cancel2()
	_, err = r.reserveClass(short, classOf(0, levelNormal), 1)
	require.ErrorIs(t, err, context.DeadlineExceeded, "a paused queue read more")
	r.push(&slot{queue: 1})
	s, ok := r.tryTake()
	require.True(t, ok)
	require.Equal(t, 1, s.queue)
	_, ok = r.tryTake()
	require.False(t, ok, "a paused queue's slot was taken")
	r.setPaused(0, false)
	s, ok = r.tryTake()
	require.True(t, ok)
	require.Equal(t, 0, s.queue)
}

// TestRingTokenWaitersHoldUntilTheLast: the rate-limit hold of a queue is
// a count of waiting workers: two workers that took the queue's slots
// before either said it waits both hold it, and the first to get its token
// does not release it while the second still waits (it did, a bool: a
// third worker then took a slot and waited too).
func TestRingTokenWaitersHoldUntilTheLast(t *testing.T) {
	r := newSharedRing(64, 2, 2)
	for range 3 {
		r.push(&slot{queue: 0})
	}
	r.addWaiting(0, 1)
	r.addWaiting(0, 1)
	r.addWaiting(0, -1)
	_, ok := r.tryTake()
	require.False(t, ok, "taken while a worker still waits for the queue's token")
	r.addWaiting(0, -1)
	_, ok = r.tryTake()
	require.True(t, ok)
}

// The ring keeps push order, grows with what it holds and gives memory back
// once drained; closing it ends the workers' range after the queued slots.
func TestRingGrowsAndShrinksInOrder(t *testing.T) {
	r := newRing(MaxPrefetch, 1)
	require.Empty(t, r.qs[0].q[levelNormal].buf, "no storage before the first push")
	ctx := context.Background()
	const n = 5000
	got, err := r.reserve(ctx, n)
	require.NoError(t, err)
	require.Equal(t, n, got)
	for i := range n {
		r.push(&slot{entry: Entry{EntryID: fmt.Sprint(i)}})
	}
	require.LessOrEqual(t, len(r.qs[0].q[levelNormal].buf), 2*n)
	r.close()
	i := 0
	for s := range r.slots {
		require.Equal(t, fmt.Sprint(i), s.entry.EntryID)
		i++
	}
	require.Equal(t, n, i)
	require.LessOrEqual(t, len(r.qs[0].q[levelNormal].buf), ringKeepCap, "storage shrinks as the ring drains")
}

// TestPriorityRingTakes: the ring's choice among queued levels. Strict takes
// every higher slot first; weighted takes follow the weights in every window
// of one round (sum of weights), while all levels stay queued, and a level
// with nothing queued gives its turns away.
func TestRingPriorityTakes(t *testing.T) {
	fill := func(r *ring, per int) {
		for i := range per {
			for l := range numLevels {
				r.push(&slot{level: l, entry: Entry{EntryID: fmt.Sprint(i)}})
			}
		}
	}
	t.Run("strict", func(t *testing.T) {
		r := newRing(1000, 1)
		r.qs[0].strict = true
		fill(r, 50)
		var got []int
		for range 150 {
			s, ok := r.tryTake()
			require.True(t, ok)
			got = append(got, s.level)
		}
		for i, l := range got {
			require.Equal(t, levelOrder[i/50], l, "take %d", i)
		}
	})
	t.Run("weighted", func(t *testing.T) {
		r := newRing(1000, 1)
		for l := range numLevels {
			r.qs[0].weights[l] = DefaultPriorityWeights[weightIndex[l]]
		}
		round := 0
		for _, w := range r.qs[0].weights {
			round += w
		}
		fill(r, 100)
		for w := range 10 {
			var counts [numLevels]int
			for range round {
				s, ok := r.tryTake()
				require.True(t, ok)
				counts[s.level]++
			}
			require.Equal(t, r.qs[0].weights, counts, "round %d", w)
		}
		// Drain the rest: with the high level empty, normal and low share 3:1
		// (credit carried over from the rounds before moves a take or two
		// between them, never more than one round's worth).
		for r.qs[0].q[levelHigh].n > 0 {
			r.tryTake()
		}
		const rounds = 10
		var counts [numLevels]int
		for range rounds * (r.qs[0].weights[levelNormal] + r.qs[0].weights[levelLow]) {
			s, ok := r.tryTake()
			require.True(t, ok)
			counts[s.level]++
		}
		require.InDelta(t, rounds*r.qs[0].weights[levelNormal], counts[levelNormal], float64(round))
		require.InDelta(t, rounds*r.qs[0].weights[levelLow], counts[levelLow], float64(round))
	})
}

// TestReservePlacesWaitsForTheRingHoldingNoShardPlaces: a feeder whose
// level has no room in the ring (its share is out, its slots wait for the
// workers) waits for the ring without sitting on its shard's places, so
// another level of the shard, with room in the ring, reads meanwhile. (A
// feeder that kept its shard's places while it waited starved the shard's
// other levels until the workers freed room: with every handler busy, a
// level never read at all.)
func TestReservePlacesWaitsForTheRingHoldingNoShardPlaces(t *testing.T) {
	c := &Consumer[string, string]{nShards: 1}
	rg := newRing(300, 1)
	rg.addFeeder()
	rg.addFeeder() // the high and low levels' feeders
	for l := range numLevels {
		rg.qs[0].weights[l] = DefaultPriorityWeights[weightIndex[l]]
		rg.backlog[classOf(0, l)] = 1 // every level backlogged: shares 180, 90, 30
	}
	places := newShardPlaces(300, 1)
	places.addFeeder(0)
	places.addFeeder(0)
	r := &run[string, string]{c: c, ring: rg, places: places}
	ctx := context.Background()
	// The high level read 100 entries, which wait for the workers: more
	// than half its share is out, so it reads again only once some start.
	high, low := levelHigh*c.nShards, levelLow*c.nShards
	n, err := r.reservePlaces(ctx, high, 100, nil)
	require.NoError(t, err)
	require.Equal(t, 100, n)
	for i := range n {
		rg.push(&slot{level: levelHigh, entry: Entry{EntryID: fmt.Sprint(i)}})
	}
	// Another 100 of the shard's places are held (normal's slots): 100 are free.
	got, err := places.reserve(ctx, 0, 100, nil)
	require.NoError(t, err)
	require.Equal(t, 100, got)

	highCtx, stopHigh := context.WithCancel(ctx)
	defer stopHigh()
	highDone := make(chan error, 1)
	go func() {
		_, err := r.reservePlaces(highCtx, high, 100, nil)
		highDone <- err
	}()
	// Wait until the high feeder waits for the ring.
	require.Eventually(t, func() bool {
		rg.mu.Lock()
		defer rg.mu.Unlock()
		return rg.wake != nil
	}, 5*time.Second, time.Millisecond)

	lowCtx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	n, err = r.reservePlaces(lowCtx, low, 100, nil)
	require.NoError(t, err, "the low level found no shard places: the waiting high feeder held them")
	require.Equal(t, 30, n, "the low level's share of the ring")
	stopHigh()
	require.ErrorIs(t, <-highDone, context.Canceled)
}
