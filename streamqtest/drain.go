package streamqtest

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/streamq/streamq"
	"github.com/streamq/streamq/internal/keys"
)

// Runner is what Drain runs: a *streamq.Consumer, or anything whose Run
// consumes until its context ends and then returns.
type Runner interface {
	Run(ctx context.Context) error
}

// DrainOptions tunes Drain. The zero value (or nil) uses the defaults.
type DrainOptions struct {
	// Timeout bounds the whole drain; the test fails when the queue still has
	// work then. Defaults to DefaultDrainTimeout (30s).
	Timeout time.Duration

	// DueWithin: scheduled jobs (delayed requests and retries waiting for
	// their back-off) due within this much of now are waited for; later ones
	// are left in the schedule and do not keep Drain from returning.
	// Defaults to DefaultDueWithin (10s).
	DueWithin time.Duration

	// PollInterval is how often the queue's state is read.
	// Defaults to 10ms.
	PollInterval time.Duration
}

// Defaults of DrainOptions.
const (
	DefaultDrainTimeout = 30 * time.Second
	DefaultDueWithin    = 10 * time.Second
)

// Drain runs c (usually a *streamq.Consumer of queue) until the queue has
// nothing left to do, then stops it and waits for Run to return. The queue is
// drained when its stream holds no entries, no consumer group has pending or
// undelivered entries, and no scheduled job is due within DueWithin. Drain
// fails the test when Run returns early or with an error, or when the queue is
// not drained within Timeout. Produce what the test needs before calling it;
// entries produced by the handlers themselves are waited for too.
func Drain(ctx context.Context, t TB, client redis.UniversalClient, queue string, c Runner, opts *DrainOptions) {
	mustContext(ctx, "Drain")
	t.Helper()
	o := DrainOptions{}
	if opts != nil {
		o = *opts
	}
	if o.Timeout <= 0 {
		o.Timeout = DefaultDrainTimeout
	}
	if o.DueWithin <= 0 {
		o.DueWithin = DefaultDueWithin
	}
	if o.PollInterval <= 0 {
		o.PollInterval = 10 * time.Millisecond
	}
	admin, err := streamq.NewAdmin(client, queue, nil)
	if err != nil {
		fatalf(t, "drain %s: %v", queue, err)
		return
	}
	runCtx, stop := context.WithCancel(ctx)
	defer stop()
	done := make(chan error, 1)
	go func() { done <- c.Run(runCtx) }()

	deadline := time.NewTimer(o.Timeout)
	defer deadline.Stop()
	tick := time.NewTicker(o.PollInterval)
	defer tick.Stop()
	// Two drained readings in a row: a handler's outcome and the entries it
	// produced are recorded together, but a retry moves from the stream to the
	// schedule between two reads of Stats.
	streak := 0
	var why string
	for streak < 2 {
		select {
		case err := <-done:
			fatalf(t, "drain %s: the consumer's Run returned before the queue was drained (%s): %v", queue, why, err)
			return
		case <-deadline.C:
			stop()
			<-done
			fatalf(t, "drain %s: not drained after %v: %s", queue, o.Timeout, why)
			return
		case <-ctx.Done():
			<-done
			fatalf(t, "drain %s: %v before the queue was drained (%s)", queue, ctx.Err(), why)
			return
		case <-tick.C:
		}
		why, err = busy(ctx, client, admin, queue, o.DueWithin)
		switch {
		case err != nil:
			why, streak = err.Error(), 0
		case why != "":
			streak = 0
		default:
			streak++
		}
	}
	stop()
	if err := <-done; err != nil {
		fatalf(t, "drain %s: the consumer's Run returned an error: %v", queue, err)
	}
}

// busy says what work the queue still has ("" when it has none).
func busy(ctx context.Context, client redis.UniversalClient, admin *streamq.Admin, queue string, dueWithin time.Duration) (string, error) {
	st, err := admin.Stats(ctx)
	if errors.Is(err, streamq.ErrNotFound) {
		return "the queue does not exist yet", nil
	}
	if err != nil {
		return "", err
	}
	if st.Length > 0 {
		return fmt.Sprintf("%d entries in the stream", st.Length), nil
	}
	for _, g := range st.Groups {
		if g.Pending > 0 || g.Lag != 0 {
			return fmt.Sprintf("group %s has %d pending and %d undelivered entries", g.Name, g.Pending, g.Lag), nil
		}
	}
	if st.Scheduled == 0 {
		return "", nil
	}
	// Some jobs are scheduled: wait only for those due soon.
	ks, err := admin.Keys(ctx)
	if err != nil {
		return "", err
	}
	shards, err := keys.Shards(queue, len(ks))
	if err != nil {
		return "", err
	}
	now, err := client.Time(ctx).Result()
	if err != nil {
		return "", err
	}
	limit := strconv.FormatInt(now.Add(dueWithin).UnixMilli(), 10)
	for _, k := range shards {
		n, err := client.ZCount(ctx, k.Schedule, "-inf", limit).Result()
		if err != nil {
			return "", err
		}
		r, err := client.ZCount(ctx, k.Retry, "-inf", limit).Result()
		if err != nil {
			return "", err
		}
		if n += r; n > 0 {
			return fmt.Sprintf("%d scheduled jobs due within %v", n, dueWithin), nil
		}
	}
	return "", nil
}
