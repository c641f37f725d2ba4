package streamq

import (
	"context"
	"encoding/json"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/streamq/streamq/internal/keys"
)

// Delivery is an untyped view of a message about to be handled, for
// middleware: the same Middleware works for every Consumer[Req, Resp],
// whatever its request and response types.
type Delivery struct {
	// Queue is the queue's name.
	Queue string
	// Group is the consumer group.
	Group string
	// Consumer is the consumer's name in its group.
	Consumer string
	// Shard is the shard (0 for an unsharded queue) the entry came from.
	Shard int
	// ID is the request id given to Produce.
	ID string
	// EntryID is the stream entry id.
	EntryID string
	// Deliveries counts the handler starts of this request, this one included.
	Deliveries int
	// MaxDeliveries is the consumer's MaxDeliveries: a failure of the start
	// numbered MaxDeliveries dead-letters the request.
	MaxDeliveries int
	// Headers are the request's headers, set at produce time (Headers,
	// ProduceInterceptor); nil when it has none. Read it; do not modify it.
	Headers map[string]string
	// ProducedAt is when the entry was appended to the stream, on the Redis
	// server's clock (the time part of EntryID): for a delayed request or a
	// retry, when it became due. StartedAt minus ProducedAt is the queue wait.
	ProducedAt time.Time
	// ReadAt is when this consumer read (or claimed) the entry.
	ReadAt time.Time
	// StartedAt is when the handler starts: after the payload was fetched and
	// the start was recorded. StartedAt minus ReadAt is the prefetch and
	// fetch time.
	StartedAt time.Time
	// Deadline is the request's deadline (Deadline, Timeout); zero when it
	// has none.
	Deadline time.Time
}

// Final reports whether err, returned for this delivery, ends the request
// for good (it is dead-lettered): err is permanent, or this was the last
// delivery MaxDeliveries allows. A nil err is final too (success).
func (d *Delivery) Final(err error) bool {
	return err == nil || IsPermanent(err) || d.Deliveries >= d.MaxDeliveries
}

// Middleware wraps the handling of one message. It gets the message's
// untyped view and next, which runs the rest of the chain and then the
// handler; it may change the context passed to next (to add a span, a
// logger, a deadline) and run code before and after it.
//
// The error Middleware returns is the attempt's outcome: nil records the
// handler's response (the zero response when next was not called or
// failed), an error is a failure handled like a handler's (retried unless
// Permanent, see RetryAfter). A middleware that does not call next skips the
// handler. A panic in the handler reaches middleware as an error matching
// ErrPanic; a panic in a middleware is recovered too and fails the attempt
// the same way. Middleware runs only for messages that start: entries
// dead-lettered without running (undecodable, past their deadline, out of
// deliveries) and fetch failures do not pass through it.
//
// ConsumerOptions.Middleware lists middleware outermost first: the first
// one runs first and sees the outcome of all the others.
type Middleware func(ctx context.Context, d *Delivery, next func(context.Context) error) error

// Outgoing is an untyped view of one request being produced, for
// ProduceInterceptor.
type Outgoing struct {
	// Queue is the queue's name.
	Queue string
	// ID is the request id.
	ID string
	// Headers are the headers the request is stored with. An interceptor
	// may set or delete headers before calling next (to inject a trace
	// context, say); changes after next returns have no effect. Nil when
	// no header is set: assign a new map to add one.
	Headers map[string]string
	// EntryID is the stream entry id, set when next returns nil and the
	// request has an entry ("" when it is scheduled for later, or was
	// answered from a stored outcome).
	EntryID string
}

// ProduceInterceptor wraps one Produce, Enqueue or Send call (msgs holds its
// one request) or one ProduceBatch call (msgs holds every job, in order). It
// runs in the caller's goroutine before the request is validated and sent,
// may change ctx and the headers, and returns what the call returns; next
// sends the request(s). For Send, next returns once the request is accepted,
// before it is written, and EntryID stays empty. An interceptor that does not call next fails the call with
// its error (or with ErrIntercepted when it returns nil).
//
// ProducerOptions.Interceptors lists interceptors outermost first.
type ProduceInterceptor func(ctx context.Context, msgs []*Outgoing, next func(context.Context) error) error

// chainMiddleware runs mws around inner, the first outermost.
func chainMiddleware(ctx context.Context, mws []Middleware, d *Delivery, inner func(context.Context) error) error {
	if len(mws) == 0 {
		return inner(ctx)
	}
	return mws[0](ctx, d, func(ctx context.Context) error {
		return chainMiddleware(ctx, mws[1:], d, inner)
	})
}

// intercept runs the producer's interceptors around send. send gets the
// (possibly changed) headers of each request, in order; with no interceptor
// it gets nil and the headers of the call's options apply unchanged.
func (p *Producer[Req, Resp]) intercept(ctx context.Context, ids []string, opts [][]ProduceOption,
	send func(ctx context.Context, outs []*Outgoing) error) error {
	return p.interceptQueues(ctx, nil, ids, opts, send)
}

// interceptQueues is intercept for requests on several queues (a flow):
// queues[i] is request i's queue (nil: every request is on p's queue).
func (p *Producer[Req, Resp]) interceptQueues(ctx context.Context, queues, ids []string, opts [][]ProduceOption,
	send func(ctx context.Context, outs []*Outgoing) error) error {
	ics := p.opts.Interceptors
	if len(ics) == 0 {
		return send(ctx, nil)
	}
	outs := make([]*Outgoing, len(ids))
	for i, id := range ids {
		var h map[string]string
		if s := applyProduceOptions(opts[i]); len(s.headers) > 0 {
			h = make(map[string]string, len(s.headers))
			for k, v := range s.headers {
				h[k] = v
			}
		}
		q := p.queue
		if queues != nil {
			q = queues[i]
		}
		outs[i] = &Outgoing{Queue: q, ID: id, Headers: h}
	}
	sent := false
	var chain func(ctx context.Context, i int) error
	chain = func(ctx context.Context, i int) error {
		if i == len(ics) {
			sent = true
			return send(ctx, outs)
		}
		return ics[i](ctx, outs, func(ctx context.Context) error { return chain(ctx, i+1) })
	}
	err := chain(ctx, 0)
	if err == nil && !sent {
		return ErrIntercepted
	}
	return err
}

// headersOf returns the headers for request i of an intercepted call: the
// interceptors' when there are any, else nil (the options' apply).
func headersOf(outs []*Outgoing, i int) (map[string]string, bool) {
	if outs == nil {
		return nil, false
	}
	return outs[i].Headers, true
}

// encodeHeaders encodes h for the entry field; "" when empty.
func encodeHeaders(h map[string]string) (string, error) {
	if len(h) == 0 {
		return "", nil
	}
	for k := range h {
		if k == "" {
			return "", fmt.Errorf("%w: a header name is empty", ErrInvalidOptions)
		}
	}
	b, err := json.Marshal(h)
	return string(b), err
}

// messageMeta is what an entry carries beside its id and payload.
type messageMeta struct {
	headers  map[string]string
	deadline time.Time
	readAt   time.Time
	// parent is the flow hash of the flow this entry is a child of (field
	// "pa"), or "": its outcome is counted there (complete.lua).
	parent string
	// flow: the entry is a flow's parent (field "fp"): Message.Children
	// reads its flow hash.
	flow bool
	// flowFailed is a flow parent's failure when a child failed under
	// FailOnChildFailure (field "ff"): recorded without running the handler.
	flowFailed string
	// key is the request's key (field "k", Key), or "".
	key string
}

// parseMeta reads the optional fields of an entry. Entries written without
// them (by older versions, by other programs) have none; a field that does
// not parse is ignored, so it never stops the request from running.
func parseMeta(values map[string]any, readAt time.Time) messageMeta {
	m := messageMeta{readAt: readAt}
	if len(values) > 2 { // a plain entry has only its id and payload
		m.parent, _ = values[keys.FieldParent].(string)
		m.flow = values[keys.FieldFlow] != nil
		m.flowFailed, _ = values[keys.FieldFlowFailed].(string)
		m.key, _ = values[keys.FieldKey].(string)
	}
	if h, ok := values[keys.FieldHeaders].(string); ok && h != "" {
		var hs map[string]string
		if json.Unmarshal([]byte(h), &hs) == nil && len(hs) > 0 {
			m.headers = hs
		}
	}
	if dl, ok := values[keys.FieldDeadline].(string); ok {
		if ms, err := strconv.ParseInt(dl, 10, 64); err == nil && ms > 0 {
			m.deadline = time.UnixMilli(ms)
		}
	}
	return m
}

// entryTime is the time part of a stream entry id (zero when it has none).
func entryTime(entryID string) time.Time {
	ms, _, _ := strings.Cut(entryID, "-")
	n, err := strconv.ParseInt(ms, 10, 64)
	if err != nil {
		return time.Time{}
	}
	return time.UnixMilli(n)
}
