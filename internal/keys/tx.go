package keys

import "strings"

// TxKey returns the name of a key that a handler's staged writes (the
// consumer's Tx) may use on this queue or shard: name under the queue's key
// prefix, after "tx:", so it shares the shard's hash slot and the queue's
// least-privilege ACL pattern covers it.
func (k Keys) TxKey(name string) string { return k.base + "tx:" + name }

// TagSlot returns the Redis Cluster hash slot of every name of k.
func (k Keys) TagSlot() int { return KeySlot(k.base) }

// KeySlot returns the Redis Cluster hash slot of key, by Redis's rule: when
// the key holds a '{' followed later by a '}' with at least one byte between
// them, only those bytes are hashed (the first such pair); otherwise the
// whole key is.
func KeySlot(key string) int {
	if i := strings.IndexByte(key, '{'); i >= 0 {
		if j := strings.IndexByte(key[i+1:], '}'); j > 0 {
			return Slot(key[i+1 : i+1+j])
		}
	}
	return Slot(key)
}
