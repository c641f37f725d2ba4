package streamq

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/streamq/streamq/internal/keys"
)

// TestProgressOutlivesShortRecordTTLOfLongHandler: a handler's last
// progress value lives the longer of the record's TTL and ResultTTL from
// each report, as DESIGN.md says. The record of a running request is kept
// alive by the consumer's leases, not by its InflightTTL; before, a report
// took the record's TTL of the moment (under 1s here), so a handler running
// on after it lost its value: Admin.Job showed none while it ran, and the
// completion found no value to keep.
func TestProgressOutlivesShortRecordTTLOfLongHandler(t *testing.T) {
	t.Parallel()
	client := realRedis(t)
	q := queueName(t)
	reported, finish := make(chan struct{}), make(chan struct{})
	c, err := NewConsumer(client, q, func(ctx context.Context, m *Message[string]) (string, error) {
		if err := m.Progress(ctx, "half"); err != nil {
			return "", err
		}
		close(reported)
		<-finish
		return "ok", nil
	}, fastOpts(t, "long", 300*time.Millisecond))
	require.NoError(t, err)
	runConsumer(t, c)
	done := sync.OnceFunc(func() { close(finish) })
	t.Cleanup(done) // before the consumer stops
	p, err := NewProducer[string, string](client, q, &ProducerOptions{InflightTTL: time.Second, Logger: testLogger(t)})
	require.NoError(t, err)
	t.Cleanup(func() { _ = p.Close() })
	pr := mustProduce(t, p, "long", "x")
	<-reported

	a, err := NewAdmin(client, q, nil)
	require.NoError(t, err)
	// Past the record's TTL at the report: the leases keep the record.
	time.Sleep(2 * time.Second)
	info, err := a.Job(context.Background(), "long")
	require.NoError(t, err)
	require.Equal(t, JobRunning, info.State)
	require.JSONEq(t, `"half"`, string(info.Progress), "the running request's last progress value")

	done()
	_, err = pr.Wait(waitCtx(t, 10*time.Second))
	require.NoError(t, err)
	info, err = a.Job(context.Background(), "long")
	require.NoError(t, err)
	require.JSONEq(t, `"half"`, string(info.Progress), "kept with the outcome")
}

// TestProgressOutlivesResultTTLWhileHandlerIsSilent: a handler that reports
// once and then works on, silent, for longer than both the record's TTL at
// the report and ResultTTL keeps its value while it runs: the consumer's
// leases keep the progress key alive with the record. Before, the key lived
// the longer of the two from the report only, and Admin.Job showed no
// progress for a request still running.
func TestProgressOutlivesResultTTLWhileHandlerIsSilent(t *testing.T) {
	t.Parallel()
	client := realRedis(t)
	q := queueName(t)
	reported, finish := make(chan struct{}), make(chan struct{})
	opts := fastOpts(t, "silent", 300*time.Millisecond)
	opts.ResultTTL = 500 * time.Millisecond
	c, err := NewConsumer(client, q, func(ctx context.Context, m *Message[string]) (string, error) {
		if err := m.Progress(ctx, "half"); err != nil {
			return "", err
		}
		close(reported)
		<-finish
		return "ok", nil
	}, opts)
	require.NoError(t, err)
	runConsumer(t, c)
	done := sync.OnceFunc(func() { close(finish) })
	t.Cleanup(done) // before the consumer stops
	p, err := NewProducer[string, string](client, q, &ProducerOptions{InflightTTL: 500 * time.Millisecond, Logger: testLogger(t)})
	require.NoError(t, err)
	t.Cleanup(func() { _ = p.Close() })
	pr := mustProduce(t, p, "silent", "x")
	<-reported

	k, err := keys.New(q)
	require.NoError(t, err)
	ttl, err := client.PTTL(context.Background(), k.Progress("silent")).Result()
	require.NoError(t, err)
	require.Greater(t, ttl, time.Duration(0), "the progress key has a TTL")
	// Past the key's TTL at the report, and past ResultTTL: the handler is
	// still running, silent.
	time.Sleep(ttl + opts.ResultTTL + time.Second)
	a, err := NewAdmin(client, q, nil)
	require.NoError(t, err)
	info, err := a.Job(context.Background(), "silent")
	require.NoError(t, err)
	require.Equal(t, JobRunning, info.State)
	require.JSONEq(t, `"half"`, string(info.Progress), "the running request's last progress value")

	done()
	_, err = pr.Wait(waitCtx(t, 10*time.Second))
	require.NoError(t, err)
}
