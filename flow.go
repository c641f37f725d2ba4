package streamq

// Flows: a parent request that runs once each of its children has an
// outcome (flow.lua produces it, complete.lua releases it in the step that
// records the last child's outcome). See DESIGN.md, "Flows".

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"

	"github.com/streamq/streamq/internal/keys"
	"github.com/streamq/streamq/internal/scripts"
)

// MaxFlowChildren is the most children one flow may have.
const MaxFlowChildren = 1000

// ErrChildInFlight is returned by ProduceFlow when a child's id is queued,
// running or waiting for a retry outside the flow (produced on its own, or
// by another flow): such a child cannot join the flow. Wait for its outcome,
// then produce the flow: a child whose id has a stored outcome counts as done
// with that outcome.
var ErrChildInFlight = errors.New("streamq: a child of the flow is already in flight outside it")

// ErrCrossSlot is returned by ProduceFlow on a Redis Cluster when a child's
// keys are in another hash slot than the parent's: the last child's
// completion releases the parent in one script, whose keys must share a
// slot. On a cluster, a flow's children must be on the parent's queue, and
// that queue unsharded (Shards = 1).
var ErrCrossSlot = errors.New("streamq: a child's keys are in another cluster slot than its parent's")

// ErrChildFailed matches (errors.Is) the error of a flow's parent that did
// not run because a child failed (policy FailOnChildFailure); the error's
// text lists each failed child as queue/id: error.
var ErrChildFailed = errors.New("streamq: a child of the flow failed")

// Child is one child of a flow, made by ChildOf, RawChild or ChildFlow.
type Child struct {
	queue   string
	id      string
	payload []byte
	opts    []ProduceOption
	err     error
	// kids and policy: a child that is itself a flow's parent (ChildFlow).
	kids   []Child
	policy FlowPolicy
	flow   bool
}

// ChildOf returns a child of a flow: request req with id on queue q,
// encoded with q's codec (JSONCodec when q has none; []byte as is). opts
// may set Headers, Deadline (Timeout), Priority (the child is appended to
// its level's stream) and At or After (the child waits in its queue's
// schedule until then, like a delayed request) and Key (the child takes
// its key's turns and holds a slot of its key, as any keyed request; its
// outcome still counts in its flow); RetryFailed, Throttle, Debounce and
// Replace are refused by ProduceFlow. The child is deduplicated like any
// request.
func ChildOf[Req, Resp any](q Queue[Req, Resp], id string, req Req, opts ...ProduceOption) Child {
	codec := q.codec
	if codec == nil {
		codec = JSONCodec{}
	}
	b, err := encode(codec, req)
	return Child{queue: q.name, id: id, payload: b, opts: opts, err: err}
}

// RawChild returns a child of a flow on queue with id and an already
// encoded request (the bytes its consumer's codec decodes).
func RawChild(queue, id string, payload []byte, opts ...ProduceOption) Child {
	return Child{queue: queue, id: id, payload: payload, opts: opts}
}

// ChildFlow returns a child of a flow that is itself a flow's parent (a
// nested flow): request req with id on queue q runs once each of children
// has an outcome (under opts.Policy), and its own outcome counts for its
// parent. A chain (B after A, with A's result) is a ChildFlow whose only
// child is A, under a parent that is C, and so on: ProduceFlow(C, [ChildFlow(B,
// [ChildOf(A)])]). opts.Parent sets the node's Headers and Deadline; nil
// opts is the default.
func ChildFlow[Req, Resp any](q Queue[Req, Resp], id string, req Req, children []Child, opts *FlowOptions) Child {
	c := ChildOf(q, id, req)
	c.kids, c.flow = children, true
	if opts != nil {
		c.policy, c.opts = opts.Policy, opts.Parent
	}
	return c
}

// FlowPolicy says what a flow's parent does when a child failed for good
// (an error outcome, a dead letter, or a cancellation).
type FlowPolicy int

const (
	// FailOnChildFailure: the parent does not run; its outcome is a failure
	// (errors.Is ErrFailed and ErrChildFailed) listing the failed children's
	// errors. The default.
	FailOnChildFailure FlowPolicy = iota
	// RunAnyway: the parent runs once every child has an outcome, whatever
	// it is; Message.Children shows which failed.
	RunAnyway
)

// FlowOptions configures one ProduceFlow call. The zero value (or nil) is
// the default.
type FlowOptions struct {
	// Policy is what the parent does when a child failed. Defaults to
	// FailOnChildFailure.
	Policy FlowPolicy
	// Parent are the parent's produce options: Headers, Deadline
	// (Timeout), Priority (the parent is appended to its level's stream
	// when released) and At or After (a parent released before that time
	// waits in the schedule until then; the time counts from the produce,
	// not from the release; a parent failed by its children under
	// FailOnChildFailure is failed at once) and Key (once released, the
	// parent takes its key's turn like any keyed request). RetryFailed,
	// Throttle, Debounce and Replace are refused. Defaults to none.
	Parent []ProduceOption
}

// ProduceFlow produces a flow: the parent request req with id, which runs
// (once) after every child has an outcome, and the children, each appended
// to its queue like a new request. The parent's handler reads the children's
// outcomes with Message.Children. The returned promise resolves with the
// parent's outcome, so waiting on it waits for the whole flow; under
// FailOnChildFailure a failed child fails the parent without running it.
//
// One atomic step in Redis: a parent id already known writes nothing and
// attaches to it (its children are not looked at); a child whose id has a
// stored outcome counts as done with it (when no child is left, the parent
// is appended at once); a child in flight outside the flow fails the call
// with ErrChildInFlight before anything is written. The parent is released
// in the same step that records its last child's outcome, exactly once.
//
// Children may be on other queues of the same Redis (their shard counts are
// read once per queue). On a Redis Cluster every child must map to the
// parent's slot, which in practice means the parent's own unsharded queue:
// any other child is refused with ErrCrossSlot. Records and the flow hash
// live InflightTTL (a node with a due time: that long after it); a flow
// must finish within it. ProduceInterceptors see one call whose requests
// are the parent, then every node below it, parents before their children
// (each Outgoing with its own Queue and Headers); only the parent's EntryID
// is set (when it was appended at once). A nil ctx panics.
func (p *Producer[Req, Resp]) ProduceFlow(ctx context.Context, id string, req Req, children []Child, opts *FlowOptions) (*Promise[Resp], error) {
	mustContext(ctx, "Producer.ProduceFlow")
	// The interceptors see the parent, then every node below it, parents
	// before their children (the order produceFlow numbers them in).
	queues, ids, nodeOpts := []string{p.queue}, []string{id}, [][]ProduceOption{nil}
	if opts != nil {
		nodeOpts[0] = opts.Parent
	}
	var walk func([]Child)
	walk = func(cs []Child) {
		for _, c := range cs {
			queues, ids, nodeOpts = append(queues, c.queue), append(ids, c.id), append(nodeOpts, c.opts)
			walk(c.kids)
		}
	}
	walk(children)
	var pr *Promise[Resp]
	err := p.interceptQueues(ctx, queues, ids, nodeOpts, func(ctx context.Context, outs []*Outgoing) error {
		var err error
		pr, err = p.produceFlow(ctx, id, req, children, opts, outs)
		if err == nil && outs != nil {
			outs[0].EntryID = pr.EntryID()
		}
		return err
	})
	return pr, err
}

// flowRefused is the options a flow's node cannot take.
const flowRefused = "a flow's parent or child cannot take RetryFailed, Throttle, Debounce or Replace"

// produceFlow is ProduceFlow inside the interceptors: outs, when set, holds
// each node's headers (index 0 the parent, then as ProduceFlow lists them).
func (p *Producer[Req, Resp]) produceFlow(ctx context.Context, id string, req Req, children []Child, opts *FlowOptions, outs []*Outgoing) (*Promise[Resp], error) {
	var fo FlowOptions
	if opts != nil {
		fo = *opts
	}
	if fo.Policy != FailOnChildFailure && fo.Policy != RunAnyway {
		return nil, fmt.Errorf("%w: FlowOptions.Policy %d is not a FlowPolicy", ErrInvalidOptions, fo.Policy)
	}
	if len(children) == 0 || len(children) > MaxFlowChildren {
		return nil, fmt.Errorf("%w: a flow has %d children, it needs 1 to MaxFlowChildren=%d", ErrInvalidOptions, len(children), MaxFlowChildren)
	}
	h, set := headersOf(outs, 0)
	parent, err := p.newItem(ctx, id, req, fo.Parent, h, set)
	if err != nil {
		return nil, err
	}
	if strings.Contains(parent.flags, flagRetryFailed) || parent.mode != modeNone {
		return nil, fmt.Errorf("%w: %s", ErrInvalidOptions, flowRefused)
	}
	if err := p.ensureMeta(ctx); err != nil {
		return nil, err
	}
	// Its caller waits for the outcome, most likely: listen before the
	// append, so that the notice reaches this producer even when the
	// consumers keep no result (DiscardResults).
	if err := p.listen(ctx); err != nil {
		return nil, err
	}
	if err := p.resolveQueues(ctx, children); err != nil {
		return nil, err
	}
	pk := p.shards[parent.shard]
	flowKey := pk.Flow(id)
	keyList := []string{pk.Stream, pk.Record(id), flowKey}
	pfields := []string{keys.FieldID, id, keys.FieldPayload, string(parent.payload), keys.FieldFlow, "1"}
	pfields = append(pfields, parent.fields...)
	policy := "f"
	if fo.Policy == RunAnyway {
		policy = "r"
	}
	args := []any{p.opts.InflightTTL.Milliseconds(), policy, id, lengthPrefixed(pfields), parent.flowDue(), p.flowPlace(pk, parent)}
	total := parent.size()
	nodes := 0
	// add appends node c (a child of the node at index parentIdx, whose flow
	// hash is parentFlow) and its subtree, parents before their children.
	var add func(c Child, parentIdx int, parentFlow string) error
	add = func(c Child, parentIdx int, parentFlow string) error {
		nodes++
		idx := nodes
		if nodes > MaxFlowChildren {
			return fmt.Errorf("%w: the flow has more than MaxFlowChildren=%d nodes", ErrInvalidOptions, MaxFlowChildren)
		}
		if c.err != nil {
			return fmt.Errorf("child %q: %w", c.id, c.err)
		}
		if err := validateID(c.id); err != nil {
			return fmt.Errorf("child of %q: %w", parentFlow, err)
		}
		if len(c.payload) > p.opts.MaxPayloadBytes {
			return fmt.Errorf("%w: child %q encodes to %d bytes, the limit is MaxPayloadBytes=%d",
				ErrPayloadTooLarge, c.id, len(c.payload), p.opts.MaxPayloadBytes)
		}
		it := &produceItem{id: c.id, payload: c.payload}
		settings := applyProduceOptions(c.opts)
		if h, set := headersOf(outs, idx); set {
			settings.headers = h
		}
		if err := it.apply(settings); err != nil {
			return fmt.Errorf("child %q: %w", c.id, err)
		}
		if strings.Contains(it.flags, flagRetryFailed) || it.mode != modeNone {
			return fmt.Errorf("%w: child %q: %s", ErrInvalidOptions, c.id, flowRefused)
		}
		ck, err := p.childKeys(c.queue, c.id)
		if err != nil {
			return err
		}
		if p.sharded && keys.KeySlot(ck.Stream) != keys.KeySlot(pk.Stream) {
			return fmt.Errorf("%w: child %q on queue %q (on a cluster, a flow's children must be on the parent's unsharded queue %q)",
				ErrCrossSlot, c.id, c.queue, p.queue)
		}
		total += it.size()
		keyList = append(keyList, ck.Stream, ck.Record(c.id), ck.Flow(c.id))
		kind, e := "l", ""
		if c.flow {
			if len(c.kids) == 0 {
				return fmt.Errorf("%w: child flow %q has no children", ErrInvalidOptions, c.id)
			}
			if c.policy != FailOnChildFailure && c.policy != RunAnyway {
				return fmt.Errorf("%w: child flow %q: policy %d is not a FlowPolicy", ErrInvalidOptions, c.id, c.policy)
			}
			kind = "f"
			if c.policy == RunAnyway {
				kind = "r"
			}
			fields := []string{keys.FieldID, c.id, keys.FieldPayload, string(c.payload), keys.FieldFlow, "1", keys.FieldParent, parentFlow}
			e = lengthPrefixed(append(fields, it.fields...))
			args = append(args, parentIdx, c.queue, c.id, c.payload, kind, e, it.flowDue(), p.flowPlace(ck, it), 0)
			for _, k := range c.kids {
				if err := add(k, idx, ck.Flow(c.id)); err != nil {
					return err
				}
			}
			return nil
		}
		args = append(args, parentIdx, c.queue, c.id, c.payload, kind, e, it.flowDue(), p.flowPlace(ck, it), len(it.fields))
		for _, f := range it.fields {
			args = append(args, f)
		}
		return nil
	}
	for _, c := range children {
		if err := add(c, 0, flowKey); err != nil {
			return nil, err
		}
	}
	if total > p.opts.MaxBatchBytes {
		return nil, fmt.Errorf("%w: the flow is %d bytes, the limit is MaxBatchBytes=%d", ErrBatchTooLarge, total, p.opts.MaxBatchBytes)
	}
	if err := p.startBatch(); err != nil {
		return nil, err
	}
	c, joined := p.waiters.join(id)
	done := make(chan produceOutcome, 1)
	go func() {
		defer p.batches.Done()
		done <- p.runFlow(ctx, keyList, args)
	}()
	var out produceOutcome
	select {
	case out = <-done:
	case <-ctx.Done():
		select {
		case out = <-done:
		default:
			p.waiters.drop(id, c)
			return nil, ctx.Err()
		}
	case <-p.lifetime.Done():
		select {
		case out = <-done:
		default:
			p.waiters.drop(id, c)
			return nil, errClosedUnknown
		}
	}
	if out.err != nil {
		p.waiters.drop(id, c)
		return nil, out.err
	}
	return p.settle(id, c, out, joined)
}

// flowDue is the item's due time as flow.lua reads it: "0" (none), Unix
// milliseconds, or "r" and a delay in milliseconds from the server's clock.
func (it *produceItem) flowDue() string {
	switch {
	case it.due == 0:
		return "0"
	case strings.Contains(it.flags, flagRelative):
		return "r" + strconv.FormatInt(it.due, 10)
	}
	return strconv.FormatInt(it.due, 10)
}

// flowPlace is a flow node's placement for flow.lua (k: the node's shard):
// its level's stream and notice, its shard's schedule, the wake channel.
// "" for a node of the default level without a due time or key, which
// costs nothing more (a keyed node's append may hold its key back for its
// rate and tell the promoters on the wake channel).
func (p *Producer[Req, Resp]) flowPlace(k keys.Keys, it *produceItem) string {
	if it.level == levelNormal && it.due == 0 && it.key == "" {
		return ""
	}
	var list []string
	if it.level != levelNormal {
		list = append(list, "st", k.LevelStream(levelNames[it.level]), "lv", "+"+levelNames[it.level])
	}
	if it.due != 0 {
		list = append(list, "sch", k.Schedule, "sd", k.ScheduleData)
	}
	list = append(list, "wk", k.Wake, "pub", publishCommand(p.sharded))
	return lengthPrefixed(list)
}

// runFlow runs flow.lua and turns its reply into the parent's outcome.
func (p *Producer[Req, Resp]) runFlow(ctx context.Context, keyList []string, args []any) produceOutcome {
	res, err := scripts.Flow.Run(ctx, p.client, keyList, args...).Slice()
	if err != nil {
		p.slots.onError(err)
		msg := err.Error()
		switch {
		case strings.HasPrefix(msg, "INFLIGHT "):
			return produceOutcome{err: fmt.Errorf("%w: child %s", ErrChildInFlight, strings.TrimPrefix(msg, "INFLIGHT "))}
		case strings.HasPrefix(msg, "DUPLICATE "):
			return produceOutcome{err: fmt.Errorf("%w: child %s appears twice in the flow", ErrInvalidOptions, strings.TrimPrefix(msg, "DUPLICATE "))}
		case strings.HasPrefix(msg, "WRONGTYPE"):
			return produceOutcome{err: fmt.Errorf("%w: %v", ErrWrongType, err)}
		}
		return produceOutcome{err: fmt.Errorf("streamq: produce the flow of %s: %w", keyList[1], err)}
	}
	if len(res) != 2 {
		return produceOutcome{err: fmt.Errorf("streamq: produce a flow: unexpected reply %v", res)}
	}
	code, _ := res[0].(int64)
	data, _ := res[1].(string)
	return produceOutcome{code: code, data: data}
}

// resolveQueues reads, once per producer, the shard count of each queue
// other than the producer's that children (at any depth) are on. The reads
// run in a goroutine of the producer's (counted with the batches, which
// Close waits for); the caller waits with ctx.
func (p *Producer[Req, Resp]) resolveQueues(ctx context.Context, children []Child) error {
	var missing []string
	seen := map[string]bool{}
	var walk func([]Child) error
	walk = func(cs []Child) error {
		for _, c := range cs {
			if c.queue != p.queue && !seen[c.queue] {
				seen[c.queue] = true
				if _, ok := p.flowQueues.Load(c.queue); !ok {
					if err := keys.ValidateQueue(c.queue); err != nil {
						return fmt.Errorf("%w: child %q: %v", ErrInvalidOptions, c.id, err)
					}
					missing = append(missing, c.queue)
				}
			}
			if err := walk(c.kids); err != nil {
				return err
			}
		}
		return nil
	}
	if err := walk(children); err != nil || len(missing) == 0 {
		return err
	}
	if err := p.startBatch(); err != nil {
		return err
	}
	done := make(chan error, 1)
	go func() {
		defer p.batches.Done()
		for _, q := range missing {
			n, err := queueShards(ctx, p.client, q)
			if err != nil {
				done <- err
				return
			}
			ks, err := keys.Shards(q, n)
			if err != nil {
				done <- fmt.Errorf("%w: %v", ErrInvalidOptions, err)
				return
			}
			p.flowQueues.Store(q, ks)
		}
		done <- nil
	}()
	select {
	case err := <-done:
		return err
	case <-ctx.Done():
		return ctx.Err()
	case <-p.lifetime.Done():
		return errClosedUnknown
	}
}

// childKeys returns the keys of the shard of queue that holds id (a queue
// other than the producer's was resolved by resolveQueues).
func (p *Producer[Req, Resp]) childKeys(queue, id string) (keys.Keys, error) {
	if queue == p.queue {
		return p.shards[keys.ShardOf(id, len(p.shards))], nil
	}
	v, ok := p.flowQueues.Load(queue)
	if !ok {
		return keys.Keys{}, fmt.Errorf("streamq: the shard count of queue %q was not read", queue)
	}
	ks := v.([]keys.Keys)
	return ks[keys.ShardOf(id, len(ks))], nil
}

// lengthPrefixed encodes strings as "<len>:<s>"..., the schedule's format.
func lengthPrefixed(list []string) string {
	var b strings.Builder
	for _, s := range list {
		b.WriteString(strconv.Itoa(len(s)))
		b.WriteByte(':')
		b.WriteString(s)
	}
	return b.String()
}

// splitLengthPrefixed decodes what lengthPrefixed encodes; false when s is
// malformed.
func splitLengthPrefixed(s string) ([]string, bool) {
	var out []string
	for len(s) > 0 {
		colon := strings.IndexByte(s, ':')
		if colon <= 0 {
			return nil, false
		}
		n, err := strconv.Atoi(s[:colon])
		if err != nil || n < 0 || colon+1+n > len(s) {
			return nil, false
		}
		out = append(out, s[colon+1:colon+1+n])
		s = s[colon+1+n:]
	}
	return out, true
}

// ChildResult is the outcome of one child of a flow, as the parent's
// handler reads it (Message.Children).
type ChildResult struct {
	// Queue and ID name the child.
	Queue, ID string
	// Result is the child's encoded response (its queue's codec); nil when
	// it failed or its consumers discard results.
	Result []byte
	// Err is nil when the child succeeded, else what its callers got: a
	// *RequestError (errors.Is ErrFailed, ErrDeadLettered), ErrCanceled, or
	// ErrNoResult when it succeeded and its result was not stored; or
	// ErrChildPending while it has no outcome yet (Admin.Job).
	Err error
}

// ChildResultOf decodes a child's response with q's codec (JSONCodec when q
// has none), or returns the child's error.
func ChildResultOf[Req, Resp any](q Queue[Req, Resp], c ChildResult) (Resp, error) {
	if c.Err != nil {
		var zero Resp
		return zero, c.Err
	}
	codec := q.codec
	if codec == nil {
		codec = JSONCodec{}
	}
	return decode[Resp](codec, c.Result)
}

// Children returns the outcomes of the children of a flow's parent, in the
// order they were given to ProduceFlow; nil for a message that is no flow's
// parent. One Redis read (the flow hash), with ctx. The outcomes are final:
// the parent runs only once every child has one. It returns ErrNotFound when
// the flow's hash expired (InflightTTL) or was deleted. A nil ctx panics.
func (m *Message[Req]) Children(ctx context.Context) ([]ChildResult, error) {
	mustContext(ctx, "Message.Children")
	if !m.flow || m.link == nil {
		return nil, nil
	}
	return m.link.children(ctx, m.shard, m.ID)
}

// children reads the flow hash of parent id (Message.Children).
func (r *run[Req, Resp]) children(ctx context.Context, shard int, id string) ([]ChildResult, error) {
	key := r.c.shards[shard].Flow(id)
	// Bounded by ctx even when the connection stalls (callBounded).
	h, err := callBounded(ctx, func(ctx context.Context) (map[string]string, error) {
		return r.c.client.HGetAll(ctx, key).Result()
	})
	if err != nil {
		return nil, fmt.Errorf("streamq: read the children of %q: %w", id, err)
	}
	return parseFlowChildren(h, key)
}

// parseFlowChildren turns a flow hash into its children's outcomes.
func parseFlowChildren(h map[string]string, key string) ([]ChildResult, error) {
	if len(h) == 0 {
		return nil, fmt.Errorf("%w: flow hash %s (expired after InflightTTL, or deleted)", ErrNotFound, key)
	}
	order, ok := splitLengthPrefixed(h["o"])
	if !ok || len(order)%3 != 0 {
		return nil, fmt.Errorf("%w: flow hash %s has a malformed child list", ErrWrongType, key)
	}
	out := make([]ChildResult, 0, len(order)/3)
	for i := 0; i < len(order); i += 3 {
		c := ChildResult{Queue: order[i+1], ID: order[i+2]}
		rec, ok := h["k:"+order[i]]
		switch {
		case !ok:
			c.Err = fmt.Errorf("%w: the flow has no entry for child %q", ErrWrongType, c.ID)
		case rec == "":
			c.Err = ErrChildPending
		case rec[0] == keys.RecordResult:
			c.Result = []byte(rec[1:])
		default:
			_, c.Err = decodeRecord[[]byte](JSONCodec{}, rec, nil)
		}
		out = append(out, c)
	}
	return out, nil
}

// ErrChildPending is the error of a child without an outcome yet
// (ChildResult.Err, and so ChildResultOf): Admin.Job shows it for a flow's
// children still scheduled, queued or running. A parent's handler never
// sees it (the parent runs once every child has an outcome). Wait for the
// flow's promise, or look again later.
var ErrChildPending = errors.New("streamq: the child has no outcome yet")

// messageLink is what a Message reaches its consumer through (Progress,
// Children); nil in a Message a test built by hand.
type messageLink interface {
	children(ctx context.Context, shard int, id string) ([]ChildResult, error)
	progress(ctx context.Context, shard int, id, entryID string, v any) error
}
