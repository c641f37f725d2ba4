package main

import (
	"context"
	"encoding/json"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestTrackerReportsLostAndDuplicatedJobs(t *testing.T) {
	tr := newTracker(4)
	require.NoError(t, tr.mark(0, 10))
	require.NoError(t, tr.mark(1, 20))
	require.NoError(t, tr.mark(1, 30)) // a duplicate
	require.NoError(t, tr.mark(3, 40))
	require.Error(t, tr.mark(4, 0), "an index outside the run is reported")
	err := tr.verify("test")
	require.ErrorContains(t, err, "1 of 4 jobs lost (first: [2])")
	require.ErrorContains(t, err, "1 duplicated (first: [1])")
	require.ElementsMatch(t, []int64{10, 20, 40}, tr.latencies(), "the first execution's sample is kept")

	require.NoError(t, tr.mark(2, 50))
	require.NoError(t, tr.wait(context.Background()), "every job was handled once at least")
}

func TestTrackerVerifiesACompleteRun(t *testing.T) {
	tr := newTracker(3)
	for i := range 3 {
		require.NoError(t, tr.mark(i, int64(i)))
	}
	require.NoError(t, tr.verify("test"))
}

func TestPercentiles(t *testing.T) {
	ns := make([]int64, 0, 100)
	for i := 100; i >= 1; i-- {
		ns = append(ns, int64(i)*1e6)
	}
	p50, p99, mx := percentiles(ns)
	require.Equal(t, 50.0, p50)
	require.Equal(t, 99.0, p99)
	require.Equal(t, 100.0, mx)
	p50, p99, mx = percentiles(nil)
	require.Zero(t, p50+p99+mx)
}

func TestPadForReachesThePayloadSize(t *testing.T) {
	for _, size := range []int{100, 1000} {
		b, err := jsonSize(job{Seq: 123_456, T: 1_700_000_000_000_000_000, Pad: padFor(size)})
		require.NoError(t, err)
		require.InDelta(t, size, b, 8)
	}
}

// jsonSize returns the encoded size of v.
func jsonSize(v any) (int, error) {
	b, err := json.Marshal(v)
	return len(b), err
}
