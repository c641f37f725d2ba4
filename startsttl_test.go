package streamq

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/streamq/streamq/internal/keys"
)

// The start-count hash keeps its TTL, but the consumer sets it at most once
// per startsExpireEvery per shard, not with every tick's HSET: a PEXPIRE per
// tick was 0.37 commands per job on the one-job path.
func TestStartsHashExpiresWithoutAPexpirePerTick(t *testing.T) {
	t.Parallel()
	client := privateRedis(t)
	ctx := context.Background()

	q := queueName(t)
	p := newStringProducer(t, client, q)
	hold := make(chan struct{})
	c, err := NewConsumer(client, q, func(ctx context.Context, m *Message[string]) (string, error) {
		if m.ID == "held" {
			<-hold
		}
		return m.Payload, nil
	}, &ConsumerOptions{Workers: 2, ReadBlock: 50 * time.Millisecond, Logger: testLogger(t)})
	require.NoError(t, err)
	runConsumer(t, c)
	var release sync.Once
	t.Cleanup(func() { release.Do(func() { close(hold) }) }) // before the consumer's stop

	// A running handler's start count is there, with its TTL.
	k, err := keys.New(q)
	require.NoError(t, err)
	held := mustProduce(t, p, "held", "x")
	eventually(t, 10*time.Second, func() bool {
		return client.HLen(ctx, k.Starts(DefaultGroup)).Val() == 1
	}, "the held job's start was never counted")
	ttl := client.PTTL(ctx, k.Starts(DefaultGroup)).Val()
	require.Greater(t, ttl, startsTTL-time.Minute, "the start-count hash has no TTL")

	// One job at a time: a tick each, and no PEXPIRE of the hash among them.
	d := commandDelta(t, client, func() {
		for i := range 50 {
			pr := mustProduce(t, p, fmt.Sprintf("job-%d", i), "y")
			_, err := pr.Wait(waitCtx(t, 10*time.Second))
			require.NoError(t, err)
		}
	})
	require.GreaterOrEqual(t, d["hset"], int64(50), "a start count per job")
	require.Less(t, d["pexpire"], int64(5), "PEXPIREs over 50 ticks: %v", d)
	release.Do(func() { close(hold) })
	_, err = held.Wait(waitCtx(t, 10*time.Second))
	require.NoError(t, err)
}
