package streamqdash

import (
	"context"
	"errors"
	"net/http"
	"slices"
	"sync"
	"time"

	"github.com/streamq/streamq"
)

// historySpan is how far back the chart goes.
const historySpan = 24 * time.Hour

// historyResponse is the body of GET api/history: the jobs processed and
// failed per minute over the last 24 hours, oldest first, summed over the
// queues asked for (q=, else every queue shown). It comes from the counts the
// consumers' completions keep in Redis (Admin.History), so it covers every
// replica and is the same after a reload.
type historyResponse struct {
	// Time is when it was read, Unix milliseconds.
	Time int64 `json:"time"`
	// Points are the minutes, oldest first.
	Points []streamq.HistoryPoint `json:"points"`
}

func (h *Handler) apiHistory(w http.ResponseWriter, r *http.Request) {
	ctx, cancel := context.WithTimeout(r.Context(), h.opts.Timeout)
	defer cancel()
	pts, err := h.history(ctx, r.FormValue("q"))
	if err != nil {
		h.fail(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, historyResponse{Time: time.Now().UnixMilli(), Points: pts})
}

// history reads the history of one queue, or sums that of every queue shown
// (summaryWorkers at once) when only is "".
func (h *Handler) history(ctx context.Context, only string) ([]streamq.HistoryPoint, error) {
	names := []string{only}
	if only == "" {
		var err error
		if names, err = h.queues(ctx); err != nil {
			return nil, err
		}
	} else if _, err := h.admin(ctx, only, ""); err != nil {
		return nil, err
	}
	all := make([][]streamq.HistoryPoint, len(names))
	errs := make([]error, len(names))
	sem := make(chan struct{}, summaryWorkers)
	var wg sync.WaitGroup
	for i, name := range names {
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer func() { <-sem; wg.Done() }()
			a, err := streamq.NewAdmin(h.client, name, nil)
			if err == nil {
				all[i], err = a.History(ctx, historySpan)
			}
			errs[i] = err
		}()
	}
	wg.Wait()
	at := map[int64]int{} // minute -> index in out
	var out []streamq.HistoryPoint
	for i, pts := range all {
		switch err := errs[i]; {
		case err == nil:
		case only == "" && errors.Is(err, streamq.ErrNotFound):
			continue // deleted since discovered
		default:
			return nil, err
		}
		for _, p := range pts {
			k := p.Minute.Unix()
			if j, ok := at[k]; ok {
				out[j].Processed += p.Processed
				out[j].Failed += p.Failed
				continue
			}
			at[k] = len(out)
			out = append(out, p)
		}
	}
	// Queues read a moment apart may disagree on the last minute: keep the
	// minutes in order.
	slices.SortFunc(out, func(a, b streamq.HistoryPoint) int { return a.Minute.Compare(b.Minute) })
	if out == nil {
		out = []streamq.HistoryPoint{}
	}
	return out, nil
}
