package streamq

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// taggedCodec is JSON behind a tag, so that a value decodes only with it.
type taggedCodec struct{}

func (taggedCodec) Marshal(v any) ([]byte, error) {
	b, err := json.Marshal(v)
	return append([]byte("T:"), b...), err
}

func (taggedCodec) Unmarshal(b []byte, v any) error {
	rest, ok := bytes.CutPrefix(b, []byte("T:"))
	if !ok {
		return fmt.Errorf("not tagged: %q", b)
	}
	return json.Unmarshal(rest, v)
}

type stepProgress struct {
	Step  int
	Label string
}

// TestProgressOfDecodesWithTheQueuesCodec: a value the handler reports with
// the queue's codec comes out of Promise.Progress encoded, and ProgressOf
// decodes it with that codec, while the request runs and from the stored
// value once it completed; a type the value does not decode into is an
// error that says what to check.
func TestProgressOfDecodesWithTheQueuesCodec(t *testing.T) {
	t.Parallel()
	client := realRedis(t)
	q := NewQueue[string, string](queueName(t)).WithCodec(taggedCodec{})
	gate := make(chan struct{})
	c, err := q.NewConsumer(client, func(ctx context.Context, m *Message[string]) (string, error) {
		if err := m.Progress(ctx, stepProgress{Step: 3, Label: "copy"}); err != nil {
			return "", err
		}
		<-gate
		return "ok", nil
	}, fastOpts(t, "progress", 10*time.Second))
	require.NoError(t, err)
	runConsumer(t, c)
	p, err := q.NewProducer(client, &ProducerOptions{Logger: testLogger(t)})
	require.NoError(t, err)
	t.Cleanup(func() { _ = p.Close() })
	ctx := waitCtx(t, 20*time.Second)
	pr, err := p.Produce(ctx, "job", "x")
	require.NoError(t, err)
	var raw []byte
	select {
	case raw = <-pr.Progress():
	case <-ctx.Done():
		t.Fatal("no progress value")
	}
	require.True(t, bytes.HasPrefix(raw, []byte("T:")), "encoded with the queue's codec: %q", raw)
	got, err := ProgressOf[stepProgress](q, raw)
	require.NoError(t, err)
	require.Equal(t, stepProgress{Step: 3, Label: "copy"}, got)
	asIs, err := ProgressOf[[]byte](q, raw)
	require.NoError(t, err)
	require.Equal(t, raw, asIs)
	_, err = ProgressOf[int](q, raw)
	require.ErrorContains(t, err, "check that the handler passes a int to Message.Progress")
	_, err = ProgressOf[stepProgress](NewQueue[string, string](q.Name()), raw)
	require.Error(t, err, "JSON does not decode the tagged value")

	close(gate)
	_, err = pr.Wait(ctx)
	require.NoError(t, err)
	pr.Release()
	// After completion: a new caller of the id gets the stored last value.
	late, err := p.Produce(ctx, "job", "x")
	require.NoError(t, err)
	defer late.Release()
	var stored []byte
	for v := range late.Progress() {
		stored = v
	}
	got, err = ProgressOf[stepProgress](q, stored)
	require.NoError(t, err)
	require.Equal(t, stepProgress{Step: 3, Label: "copy"}, got)
}
