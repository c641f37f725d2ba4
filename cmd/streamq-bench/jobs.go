package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/streamq/streamq"
	"github.com/streamq/streamq/internal/keys"
)

// job is the request of every scenario. It carries its index in the run, for
// the exactly-once check, and its enqueue time, for latency.
type job struct {
	Seq int    `json:"seq"`
	T   int64  `json:"t"` // unix nanoseconds when it was enqueued
	Pad string `json:"pad,omitempty"`
}

// padFor returns padding that makes an encoded job about size bytes long.
func padFor(size int) string {
	b, _ := json.Marshal(job{Seq: 100_000, T: time.Now().UnixNano(), Pad: "x"})
	return strings.Repeat("x", max(size-len(b)+1, 0))
}

func jobID(i int) string { return "j" + strconv.Itoa(i) }

func parseJobID(id string) (int, error) {
	if !strings.HasPrefix(id, "j") {
		return 0, fmt.Errorf("unexpected request id %q", id)
	}
	return strconv.Atoi(id[1:])
}

// sinceNs returns the nanoseconds from unix time t until now.
func sinceNs(t int64) int64 { return time.Now().UnixNano() - t }

// errGroup runs goroutines and keeps the first error.
type errGroup struct {
	wg   sync.WaitGroup
	mu   sync.Mutex
	errs []error
}

func (g *errGroup) Go(f func() error) {
	g.wg.Go(func() {
		if err := f(); err != nil {
			g.mu.Lock()
			g.errs = append(g.errs, err)
			g.mu.Unlock()
		}
	})
}

func (g *errGroup) Wait() error {
	g.wg.Wait()
	g.mu.Lock()
	defer g.mu.Unlock()
	if len(g.errs) > 3 {
		return errors.Join(append(g.errs[:3:3], fmt.Errorf("and %d more errors", len(g.errs)-3))...)
	}
	return errors.Join(g.errs...)
}

// handlerErrors collects errors raised inside handlers, which cannot fail a
// run by themselves.
type handlerErrors struct {
	mu   sync.Mutex
	errs []error
}

func (h *handlerErrors) add(err error) {
	h.mu.Lock()
	if len(h.errs) < 3 {
		h.errs = append(h.errs, err)
	}
	h.mu.Unlock()
}

func (h *handlerErrors) err() error {
	h.mu.Lock()
	defer h.mu.Unlock()
	return errors.Join(h.errs...)
}

// ---- streamq side ----

// streamKey returns the stream key of a streamq queue.
func streamKey(queue string) string {
	k, err := keys.New(queue)
	if err != nil {
		panic(err) // bench queue names are valid
	}
	return k.Stream
}

// consumers is a set of running streamq consumers, each with its own client.
type consumers struct {
	cancel  context.CancelFunc
	g       errGroup
	clients []*redis.Client
}

// startConsumers creates the group (so nothing produced is missed) and runs
// one consumer per element of opts.
func startConsumers[Req, Resp any](ctx context.Context, e *env, queue string, handler streamq.Handler[Req, Resp], opts []streamq.ConsumerOptions) (*consumers, error) {
	err := e.admin.XGroupCreateMkStream(ctx, streamKey(queue), streamq.DefaultGroup, "0").Err()
	if err != nil && !strings.HasPrefix(err.Error(), "BUSYGROUP") { // a second set joins the group
		return nil, fmt.Errorf("create group: %w", err)
	}
	cs := &consumers{}
	runCtx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	cs.cancel = cancel
	for i, o := range opts {
		o.Logger = e.log
		if o.Name == "" {
			o.Name = fmt.Sprintf("c%d", i)
		}
		if o.ReadBlock == 0 {
			o.ReadBlock = 250 * time.Millisecond // quick shutdown between runs
		}
		cl := e.client(0)
		cs.clients = append(cs.clients, cl)
		c, err := streamq.NewConsumer(cl, queue, handler, &o)
		if err != nil {
			cs.stop()
			return nil, err
		}
		cs.g.Go(func() error { return c.Run(runCtx) })
	}
	return cs, nil
}

// stop shuts the consumers down and waits for them.
func (cs *consumers) stop() error {
	cs.cancel()
	err := cs.g.Wait()
	for _, c := range cs.clients {
		_ = c.Close()
	}
	return err
}

// consumerOpts spreads the configured workers over the configured consumers.
func consumerOpts(e *env, base streamq.ConsumerOptions) []streamq.ConsumerOptions {
	out := make([]streamq.ConsumerOptions, e.cfg.consumers)
	for i := range out {
		out[i] = base
		out[i].Workers = e.workersPer(i)
		if e.cfg.ring > 0 {
			out[i].Prefetch = max(e.cfg.ring, out[i].Workers)
		}
	}
	return out
}

// finish waits until every job was handled and acknowledged, and stops the
// meter there.
func finish(ctx context.Context, e *env, m *meter, t *tracker, stream, group string) error {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Minute)
	defer cancel()
	if err := t.wait(ctx); err != nil {
		return err
	}
	if err := waitDrained(ctx, e.admin, stream, group); err != nil {
		return err
	}
	return m.stop(ctx)
}

// checkEmpty reports entries left in a stream whose jobs all completed.
func checkEmpty(ctx context.Context, e *env, stream string) error {
	n, err := e.admin.XLen(ctx, stream).Result()
	if err != nil {
		return err
	}
	if n != 0 {
		return fmt.Errorf("%s still holds %d entries after every job completed", stream, n)
	}
	return nil
}

// ---- baseline side ----

const baselineGroup = "g"

// baseline is the hand-written go-redis queue: one stream, one group.
type baseline struct {
	stream string
	prefix string // for reply keys
}

func newBaseline(ctx context.Context, e *env, scenario string) (baseline, error) {
	q := e.queue(scenario, "baseline")
	b := baseline{stream: "bench:{" + q + "}:stream", prefix: "bench:{" + q + "}:"}
	err := e.admin.XGroupCreateMkStream(ctx, b.stream, baselineGroup, "0").Err()
	return b, err
}

// cleanup deletes the baseline's stream.
func (b baseline) cleanup(ctx context.Context, e *env) { e.admin.Unlink(ctx, b.stream) }

// decodeJob returns the job of a baseline entry.
func decodeJob(m redis.XMessage) (job, error) {
	var j job
	p, ok := m.Values[keys.FieldPayload].(string)
	if !ok {
		return j, fmt.Errorf("entry %s has no payload", m.ID)
	}
	if err := json.Unmarshal([]byte(p), &j); err != nil {
		return j, fmt.Errorf("entry %s: %w", m.ID, err)
	}
	return j, nil
}

// consume is a hand-written consumer loop: XREADGROUP COUNT count BLOCK
// block, handle each message (handle may queue replies on pipe), then XACK
// and XDEL the batch in the same pipeline. It runs until ctx ends.
func (b baseline) consume(ctx context.Context, c *redis.Client, name string, count int64, block time.Duration,
	handle func(m redis.XMessage, pipe redis.Pipeliner) error) error {
	for ctx.Err() == nil {
		res, err := c.XReadGroup(ctx, &redis.XReadGroupArgs{
			Group: baselineGroup, Consumer: name, Streams: []string{b.stream, ">"},
			Count: count, Block: block,
		}).Result()
		if errors.Is(err, redis.Nil) || ctx.Err() != nil {
			continue
		}
		if err != nil {
			return fmt.Errorf("XREADGROUP: %w", err)
		}
		pipe := c.Pipeline()
		ids := make([]string, 0, count)
		for _, st := range res {
			for _, m := range st.Messages {
				if err := handle(m, pipe); err != nil {
					return err
				}
				ids = append(ids, m.ID)
			}
		}
		if len(ids) == 0 {
			continue
		}
		pipe.XAck(ctx, b.stream, baselineGroup, ids...)
		pipe.XDel(ctx, b.stream, ids...)
		if _, err := pipe.Exec(ctx); err != nil {
			return fmt.Errorf("XACK+XDEL: %w", err)
		}
	}
	return nil
}

// runConsumers runs k baseline consumer loops, each with its own client, until
// the returned stop is called.
func (b baseline) runConsumers(ctx context.Context, e *env, k int, count int64, block time.Duration,
	handle func(m redis.XMessage, pipe redis.Pipeliner) error) (stop func() error) {
	runCtx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	var g errGroup
	for i := range k {
		c := e.client(0)
		g.Go(func() error {
			defer c.Close()
			return b.consume(runCtx, c, fmt.Sprintf("c%d", i), count, block, handle)
		})
	}
	return func() error {
		cancel()
		return g.Wait()
	}
}

// xaddArgs returns the XADD of one baseline job.
func (b baseline) xaddArgs(id string, payload []byte, extra ...any) *redis.XAddArgs {
	values := append([]any{keys.FieldID, id, keys.FieldPayload, payload}, extra...)
	return &redis.XAddArgs{Stream: b.stream, Values: values}
}

// markStream reads a whole stream and marks each entry's job in t: it proves
// that each job was appended exactly once.
func markStream(ctx context.Context, e *env, stream string, t *tracker) error {
	start := "-"
	for {
		msgs, err := e.admin.XRangeN(ctx, stream, start, "+", 10_000).Result()
		if err != nil {
			return err
		}
		if len(msgs) == 0 {
			return nil
		}
		for _, m := range msgs {
			id, _ := m.Values[keys.FieldID].(string)
			i, err := parseJobID(id)
			if err != nil {
				return err
			}
			if err := t.mark(i, 0); err != nil {
				return err
			}
		}
		start = "(" + msgs[len(msgs)-1].ID
	}
}
