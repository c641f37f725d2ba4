package streamq

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/streamq/streamq/internal/keys"
	"github.com/streamq/streamq/internal/scripts"
)

// trimLoop trims the stream and prunes idle consumers every TrimInterval ±20%.
// Every consumer runs it; it needs no leader, because each step is one atomic
// script whose result is safe whoever runs it and however often.
func (r *run[Req, Resp]) trimLoop() {
	defer r.loops.Done()
	o := &r.c.opts
	for {
		d := o.TrimInterval*4/5 + rand.N(o.TrimInterval*2/5+1)
		t := time.NewTimer(d)
		select {
		case <-r.stopLoops:
			t.Stop()
			return
		case <-r.runCtx.Done():
			t.Stop()
			return
		case <-t.C:
		}
		if _, err := trimStream(r.runCtx, r.c); err != nil && r.runCtx.Err() == nil {
			r.c.log.WarnContext(r.runCtx, "streamq: trimming the stream failed; will retry", "err", err)
		}
		deleted, err := pruneConsumers(r.runCtx, r.c)
		if err != nil && r.runCtx.Err() == nil {
			r.c.log.WarnContext(r.runCtx, "streamq: pruning idle consumers failed; will retry", "err", err)
		} else if len(deleted) > 0 {
			r.c.log.InfoContext(r.runCtx, "streamq: pruned idle consumers with no pending entries", "consumers", deleted)
		}
	}
}

// trimStream removes, from every shard, the entries every group is done with
// (MINID ~ the safe point) and returns how many were removed. A shard that
// fails does not stop the others: its error, naming the stream, is joined
// to the result (while ctx lives), so one failing shard never leaves the
// healthy ones to grow.
func trimStream[Req, Resp any](ctx context.Context, c *Consumer[Req, Resp]) (int64, error) {
	return trimShards(ctx, c.client, c.shards)
}

// trimShards is trimStream over the given shards (Admin.Trim's too).
func trimShards(ctx context.Context, client redis.UniversalClient, shards []keys.Keys) (int64, error) {
	var total int64
	var errs []error
	for _, k := range shards {
		res, err := scripts.Trim.Run(ctx, client, []string{k.Stream, k.Fanout}).Slice()
		if err != nil {
			if ctx.Err() != nil {
				return total, ctx.Err()
			}
			errs = append(errs, fmt.Errorf("trim %s: %w", k.Stream, err))
			continue
		}
		if len(res) > 0 {
			n, _ := res[0].(int64)
			total += n
		}
	}
	return total, errors.Join(errs...)
}

// pruneConsumers deletes consumers of the group, other than c, that hold no
// pending entries on any shard they are known on and have been idle for
// ConsumerIdleTimeout. Each shard's group has its own consumer list. A shard
// that fails does not stop the others (see trimStream).
func pruneConsumers[Req, Resp any](ctx context.Context, c *Consumer[Req, Resp]) ([]string, error) {
	var deleted []string
	var errs []error
	for _, k := range c.shards {
		names, err := scripts.Prune.Run(ctx, c.client, []string{k.Stream},
			c.opts.Group, c.opts.ConsumerIdleTimeout.Milliseconds(), c.opts.Name).StringSlice()
		if err != nil {
			if ctx.Err() != nil {
				return deleted, ctx.Err()
			}
			errs = append(errs, fmt.Errorf("prune the consumers of %s: %w", k.Stream, err))
			continue
		}
		deleted = append(deleted, names...)
	}
	return deleted, errors.Join(append(errs, pruneSeen(ctx, c, deleted))...)
}

// Trim removes the stream entries that every consumer group has acknowledged,
// as the consumer's periodic trim does, and returns how many were removed.
// It never removes an entry a group has not acknowledged. It returns ctx's
// error as soon as ctx ends, also while Redis does not answer (the
// removal under way may still happen).
func (c *Consumer[Req, Resp]) Trim(ctx context.Context) (int64, error) {
	mustContext(ctx, "Consumer.Trim")
	return callBounded(ctx, func(ctx context.Context) (int64, error) { return trimStream(ctx, c) })
}

// PruneConsumers deletes consumers of the group, other than c, that hold no
// pending entries and have been idle for ConsumerIdleTimeout, as the periodic
// maintenance does, and returns their names. It returns ctx's error as
// soon as ctx ends, also while Redis does not answer (the deletion under
// way may still happen).
func (c *Consumer[Req, Resp]) PruneConsumers(ctx context.Context) ([]string, error) {
	mustContext(ctx, "Consumer.PruneConsumers")
	return callBounded(ctx, func(ctx context.Context) ([]string, error) { return pruneConsumers(ctx, c) })
}
