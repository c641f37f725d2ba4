package streamq

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/robfig/cron/v3"

	"github.com/streamq/streamq/internal/keys"
	"github.com/streamq/streamq/internal/scripts"
)

// Schedule says when a periodic job is due: Next returns the first slot
// strictly after t, or the zero time when there is none. Every replica must
// compute the same slots from the same times, so a schedule may depend on the
// time it is given only, never on when the process started.
type Schedule interface {
	Next(t time.Time) time.Time
}

// Every returns a schedule of fixed intervals aligned to the Unix epoch
// (slots at every multiple of d since 1970-01-01 UTC), so replicas started at
// different times agree on the slots. It panics when d is below 1ms (slots
// are recorded in milliseconds).
func Every(d time.Duration) Schedule {
	if d < time.Millisecond {
		panic(fmt.Sprintf("streamq: Every(%v): the interval must be at least 1ms", d))
	}
	return every(d)
}

type every time.Duration

func (e every) Next(t time.Time) time.Time {
	d := int64(e)
	n := t.UnixNano()
	slot := n - n%d
	if n%d < 0 { // before 1970
		slot -= d
	}
	return time.Unix(0, slot+d).UTC()
}

// latest returns the last slot at or before t.
func (e every) latest(t time.Time) time.Time {
	return e.Next(t.Add(-time.Duration(e)))
}

// Cron parses a standard five-field cron spec (minute, hour, day of month,
// month, day of week) with github.com/robfig/cron/v3's standard parser:
// descriptors such as "@daily" and "@hourly", and a "CRON_TZ=Europe/Berlin "
// prefix for a time zone (the default is UTC, so replicas in different zones
// agree). "@every <duration>" is Every(duration): aligned to the epoch, not
// to when the process started.
func Cron(spec string) (Schedule, error) {
	if rest, ok := strings.CutPrefix(strings.TrimSpace(spec), "@every "); ok {
		d, err := time.ParseDuration(strings.TrimSpace(rest))
		if err != nil || d < time.Millisecond {
			return nil, fmt.Errorf("%w: cron spec %q: @every needs a duration of at least 1ms, such as 1h30m", ErrInvalidOptions, spec)
		}
		return Every(d), nil
	}
	if !strings.HasPrefix(spec, "CRON_TZ=") && !strings.HasPrefix(spec, "TZ=") {
		spec = "CRON_TZ=UTC " + spec
	}
	s, err := cron.ParseStandard(spec)
	if err != nil {
		return nil, fmt.Errorf("%w: cron spec %q: %v", ErrInvalidOptions, spec, err)
	}
	return s, nil
}

// MissedSlots says what a Periodic does with the slots of a job that passed
// while no replica ran (or while this one was stalled).
type MissedSlots int

const (
	// SkipMissed drops missed slots: the job next runs at its next slot.
	SkipMissed MissedSlots = iota
	// RunLatestMissed produces the latest missed slot once (earlier ones are
	// dropped), at start or as soon as the loop notices. It needs the job to
	// have run before: the last slot produced is read from Redis.
	RunLatestMissed
)

// PeriodicJob is a job that a Periodic produces at every slot of its schedule.
type PeriodicJob[Req any] struct {
	// Name identifies the job across replicas: each slot is produced with the
	// request id "<Name>@<slot>", the slot in RFC 3339 (UTC, fractional
	// seconds only when not zero), e.g. "report@2026-12-01T02:00:00Z", so
	// deduplication makes a slot run once however many replicas produce it.
	// Required; no '@'; at most 256 bytes.
	Name string
	// Schedule gives the slots: Every, Cron, or your own. Required.
	Schedule Schedule
	// Request builds the request of a slot. Required. An error skips the slot
	// (logged).
	Request func(slot time.Time) (Req, error)
	// Missed says what happens to slots that passed while no replica ran.
	// Defaults to SkipMissed.
	Missed MissedSlots
}

// PeriodicOptions configure a Periodic. The zero value is valid.
type PeriodicOptions struct {
	// Logger receives the Periodic's logs. Defaults to slog.Default().
	Logger *slog.Logger
}

// Periodic produces periodic jobs into a queue through a Producer. Run the
// same registrations in every replica that should produce them: each slot is
// produced under the same request id by all of them, and the queue's
// deduplication (plus the last produced slot, kept in Redis) makes it run
// once, with no leader election. Slots follow each replica's clock: the
// first replica to reach a slot produces it.
//
// A slot is deduplicated by its request's record while the record lives (the
// producer's InflightTTL while queued, the consumers' ResultTTL once done)
// and, after that, by the last produced slot recorded in
// "streamq:{<queue>}:periodic": keep ResultTTL longer than the spread of the
// replicas' clocks plus any stall of a replica (the default 1h is ample).
type Periodic[Req, Resp any] struct {
	p    *Producer[Req, Resp]
	key  string
	log  *slog.Logger
	mu   sync.Mutex
	jobs []PeriodicJob[Req]
	runs bool
}

// NewPeriodic returns a Periodic that produces through p. opts may be nil.
func NewPeriodic[Req, Resp any](p *Producer[Req, Resp], opts *PeriodicOptions) (*Periodic[Req, Resp], error) {
	if p == nil {
		return nil, fmt.Errorf("%w: producer is nil", ErrInvalidOptions)
	}
	var o PeriodicOptions
	if opts != nil {
		o = *opts
	}
	if o.Logger == nil {
		o.Logger = slog.Default()
	}
	return &Periodic[Req, Resp]{p: p, key: keys.Periodic(p.queue), log: o.Logger.With("queue", p.queue)}, nil
}

// maxPeriodicName bounds PeriodicJob.Name, so that ids stay below MaxIDLen.
const maxPeriodicName = 256

// Register adds a job. Call it before Run; names must be unique.
func (pd *Periodic[Req, Resp]) Register(job PeriodicJob[Req]) error {
	switch {
	case job.Name == "":
		return fmt.Errorf("%w: PeriodicJob.Name is empty", ErrInvalidOptions)
	case len(job.Name) > maxPeriodicName:
		return fmt.Errorf("%w: PeriodicJob.Name is %d bytes; the limit is %d", ErrInvalidOptions, len(job.Name), maxPeriodicName)
	case strings.Contains(job.Name, "@"):
		return fmt.Errorf("%w: PeriodicJob.Name %q contains '@', which separates the name from the slot in request ids", ErrInvalidOptions, job.Name)
	case job.Schedule == nil:
		return fmt.Errorf("%w: PeriodicJob %q has no Schedule (use Every or Cron)", ErrInvalidOptions, job.Name)
	case job.Request == nil:
		return fmt.Errorf("%w: PeriodicJob %q has no Request function", ErrInvalidOptions, job.Name)
	case job.Missed != SkipMissed && job.Missed != RunLatestMissed:
		return fmt.Errorf("%w: PeriodicJob %q: Missed is %d; use SkipMissed or RunLatestMissed", ErrInvalidOptions, job.Name, job.Missed)
	}
	pd.mu.Lock()
	defer pd.mu.Unlock()
	if pd.runs {
		return errors.New("streamq: Periodic.Register called after Run; register every job first")
	}
	for _, j := range pd.jobs {
		if j.Name == job.Name {
			return fmt.Errorf("%w: a PeriodicJob named %q is registered already", ErrInvalidOptions, job.Name)
		}
	}
	pd.jobs = append(pd.jobs, job)
	return nil
}

// PeriodicID returns the request id of a job's slot: "<name>@<slot>".
func PeriodicID(name string, slot time.Time) string {
	return name + "@" + slot.UTC().Format(time.RFC3339Nano)
}

// Run produces the registered jobs' slots until ctx ends. It returns nil
// once ctx ended, without waiting for Redis: a Redis call in flight then is
// abandoned (its outcome is what deduplication makes of it) and ends on the
// client's timeouts, so Run returns within milliseconds of ctx's end. Failed
// attempts are logged and retried until the slot's next one is due. Run may be
// called once.
func (pd *Periodic[Req, Resp]) Run(ctx context.Context) error {
	mustContext(ctx, "Periodic.Run")
	pd.mu.Lock()
	if pd.runs {
		pd.mu.Unlock()
		return errors.New("streamq: Periodic.Run called twice")
	}
	pd.runs = true
	jobs := pd.jobs
	pd.mu.Unlock()
	var wg sync.WaitGroup
	for _, job := range jobs {
		wg.Go(func() { pd.loop(ctx, job) })
	}
	wg.Wait()
	return nil
}

// loop produces one job's slots.
func (pd *Periodic[Req, Resp]) loop(ctx context.Context, job PeriodicJob[Req]) {
	log := pd.log.With("job", job.Name)
	next := job.Schedule.Next(time.Now())
	if job.Missed == RunLatestMissed {
		pd.catchUp(ctx, log, job, next)
	}
	if !next.IsZero() {
		_, _ = pd.mark(ctx, job.Name, time.Time{}, next)
	}
	for !next.IsZero() {
		t := time.NewTimer(time.Until(next))
		select {
		case <-t.C:
		case <-ctx.Done():
			t.Stop()
			return
		}
		pd.fire(ctx, log, job, next)
		after := job.Schedule.Next(next)
		if now := time.Now(); !after.IsZero() && !after.After(now) {
			// A whole slot passed while this one was produced (a stall).
			if job.Missed == RunLatestMissed {
				pd.catchUp(ctx, log, job, job.Schedule.Next(now))
			}
			after = job.Schedule.Next(now)
		}
		next = after
	}
	log.Info("streamq: periodic job has no further slot")
}

// catchUp produces the latest slot before next that passed after the last
// slot recorded in Redis, if any.
func (pd *Periodic[Req, Resp]) catchUp(ctx context.Context, log *slog.Logger, job PeriodicJob[Req], next time.Time) {
	last, err := pd.last(ctx, job.Name)
	if err != nil {
		log.Warn("streamq: cannot read the last slot of a periodic job; missed slots are skipped", "err", err)
		return
	}
	if last.IsZero() {
		return // never ran: nothing was missed
	}
	now := time.Now()
	var latest time.Time
	if e, ok := job.Schedule.(every); ok {
		latest = e.latest(now)
	} else {
		// Walk the slots since the last one; bounded, for schedules with
		// many slots since (a second-level schedule after a long outage).
		for x, i := last, 0; i < 1_000_000; i++ {
			n := job.Schedule.Next(x)
			if n.IsZero() || n.After(now) || !n.Before(next) {
				break
			}
			latest, x = n, n
		}
	}
	if latest.After(last) && latest.Before(next) {
		log.Info("streamq: producing the latest missed slot of a periodic job", "slot", latest, "last", last)
		pd.fire(ctx, log, job, latest)
	}
}

// fire produces one slot, unless Redis records it (or a later one) as
// produced; it retries until the slot after it is due or ctx ends.
func (pd *Periodic[Req, Resp]) fire(ctx context.Context, log *slog.Logger, job PeriodicJob[Req], slot time.Time) {
	after := job.Schedule.Next(slot)
	deadline := after
	if deadline.IsZero() {
		deadline = slot.Add(time.Minute)
	}
	actx, cancel := context.WithDeadline(ctx, deadline)
	defer cancel()
	id := PeriodicID(job.Name, slot)
	var b backoff
	for {
		err := pd.produce(actx, job, slot, after, id)
		if err == nil {
			return
		}
		if actx.Err() != nil {
			if ctx.Err() == nil {
				log.Error("streamq: gave up producing a periodic slot; its next slot is due", "id", id, "err", err)
			}
			return
		}
		log.Warn("streamq: producing a periodic slot failed; retrying", "id", id, "err", err)
		if sleepCtx(actx, b.next()) != nil {
			return
		}
	}
}

func (pd *Periodic[Req, Resp]) produce(ctx context.Context, job PeriodicJob[Req], slot, after time.Time, id string) error {
	last, err := pd.last(ctx, job.Name)
	if err != nil {
		return err
	}
	if last.UnixMilli() >= slot.UnixMilli() {
		return nil // produced by a replica (and its record may be gone)
	}
	req, err := job.Request(slot)
	if err != nil {
		pd.log.ErrorContext(ctx, "streamq: a periodic job's Request failed; the slot is skipped", "id", id, "err", err)
		return nil
	}
	if err := pd.p.Enqueue(ctx, id, req); err != nil {
		if errors.Is(err, ErrInvalidID) || errors.Is(err, ErrPayloadTooLarge) || errors.Is(err, ErrWrongType) || errors.Is(err, ErrClosed) {
			pd.log.ErrorContext(ctx, "streamq: a periodic slot's request is refused; the slot is skipped", "id", id, "err", err)
			return nil
		}
		return err
	}
	_, err = pd.mark(ctx, job.Name, slot, after)
	return err
}

// last reads the last slot of a job recorded in Redis (zero when none).
func (pd *Periodic[Req, Resp]) last(ctx context.Context, name string) (time.Time, error) {
	v, err := callBounded(ctx, func(ctx context.Context) (string, error) {
		return pd.p.client.HGet(ctx, pd.key, name+":last").Result()
	})
	if errors.Is(err, redis.Nil) {
		return time.Time{}, nil
	}
	if err != nil {
		return time.Time{}, err
	}
	ms, err := strconv.ParseInt(v, 10, 64)
	if err != nil {
		return time.Time{}, nil // not ours: treat as never ran
	}
	return time.UnixMilli(ms), nil
}

// mark records slot (unless zero) as produced and next as due.
func (pd *Periodic[Req, Resp]) mark(ctx context.Context, name string, slot, next time.Time) (int64, error) {
	ms := func(t time.Time) int64 {
		if t.IsZero() {
			return 0
		}
		return max(t.UnixMilli(), 1)
	}
	return callBounded(ctx, func(ctx context.Context) (int64, error) {
		return scripts.Periodic.Run(ctx, pd.p.client, []string{pd.key}, name, ms(slot), ms(next)).Int64()
	})
}
