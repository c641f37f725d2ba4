package streamq

// Staged writes: a handler's Redis writes applied in the same atomic step
// as its successful outcome (complete.lua), and only by the delivery whose
// outcome is recorded. See Message.Tx and DESIGN.md ("Staged writes").

import (
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/streamq/streamq/internal/keys"
)

var (
	// ErrTxCommand is returned by a Tx method that refuses to stage a
	// command: one that is not on the list of writes a Tx takes (reads,
	// blocking commands, scripts, transactions, commands without keys or
	// whose keys are not known from the arguments), the wrong number of
	// arguments, an argument of a type Redis cannot take, or too many
	// commands or arguments. Nothing of the refused command is staged.
	ErrTxCommand = errors.New("streamq: command not allowed in a Tx")
	// ErrTxSlot is returned on a Redis Cluster when a staged key does not
	// hash to the slot of the message's queue (or shard): name keys with
	// Tx.Key, or put the queue's hash tag (Tx.HashTag) in them.
	ErrTxSlot = errors.New("streamq: key is outside the queue's hash slot")
	// ErrTxClosed is returned when staging after the handler returned: its
	// outcome (and with it what was staged) is already on its way.
	ErrTxClosed = errors.New("streamq: Tx used after its handler returned")
)

// Limits of one message's staged writes.
const (
	// MaxTxCommands is the most commands one message may stage.
	MaxTxCommands = 1000
	// MaxTxArgs is the most arguments (the command name included) of one
	// staged command.
	MaxTxArgs = 4096
)

// Tx holds the Redis writes a handler stages for its message (Message.Tx).
// None of them is applied while the handler runs. They are applied in the
// same atomic step (one Lua script) that records the message's successful
// outcome and acknowledges its entry, and only when this delivery's outcome
// is the one recorded: a handler that fails, is retried, dead-lettered,
// loses its lease to another consumer, or finishes after another delivery of
// the same request recorded its outcome applies nothing. So each request's
// staged writes are applied exactly once, however often its handler runs.
//
// Only writes whose keys are named in their arguments can be staged (see
// Do). Reads are out of scope: a Tx never reads, and nothing staged sees the
// effect of anything else staged until the outcome is recorded. On a Redis
// Cluster every key must hash to the slot of the message's queue (with
// ConsumerOptions.Shards > 1, of its shard): name keys with Key. On a single
// Redis any key may be used, and the writes are atomic with the outcome all
// the same (one script).
//
// A staged write that Redis would refuse (a key holding another type, a
// counter that is not a number for INCRBY or HINCRBY, ...) dead-letters the
// request instead of recording its result. Key types, and the numbers of
// counters (the increment, and the value at the key or hash field, as the
// writes of requests completed before it in the same step left it) are
// checked before anything of the request is written, so such a refusal
// applies nothing. Numbers are checked as Redis parses them: an integer
// counter (INCRBY, HINCRBY, ...) holds a plain int64 ("5", not "05", " 5" or
// "5.0"); a float counter (INCRBYFLOAT, HINCRBYFLOAT) what strtold takes
// whole (so also "0x10", "+5", ".5", "5e3"; not "5 ", "inf" or "nan") and
// stays finite, within a float64's range (which some servers exceed: a
// value beyond it is refused here though such a server would take it). A
// refusal that only shows while applying (a counter the request's own
// earlier staged write made non-numeric, an integer overflow, an index out
// of range, an explicit XADD id) leaves the earlier writes of the same
// message applied, since Redis does not roll back: the dead letter's error
// says how many.
//
// A Tx and Message.Tx are safe for use by several goroutines of its
// handler; staging after the handler returned fails with ErrTxClosed, also
// through a Tx that Message.Tx first returned after that.
type Tx struct {
	shard    *txShard
	template bool // a shard's shared template: never staged into

	mu     sync.Mutex
	cmds   []txCmd
	keys   []string
	closed bool
}

// txCmd is one staged command: its header for complete.lua (the key type it
// needs, then where its keys are) and its arguments, every one a string.
type txCmd struct {
	hdr  string
	args []any
}

// txShard is what a shard's messages need to stage: the shard's names and
// whether keys must share its slot (a Redis Cluster).
type txShard struct {
	k      keys.Keys
	slot   int
	strict bool
}

// newTxShards returns per shard the template Tx a worker puts in each
// Message (one pointer, no allocation per job); Message.Tx replaces it with
// a Tx of its own on first use.
func newTxShards(shards []keys.Keys, cluster bool) []*Tx {
	out := make([]*Tx, len(shards))
	for i, k := range shards {
		out[i] = &Tx{shard: &txShard{k: k, slot: k.TagSlot(), strict: cluster}, template: true}
	}
	return out
}

// Tx returns the message's staged writes, created on first use (a handler
// that never calls it pays nothing). Every call returns the same Tx. On a
// Message not made by a Consumer (a handler called by a test), the Tx
// stages and validates, allows any key, and is never applied: read it back
// with Commands.
func (m *Message[Req]) Tx() *Tx {
	if st := m.st; st != nil {
		st.mu.Lock()
		defer st.mu.Unlock()
		if st.tx == nil {
			// First used after the handler returned (from a goroutine of
			// its), it is closed: every staging fails with ErrTxClosed.
			st.tx = &Tx{shard: m.tx.shard, closed: st.done}
		}
		return st.tx
	}
	switch {
	case m.tx == nil:
		m.tx = &Tx{}
	case m.tx.template:
		m.tx = &Tx{shard: m.tx.shard}
	}
	return m.tx
}

// finish marks the handler of the message as returned: it waits for
// Progress calls running now, then closes the Tx. It returns the Tx when the
// handler staged writes (else nil), and whether the delivery reported
// progress.
func (st *msgState) finish() (tx *Tx, reported bool) {
	st.reports.Lock()
	st.mu.Lock()
	st.done = true
	tx = st.tx
	st.mu.Unlock()
	st.reports.Unlock()
	return tx.close(), st.reported.Load()
}

// Key returns the name of a key in the slot of the message's queue (or
// shard): name under the queue's key prefix ("streamq:{<queue>}:tx:<name>",
// or the shard's), which its least-privilege ACL pattern covers. With
// Shards > 1 each shard has its own key of that name: sum them yourself.
func (t *Tx) Key(name string) string {
	if t.shard == nil {
		return name
	}
	return t.shard.k.TxKey(name)
}

// HashTag returns the hash tag ("{...}") of the message's queue or shard: a
// key containing it is in the right slot on a Redis Cluster.
func (t *Tx) HashTag() string {
	if t.shard == nil {
		return ""
	}
	base := t.shard.k.Stream
	i := strings.IndexByte(base, '{')
	j := strings.IndexByte(base, '}')
	return base[i : j+1]
}

// Len returns the number of staged commands.
func (t *Tx) Len() int {
	t.mu.Lock()
	defer t.mu.Unlock()
	return len(t.cmds)
}

// Commands returns a copy of the staged commands, each one's arguments
// (command name first) as strings.
func (t *Tx) Commands() [][]string {
	t.mu.Lock()
	defer t.mu.Unlock()
	out := make([][]string, len(t.cmds))
	for i, c := range t.cmds {
		out[i] = make([]string, len(c.args))
		for j, a := range c.args {
			out[i][j] = a.(string)
		}
	}
	return out
}

// Set stages SET key value, with PX ttl when ttl > 0.
func (t *Tx) Set(key string, value any, ttl time.Duration) error {
	if ttl < 0 {
		return fmt.Errorf("%w: SET with a negative ttl %v", ErrTxCommand, ttl)
	}
	if ttl > 0 {
		return t.Do("SET", key, value, "PX", ttlMillis(ttl))
	}
	return t.Do("SET", key, value)
}

// Del stages DEL keys...
func (t *Tx) Del(keys ...string) error { return t.Do(append([]any{"DEL"}, txStrs(keys)...)...) }

// Incr stages INCR key.
func (t *Tx) Incr(key string) error { return t.Do("INCR", key) }

// IncrBy stages INCRBY key n.
func (t *Tx) IncrBy(key string, n int64) error { return t.Do("INCRBY", key, n) }

// IncrByFloat stages INCRBYFLOAT key f.
func (t *Tx) IncrByFloat(key string, f float64) error { return t.Do("INCRBYFLOAT", key, f) }

// HSet stages HSET key field value [field value ...].
func (t *Tx) HSet(key string, fieldValues ...any) error {
	return t.Do(append([]any{"HSET", key}, fieldValues...)...)
}

// HIncrBy stages HINCRBY key field n.
func (t *Tx) HIncrBy(key, field string, n int64) error { return t.Do("HINCRBY", key, field, n) }

// HDel stages HDEL key fields...
func (t *Tx) HDel(key string, fields ...string) error {
	return t.Do(append([]any{"HDEL", key}, txStrs(fields)...)...)
}

// SAdd stages SADD key members...
func (t *Tx) SAdd(key string, members ...any) error {
	return t.Do(append([]any{"SADD", key}, members...)...)
}

// SRem stages SREM key members...
func (t *Tx) SRem(key string, members ...any) error {
	return t.Do(append([]any{"SREM", key}, members...)...)
}

// LPush stages LPUSH key values...
func (t *Tx) LPush(key string, values ...any) error {
	return t.Do(append([]any{"LPUSH", key}, values...)...)
}

// RPush stages RPUSH key values...
func (t *Tx) RPush(key string, values ...any) error {
	return t.Do(append([]any{"RPUSH", key}, values...)...)
}

// LTrim stages LTRIM key start stop.
func (t *Tx) LTrim(key string, start, stop int64) error { return t.Do("LTRIM", key, start, stop) }

// ZAdd stages ZADD key score member.
func (t *Tx) ZAdd(key string, score float64, member any) error {
	return t.Do("ZADD", key, score, member)
}

// ZIncrBy stages ZINCRBY key incr member.
func (t *Tx) ZIncrBy(key string, incr float64, member any) error {
	return t.Do("ZINCRBY", key, incr, member)
}

// ZRem stages ZREM key members...
func (t *Tx) ZRem(key string, members ...any) error {
	return t.Do(append([]any{"ZREM", key}, members...)...)
}

// Expire stages PEXPIRE key ttl (in milliseconds, rounded up).
func (t *Tx) Expire(key string, ttl time.Duration) error {
	if ttl <= 0 {
		return fmt.Errorf("%w: expire with a ttl %v (use Del)", ErrTxCommand, ttl)
	}
	return t.Do("PEXPIRE", key, ttlMillis(ttl))
}

// XAdd stages XADD stream [MAXLEN ~ maxLen] * field value [field value ...],
// the entry id chosen by Redis when the outcome is recorded; maxLen <= 0
// caps nothing.
func (t *Tx) XAdd(stream string, maxLen int64, fieldValues ...any) error {
	args := []any{"XADD", stream}
	if maxLen > 0 {
		args = append(args, "MAXLEN", "~", maxLen)
	}
	return t.Do(append(append(args, "*"), fieldValues...)...)
}

// PFAdd stages PFADD key elements...
func (t *Tx) PFAdd(key string, elements ...any) error {
	return t.Do(append([]any{"PFADD", key}, elements...)...)
}

// Do stages one command: its name, then its arguments (strings, []byte,
// integers, floats or bools). The command must be one of these writes, whose
// keys are known from its arguments:
//
//	SET (without GET) SETEX PSETEX MSET APPEND INCR INCRBY INCRBYFLOAT DECR
//	DECRBY SETRANGE SETBIT DEL UNLINK EXPIRE PEXPIRE EXPIREAT PEXPIREAT PERSIST
//	HSET HSETNX HMSET HINCRBY HINCRBYFLOAT HDEL SADD SREM LPUSH RPUSH LPUSHX
//	RPUSHX LTRIM LSET LREM LPOP RPOP ZADD ZINCRBY ZREM ZREMRANGEBYSCORE
//	ZREMRANGEBYRANK ZREMRANGEBYLEX XADD XTRIM XDEL PFADD
//
// Any other command (a read, a blocking command, a script, MULTI, a command
// without keys or touching another database) fails with ErrTxCommand; a key
// outside the queue's slot on a Redis Cluster with ErrTxSlot. A refused
// command stages nothing; what was staged before stays.
func (t *Tx) Do(args ...any) error {
	if len(args) == 0 {
		return fmt.Errorf("%w: no command", ErrTxCommand)
	}
	name, ok := args[0].(string)
	if !ok {
		return fmt.Errorf("%w: the command name is a %T, not a string", ErrTxCommand, args[0])
	}
	up := strings.ToUpper(name)
	spec, ok := txCommands[up]
	if !ok {
		return fmt.Errorf("%w: %s is not one of the writes a Tx stages (reads, blocking commands, scripts, "+
			"transactions and commands without named keys are refused; see Tx.Do)", ErrTxCommand, up)
	}
	if len(args) < spec.min || (spec.max > 0 && len(args) > spec.max) {
		return fmt.Errorf("%w: %s with %d arguments", ErrTxCommand, up, len(args)-1)
	}
	if len(args) > MaxTxArgs {
		return fmt.Errorf("%w: %s with %d arguments, more than MaxTxArgs (%d)", ErrTxCommand, up, len(args), MaxTxArgs)
	}
	out := make([]any, len(args))
	out[0] = up
	for i, a := range args[1:] {
		s, err := txArg(a)
		if err != nil {
			return fmt.Errorf("%w: %s argument %d: %v", ErrTxCommand, up, i+1, err)
		}
		out[i+1] = s
	}
	var ks []string
	switch spec.keys {
	case 'F':
		ks = []string{out[1].(string)}
	case 'A':
		for _, a := range out[1:] {
			ks = append(ks, a.(string))
		}
	case 'P':
		if len(out)%2 == 0 {
			return fmt.Errorf("%w: %s needs key value pairs", ErrTxCommand, up)
		}
		for i := 1; i < len(out); i += 2 {
			ks = append(ks, out[i].(string))
		}
	}
	if up == "SET" || up == "HSET" || up == "HMSET" {
		if up == "SET" {
			for _, a := range out[3:] {
				if strings.EqualFold(a.(string), "GET") {
					return fmt.Errorf("%w: SET ... GET reads the old value; reads are out of scope of a Tx", ErrTxCommand)
				}
			}
		} else if len(out)%2 != 0 {
			return fmt.Errorf("%w: %s needs field value pairs", ErrTxCommand, up)
		}
	}
	for _, k := range ks {
		if err := t.checkKey(k); err != nil {
			return err
		}
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	switch {
	case t.closed:
		return ErrTxClosed
	case len(t.cmds) >= MaxTxCommands:
		return fmt.Errorf("%w: more than MaxTxCommands (%d) staged", ErrTxCommand, MaxTxCommands)
	}
	t.cmds = append(t.cmds, txCmd{hdr: spec.hdr, args: out})
	t.keys = append(t.keys, ks...)
	return nil
}

// checkKey refuses, on a Redis Cluster, a key outside the shard's slot.
func (t *Tx) checkKey(k string) error {
	if k == "" {
		return fmt.Errorf("%w: an empty key", ErrTxCommand)
	}
	if t.shard == nil || !t.shard.strict || keys.KeySlot(k) == t.shard.slot {
		return nil
	}
	return fmt.Errorf("%w: key %q hashes to slot %d, the queue's writes run in slot %d: name it with Tx.Key(%q) "+
		"(gives %q), or put the hash tag %s in it", ErrTxSlot, k, keys.KeySlot(k), t.shard.slot, k, t.Key(k), t.HashTag())
}

// close ends staging and returns what was staged (nil when nothing was).
func (t *Tx) close() *Tx {
	if t == nil || t.template {
		return nil
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	t.closed = true
	if len(t.cmds) == 0 {
		return nil
	}
	return t
}

// txArg turns an argument into the string Redis receives.
func txArg(a any) (string, error) {
	switch v := a.(type) {
	case string:
		return v, nil
	case []byte:
		return string(v), nil // a copy: the caller may reuse its buffer
	case int:
		return strconv.FormatInt(int64(v), 10), nil
	case int8:
		return strconv.FormatInt(int64(v), 10), nil
	case int16:
		return strconv.FormatInt(int64(v), 10), nil
	case int32:
		return strconv.FormatInt(int64(v), 10), nil
	case int64:
		return strconv.FormatInt(v, 10), nil
	case uint:
		return strconv.FormatUint(uint64(v), 10), nil
	case uint8:
		return strconv.FormatUint(uint64(v), 10), nil
	case uint16:
		return strconv.FormatUint(uint64(v), 10), nil
	case uint32:
		return strconv.FormatUint(uint64(v), 10), nil
	case uint64:
		return strconv.FormatUint(v, 10), nil
	case float32:
		return strconv.FormatFloat(float64(v), 'f', -1, 32), nil
	case float64:
		return strconv.FormatFloat(v, 'f', -1, 64), nil
	case bool:
		if v {
			return "1", nil
		}
		return "0", nil
	}
	return "", fmt.Errorf("a %T (use a string, []byte, number or bool)", a)
}

func ttlMillis(d time.Duration) int64 { return int64((d + time.Millisecond - 1) / time.Millisecond) }

func txStrs(ss []string) []any {
	out := make([]any, len(ss))
	for i, s := range ss {
		out[i] = s
	}
	return out
}

// txSpec describes a command a Tx stages: the argument counts it takes (the
// name included; max 0: no upper bound), where its keys are ('F' the first
// argument, 'A' every argument, 'P' every other one from the first), and
// its header for complete.lua: the type its keys must hold, or what it does
// to them, then where the keys are.
type txSpec struct {
	min, max int
	keys     byte
	hdr      string
}

// Key type codes of complete.lua's type check: s string, h hash, S set, l
// list, z zset, x stream (the key must hold that type or nothing, and holds
// it afterwards); = any type, a string afterwards (SET); - any type, nothing
// afterwards (DEL); . any type, unchanged (EXPIRE).
func txSpecOf(min, max int, keys byte, typ byte) txSpec {
	return txSpec{min: min, max: max, keys: keys, hdr: string([]byte{typ, keys})}
}

var txCommands = map[string]txSpec{
	"SET": txSpecOf(3, 0, 'F', '='), "SETEX": txSpecOf(4, 4, 'F', '='), "PSETEX": txSpecOf(4, 4, 'F', '='),
	"MSET":   txSpecOf(3, 0, 'P', '='),
	"APPEND": txSpecOf(3, 3, 'F', 's'), "INCR": txSpecOf(2, 2, 'F', 's'), "INCRBY": txSpecOf(3, 3, 'F', 's'),
	"INCRBYFLOAT": txSpecOf(3, 3, 'F', 's'), "DECR": txSpecOf(2, 2, 'F', 's'), "DECRBY": txSpecOf(3, 3, 'F', 's'),
	"SETRANGE": txSpecOf(4, 4, 'F', 's'), "SETBIT": txSpecOf(4, 4, 'F', 's'), "PFADD": txSpecOf(2, 0, 'F', 's'),
	"DEL": txSpecOf(2, 0, 'A', '-'), "UNLINK": txSpecOf(2, 0, 'A', '-'),
	"EXPIRE": txSpecOf(3, 4, 'F', '.'), "PEXPIRE": txSpecOf(3, 4, 'F', '.'), "EXPIREAT": txSpecOf(3, 4, 'F', '.'),
	"PEXPIREAT": txSpecOf(3, 4, 'F', '.'), "PERSIST": txSpecOf(2, 2, 'F', '.'),
	"HSET": txSpecOf(4, 0, 'F', 'h'), "HMSET": txSpecOf(4, 0, 'F', 'h'), "HSETNX": txSpecOf(4, 4, 'F', 'h'),
	"HINCRBY": txSpecOf(4, 4, 'F', 'h'), "HINCRBYFLOAT": txSpecOf(4, 4, 'F', 'h'), "HDEL": txSpecOf(3, 0, 'F', 'h'),
	"SADD": txSpecOf(3, 0, 'F', 'S'), "SREM": txSpecOf(3, 0, 'F', 'S'),
	"LPUSH": txSpecOf(3, 0, 'F', 'l'), "RPUSH": txSpecOf(3, 0, 'F', 'l'), "LPUSHX": txSpecOf(3, 0, 'F', 'l'),
	"RPUSHX": txSpecOf(3, 0, 'F', 'l'), "LTRIM": txSpecOf(4, 4, 'F', 'l'), "LSET": txSpecOf(4, 4, 'F', 'l'),
	"LREM": txSpecOf(4, 4, 'F', 'l'), "LPOP": txSpecOf(2, 3, 'F', 'l'), "RPOP": txSpecOf(2, 3, 'F', 'l'),
	"ZADD": txSpecOf(4, 0, 'F', 'z'), "ZINCRBY": txSpecOf(4, 4, 'F', 'z'), "ZREM": txSpecOf(3, 0, 'F', 'z'),
	"ZREMRANGEBYSCORE": txSpecOf(4, 4, 'F', 'z'), "ZREMRANGEBYRANK": txSpecOf(4, 4, 'F', 'z'),
	"ZREMRANGEBYLEX": txSpecOf(4, 4, 'F', 'z'),
	"XADD":           txSpecOf(5, 0, 'F', 'x'), "XTRIM": txSpecOf(4, 0, 'F', 'x'), "XDEL": txSpecOf(3, 0, 'F', 'x'),
}

// appendArgs appends the message's staged writes to complete.lua's
// staged-writes section (item is the item's 1-based index in the call) and
// their keys to keys.
func (t *Tx) appendArgs(args []any, keys []string, item int) ([]any, []string) {
	args = append(args, item, len(t.cmds))
	for _, c := range t.cmds {
		args = append(args, c.hdr, len(c.args))
		args = append(args, c.args...)
	}
	return args, append(keys, t.keys...)
}

// txCompleted reads complete.lua's reply for a call that carried staged
// writes (one value per item) and returns the items recorded: those it
// dropped (their entry was no longer pending for this consumer) are
// forgotten here, and those whose staged write Redis refused were
// dead-lettered.
func (r *run[Req, Resp]) txCompleted(batch []*completion, reply any) []*completion {
	vals, ok := reply.([]any)
	if !ok || len(vals) != len(batch) {
		r.c.log.ErrorContext(r.runCtx, "streamq: unexpected reply of a completion with staged writes",
			"reply", fmt.Sprint(reply), "items", len(batch))
		return batch
	}
	recorded := batch[:0:0]
	var dropped []*completion
	for i, v := range vals {
		cp := batch[i]
		switch v := v.(type) {
		case int64:
			switch v {
			case 1:
				r.c.log.InfoContext(cp.s.logContext(r.runCtx), "streamq: the request already had an outcome; its staged writes were not applied",
					"id", cp.s.entry.ID, "entry", cp.s.entry.EntryID)
			case 2:
				r.c.log.InfoContext(cp.s.logContext(r.runCtx), "streamq: the entry was no longer pending for this consumer (its lease was lost, "+
					"or a resent completion recorded it already); its outcome and staged writes were dropped",
					"id", cp.s.entry.ID, "entry", cp.s.entry.EntryID)
				dropped = append(dropped, cp)
				continue
			}
		case string:
			r.c.outcomes.failed.Add(1)
			r.c.log.WarnContext(cp.s.logContext(r.runCtx), "streamq: a staged write was refused; the request was dead-lettered",
				"id", cp.s.entry.ID, "entry", cp.s.entry.EntryID, "err", v)
			cp.code = keys.RecordDead
		}
		recorded = append(recorded, cp)
	}
	if len(dropped) > 0 {
		r.forgetCompletions(dropped)
	}
	return recorded
}
