package streamq

import (
	"context"
	"strconv"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/streamq/streamq/internal/keys"
	"github.com/streamq/streamq/internal/scripts"
)

// TestReplaceCompletionSentTwiceKeepsTheFollowUp runs complete.lua twice
// for an entry with a Replace follow-up behind it, as go-redis does when the
// reply of the committer's pipeline is lost (and as a consumer whose lease
// lapsed does after another one completed the entry). The second call finds
// the record pointing at the follow-up's entry: it records, announces and
// dead-letters nothing, so the follow-up's run decides the outcome. Before,
// the second call overwrote the follow-up's record with the first run's
// outcome (and its dead letter was written twice): every caller got the
// replaced payload's outcome, and the follow-up's completion kept it.
func TestReplaceCompletionSentTwiceKeepsTheFollowUp(t *testing.T) {
	t.Parallel()
	client := realRedis(t)
	ctx := context.Background()
	k, err := keys.New(queueName(t))
	require.NoError(t, err)
	require.NoError(t, client.XGroupCreateMkStream(ctx, k.Stream, "g", "0").Err())
	sub := client.Subscribe(ctx, k.Channel)
	defer sub.Close()
	_, err = sub.Receive(ctx)
	require.NoError(t, err)
	complete := func(rid, eid, code, value string) {
		t.Helper()
		_, err := scripts.Complete.Run(ctx, client,
			[]string{k.Stream, k.DeadLetter, k.Fanout, k.Record(rid), k.Starts("g")},
			"g", k.Channel, 60000, "1", 100, "me", time.Now().UnixMilli(), "PUBLISH", "0",
			eid, rid, code, value, "x", 1).Result()
		require.NoError(t, err)
	}
	read := func() string {
		t.Helper()
		res, err := client.XReadGroup(ctx, &redis.XReadGroupArgs{Group: "g", Consumer: "me", Streams: []string{k.Stream, ">"}, Count: 1, Block: -1}).Result()
		require.NoError(t, err)
		require.Len(t, res[0].Messages, 1)
		return res[0].Messages[0].ID
	}
	for _, tc := range []struct{ rid, code, value string }{{"ok", "R", "first"}, {"dead", "L", "boom"}} {
		eid, err := client.XAdd(ctx, &redis.XAddArgs{Stream: k.Stream, Values: []any{"id", tc.rid, "p", "v1"}}).Result()
		require.NoError(t, err)
		require.Equal(t, eid, read())
		fields := "2:id" + strconv.Itoa(len(tc.rid)) + ":" + tc.rid + "1:p2:v2"
		require.NoError(t, client.Set(ctx, k.Record(tc.rid), "P"+eid+"+0:5:60000"+strconv.Itoa(len(fields))+":"+fields, time.Minute).Err())

		complete(tc.rid, eid, tc.code, tc.value)
		rec := client.Get(ctx, k.Record(tc.rid)).Val()
		follow := rec[1:]
		require.NotEqual(t, eid, follow)
		complete(tc.rid, eid, tc.code, tc.value) // the same call again
		require.Equal(t, "P"+follow, client.Get(ctx, k.Record(tc.rid)).Val(), "%s: the follow-up's record after the call ran twice", tc.rid)
		require.Greater(t, client.PTTL(ctx, k.Record(tc.rid)).Val(), 50*time.Second)

		// The follow-up runs and its outcome is the request's.
		require.Equal(t, follow, read())
		complete(tc.rid, follow, "R", "second")
		require.Equal(t, "Rsecond", client.Get(ctx, k.Record(tc.rid)).Val(), tc.rid)
	}
	require.EqualValues(t, 1, client.XLen(ctx, k.DeadLetter).Val(), "dead letters of the failed run")
	// Only the follow-ups' outcomes were announced.
	for _, want := range []string{"2:ok7:Rsecond", "4:dead7:Rsecond"} {
		msg, err := sub.ReceiveMessage(waitCtx(t, 5*time.Second))
		require.NoError(t, err)
		require.Equal(t, want, msg.Payload)
	}
}
