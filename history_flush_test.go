package streamq

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"net"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/streamq/streamq/internal/keys"
)

// wordCountingConn counts how often word appears in what is written.
type wordCountingConn struct {
	net.Conn
	word []byte
	n    *atomic.Int64
}

func (c wordCountingConn) Write(b []byte) (int, error) {
	c.n.Add(int64(bytes.Count(b, c.word)))
	return c.Conn.Write(b)
}

// The committers add the completions they recorded to Admin.History at most
// about once per second (historyEvery), riding a tick or, when the consumer
// is idle, on their own: the counts are exact once a second has passed, a
// consumer left running idle adds what it holds, and thousands of
// completions cost a few HINCRBYs instead of one per complete.lua call.
func TestHistoryAddedOncePerSecond(t *testing.T) {
	raw := realRedis(t)
	ctx := context.Background()
	var hincrby atomic.Int64
	client := wrappedClient(t, raw, func(c net.Conn) net.Conn {
		return wordCountingConn{Conn: c, word: []byte("hincrby"), n: &hincrby}
	})
	q := queueName(t)
	var failures atomic.Int64
	c, err := NewConsumer(client, q, func(_ context.Context, m *Message[int]) (int, error) {
		if m.Payload%10 == 0 {
			failures.Add(1)
			return 0, Permanent(fmt.Errorf("poison %d", m.Payload))
		}
		return m.Payload, nil
	}, &ConsumerOptions{Logger: testLogger(t)})
	require.NoError(t, err)
	start := time.Now()
	runConsumer(t, c)
	p, err := NewProducer[int, int](raw, q, &ProducerOptions{Logger: testLogger(t)})
	require.NoError(t, err)
	defer p.Close()
	const n = 2000
	for b := 0; b < n; b += 100 {
		jobs := make([]Job[int], 100)
		for i := range jobs {
			jobs[i] = Job[int]{ID: fmt.Sprintf("h-%d", b+i), Request: b + i}
		}
		_, err := p.ProduceBatch(ctx, jobs)
		require.NoError(t, err)
	}
	a, err := NewAdmin(raw, q, nil)
	require.NoError(t, err)
	sums := func() (processed, failed int64) {
		pts, err := a.History(ctx, 10*time.Minute)
		require.NoError(t, err)
		for _, pt := range pts {
			processed += pt.Processed
			failed += pt.Failed
		}
		return processed, failed
	}
	eventually(t, 20*time.Second, func() bool { p, _ := sums(); return p == n }, "the history counts every outcome")
	processed, failed := sums()
	require.EqualValues(t, n, processed)
	require.EqualValues(t, n/10, failed, "dead letters count as failed")
	require.EqualValues(t, n/10, failures.Load())
	// At most one flush per second from a tick and one from the timer, per
	// shard (one here).
	bound := 2*int64(time.Since(start)/time.Second) + 3
	require.LessOrEqual(t, hincrby.Load(), bound, "HINCRBYs sent for %d completions", n)
	t.Logf("%d completions, %d HINCRBYs in %s", n, hincrby.Load(), time.Since(start))
}

// A history hash that cannot take the counts (another program's value of
// another type at its key) does not stop the outcomes: they are recorded and
// their callers answered, and each failed flush is logged and retried (it
// used to fail silently; before the history moved out of complete.lua, it
// failed the whole outcome batch).
func TestHistoryFlushFailureIsLoggedAndOutcomesGoOn(t *testing.T) {
	client := realRedis(t)
	ctx := context.Background()
	q := queueName(t)
	var logs syncBuffer
	c, err := NewConsumer(client, q, func(_ context.Context, m *Message[int]) (int, error) {
		return m.Payload * 2, nil
	}, &ConsumerOptions{ReadBlock: 50 * time.Millisecond, Logger: slog.New(slog.NewTextHandler(&logs, nil))})
	require.NoError(t, err)
	p, err := NewProducer[int, int](client, q, &ProducerOptions{Logger: testLogger(t)})
	require.NoError(t, err)
	defer p.Close()
	// The hour's history key of the only shard, taken by a string for the
	// next two hours (the test may cross an hour).
	n, err := queueShards(ctx, client, q)
	if err != nil || n == 0 {
		n = 1
	}
	ks, err := keys.Shards(q, n)
	require.NoError(t, err)
	hour := time.Now().UnixMilli() / msPerHour
	for _, k := range ks {
		for h := hour; h <= hour+1; h++ {
			require.NoError(t, client.Set(ctx, k.History(h), "not a hash", time.Hour*3).Err())
		}
	}
	runConsumer(t, c)
	for i := range 5 {
		pr, err := p.Produce(ctx, fmt.Sprintf("hf-%d", i), i)
		require.NoError(t, err)
		got, err := pr.Wait(waitCtx(t, 10*time.Second))
		require.NoError(t, err)
		require.Equal(t, 2*i, got)
	}
	eventually(t, 10*time.Second, func() bool {
		return strings.Contains(logs.String(), "adding completions to the history failed; retrying")
	}, "the failed flush was not logged")
}
