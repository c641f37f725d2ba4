package main

import (
	"bytes"
	"encoding/json"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestSplitByWeightKeepsEveryJob(t *testing.T) {
	require.Equal(t, []int{54_000, 27_000, 9_000}, splitByWeight(90_000, []int{6, 3, 1}))
	got := splitByWeight(11, []int{6, 3, 1})
	require.Equal(t, 11, sum(got), "the last queue takes the rounding")
	require.Equal(t, []int{6, 3, 2}, got)
}

// pattern repeats one round of smooth 6:3:1 starts.
func pattern(rounds int) []int {
	round := []int{0, 1, 0, 2, 0, 1, 0, 0, 1, 0}
	var out []int
	for range rounds {
		out = append(out, round...)
	}
	return out
}

func TestBacklogSharesEndAtTheFirstQueueToRunOut(t *testing.T) {
	// Queue 2 has 5 jobs: its last start is the 4th of the 5th round (index
	// 43); queue 0 then runs alone.
	order := append(pattern(5), 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)
	shares, span, lo, hi := backlogShares(order, []int{40, 16, 5}, 10)
	require.Equal(t, 44, span)
	require.InDeltaSlice(t, []float64{26.0 / 44, 13.0 / 44, 5.0 / 44}, shares, 1e-9)
	require.InDeltaSlice(t, []float64{0.6, 0.3, 0.1}, lo, 1e-9, "every full window of 10 within the span is one round")
	require.InDeltaSlice(t, []float64{0.6, 0.3, 0.1}, hi, 1e-9)
}

func TestBacklogSharesWindowsShowTheSpread(t *testing.T) {
	// Two windows of 4: all queue 0, then all queue 1; nobody runs out.
	order := []int{0, 0, 0, 0, 1, 1, 1, 1, 0}
	shares, span, lo, hi := backlogShares(order, []int{100, 100}, 4)
	require.Equal(t, len(order), span, "no queue ran out: the whole log counts")
	require.InDeltaSlice(t, []float64{5.0 / 9, 4.0 / 9}, shares, 1e-9)
	require.Equal(t, []float64{0, 0}, lo)
	require.Equal(t, []float64{1, 1}, hi)

	_, _, lo, hi = backlogShares(order, []int{100, 100}, 10)
	require.Nil(t, lo, "no full window")
	require.Nil(t, hi)
}

func TestStartLogKeepsEveryStart(t *testing.T) {
	l := newStartLog(300)
	var wg sync.WaitGroup
	for q := range 3 {
		wg.Go(func() {
			for range 100 {
				l.add(q)
			}
		})
	}
	wg.Wait()
	l.add(0) // beyond the log: not recorded
	counts := make([]int, 3)
	for _, q := range l.order() {
		counts[q]++
	}
	require.Equal(t, []int{100, 100, 100}, counts)
}

func TestPrinterMultiLinesLeaveOtherScenariosAlone(t *testing.T) {
	var buf bytes.Buffer
	p := &printer{w: &buf}
	p.ratio(Ratio{Scenario: "drain", Ratio: 0.24})
	require.Equal(t, "drain      ratio streamq/baseline jobs/s = 0.24\n", buf.String())

	buf.Reset()
	p.ratio(Ratio{Scenario: "multi", Ratio: 0.1, VsSingleQueue: 0.7})
	p.ratio(Ratio{Scenario: "multi", System: "streamq-1q", Ratio: 0.14})
	require.Equal(t, "multi      ratio streamq/baseline jobs/s = 0.10; streamq/streamq-1q jobs/s = 0.70\n"+
		"multi      ratio streamq-1q/baseline jobs/s = 0.14\n", buf.String())

	buf.Reset()
	p.result(Result{Scenario: "multi", System: "streamq", N: 100, QueueWeights: []int{6, 3, 1},
		QueueShares: []float64{0.6, 0.3, 0.1}, QueueSharesStarts: 90,
		QueueShareWindowMin: []float64{0.5, 0.25, 0.05}, QueueShareWindowMax: []float64{0.7, 0.35, 0.15}})
	require.Contains(t, buf.String(), "starts while every queue had work (90 of 100), weights 6:3:1: 60.0% / 30.0% / 10.0%; per 1000 starts: 50.0-70.0% / 25.0-35.0% / 5.0-15.0%\n")

	b, err := json.Marshal(Result{Scenario: "drain", System: "streamq"})
	require.NoError(t, err)
	require.NotContains(t, string(b), "queue_", "other scenarios' JSON is unchanged")
	b, err = json.Marshal(Ratio{Scenario: "drain", Ratio: 0.24})
	require.NoError(t, err)
	require.JSONEq(t, `{"scenario":"drain","ratio":0.24}`, string(b))
}
