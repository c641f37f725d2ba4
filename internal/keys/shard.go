package keys

import (
	"fmt"
	"hash/fnv"
	"strings"
)

// MaxShards is the largest number of shards a queue may have.
const MaxShards = 1024

// slotCount is the number of Redis Cluster hash slots.
const slotCount = 16384

// Shards returns the names of the n shards of queue. With n == 1 the only
// shard is the queue itself. With n > 1, shard i's names are
// "streamq:shard:{<queue>/<iiii>.<kkkkkk>}:...", with i and k zero-padded
// decimals: k is the first suffix whose slot falls in the i-th n-th of the
// slot space, so shards spread evenly over the masters of a cluster whose
// masters own equal slot ranges.
//
// Shard names live under their own prefix ("streamq:shard:{", where a
// queue's names start with "streamq:{"), so no queue name produces a shard's
// names: queue "jobs/0001.000002" and a shard of queue "jobs" never share a
// key. The fixed width lets an ACL pattern name exactly one queue's shards:
// "streamq:shard:{<queue>/????.??????}:*".
func Shards(queue string, n int) ([]Keys, error) {
	if err := ValidateQueue(queue); err != nil {
		return nil, err
	}
	if n < 1 || n > MaxShards {
		return nil, fmt.Errorf("shard count %d is out of range 1..%d", n, MaxShards)
	}
	if n == 1 {
		k, err := New(queue)
		return []Keys{k}, err
	}
	out := make([]Keys, n)
	for i := range out {
		lo, hi := i*slotCount/n, (i+1)*slotCount/n
		for attempt := 0; ; attempt++ {
			// A window holds n-ths of 16384 slots: with n = MaxShards the
			// expected attempt is about 1,000, and more than 999,999 (which
			// would widen the name) has a probability below 1e-400.
			tag := fmt.Sprintf("%s/%04d.%06d", queue, i, attempt)
			if s := Slot(tag); s >= lo && s < hi {
				// The queue name was validated; the shard suffix may take it
				// past MaxQueueNameLen, which limits what users choose.
				k := buildTagged(shardPrefix + "{" + tag + "}:")
				k.Queue = queue
				out[i] = k
				break
			}
		}
	}
	return out, nil
}

// shardPrefix starts the names of the shards of a sharded queue. Queue names
// start with "streamq:{" instead, so the two never meet.
const shardPrefix = "streamq:shard:"

// ChannelRule returns the ACL channel pattern ("&...") that covers the notice
// channels of queue with n shards.
func ChannelRule(queue string, n int) string {
	q := globEscaper.Replace(queue)
	if n <= 1 {
		return "&streamq:{" + q + "}:*"
	}
	return "&" + shardPrefix + "{" + q + "/????.??????}:*"
}

// Meta returns the key recording a queue's shard count, so that producers and
// consumers that disagree on it are refused instead of splitting the queue.
func Meta(queue string) string { return "streamq:{" + queue + "}:meta" }

// AnsweringGroup returns the key naming the queue's answering consumer group:
// the one group whose outcomes callers receive (see ConsumerOptions.Fanout).
func AnsweringGroup(queue string) string { return "streamq:{" + queue + "}:answering" }

// ShardOf returns the shard of a request id: a stable hash of the id, so that
// every producer routes an id to the same shard and deduplication holds.
func ShardOf(id string, n int) int {
	if n <= 1 {
		return 0
	}
	h := fnv.New64a()
	_, _ = h.Write([]byte(id))
	return int(h.Sum64() % uint64(n))
}

// Slot returns the Redis Cluster hash slot of a key whose hash tag is the
// whole string (the shard name inside the braces).
func Slot(tag string) int { return int(crc16(tag) % slotCount) }

// crc16 is CRC-16/XMODEM, the checksum Redis Cluster uses for key slots.
func crc16(s string) uint16 {
	var crc uint16
	for i := 0; i < len(s); i++ {
		crc ^= uint16(s[i]) << 8
		for range 8 {
			if crc&0x8000 != 0 {
				crc = crc<<1 ^ 0x1021
			} else {
				crc <<= 1
			}
		}
	}
	return crc
}

// Seen returns the key of the hash in which the consumers of group heartbeat:
// field consumer name, value the unix milliseconds of its last heartbeat.
// Per queue, not per shard: a consumer reads every shard.
func Seen(queue, group string) string { return "streamq:{" + queue + "}:seen:" + group }

// MetaPattern is the SCAN pattern matching the Meta key of every queue.
const MetaPattern = "streamq:{*}:meta"

// QueueOfMeta returns the queue whose Meta key is key, and false when key is
// not a Meta key.
func QueueOfMeta(key string) (string, bool) {
	q, ok := strings.CutPrefix(key, "streamq:{")
	if !ok {
		return "", false
	}
	q, ok = strings.CutSuffix(q, "}:meta")
	if !ok || ValidateQueue(q) != nil {
		return "", false
	}
	return q, true
}

// Paused returns the key whose presence pauses a queue: consumers of every
// group start no handler while it exists. Its value is the unix time in
// milliseconds at which the queue was paused. Queue-level, like Meta.
func Paused(queue string) string { return "streamq:{" + queue + "}:paused" }

// RateLimit returns the key holding the GCRA state (the theoretical arrival
// time, in microseconds of the server's clock) of the rate limit that the
// consumers of group share on queue.
func RateLimit(queue, group string) string { return "streamq:{" + queue + "}:rate:" + group }

// Periodic returns the hash recording, per periodic job name, the last slot
// produced ("<name>:last") and the next one due ("<name>:next"), in unix
// milliseconds.
func Periodic(queue string) string { return "streamq:{" + queue + "}:periodic" }
