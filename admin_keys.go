package streamq

// Operator views and controls of fair queuing by key (see Key).

import (
	"context"
	"fmt"
	"sort"

	"github.com/streamq/streamq/internal/scripts"
)

// KeyStat is one key of a queue (see Key), summed over its shards.
type KeyStat struct {
	// Key is the key.
	Key string `json:"key"`
	// Waiting counts the key's jobs waiting for its turn (outside the stream).
	Waiting int64 `json:"waiting"`
	// Running counts the key's slots: its jobs in the stream, read ahead by
	// a consumer or running. At most its limit (per shard).
	Running int64 `json:"running"`
	// Paused is true while PauseKey holds the key.
	Paused bool `json:"paused"`
	// Limit is the key's limit per shard (0: none): its own (SetKeyLimit),
	// else the queue's (ConsumerOptions.KeyLimit).
	Limit int `json:"limit"`
	// Weight is how many jobs the key appends per turn (SetKeyWeight; 1 by
	// default).
	Weight int `json:"weight"`
	// Rate is the key's rate limit (SetKeyRate, else the queue's
	// ConsumerOptions.KeyRate); nil: none.
	Rate *RateLimit `json:"rate,omitempty"`
	// Held is true while the key's rate holds its waiting jobs back (on
	// any shard): its next job enters the stream when its rate allows.
	Held bool `json:"held"`
}

// TopKeys returns the n keys (n <= 0: 20) with the most waiting jobs, then
// the most running ones, among the keys that have either; a key with
// nothing waiting or running is not stored anywhere, so it is not listed.
// Its cost is bounded: on each shard it looks at no more than the next 500
// keys in turn, 500 parked keys (a sample when there are more), 500 keys
// with jobs in the stream or running (likewise) and the 500 keys held by
// their rate that are due first. With more active keys than that, the list
// is the top of the keys it looked at; KeyStats reads any one key exactly.
// A nil ctx panics.
func (a *Admin) TopKeys(ctx context.Context, n int) ([]KeyStat, error) {
	mustContext(ctx, "Admin.TopKeys")
	return callBounded(ctx, func(ctx context.Context) ([]KeyStat, error) { return a.topKeys(ctx, n) })
}

// topKeys is the body of TopKeys, run by callBounded.
func (a *Admin) topKeys(ctx context.Context, n int) ([]KeyStat, error) {
	if n <= 0 {
		n = 20
	}
	byKey := map[string]*KeyStat{}
	err := a.eachKeyShard(ctx, "top", func(res []any) {
		for i := 0; i+keyStatLen-1 < len(res); i += keyStatLen {
			s := parseKeyStat(res[i : i+keyStatLen])
			if have, ok := byKey[s.Key]; ok {
				have.Waiting += s.Waiting
				have.Running += s.Running
				have.Paused = have.Paused || s.Paused
				have.Held = have.Held || s.Held
				continue
			}
			byKey[s.Key] = &s
		}
	}, n)
	if err != nil {
		return nil, err
	}
	out := make([]KeyStat, 0, len(byKey))
	for _, s := range byKey {
		out = append(out, *s)
	}
	sort.Slice(out, func(i, j int) bool {
		if out[i].Waiting != out[j].Waiting {
			return out[i].Waiting > out[j].Waiting
		}
		if out[i].Running != out[j].Running {
			return out[i].Running > out[j].Running
		}
		return out[i].Key < out[j].Key
	})
	if len(out) > n {
		out = out[:n]
	}
	return out, nil
}

// KeyStats returns one key's waiting and running jobs, summed over the
// queue's shards (zero counts for a key with none). A nil ctx panics.
func (a *Admin) KeyStats(ctx context.Context, key string) (KeyStat, error) {
	mustContext(ctx, "Admin.KeyStats")
	return callBounded(ctx, func(ctx context.Context) (KeyStat, error) { return a.keyStats(ctx, key) })
}

// keyStats is the body of KeyStats, run by callBounded.
func (a *Admin) keyStats(ctx context.Context, key string) (KeyStat, error) {
	if err := validateKey(key); err != nil {
		return KeyStat{}, err
	}
	out := KeyStat{Key: key}
	err := a.eachKeyShard(ctx, "get", func(res []any) {
		s := parseKeyStat(res)
		out.Waiting += s.Waiting
		out.Running += s.Running
		out.Paused = out.Paused || s.Paused
		out.Held = out.Held || s.Held
		out.Limit, out.Weight, out.Rate = s.Limit, s.Weight, s.Rate
	}, key)
	return out, err
}

// PauseKey stops key's waiting jobs from entering the stream, on every
// shard, until ResumeKey: its jobs already in the stream or running go on,
// and other keys are not affected. New jobs of the key wait too. A nil ctx
// panics.
func (a *Admin) PauseKey(ctx context.Context, key string) error {
	mustContext(ctx, "Admin.PauseKey")
	return callBoundedErr(ctx, func(ctx context.Context) error { return a.pauseKey(ctx, key) })
}

// pauseKey is the body of PauseKey, run by callBounded.
func (a *Admin) pauseKey(ctx context.Context, key string) error {
	return a.changeKey(ctx, "Admin.PauseKey", "pause", key)
}

// ResumeKey undoes PauseKey: the key takes its turns again at once.
// A nil ctx panics.
func (a *Admin) ResumeKey(ctx context.Context, key string) error {
	mustContext(ctx, "Admin.ResumeKey")
	return callBoundedErr(ctx, func(ctx context.Context) error { return a.resumeKey(ctx, key) })
}

// resumeKey is the body of ResumeKey, run by callBounded.
func (a *Admin) resumeKey(ctx context.Context, key string) error {
	return a.changeKey(ctx, "Admin.ResumeKey", "resume", key)
}

// SetKeyLimit sets how many jobs of key may be in the stream or running at
// once, per shard, overriding ConsumerOptions.KeyLimit; n = 0 removes the
// key's own limit. A raised limit lets waiting jobs in at once; a lowered
// one lets no more in until the key's running jobs fall below it. A nil
// ctx panics.
func (a *Admin) SetKeyLimit(ctx context.Context, key string, n int) error {
	mustContext(ctx, "Admin.SetKeyLimit")
	return callBoundedErr(ctx, func(ctx context.Context) error { return a.setKeyLimit(ctx, key, n) })
}

// setKeyLimit is the body of SetKeyLimit, run by callBounded.
func (a *Admin) setKeyLimit(ctx context.Context, key string, n int) error {
	if n < 0 {
		return fmt.Errorf("%w: SetKeyLimit(%q, %d): the limit must be 0 (none) or more", ErrInvalidOptions, key, n)
	}
	return a.changeKey(ctx, "Admin.SetKeyLimit", "limit", key, n)
}

// SetKeyWeight sets how many jobs key appends per turn (w >= 1; 1, the
// default, is plain round robin). A nil ctx panics.
func (a *Admin) SetKeyWeight(ctx context.Context, key string, w int) error {
	mustContext(ctx, "Admin.SetKeyWeight")
	return callBoundedErr(ctx, func(ctx context.Context) error { return a.setKeyWeight(ctx, key, w) })
}

// setKeyWeight is the body of SetKeyWeight, run by callBounded.
func (a *Admin) setKeyWeight(ctx context.Context, key string, w int) error {
	if w < 1 {
		return fmt.Errorf("%w: SetKeyWeight(%q, %d): the weight must be at least 1", ErrInvalidOptions, key, w)
	}
	return a.changeKey(ctx, "Admin.SetKeyWeight", "weight", key, w)
}

// SetKeyDefaults stores the queue's default limit per key (limit; 0: none)
// and its window (window; 0: DefaultKeyWindow) on every shard, as a
// consumer with ConsumerOptions.KeyLimit and KeyWindow does when it starts.
// Store them before producing keyed jobs that must respect them: a job
// appended to the stream before a limit was stored holds a slot but was not
// held back by the limit. A nil ctx panics.
func (a *Admin) SetKeyDefaults(ctx context.Context, limit, window int) error {
	mustContext(ctx, "Admin.SetKeyDefaults")
	return callBoundedErr(ctx, func(ctx context.Context) error { return a.setKeyDefaults(ctx, limit, window) })
}

// setKeyDefaults is the body of SetKeyDefaults, run by callBounded.
func (a *Admin) setKeyDefaults(ctx context.Context, limit, window int) error {
	if limit < 0 || window < 0 {
		return fmt.Errorf("%w: SetKeyDefaults(%d, %d): the limit and window must be 0 (the default) or more", ErrInvalidOptions, limit, window)
	}
	if err := a.eachKeyShard(ctx, "deflimit", nil, limit); err != nil {
		return err
	}
	return a.eachKeyShard(ctx, "window", nil, window)
}

// SetKeyRate sets key's own rate limit (see ConsumerOptions.KeyRate): at
// most limit.N of its jobs enter the stream per limit.Per, plus
// limit.Burst (default 1) after a quiet time, counted on every shard's
// own (per shard with Shards > 1). nil removes the key's own rate (the
// queue's KeyRate applies again). The new rate starts from a quiet state
// (up to Burst jobs at once), and a key held back by its old rate takes
// its turn again at once. The limit is validated as RateLimit is
// (ErrInvalidOptions). A nil ctx panics.
func (a *Admin) SetKeyRate(ctx context.Context, key string, limit *RateLimit) error {
	mustContext(ctx, "Admin.SetKeyRate")
	return callBoundedErr(ctx, func(ctx context.Context) error { return a.setKeyRate(ctx, key, limit) })
}

// setKeyRate is the body of SetKeyRate, run by callBounded.
func (a *Admin) setKeyRate(ctx context.Context, key string, limit *RateLimit) error {
	v, err := storedKeyRate(fmt.Sprintf("SetKeyRate(%q)", key), limit)
	if err != nil {
		return err
	}
	return a.changeKey(ctx, "Admin.SetKeyRate", "rate", key, v)
}

// SetKeyRateDefault stores the queue's rate limit per key on every shard,
// as a consumer with ConsumerOptions.KeyRate does when it starts; nil
// removes it (no rate per key, except the keys' own). A nil ctx panics.
func (a *Admin) SetKeyRateDefault(ctx context.Context, limit *RateLimit) error {
	mustContext(ctx, "Admin.SetKeyRateDefault")
	return callBoundedErr(ctx, func(ctx context.Context) error { return a.setKeyRateDefault(ctx, limit) })
}

// setKeyRateDefault is the body of SetKeyRateDefault, run by callBounded.
func (a *Admin) setKeyRateDefault(ctx context.Context, limit *RateLimit) error {
	v, err := storedKeyRate("SetKeyRateDefault", limit)
	if err != nil {
		return err
	}
	return a.eachKeyShard(ctx, "defrate", nil, v)
}

// storedKeyRate validates limit (a copy: resolve sets its defaults) and
// returns it as fair.lua stores it ("" for nil).
func storedKeyRate(name string, limit *RateLimit) (string, error) {
	if limit == nil {
		return "", nil
	}
	l := *limit
	if err := keyRateError(name, &l); err != nil {
		return "", err
	}
	return l.stored(), nil
}

func (a *Admin) changeKey(ctx context.Context, name, op, key string, args ...any) error {
	mustContext(ctx, name)
	if err := validateKey(key); err != nil {
		return err
	}
	return a.eachKeyShard(ctx, op, nil, append([]any{key}, args...)...)
}

// eachKeyShard runs fairadmin.lua's op on every shard, handing each reply
// to fn.
func (a *Admin) eachKeyShard(ctx context.Context, op string, fn func([]any), args ...any) error {
	shards, err := a.shards(ctx)
	if err != nil {
		return err
	}
	// The publish command ends the arguments (fairadmin.lua).
	args = append(append([]any{op}, args...), publishCommand(isCluster(a.client)))
	for _, k := range shards {
		res, err := scripts.FairAdmin.Run(ctx, a.client, []string{k.Stream}, args...).Result()
		if err != nil {
			return fmt.Errorf("streamq: keys of %s (%s): %w", a.queue, op, err)
		}
		if fn != nil {
			list, _ := res.([]any)
			fn(list)
		}
	}
	return nil
}

// keyStatLen is the length of one key's reply of fairadmin.lua.
const keyStatLen = 8

// parseKeyStat reads fairadmin.lua's {key, waiting, running, paused, limit,
// weight, rate, held}.
func parseKeyStat(v []any) KeyStat {
	if len(v) < keyStatLen {
		return KeyStat{}
	}
	num := func(x any) int64 { n, _ := x.(int64); return n }
	key, _ := v[0].(string)
	rate, _ := v[6].(string)
	return KeyStat{Key: key, Waiting: num(v[1]), Running: num(v[2]), Paused: num(v[3]) == 1,
		Limit: int(num(v[4])), Weight: int(num(v[5])), Rate: parseStoredRate(rate), Held: num(v[7]) == 1}
}
