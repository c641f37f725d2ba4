package streamq

// Fair queuing by key: the Key produce option, the consumer's settings in
// Redis. The policy itself runs in Redis (internal/scripts/fair.lua): keyed
// jobs wait in their key's list and take turns into the stream, each
// appended entry holding a slot of its key until its outcome.

import (
	"context"
	"fmt"
	"time"

	"github.com/streamq/streamq/internal/keys"
	"github.com/streamq/streamq/internal/scripts"
)

// DefaultKeyWindow is the most keyed jobs a shard lets its consumers hold at
// once (read ahead, waiting in the stream or running): see
// ConsumerOptions.KeyWindow.
const DefaultKeyWindow = 128

// MaxKeyLen is the longest key Key accepts (the same as MaxIDLen).
const MaxKeyLen = MaxIDLen

// Key puts the request in key k's share of the queue: fair queuing by key.
// Consumers serve the keys that have work in turn, so when a keyed job's
// produce returns with j jobs of its key waiting ahead of it, at most
// W + (j+1)·(K−1) + j other keyed jobs appended before it have not started,
// W the window (ConsumerOptions.KeyWindow) and K the keys with work,
// whatever any key's backlog (weights 1, no limit, pause or rate holding
// its key); and ConsumerOptions.KeyLimit (or Admin.SetKeyLimit) bounds how many of one
// key's handlers run at once across every consumer. Retries, delayed
// requests, RunNow and Requeue keep the key. A key follows the rules of
// ids (non-empty, at most MaxKeyLen bytes); it cannot be combined with
// Throttle, Debounce or Replace (ErrInvalidOptions). A flow's children and parent
// take keys (see ChildOf, FlowOptions.Parent). Default: no key (plain
// FIFO).
//
// With Priority, a key's jobs still take their key's turns in the order
// they were produced, whatever their levels (a high job of a key waits for
// the key's earlier jobs); on its turn a job is appended to its own level's
// stream and then starts before the waiting entries of lower levels, as any
// request of its level.
func Key(k string) ProduceOption {
	return func(s *produceSettings) { s.key, s.keySet = k, true }
}

// validateKey checks a key as validateID checks an id.
func validateKey(k string) error {
	if k == "" {
		return fmt.Errorf("%w: Key(\"\"): the key is empty", ErrInvalidOptions)
	}
	if len(k) > MaxKeyLen {
		return fmt.Errorf("%w: Key: the key is %d bytes, the limit is MaxKeyLen=%d", ErrInvalidOptions, len(k), MaxKeyLen)
	}
	return nil
}

// applyKey copies the Key option into the item: field "k" (produce.lua
// takes keyed items apart when the call says "K").
func (it *produceItem) applyKey(s produceSettings) error {
	if !s.keySet {
		return nil
	}
	if err := validateKey(s.key); err != nil {
		return err
	}
	if it.mode != modeNone {
		return fmt.Errorf("%w: Key cannot be combined with Throttle, Debounce or Replace", ErrInvalidOptions)
	}
	it.key = s.key
	it.fields = append(it.fields, keys.FieldKey, s.key)
	return nil
}

// keyedCall is the marker runProduce adds to produce.lua's ARGV[2] when an
// item of the call has a key.
const keyedCall = "K"

// anyKeyed reports whether an item of the call has a key.
func anyKeyed(items []*produceItem) bool {
	for _, it := range items {
		if it.key != "" {
			return true
		}
	}
	return false
}

// writeKeySettings stores the consumer's KeyWindow, KeyLimit and KeyRate in
// each shard's settings hash, only those set: a consumer that sets none
// writes nothing. fairadmin.lua stores them, so that a limit that appears
// starts the shard's count of slots per key (fair.lua's fairRetrack).
func (c *Consumer[Req, Resp]) writeKeySettings(ctx context.Context) error {
	o := &c.opts
	if o.KeyWindow == 0 && o.KeyLimit == 0 && o.KeyRate == nil {
		return nil
	}
	var vals []any
	if o.KeyWindow > 0 {
		vals = append(vals, "window", o.KeyWindow)
	}
	if o.KeyLimit > 0 {
		vals = append(vals, "limit", o.KeyLimit)
	}
	if o.KeyRate != nil {
		vals = append(vals, "rate", o.KeyRate.stored())
	}
	args := append(append([]any{"set"}, vals...), publishCommand(isCluster(c.client)))
	for shard := range c.nShards {
		if err := scripts.FairAdmin.Run(ctx, c.client, []string{c.shards[shard].Stream}, args...).Err(); err != nil {
			return fmt.Errorf("streamq: store the key settings of %s: %w", c.queue, err)
		}
	}
	return nil
}

// keyRateError validates a per-key rate limit (nil: none) as RateLimit is
// validated, setting its defaults; name says where it was given.
func keyRateError(name string, l *RateLimit) error {
	if err := l.resolve(); err != nil {
		return fmt.Errorf("%s: %w", name, err)
	}
	return nil
}

// stored is a per-key rate limit as fair.lua reads it: "<N>:<Per in
// ns>:<Burst>" (Burst resolved).
func (l *RateLimit) stored() string {
	return fmt.Sprintf("%d:%d:%d", l.N, l.Per.Nanoseconds(), l.Burst)
}

// parseStoredRate reads what stored wrote; nil for "" or a value it did
// not write.
func parseStoredRate(s string) *RateLimit {
	var n, burst int
	var per int64
	if _, err := fmt.Sscanf(s, "%d:%d:%d", &n, &per, &burst); err != nil || n < 1 || per < 1 {
		return nil
	}
	return &RateLimit{N: n, Per: time.Duration(per), Burst: burst}
}
