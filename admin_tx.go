package streamq

// Reading the keys that handlers' staged writes (Tx) use, from outside a
// handler.

import (
	"context"
	"errors"
	"fmt"
	"math"
	"strconv"
	"strings"

	"github.com/redis/go-redis/v9"

	"github.com/streamq/streamq/internal/keys"
)

// TxKeys returns the names Tx.Key(name) gives the handlers of queue when
// it has shards shards (ConsumerOptions.Shards; 1 for an unsharded queue),
// in shard order: element i is the key of the requests of shard i. It
// needs no Redis: use it where no Admin is at hand (Admin.TxKeys reads the
// shard count from Redis).
func TxKeys(queue string, shards int, name string) ([]string, error) {
	if name == "" {
		return nil, errors.New("streamq: an empty Tx key name; pass the name the handlers give Tx.Key")
	}
	ks, err := keys.Shards(queue, shards)
	if err != nil {
		return nil, fmt.Errorf("streamq: Tx keys of queue %q: %w", queue, err)
	}
	out := make([]string, len(ks))
	for i, k := range ks {
		out[i] = k.TxKey(name)
	}
	return out, nil
}

// TxKeys returns the names Tx.Key(name) gives the queue's handlers, one per
// shard in shard order (one for an unsharded queue), with the shard count
// the queue records in Redis: with Shards > 1 each shard's handlers write
// their own key of that name, and a total is theirs together (see TxSum).
// Read them with any command; on a Redis Cluster each is in its shard's
// slot, so read them one by one (or with a pipeline), not with one
// multi-key command.
func (a *Admin) TxKeys(ctx context.Context, name string) ([]string, error) {
	mustContext(ctx, "Admin.TxKeys")
	return callBounded(ctx, func(ctx context.Context) ([]string, error) { return a.txKeys(ctx, name) })
}

// txKeys is the body of TxKeys, run by callBounded.
func (a *Admin) txKeys(ctx context.Context, name string) ([]string, error) {
	if name == "" {
		return nil, errors.New("streamq: an empty Tx key name; pass the name the handlers give Tx.Key")
	}
	shards, err := a.shards(ctx)
	if err != nil {
		return nil, err
	}
	out := make([]string, len(shards))
	for i, k := range shards {
		out[i] = k.TxKey(name)
	}
	return out, nil
}

// TxSum returns the sum over the queue's shards of the counter that
// handlers stage under Tx.Key(name) (Tx.Incr, IncrBy, Decr, DecrBy, or a
// SET of an integer): one GET per shard, in one pipeline. A shard whose key
// does not exist counts 0. It fails, naming the key, when a key holds a
// value that is not an integer (ErrWrongType when it is not a string: a
// hash or a set is read with TxKeys and the command of its type) or when
// the sum overflows int64.
func (a *Admin) TxSum(ctx context.Context, name string) (int64, error) {
	mustContext(ctx, "Admin.TxSum")
	return callBounded(ctx, func(ctx context.Context) (int64, error) { return a.txSum(ctx, name) })
}

// txSum is the body of TxSum, run by callBounded.
func (a *Admin) txSum(ctx context.Context, name string) (int64, error) {
	names, err := a.txKeys(ctx, name)
	if err != nil {
		return 0, err
	}
	pipe := a.client.Pipeline()
	gets := make([]*redis.StringCmd, len(names))
	for i, key := range names {
		gets[i] = pipe.Get(ctx, key)
	}
	if _, err := pipe.Exec(ctx); err != nil && !errors.Is(err, redis.Nil) && !strings.HasPrefix(err.Error(), "WRONGTYPE") {
		return 0, fmt.Errorf("streamq: read the Tx keys %q of %s: %w", name, a.queue, err)
	}
	var sum int64
	for i, g := range gets {
		v, err := g.Result()
		switch {
		case errors.Is(err, redis.Nil):
			continue
		case err != nil && strings.HasPrefix(err.Error(), "WRONGTYPE"):
			return 0, fmt.Errorf("%w: %s is not a counter (read it with TxKeys and the command of its type)", ErrWrongType, names[i])
		case err != nil:
			return 0, fmt.Errorf("streamq: read %s: %w", names[i], err)
		}
		n, err := strconv.ParseInt(v, 10, 64)
		if err != nil {
			return 0, fmt.Errorf("streamq: %s holds %q, not an integer: TxSum adds counters (Tx.IncrBy); read other values with TxKeys", names[i], v)
		}
		if (n > 0 && sum > math.MaxInt64-n) || (n < 0 && sum < math.MinInt64-n) {
			return 0, fmt.Errorf("streamq: the sum of the Tx keys %q of %s overflows int64; add them yourself with TxKeys", name, a.queue)
		}
		sum += n
	}
	return sum, nil
}
