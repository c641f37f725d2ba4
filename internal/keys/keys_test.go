package keys

import (
	"fmt"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestNewSharesOneHashTag(t *testing.T) {
	k, err := New("orders")
	require.NoError(t, err)
	for _, name := range []string{k.Stream, k.DeadLetter, k.Channel, k.Schedule, k.Retry, k.History(494000), k.RunNowMarker("rx"), k.ScheduleData, k.Wake, k.Fanout, k.Counts, k.Record("a:b")} {
		require.True(t, strings.HasPrefix(name, "streamq:{orders}:"), name)
	}
	require.Equal(t, "streamq:{orders}:id:a:b", k.Record("a:b"))
}

func TestValidateQueue(t *testing.T) {
	require.Error(t, ValidateQueue(""))
	require.Error(t, ValidateQueue("a{b"))
	require.Error(t, ValidateQueue(strings.Repeat("q", MaxQueueNameLen+1)))
	require.NoError(t, ValidateQueue("jobs.v1"))
}

func TestRecordPatternEscapesGlob(t *testing.T) {
	k, err := New("a*b")
	require.NoError(t, err)
	require.Equal(t, `streamq:{a\*b}:id:*`, k.RecordPattern())
}

func TestSlotMatchesRedis(t *testing.T) {
	// Reference values of the Redis Cluster specification's CRC16.
	require.Equal(t, 12739, Slot("123456789"))
	require.Equal(t, 5542, Slot("foo{}"))
}

func TestShardsSpreadOverTheSlotSpace(t *testing.T) {
	ks, err := Shards("jobs", 6)
	require.NoError(t, err)
	require.Len(t, ks, 6)
	seen := map[string]bool{}
	for i, k := range ks {
		require.Equal(t, "jobs", k.Queue)
		tag := k.Stream[strings.Index(k.Stream, "{")+1 : strings.Index(k.Stream, "}")]
		s := Slot(tag)
		require.GreaterOrEqual(t, s, i*16384/6)
		require.Less(t, s, (i+1)*16384/6)
		require.False(t, seen[tag])
		seen[tag] = true
	}
	one, err := Shards("jobs", 1)
	require.NoError(t, err)
	require.Equal(t, "streamq:{jobs}:stream", one[0].Stream)
	_, err = Shards("jobs", 0)
	require.Error(t, err)
}

func TestShardOfIsStable(t *testing.T) {
	require.Equal(t, 0, ShardOf("x", 1))
	counts := make([]int, 6)
	for i := range 6000 {
		s := ShardOf(strings.Repeat("k", i%7)+string(rune('a'+i%26))+strings.Repeat("z", i/26), 6)
		counts[s]++
	}
	for _, c := range counts {
		require.Greater(t, c, 600, "ids spread over shards: %v", counts)
	}
	require.Equal(t, ShardOf("order-17", 6), ShardOf("order-17", 6))
}

func TestShardNamesAreNoQueuesNames(t *testing.T) {
	ks, err := Shards("jobs", 2)
	require.NoError(t, err)
	for i, k := range ks {
		require.True(t, strings.HasPrefix(k.Stream, "streamq:shard:{jobs/"), k.Stream)
		tag := k.Stream[strings.Index(k.Stream, "{")+1 : strings.Index(k.Stream, "}")]
		require.Regexp(t, `^jobs/\d{4}\.\d{6}$`, tag, "fixed width, for exact ACL patterns")
		require.Equal(t, fmt.Sprintf("jobs/%04d", i), tag[:9])
		// The queue named like the tag has other names.
		q, err := New(tag)
		require.NoError(t, err)
		for _, pair := range [][2]string{{k.Stream, q.Stream}, {k.DeadLetter, q.DeadLetter}, {k.Channel, q.Channel}, {k.Record("x"), q.Record("x")}} {
			require.NotEqual(t, pair[0], pair[1])
		}
	}
}

func TestChannelRule(t *testing.T) {
	require.Equal(t, "&streamq:{jobs}:*", ChannelRule("jobs", 1))
	require.Equal(t, "&streamq:shard:{jobs/????.??????}:*", ChannelRule("jobs", 4))
	require.Equal(t, `&streamq:{a\*b}:*`, ChannelRule("a*b", 1))
}

func TestKeySlotFollowsRedisHashTags(t *testing.T) {
	// Known slots (CLUSTER KEYSLOT on redis-server 7.0).
	require.Equal(t, 12182, KeySlot("foo"))
	require.Equal(t, KeySlot("bar"), KeySlot("{bar}:x"))
	require.Equal(t, KeySlot("{}x"), Slot("{}x"), "an empty tag hashes the whole key")
	require.Equal(t, KeySlot("a{b}{c}"), Slot("b"), "the first tag counts")
	k, err := New("orders")
	require.NoError(t, err)
	require.Equal(t, Slot("orders"), k.TagSlot())
	require.Equal(t, k.TagSlot(), KeySlot(k.TxKey("total")))
	require.Equal(t, "streamq:{orders}:tx:total", k.TxKey("total"))
	ks, err := Shards("orders", 4)
	require.NoError(t, err)
	for i, s := range ks {
		require.Equal(t, s.TagSlot(), KeySlot(s.TxKey("n")), "shard %d", i)
		require.Equal(t, KeySlot(s.Stream), s.TagSlot())
	}
}

func TestFlowParentRoundTrips(t *testing.T) {
	for _, n := range []int{1, 3} {
		ks, err := Shards("jobs:a", n)
		require.NoError(t, err)
		for _, k := range ks {
			rec, stream, ok := FlowParent(k.Flow("p:1}x"))
			require.True(t, ok)
			require.Equal(t, k.Record("p:1}x"), rec)
			require.Equal(t, k.Stream, stream)
			require.Equal(t, KeySlot(k.Stream), KeySlot(k.Flow("p")))
			require.Equal(t, KeySlot(k.Stream), KeySlot(k.Progress("p")))
		}
	}
	for _, bad := range []string{"", "streamq:{q}:id:x", "streamq:{q}:flow:", "other:{q}:flow:x", "streamq:q}:flow:x"} {
		_, _, ok := FlowParent(bad)
		require.False(t, ok, bad)
	}
}
