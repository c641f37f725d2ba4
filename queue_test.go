package streamq

import (
	"context"
	"encoding/json"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

type queueTestDoc struct {
	Title string `json:"title"`
}

// countingCodec is JSON that counts its calls.
type countingCodec struct{ calls *atomic.Int64 }

func (c countingCodec) Marshal(v any) ([]byte, error) { c.calls.Add(1); return json.Marshal(v) }
func (c countingCodec) Unmarshal(b []byte, v any) error {
	c.calls.Add(1)
	return json.Unmarshal(b, v)
}

// TestQueueDefinition: a producer and a consumer made from one typed Queue
// share its types and codec (issue 17: types written once, so that a
// mismatch does not compile).
func TestQueueDefinition(t *testing.T) {
	client, _ := miniRedis(t)
	var calls atomic.Int64
	q := NewQueue[queueTestDoc, int](queueName(t)).WithCodec(countingCodec{&calls})
	c, err := q.NewConsumer(client, func(ctx context.Context, m *Message[queueTestDoc]) (int, error) {
		return len(m.Payload.Title), nil
	}, &ConsumerOptions{ReadBlock: 50 * time.Millisecond, Logger: testLogger(t)})
	require.NoError(t, err)
	runConsumer(t, c)
	p, err := q.NewProducer(client, &ProducerOptions{Logger: testLogger(t)})
	require.NoError(t, err)
	defer p.Close()
	pr, err := p.Produce(context.Background(), "d1", queueTestDoc{Title: "hello"})
	require.NoError(t, err)
	n, err := pr.Wait(waitCtx(t, 10*time.Second))
	require.NoError(t, err)
	require.Equal(t, 5, n)
	require.EqualValues(t, 4, calls.Load(), "request and response each encoded and decoded with the queue's codec")

	a, err := q.NewAdmin(client, nil)
	require.NoError(t, err)
	require.Equal(t, q.Name(), a.Queue())

	_, err = NewQueue[string, string]("").NewProducer(client, nil)
	require.True(t, errors.Is(err, ErrInvalidOptions), "%v", err)
}
