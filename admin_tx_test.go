package streamq

import (
	"context"
	"fmt"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// TestAdminTxKeysAndSum: handlers of a queue of 3 shards stage a counter
// and a set under Tx.Key; from outside a handler, Admin.TxKeys names the
// same keys (and the package's TxKeys, given the shard count), TxSum adds
// the counters of every shard (a missing name is 0), and a set or a value
// that is not an integer is refused with an error naming the key.
func TestAdminTxKeysAndSum(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	client := realRedis(t)
	q := queueName(t)
	const shards, n = 3, 60
	var mu sync.Mutex
	used := map[string]bool{} // the names tx.Key gave the handlers
	c, err := NewConsumer(client, q, func(_ context.Context, m *Message[string]) (string, error) {
		v, _ := strconv.Atoi(m.Payload)
		tx := m.Tx()
		mu.Lock()
		used[tx.Key("total")] = true
		mu.Unlock()
		if err := tx.IncrBy(tx.Key("total"), int64(v)); err != nil {
			return "", err
		}
		return "", tx.SAdd(tx.Key("seen"), m.ID)
	}, &ConsumerOptions{Name: "w", Shards: shards, ReadBlock: 50 * time.Millisecond, Logger: testLogger(t)})
	require.NoError(t, err)
	runConsumer(t, c)
	p, err := NewProducer[string, string](client, q, &ProducerOptions{Shards: shards, Logger: testLogger(t)})
	require.NoError(t, err)
	t.Cleanup(func() { _ = p.Close() })
	want := int64(0)
	var prs []*Promise[string]
	for i := 1; i <= n; i++ {
		pr, err := p.Produce(ctx, fmt.Sprint("job-", i), strconv.Itoa(i))
		require.NoError(t, err)
		prs = append(prs, pr)
		want += int64(i)
	}
	for _, pr := range prs {
		_, err := pr.Wait(waitCtx(t, 30*time.Second))
		require.NoError(t, err)
		pr.Release()
	}

	a, err := NewAdmin(client, q, nil)
	require.NoError(t, err)
	names, err := a.TxKeys(ctx, "total")
	require.NoError(t, err)
	require.Len(t, names, shards)
	mu.Lock()
	require.Len(t, used, shards, "the requests ran on every shard")
	for _, k := range names {
		require.True(t, used[k], "%s is not a name the handlers used: %v", k, used)
	}
	mu.Unlock()
	offline, err := TxKeys(q, shards, "total")
	require.NoError(t, err)
	require.Equal(t, names, offline)

	sum, err := a.TxSum(ctx, "total")
	require.NoError(t, err)
	require.Equal(t, want, sum)
	t.Logf("TxSum over %d shards: %d (keys %v)", shards, sum, names)

	seen, err := a.TxKeys(ctx, "seen")
	require.NoError(t, err)
	members := int64(0)
	for _, k := range seen {
		members += client.SCard(ctx, k).Val()
	}
	require.EqualValues(t, n, members)

	zero, err := a.TxSum(ctx, "never-written")
	require.NoError(t, err)
	require.Zero(t, zero)
	_, err = a.TxSum(ctx, "seen")
	require.ErrorIs(t, err, ErrWrongType)
	require.ErrorContains(t, err, seen[0][:len(seen[0])-len("seen")])
	require.NoError(t, client.Set(ctx, names[1], "abc", 0).Err())
	_, err = a.TxSum(ctx, "total")
	require.ErrorContains(t, err, names[1]+` holds "abc", not an integer`)
	_, err = a.TxKeys(ctx, "")
	require.ErrorContains(t, err, "empty Tx key name")
	_, err = TxKeys(q, 0, "total")
	require.Error(t, err)
}
