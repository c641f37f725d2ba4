package streamq

import (
	"cmp"
	"context"
	"fmt"
	"strconv"
	"strings"
	"sync"

	"github.com/streamq/streamq/internal/keys"
	"github.com/streamq/streamq/internal/scripts"
)

// Job is one request of a ProduceBatch call.
type Job[Req any] struct {
	// ID identifies the request: jobs with one id are done once.
	ID string
	// Request is the request value, encoded with the producer's codec.
	Request Req
	// Options are this job's produce options (nil: none).
	Options []ProduceOption
}

// ProduceBatch appends jobs in one atomic step: either every job is recorded
// (appended, or attached to an earlier request with the same id) or none is.
// Each job gets its own stream entry and its own promise, in input order; jobs
// sharing an id within the batch share one entry.
//
// The batch is validated before anything is written: more than MaxBatchItems
// jobs or more than MaxBatchBytes of encoded requests gives ErrBatchTooLarge, an
// invalid id ErrInvalidID, an oversized request ErrPayloadTooLarge. A batch is
// never split. When ctx ends first, ProduceBatch returns ctx's error at once,
// whatever the connection does. Retrying a batch whose outcome is unknown (a
// timeout, a dropped connection) is safe: ids already appended attach to their
// existing entries. A nil ctx panics.
//
// ProduceBatch does not subscribe to completion notices: a producer listens
// from its first Produce or ProduceFlow, or from the first Wait, Done or
// Progress of any of its promises, and then reads the records of the requests
// appended before (their notices went to nobody). So a producer whose batch
// promises are released unheard is sent no notice. Until it listens, a
// batch's outcomes reach its promises from their records: when the consumers
// keep no result (ConsumerOptions.DiscardResults), a request that completed
// before then resolves with ErrNoResult; call Wait (or Produce) first to hear
// those results. Fire-and-forget batches are cheaper still with EnqueueBatch.
func (p *Producer[Req, Resp]) ProduceBatch(ctx context.Context, jobs []Job[Req]) ([]*Promise[Resp], error) {
	mustContext(ctx, "Producer.ProduceBatch")
	if len(jobs) == 0 {
		return nil, nil
	}
	if len(jobs) > p.opts.MaxBatchItems {
		return nil, fmt.Errorf("%w: %d jobs, the limit is MaxBatchItems=%d; split the batch", ErrBatchTooLarge, len(jobs), p.opts.MaxBatchItems)
	}
	if len(p.opts.Interceptors) == 0 {
		return p.produceBatch(ctx, jobs, nil)
	}
	ids := make([]string, len(jobs))
	opts := make([][]ProduceOption, len(jobs))
	for i, j := range jobs {
		ids[i], opts[i] = j.ID, j.Options
	}
	var promises []*Promise[Resp]
	err := p.intercept(ctx, ids, opts, func(ctx context.Context, outs []*Outgoing) error {
		var err error
		promises, err = p.produceBatch(ctx, jobs, outs)
		for i, pr := range promises {
			if pr != nil {
				outs[i].EntryID = pr.EntryID()
			}
		}
		return err
	})
	if err != nil && promises == nil {
		return nil, err
	}
	return promises, err
}

// batchItems encodes and checks a batch's jobs (their headers from outs,
// the interceptors').
func (p *Producer[Req, Resp]) batchItems(ctx context.Context, jobs []Job[Req], outs []*Outgoing) ([]*produceItem, error) {
	items := make([]*produceItem, len(jobs))
	total := 0
	for i, j := range jobs {
		h, set := headersOf(outs, i)
		it, err := p.newItem(ctx, j.ID, j.Request, j.Options, h, set)
		if err != nil {
			return nil, fmt.Errorf("job %d: %w", i, err)
		}
		if it.mode != modeNone {
			return nil, fmt.Errorf("%w: job %d: Throttle, Debounce and Replace cannot be used in ProduceBatch (an atomic batch); produce such jobs with Produce, Enqueue or Send",
				ErrInvalidOptions, i)
		}
		items[i] = it
		total += it.size()
	}
	if total > p.opts.MaxBatchBytes {
		return nil, fmt.Errorf("%w: %d bytes, the limit is MaxBatchBytes=%d; split the batch", ErrBatchTooLarge, total, p.opts.MaxBatchBytes)
	}
	return items, nil
}

// batchResult is what runShards answered for a batch's items.
type batchResult struct {
	outs []produceOutcome
	errs []error
}

// awaitBatch runs a batch's round trip (one atomic produce.lua call per
// shard), counted in batches (startBatch has added it), which Close waits
// for within CloseTimeout. A batch of one shard goes from the caller's
// goroutine on the direct connection when that is free (sendBatchDirect);
// otherwise the round trip runs in a goroutine of its own and the caller
// waits for it with ctx. It returns ctx's error, or errClosedUnknown once
// Close gave up, when that came first: the outcome is then unknown, and
// producing the batch again is safe.
func (p *Producer[Req, Resp]) awaitBatch(ctx context.Context, items []*produceItem) (batchResult, error) {
	mine := true // the round trip is this goroutine's until handed to another
	defer func() {
		if mine {
			p.batches.Done() // a panic included: Close does not wait for it
		}
	}()
	if r, sent, err := p.sendBatchDirect(ctx, items); sent {
		return r, err
	}
	mine = false
	done := make(chan batchResult, 1)
	go func() {
		defer p.batches.Done()
		outs, errs := p.runShards(ctx, items, true)
		done <- batchResult{outs, errs}
	}()
	select {
	case r := <-done:
		return r, nil
	case <-ctx.Done():
		select {
		case r := <-done:
			return r, nil
		default:
			return batchResult{}, ctx.Err()
		}
	case <-p.lifetime.Done():
		select {
		case r := <-done:
			return r, nil
		default:
			return batchResult{}, errClosedUnknown
		}
	}
}

// produceBatch is ProduceBatch inside the interceptors.
func (p *Producer[Req, Resp]) produceBatch(ctx context.Context, jobs []Job[Req], outs []*Outgoing) ([]*Promise[Resp], error) {
	items, err := p.batchItems(ctx, jobs, outs)
	if err != nil {
		return nil, err
	}
	if err := p.ensureMeta(ctx); err != nil {
		return nil, err
	}
	p.ensureBackstop()
	// The round trip runs in its own goroutine, which Close waits for (within
	// CloseTimeout); this caller waits for it with ctx. No lock is held across
	// the round trip: a call registered after Close is resolved at once.
	if err := p.startBatch(); err != nil {
		return nil, err
	}
	calls := make([]*call, len(items))
	joined := make([]bool, len(items))
	for i, it := range items {
		calls[i], joined[i] = p.waiters.join(it.id)
	}
	// A producer that does not listen yet appends quiet requests: their
	// completions announce nothing (nobody would hear it), and when it
	// listens, its check of the waiting records makes those still in flight
	// announced (hear.lua). See the kick below.
	quiet := !p.subscribed.Load()
	if quiet {
		for _, it := range items {
			it.hush()
		}
	}
	r, err := p.awaitBatch(ctx, items)
	if err != nil {
		for i, it := range items {
			p.waiters.drop(it.id, calls[i])
		}
		return nil, err
	}
	var failed error
	promises := make([]*Promise[Resp], len(items))
	for i, it := range items {
		if r.errs[i] != nil {
			p.waiters.drop(it.id, calls[i])
			failed = cmp.Or(failed, r.errs[i])
			continue
		}
		var err error
		promises[i], err = p.settle(it.id, calls[i], r.outs[i], joined[i])
		failed = cmp.Or(failed, err)
	}
	if quiet && p.subscribed.Load() {
		// The subscription was confirmed meanwhile, and its check may have
		// run before these calls were marked appended (settle): check
		// again, so their quiet records are announced. (Otherwise the check
		// that follows the confirmation comes after the marks.)
		p.kickBackstop()
	}
	if failed != nil {
		if len(p.shards) > 1 {
			return promises, fmt.Errorf("%w (with %d shards a batch is atomic per shard: jobs of other shards may be recorded; retrying the batch is safe)",
				failed, len(p.shards))
		}
		for _, pr := range promises {
			if pr != nil {
				pr.Release()
			}
		}
		return nil, failed
	}
	return promises, nil
}

// EnqueueBatch appends jobs as ProduceBatch does, without promises:
// fire-and-forget, as Enqueue is for Produce. It is one atomic step (with
// Shards > 1, one per shard), with ProduceBatch's validation, limits,
// deduplication (a job whose id is in flight or done is recorded as it is,
// with nil error), interceptors and handling of ctx, and sends the same
// script calls; it needs no subscription and keeps nothing in memory once
// it returns, so a batch of thousands of jobs has no promise to release.
// A nil error means every job is recorded. Retrying a batch whose outcome
// is unknown (an error from the connection or ctx) is safe: ids already
// appended are not appended again. A nil ctx panics.
func (p *Producer[Req, Resp]) EnqueueBatch(ctx context.Context, jobs []Job[Req]) error {
	mustContext(ctx, "Producer.EnqueueBatch")
	if len(jobs) == 0 {
		return nil
	}
	if len(jobs) > p.opts.MaxBatchItems {
		return fmt.Errorf("%w: %d jobs, the limit is MaxBatchItems=%d; split the batch", ErrBatchTooLarge, len(jobs), p.opts.MaxBatchItems)
	}
	if len(p.opts.Interceptors) == 0 {
		_, err := p.enqueueBatch(ctx, jobs, nil)
		return err
	}
	ids := make([]string, len(jobs))
	opts := make([][]ProduceOption, len(jobs))
	for i, j := range jobs {
		ids[i], opts[i] = j.ID, j.Options
	}
	return p.intercept(ctx, ids, opts, func(ctx context.Context, outs []*Outgoing) error {
		entryIDs, err := p.enqueueBatch(ctx, jobs, outs)
		for i, id := range entryIDs {
			if i < len(outs) {
				outs[i].EntryID = id
			}
		}
		return err
	})
}

// enqueueBatch is EnqueueBatch inside the interceptors; it returns the
// jobs' entry ids ("" for a job scheduled, done, or not recorded).
func (p *Producer[Req, Resp]) enqueueBatch(ctx context.Context, jobs []Job[Req], outs []*Outgoing) ([]string, error) {
	items, err := p.batchItems(ctx, jobs, outs)
	if err != nil {
		return nil, err
	}
	for _, it := range items {
		it.hush()
	}
	if err := p.ensureMeta(ctx); err != nil {
		return nil, err
	}
	// The round trip runs in its own goroutine, which Close waits for, as
	// ProduceBatch's does.
	if err := p.startBatch(); err != nil {
		return nil, err
	}
	r, err := p.awaitBatch(ctx, items)
	if err != nil {
		return nil, err
	}
	var failed error
	entryIDs := make([]string, len(items))
	for i, it := range items {
		switch {
		case r.errs[i] != nil:
			failed = cmp.Or(failed, r.errs[i])
		case r.outs[i].code == outcomeRejected:
			failed = cmp.Or(failed, fmt.Errorf("%w: request %q: %s", ErrWrongType, it.id, r.outs[i].data))
		case r.outs[i].code == outcomeAppended || r.outs[i].code == outcomeInflight:
			entryIDs[i] = r.outs[i].data
		}
	}
	if failed != nil && len(p.shards) > 1 {
		return entryIDs, fmt.Errorf("%w (with %d shards a batch is atomic per shard: jobs of other shards may be recorded; retrying the batch is safe)",
			failed, len(p.shards))
	}
	return entryIDs, failed
}

// startBatch registers a ProduceBatch round trip, unless the producer is closed.
func (p *Producer[Req, Resp]) startBatch() error {
	p.mu.RLock()
	defer p.mu.RUnlock()
	if p.closed {
		return ErrClosed
	}
	p.batches.Add(1)
	return nil
}

// runShards appends items, grouped by shard, with one script call per shard
// (concurrently when there are several), and returns each item's outcome or error.
func (p *Producer[Req, Resp]) runShards(ctx context.Context, items []*produceItem, atomic bool) ([]produceOutcome, []error) {
	return p.runShardsOn(ctx, p.client, items, atomic)
}

// runShardsOn is runShards on client: the producer's client, or the
// connection of a call sent from its caller's goroutine (see direct).
func (p *Producer[Req, Resp]) runShardsOn(ctx context.Context, client scripts.Client, items []*produceItem, atomic bool) ([]produceOutcome, []error) {
	errs := make([]error, len(items))
	if len(p.shards) == 1 {
		outs, err := p.runProduce(ctx, client, 0, items, atomic)
		if err != nil {
			for i := range errs {
				errs[i] = err
			}
			return make([]produceOutcome, len(items)), errs
		}
		return outs, errs
	}
	outs := make([]produceOutcome, len(items))
	run := func(shard int, idx []int) {
		group := make([]*produceItem, len(idx))
		for j, i := range idx {
			group[j] = items[i]
		}
		res, err := p.runProduce(ctx, client, shard, group, atomic)
		for j, i := range idx {
			if err != nil {
				errs[i] = err
			} else {
				outs[i] = res[j]
			}
		}
	}
	groups := make(map[int][]int)
	for i, it := range items {
		groups[it.shard] = append(groups[it.shard], i)
	}
	var wg sync.WaitGroup
	for shard, idx := range groups {
		wg.Go(func() { run(shard, idx) })
	}
	wg.Wait()
	return outs, errs
}

// produceConsts are one shard's produce.lua arguments that never change, as
// argument list values (see Producer.boxed).
type produceConsts struct {
	stream, schedule, scheduleData, wake, publish any
}

func boxProduceConsts(shards []keys.Keys, sharded bool) []produceConsts {
	out := make([]produceConsts, len(shards))
	for i, k := range shards {
		out[i] = produceConsts{stream: k.Stream, schedule: k.Schedule, scheduleData: k.ScheduleData,
			wake: k.Wake, publish: publishCommand(sharded)}
	}
	return out
}

// produceItem is one request on its way to Redis.
type produceItem struct {
	ctx     context.Context
	id      string
	shard   int
	payload []byte
	// due is when the request may start, in Unix milliseconds; 0: now.
	due int64
	// flags are single-letter switches for produce.lua: "r", due is a delay
	// in milliseconds from the server's clock; "f", RetryFailed.
	flags string
	// fields are extra stream fields, name then value, written beside the
	// id and payload.
	fields []string
	// level is the request's priority level (levelNormal unless Priority
	// set another).
	level int
	// mode is the flow-control mode (modeNone, modeThrottle, modeDebounce)
	// and modeA, modeB its numbers in milliseconds (see modeArgs).
	mode         byte
	modeA, modeB int64
	// key is the request's key (Key; "" for none), also in fields.
	key string
	// call is the waiters' call the Produce caller holds (nil for Enqueue,
	// Send, batches, flows); runProduce moves it to a new run's call when a
	// mode's new run replaced the id's stored outcome.
	call *call
	// joined says call was marked appended when its caller took it
	// (waiters.join): an earlier caller waits on it for an earlier run.
	joined bool
	// headerBytes is the size of the encoded headers, counted against
	// MaxPayloadBytes with the payload.
	headerBytes int
	out         chan produceOutcome // buffered: the sender never blocks; set by submit
	// done, when set (Send), takes the outcome instead of out; it runs on
	// the coalescer's goroutine.
	done func(produceOutcome)
}

// deliver passes the item's outcome to whoever waits for it.
func (it *produceItem) deliver(out produceOutcome) {
	if it.done != nil {
		it.done(out)
		return
	}
	it.out <- out
}

// hush marks an item whose outcome nobody waits for (Enqueue, EnqueueBatch,
// Send, and ProduceBatch while its producer does not listen): see flagQuiet.
func (it *produceItem) hush() {
	it.flags += flagQuiet // no allocation when it has no other flag
}

// apply copies what a call's options set into the item.
func (it *produceItem) apply(s produceSettings) error {
	due, flags, err := s.due()
	if err != nil {
		return err
	}
	it.due = due
	it.flags += flags
	if !s.deadline.IsZero() {
		it.fields = append(it.fields, keys.FieldDeadline, strconv.FormatInt(max(s.deadline.UnixMilli(), 1), 10))
	}
	h, err := encodeHeaders(s.headers)
	if err != nil {
		return err
	}
	if h != "" {
		it.fields = append(it.fields, keys.FieldHeaders, h)
		it.headerBytes = len(h)
	}
	if s.retryFailed {
		it.flags += flagRetryFailed
	}
	if it.mode, it.modeA, it.modeB, err = s.modeArgs(); err != nil {
		return err
	}
	if s.prioritySet {
		l, ok := levelOf[s.priority]
		if !ok {
			return fmt.Errorf("%w: Priority(%d): the levels are PriorityHigh (1), PriorityNormal (0) and PriorityLow (-1)", ErrInvalidOptions, int(s.priority))
		}
		if l != levelNormal {
			it.level = l
			it.flags += levelFlags[l]
			it.fields = append(it.fields, keys.FieldPriority, levelNames[l])
		}
	}
	return it.applyKey(s)
}

// size is what the item weighs against MaxBatchBytes and MaxPendingBytes.
func (it *produceItem) size() int {
	n := len(it.id) + len(it.payload)
	for _, f := range it.fields {
		n += len(f)
	}
	return n
}

// produceOutcome is the reply of produce.lua for one item.
type produceOutcome struct {
	code int64  // outcomeAppended, outcomeInflight, outcomeDone, outcomeRejected
	data string // entry id, record, or reason
	err  error  // the round trip failed
}

const (
	outcomeAppended = 0
	outcomeInflight = 1
	outcomeDone     = 2
	outcomeRejected = -1
	// outcomeExpired (Throttle): the id ran in the open window and its
	// outcome has expired.
	outcomeExpired = 4
	// outcomeReplaced is produce.lua's reply for a new run of a mode that
	// replaced a stored outcome; runProduce answers that outcome's waiters
	// and passes it on as outcomeAppended.
	outcomeReplaced = 3
	// outcomeRefused (Replace): the id is part of a flow, or keyed; nothing written.
	outcomeRefused = 5
)

// runProduce appends items of one shard with one script call and returns one
// outcome per item.
func (p *Producer[Req, Resp]) runProduce(ctx context.Context, client scripts.Client, shard int, items []*produceItem, atomic bool) ([]produceOutcome, error) {
	args := p.produceArgs(shard, items, atomic)
	res, err := scripts.ProduceHead.Run(ctx, client, args).Slice()
	return p.produceReply(shard, items, res, err)
}

// produceArgs returns the EVALSHA command of produce.lua for items of one
// shard (see the script's header).
func (p *Producer[Req, Resp]) produceArgs(shard int, items []*produceItem, atomic bool) []any {
	k := p.shards[shard]
	b := &p.boxed[shard]
	call := "0"
	if atomic {
		call = "1"
	}
	leveled, moded := false, false
	n := 2 + 2 // the arguments around the items
	for _, it := range items {
		// Replace looks for an id's entry in every level's stream.
		leveled = leveled || it.level != levelNormal || it.mode == modeReplace
		moded = moded || it.mode != modeNone
		n += 1 + 5 + 3 + len(it.fields) // its record key, arguments and mode's
	}
	if leveled {
		call += "L" // the level streams follow the schedule's keys
	}
	if moded {
		call += "M" // each item carries its mode; the mode keys come last
	}
	if anyKeyed(items) {
		call += keyedCall // keyed items take their key's turn (fair.lua)
	}
	if (call == "0" || call == "1") && plainItems(items, atomic) {
		// A plain call (produce.lua's shorter form): the stream, the
		// records, the TTL, the call and the items without their due
		// times; not the schedule's keys or the wake channel, which such a
		// call never uses.
		var plain any = "0P" // independent items
		if atomic {
			plain = "1P" // all or nothing
		}
		size := 1 + len(items) + 2 // the keys, the TTL and the call
		for _, it := range items {
			size += 4 + len(it.fields) // its arguments
		}
		args := scripts.ProduceHead.Args(1+len(items), size)
		args = append(args, b.stream)
		for _, it := range items {
			args = append(args, k.Record(it.id))
		}
		args = append(args, p.inflightTTL, plain)
		for _, it := range items {
			args = append(args, it.id, it.payload, boxedFlags(it.flags), len(it.fields))
			for _, f := range it.fields {
				args = append(args, f)
			}
		}
		return args
	}
	numKeys := 1 + len(items) + 2
	if leveled {
		numKeys += 2
	}
	if moded {
		numKeys += len(items)
	}
	args := scripts.ProduceHead.Args(numKeys, n+numKeys)
	args = append(args, b.stream)
	for _, it := range items {
		args = append(args, k.Record(it.id))
	}
	args = append(args, b.schedule, b.scheduleData)
	if leveled {
		args = append(args, k.LevelStream(levelNames[levelHigh]), k.LevelStream(levelNames[levelLow]))
	}
	if moded {
		for _, it := range items {
			args = append(args, k.Mode(it.id))
		}
	}
	args = append(args, p.inflightTTL, boxedCall(call))
	for _, it := range items {
		args = append(args, it.id, it.payload, it.due, boxedFlags(it.flags), len(it.fields))
		for _, f := range it.fields {
			args = append(args, f)
		}
		if moded {
			mode := ""
			if it.mode != modeNone {
				mode = string(it.mode)
			}
			args = append(args, mode, it.modeA, it.modeB)
		}
	}
	return append(args, b.wake, b.publish)
}

// produceReply reads produce.lua's reply (res, err) for items of one shard.
func (p *Producer[Req, Resp]) produceReply(shard int, items []*produceItem, res []any, err error) ([]produceOutcome, error) {
	k := p.shards[shard]
	if err != nil {
		p.slots.onError(err)
		if strings.HasPrefix(err.Error(), "WRONGTYPE") {
			return nil, fmt.Errorf("%w: %v", ErrWrongType, err)
		}
		return nil, fmt.Errorf("streamq: append to %s: %w", k.Stream, err)
	}
	if len(res) != 2*len(items) {
		return nil, fmt.Errorf("streamq: append to %s: unexpected reply of %d elements for %d items", k.Stream, len(res), len(items))
	}
	outs := make([]produceOutcome, len(items))
	for i := range items {
		code, _ := res[2*i].(int64)
		data, _ := res[2*i+1].(string)
		if code == outcomeReplaced {
			// A new run replaced the id's stored outcome: the callers still
			// waiting here for that outcome get it, and the callers of this
			// item and of the id's later items in this call (which attached
			// to the new run) move to a new call, in item order.
			eid, record, ok := cutLengthPrefixed(data)
			if !ok {
				return nil, fmt.Errorf("streamq: append to %s: malformed reply %q", k.Stream, data)
			}
			p.waiters.handOver(items, i, record)
			code, data = outcomeAppended, eid
		}
		outs[i] = produceOutcome{code: code, data: data}
	}
	return outs, nil
}

// plainItems reports whether items may go in a plain call (produce.lua's
// shorter form): every one due now, with no mode, and in an atomic call
// without flags other than flagQuiet (RetryFailed replaces a stored failure,
// which an atomic call's undo would have to put back). The caller has
// checked that none has a level or a key.
func plainItems(items []*produceItem, atomic bool) bool {
	for _, it := range items {
		if it.due != 0 || it.mode != modeNone || (atomic && it.flags != "" && it.flags != flagQuiet) {
			return false
		}
	}
	return true
}

// boxedCall returns produce.lua's ARGV[2] as an argument list value: the
// plain calls' constants box without allocating.
func boxedCall(call string) any {
	switch call {
	case "0":
		return "0"
	case "1":
		return "1"
	}
	return call
}

// boxedFlags returns an item's flags as an argument list value: the common
// ones (none, flagQuiet) box without allocating.
func boxedFlags(flags string) any {
	switch flags {
	case "":
		return ""
	case flagQuiet:
		return flagQuiet
	}
	return flags
}

// cutLengthPrefixed splits "<len>:<s>rest" into s and rest.
func cutLengthPrefixed(data string) (s, rest string, ok bool) {
	lenStr, tail, found := strings.Cut(data, ":")
	if !found {
		return "", "", false
	}
	n, err := strconv.Atoi(lenStr)
	if err != nil || n < 0 || n > len(tail) {
		return "", "", false
	}
	return tail[:n], tail[n:], true
}
