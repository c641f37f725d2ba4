package streamq

import (
	"context"
	"strings"
	"testing"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/streamq/streamq/internal/faultproxy"
)

// TestFlowCancelNestedParentResentCancelsItsChildren: Admin.Cancel of a
// flow's root cancels a nested parent waiting for its children, and then
// those children, also when the reply to the nested parent's cancel.lua is
// lost and go-redis runs it again (the resend finds the parent cancelled
// already). Before, the resend's answer (the record "C...", not "P&") made
// Cancel skip the nested parent's children: its queued child stayed queued
// and ran.
func TestFlowCancelNestedParentResentCancelsItsChildren(t *testing.T) {
	t.Parallel()
	direct := realRedis(t)
	ctx := context.Background()
	q := NewQueue[string, string](queueName(t))
	p, err := q.NewProducer(direct, &ProducerOptions{Logger: testLogger(t)})
	require.NoError(t, err)
	defer p.Close()
	// No consumer: every child stays queued, the nested parent waits.
	pr, err := p.ProduceFlow(ctx, "root", "root", []Child{
		ChildOf(q, "a", "a"),
		ChildFlow(q, "inner", "inner", []Child{ChildOf(q, "leaf", "leaf")}, nil),
	}, nil)
	require.NoError(t, err)

	px, err := faultproxy.New(direct.Options().Addr)
	require.NoError(t, err)
	t.Cleanup(func() { _ = px.Close() })
	client := redis.NewClient(&redis.Options{Addr: px.Addr()})
	t.Cleanup(func() { _ = client.Close() })
	a, err := q.NewAdmin(client, nil)
	require.NoError(t, err)
	px.DropReplyTo([]byte("}:id:inner")) // the nested parent's cancel.lua
	require.NoError(t, a.Cancel(ctx, "root"))
	select {
	case <-px.Dropped():
	default:
		t.Fatal("no reply was dropped")
	}
	_, err = waitFor(t, pr)
	require.ErrorIs(t, err, ErrCanceled)
	for _, id := range []string{"a", "inner", "leaf"} {
		rec := direct.Get(ctx, "streamq:{"+q.Name()+"}:id:"+id).Val()
		require.True(t, strings.HasPrefix(rec, "C"), "%s: %q", id, rec)
	}
	require.Zero(t, direct.XLen(ctx, "streamq:{"+q.Name()+"}:stream").Val(), "entries left queued")
}
