package streamq

import (
	"context"
	"errors"
	"fmt"
	"math"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/streamq/streamq/internal/keys"
	"github.com/streamq/streamq/internal/redistest"
	"github.com/streamq/streamq/internal/scripts"
)

// TestTxStagingRefusals checks what a Tx refuses at staging time, without
// Redis: commands off the list, bad arity and arguments, the GET option,
// staging after the handler returned; a refused command stages nothing.
func TestTxStagingRefusals(t *testing.T) {
	m := &Message[string]{}
	tx := m.Tx()
	require.Same(t, tx, m.Tx())
	require.NoError(t, tx.IncrBy("total", 5))
	for _, args := range [][]any{
		{"GET", "k"}, {"BLPOP", "k", 0}, {"EVAL", "return 1", 0}, {"MULTI"}, {"FLUSHALL"},
		{"MOVE", "k", 1}, {"SORT", "k", "STORE", "d"}, {"SUNIONSTORE", "d", "a"}, {"RENAME", "a", "b"},
		{"INCRBY", "k"}, {"SET", "k", "v", "GET"}, {"HSET", "h", "f"}, {"MSET", "a", "1", "b"},
		{"SET", "k", struct{}{}}, {42, "k"}, {}, {"SET", "", "v"},
	} {
		err := tx.Do(args...)
		require.ErrorIs(t, err, ErrTxCommand, "%v", args)
	}
	require.ErrorIs(t, tx.Set("k", "v", -time.Second), ErrTxCommand)
	require.ErrorIs(t, tx.Expire("k", 0), ErrTxCommand)
	require.NoError(t, tx.Do("set", "k", []byte("v"), "px", 1500))
	require.NoError(t, tx.XAdd("events", 100, "id", "a", "n", 1.5, "ok", true))
	require.Equal(t, [][]string{
		{"INCRBY", "total", "5"},
		{"SET", "k", "v", "px", "1500"},
		{"XADD", "events", "MAXLEN", "~", "100", "*", "id", "a", "n", "1.5", "ok", "1"},
	}, tx.Commands())
	require.Same(t, tx, tx.close())
	require.ErrorIs(t, tx.Incr("total"), ErrTxClosed)
	require.Equal(t, 3, tx.Len())
	require.Nil(t, (&Message[string]{}).Tx().close(), "nothing staged: no Tx")
}

// TestTxSlotOnCluster checks the slot rule without a cluster: a Tx of a
// cluster's consumer refuses a key of another slot, with a message naming
// Tx.Key, and takes Key's names and names carrying the hash tag.
func TestTxSlotOnCluster(t *testing.T) {
	ks, err := keys.Shards("orders", 2)
	require.NoError(t, err)
	for i, sh := range newTxShards(ks, true) {
		tx := (&Message[string]{tx: sh}).Tx()
		err := tx.IncrBy("total", 1)
		require.ErrorIs(t, err, ErrTxSlot, "shard %d", i)
		require.Contains(t, err.Error(), "Tx.Key")
		require.NoError(t, tx.IncrBy(tx.Key("total"), 1))
		require.NoError(t, tx.SAdd("my:"+tx.HashTag()+":done", "a"))
		require.ErrorIs(t, tx.Del(tx.Key("a"), "b"), ErrTxSlot, "every key is checked")
		require.Equal(t, 2, tx.Len())
	}
	// Not a cluster: any key.
	tx := (&Message[string]{tx: newTxShards(ks, false)[0]}).Tx()
	require.NoError(t, tx.IncrBy("total", 1))
}

// txQueue runs a consumer of q whose handler is h, and returns a producer.
func txQueue(t *testing.T, client *redis.Client, q string, o *ConsumerOptions,
	h Handler[string, string]) *Producer[string, string] {
	t.Helper()
	if o == nil {
		o = fastOpts(t, "c1", 2*time.Second)
	}
	c, err := NewConsumer(client, q, h, o)
	require.NoError(t, err)
	runConsumer(t, c)
	return newStringProducer(t, client, q)
}

// TestTxAppliedOnceWithTheResult runs jobs that stage INCRBY and SADD: the
// first attempt of some fails after staging (retried), some fail for good
// (dead-lettered). Only successful deliveries apply their writes, once each.
func TestTxAppliedOnceWithTheResult(t *testing.T) {
	backends(t, func(t *testing.T, client *redis.Client) {
		ctx := context.Background()
		q := queueName(t)
		k, _ := keys.New(q)
		total, done := k.TxKey("total"), k.TxKey("done")
		var runs atomic.Int64
		p := txQueue(t, client, q, nil, func(_ context.Context, m *Message[string]) (string, error) {
			runs.Add(1)
			n, _ := strconv.Atoi(m.Payload)
			tx := m.Tx()
			if err := tx.IncrBy(tx.Key("total"), int64(n)); err != nil {
				return "", err
			}
			if err := tx.SAdd(tx.Key("done"), m.ID); err != nil {
				return "", err
			}
			switch {
			case n%5 == 0 && m.Deliveries == 1:
				return "", errors.New("fails once after staging")
			case n%7 == 0:
				return "", Permanent(errors.New("fails for good after staging"))
			}
			return "ok", nil
		})
		var prs []*Promise[string]
		want, wantDone := 0, 0
		for i := 1; i <= 40; i++ {
			pr, err := p.Produce(ctx, fmt.Sprint("job-", i), strconv.Itoa(i))
			require.NoError(t, err)
			prs = append(prs, pr)
			if i%7 != 0 {
				want += i
				wantDone++
			}
		}
		for i, pr := range prs {
			_, err := pr.Wait(waitCtx(t, 30*time.Second))
			if (i+1)%7 == 0 {
				require.ErrorIs(t, err, ErrDeadLettered)
			} else {
				require.NoError(t, err)
			}
		}
		require.Equal(t, strconv.Itoa(want), client.Get(ctx, total).Val())
		require.EqualValues(t, wantDone, client.SCard(ctx, done).Val())
		require.False(t, client.SIsMember(ctx, done, "job-7").Val(), "a dead letter applied its writes")
		require.Greater(t, runs.Load(), int64(40), "the failed attempts ran")
	})
}

// TestTxRefusedWriteDeadLetters stages writes Redis would refuse: a key of
// another type and a counter that is not a number are found before any
// write (nothing applied, the request dead-lettered); a counter made
// non-numeric by the request's own earlier staged write fails only while
// applying (the writes before it stay, and the error says so).
func TestTxRefusedWriteDeadLetters(t *testing.T) {
	backends(t, func(t *testing.T, client *redis.Client) {
		ctx := context.Background()
		q := queueName(t)
		k, _ := keys.New(q)
		require.NoError(t, client.HSet(ctx, k.TxKey("hash"), "f", "v").Err())
		require.NoError(t, client.Set(ctx, k.TxKey("word"), "abc", 0).Err())
		p := txQueue(t, client, q, nil, func(_ context.Context, m *Message[string]) (string, error) {
			tx := m.Tx()
			require.NoError(t, tx.Incr(tx.Key("n-"+m.ID)))
			switch m.ID {
			case "type":
				require.NoError(t, tx.Incr(tx.Key("hash")))
			case "value":
				require.NoError(t, tx.Incr(tx.Key("word")))
			case "field":
				require.NoError(t, tx.HIncrBy(tx.Key("hash"), "n", 1))
				require.NoError(t, tx.HIncrBy(tx.Key("hash"), "f", 1))
			case "runtime":
				require.NoError(t, tx.Set(tx.Key("later"), "abc", 0))
				require.NoError(t, tx.Incr(tx.Key("later")))
			case "deleted-first":
				// A type changed by an earlier staged write is followed.
				require.NoError(t, tx.Del(tx.Key("hash")))
				require.NoError(t, tx.Incr(tx.Key("hash")))
			}
			return "ok", nil
		})
		wait := func(id string) error {
			pr, err := p.Produce(ctx, id, "x")
			require.NoError(t, err)
			_, err = pr.Wait(waitCtx(t, 30*time.Second))
			return err
		}
		err := wait("type")
		require.ErrorIs(t, err, ErrDeadLettered)
		require.ErrorContains(t, err, "WRONGTYPE")
		require.ErrorContains(t, err, "nothing of this request's staged writes was applied")
		require.Zero(t, client.Exists(ctx, k.TxKey("n-type")).Val(), "a write applied")

		err = wait("value")
		require.ErrorIs(t, err, ErrDeadLettered)
		require.ErrorContains(t, err, `needs an integer at key `+k.TxKey("word")+`, which holds "abc"`)
		require.Zero(t, client.Exists(ctx, k.TxKey("n-value")).Val(), "a write applied")

		err = wait("field")
		require.ErrorIs(t, err, ErrDeadLettered)
		require.ErrorContains(t, err, `needs an integer at field f of key `+k.TxKey("hash")+`, which holds "v"`)
		require.Zero(t, client.Exists(ctx, k.TxKey("n-field")).Val(), "a write applied")
		require.False(t, client.HExists(ctx, k.TxKey("hash"), "n").Val(), "a write applied")

		err = wait("runtime")
		require.ErrorIs(t, err, ErrDeadLettered)
		require.ErrorContains(t, err, "2 of the request's 3 staged writes were applied")
		require.Equal(t, "1", client.Get(ctx, k.TxKey("n-runtime")).Val())
		require.Equal(t, "abc", client.Get(ctx, k.TxKey("later")).Val())

		require.NoError(t, wait("deleted-first"))
		require.Equal(t, "1", client.Get(ctx, k.TxKey("hash")).Val())

		admin, err := NewAdmin(client, q, nil)
		require.NoError(t, err)
		dls, err := admin.DeadLetters(ctx, "", 10)
		require.NoError(t, err)
		require.Len(t, dls, 4)
		require.Equal(t, `"x"`, string(dls[0].Payload), "the dead letter keeps the (encoded) payload")
		requireDrained(t, client, q)
	})
}

// TestTxCompleteScriptOwnershipAndResend drives complete.lua directly: an
// item with staged writes whose entry another consumer holds is dropped
// whole (no ack, no record, start count kept, nothing applied); an owned one
// is applied, and the same call run again (go-redis resending it after a
// lost reply) applies nothing more; a second entry of the same request
// finds the outcome and applies nothing.
func TestTxCompleteScriptOwnershipAndResend(t *testing.T) {
	backends(t, func(t *testing.T, client *redis.Client) {
		ctx := context.Background()
		q := queueName(t)
		k, _ := keys.New(q)
		require.NoError(t, client.XGroupCreateMkStream(ctx, k.Stream, DefaultGroup, "0").Err())
		add := func(id string) string {
			eid, err := client.XAdd(ctx, &redis.XAddArgs{Stream: k.Stream, Values: []any{"id", id, "p", "x"}}).Result()
			require.NoError(t, err)
			require.NoError(t, client.Set(ctx, k.Record(id), "P"+eid, time.Minute).Err())
			return eid
		}
		read := func(consumer string) {
			require.NoError(t, client.XReadGroup(ctx, &redis.XReadGroupArgs{Group: DefaultGroup, Consumer: consumer,
				Streams: []string{k.Stream, ">"}, Count: 1, Block: -1}).Err())
		}
		starts := k.Starts(DefaultGroup)
		call := func(eid, id string) any {
			tx := &Tx{}
			require.NoError(t, tx.IncrBy(k.TxKey("total"), 7))
			require.NoError(t, tx.SAdd(k.TxKey("done"), eid))
			txArgs, txKeys := tx.appendArgs(nil, nil, 1)
			ks := append([]string{k.Stream, k.DeadLetter, k.Fanout, k.Record(id), starts}, txKeys...)
			args := append([]any{DefaultGroup, k.Channel, 60000, "1", 100, "me", 1, "PUBLISH", "0/" + strconv.Itoa(len(txArgs)),
				eid, id, "R", `"ok"`, "x", 1}, txArgs...)
			v, err := scripts.Complete.Run(ctx, client, ks, args...).Result()
			require.NoError(t, err)
			return v
		}
		// Held by another consumer (its lease was lost to it).
		e1 := add("a")
		read("thief")
		require.NoError(t, client.HSet(ctx, starts, e1, 2).Err())
		require.Equal(t, []any{int64(2)}, call(e1, "a"))
		require.False(t, client.Exists(ctx, k.TxKey("total")).Val() > 0, "applied")
		require.Equal(t, "P"+e1, client.Get(ctx, k.Record("a")).Val())
		require.Equal(t, "2", client.HGet(ctx, starts, e1).Val(), "the new owner's start count")
		pend, err := client.XPendingExt(ctx, &redis.XPendingExtArgs{Stream: k.Stream, Group: DefaultGroup, Start: "-", End: "+", Count: 10}).Result()
		require.NoError(t, err)
		require.Len(t, pend, 1)
		require.Equal(t, "thief", pend[0].Consumer)
		// The thief's own completion was not checked here; clean its entry.
		require.NoError(t, client.XAck(ctx, k.Stream, DefaultGroup, e1).Err())

		// Owned: applied once, also when the call runs twice.
		e2 := add("b")
		read("me")
		require.Equal(t, []any{int64(0)}, call(e2, "b"))
		require.Equal(t, []any{int64(2)}, call(e2, "b"), "the resent call")
		require.Equal(t, "7", client.Get(ctx, k.TxKey("total")).Val())
		require.Equal(t, `R"ok"`, client.Get(ctx, k.Record("b")).Val())

		// Another entry of the same request, owned, after the outcome.
		e3, err := client.XAdd(ctx, &redis.XAddArgs{Stream: k.Stream, Values: []any{"id", "b", "p", "x"}}).Result()
		require.NoError(t, err)
		read("me")
		require.Equal(t, []any{int64(1)}, call(e3, "b"))
		require.Equal(t, "7", client.Get(ctx, k.TxKey("total")).Val())
		require.EqualValues(t, 1, client.SCard(ctx, k.TxKey("done")).Val())
		require.Zero(t, client.XLen(ctx, k.Stream).Val()-1, "only the thief's entry stays")
		sum, err := client.XPending(ctx, k.Stream, DefaultGroup).Result()
		require.NoError(t, err)
		require.Zero(t, sum.Count)
	})
}

// TestTxLostLeaseAppliesNothing: a delivery whose entry another consumer
// claims while its handler runs completes anyway; its staged writes are not
// applied. The entry comes back after MinIdle, and that delivery's writes
// are applied once.
func TestTxLostLeaseAppliesNothing(t *testing.T) {
	t.Parallel()
	client := realRedis(t)
	ctx := context.Background()
	q := queueName(t)
	k, _ := keys.New(q)
	staged := make(chan string, 1)
	resume := make(chan struct{})
	var once sync.Once
	p := txQueue(t, client, q, fastOpts(t, "owner", 900*time.Millisecond), func(_ context.Context, m *Message[string]) (string, error) {
		tx := m.Tx()
		require.NoError(t, tx.IncrBy(tx.Key("total"), 5))
		require.NoError(t, tx.SAdd(tx.Key("applied"), m.Deliveries))
		first := false
		once.Do(func() { first = true })
		if first {
			staged <- m.EntryID
			<-resume // the context is ignored: the handler succeeds after losing its lease
		}
		return fmt.Sprint("delivery ", m.Deliveries), nil
	})
	pr, err := p.Produce(ctx, "contested", "x")
	require.NoError(t, err)
	eid := <-staged
	claimed, err := client.XClaimJustID(ctx, &redis.XClaimArgs{
		Stream: k.Stream, Group: DefaultGroup, Consumer: "thief", MinIdle: 0, Messages: []string{eid},
	}).Result()
	require.NoError(t, err)
	require.Equal(t, []string{eid}, claimed)
	close(resume)

	got, err := pr.Wait(waitCtx(t, 30*time.Second))
	require.NoError(t, err)
	require.Equal(t, "delivery 2", got, "the lost delivery's outcome was recorded")
	require.Equal(t, "5", client.Get(ctx, k.TxKey("total")).Val())
	require.Equal(t, []string{"2"}, client.SMembers(ctx, k.TxKey("applied")).Val())
	requireDrained(t, client, q)
}

// TestTxCluster runs staged writes on a three-master cluster with a sharded
// queue: each shard's writes land in its own slot (Tx.Key), a refused
// command and a key of another slot fail at staging with errors saying
// why, and nothing of them is applied.
func TestTxCluster(t *testing.T) {
	t.Parallel()
	cl := redistest.StartCluster(t, 3, 0)
	client := cl.Client(t)
	ctx := context.Background()
	q := queueName(t)
	type verdict struct {
		Command, Slot bool
		SlotMsg       string
		Key           string
	}
	verdicts := make(chan verdict, 100)
	c, err := NewConsumer(client, q, func(_ context.Context, m *Message[string]) (string, error) {
		tx := m.Tx()
		errCmd := tx.Do("GET", tx.Key("total"))
		other := "elsewhere"
		for i := 0; keys.KeySlot(other) == keys.KeySlot(tx.Key("x")); i++ {
			other = fmt.Sprint("elsewhere-", i)
		}
		errSlot := tx.IncrBy(other, 1)
		verdicts <- verdict{Command: errors.Is(errCmd, ErrTxCommand), Slot: errors.Is(errSlot, ErrTxSlot),
			SlotMsg: fmt.Sprint(errSlot), Key: other}
		if err := tx.IncrBy(tx.Key("total"), 1); err != nil {
			return "", err
		}
		if err := tx.SAdd("app:"+tx.HashTag()+":done", m.ID); err != nil {
			return "", err
		}
		return "ok", nil
	}, &ConsumerOptions{Shards: clusterShards, Workers: 4, Logger: testLogger(t)})
	require.NoError(t, err)
	runConsumer(t, c)
	p, err := NewProducer[string, string](client, q, &ProducerOptions{Shards: clusterShards, Logger: testLogger(t)})
	require.NoError(t, err)
	defer p.Close()
	const n = 30
	var prs []*Promise[string]
	for i := range n {
		pr, err := p.Produce(ctx, fmt.Sprint("job-", i), "x")
		require.NoError(t, err)
		prs = append(prs, pr)
	}
	for _, pr := range prs {
		got, err := pr.Wait(waitCtx(t, 60*time.Second))
		require.NoError(t, err)
		require.Equal(t, "ok", got)
	}
	require.Len(t, verdicts, n)
	for range n {
		v := <-verdicts
		require.True(t, v.Command, "GET was not refused with ErrTxCommand")
		require.True(t, v.Slot, "a key of another slot was not refused: %s", v.SlotMsg)
		require.Contains(t, v.SlotMsg, "Tx.Key")
		require.Zero(t, client.Exists(ctx, v.Key).Val(), "a refused write was applied")
	}
	shards, err := keys.Shards(q, clusterShards)
	require.NoError(t, err)
	total, done := 0, int64(0)
	for _, k := range shards {
		v, err := client.Get(ctx, k.TxKey("total")).Int()
		if !errors.Is(err, redis.Nil) {
			require.NoError(t, err)
		}
		total += v
		tag := k.Stream[strings.IndexByte(k.Stream, '{') : strings.IndexByte(k.Stream, '}')+1]
		done += client.SCard(ctx, "app:"+tag+":done").Val()
	}
	require.Equal(t, n, total)
	require.EqualValues(t, n, done)
}

// TestTxFanoutGroup: a fan-out group's handlers stage writes too; each is
// applied once per entry with the group's acknowledgement, and a refused
// write makes a dead letter of the group.
func TestTxFanoutGroup(t *testing.T) {
	backends(t, func(t *testing.T, client *redis.Client) {
		ctx := context.Background()
		q := queueName(t)
		k, _ := keys.New(q)
		require.NoError(t, client.HSet(ctx, k.TxKey("blocked"), "f", "v").Err())
		var runs atomic.Int64
		audit, err := NewConsumer(client, q, func(_ context.Context, m *Message[string]) (string, error) {
			runs.Add(1)
			tx := m.Tx()
			require.NoError(t, tx.SAdd(tx.Key("audited"), m.ID))
			if m.ID == "bad" {
				require.NoError(t, tx.Incr(tx.Key("blocked")))
			}
			if m.Deliveries == 1 && m.ID == "flaky" {
				return "", errors.New("once")
			}
			return "", nil
		}, &ConsumerOptions{Group: "audit", Fanout: true, ReadBlock: 50 * time.Millisecond, RetryBackoff: 20 * time.Millisecond, ClaimInterval: 100 * time.Millisecond,
			Logger: testLogger(t)})
		require.NoError(t, err)
		// The fan-out group exists before the first request (or the answering
		// group could complete and delete it first).
		runConsumer(t, audit)
		eventually(t, 10*time.Second, func() bool { return client.Exists(ctx, k.Stream).Val() == 1 }, "fan-out group created")
		p := txQueue(t, client, q, nil, func(_ context.Context, m *Message[string]) (string, error) {
			return "ok", nil
		})
		ids := []string{"a", "b", "flaky", "bad"}
		for _, id := range ids {
			pr, err := p.Produce(ctx, id, "x")
			require.NoError(t, err)
			_, err = pr.Wait(waitCtx(t, 30*time.Second))
			require.NoError(t, err)
		}
		eventually(t, 30*time.Second, func() bool {
			return client.XLen(ctx, k.GroupDeadLetter("audit")).Val() == 1
		}, "no dead letter of the fan-out group")
		eventually(t, 30*time.Second, func() bool {
			sum, err := client.XPending(ctx, k.Stream, "audit").Result()
			return err == nil && sum.Count == 0 && client.SCard(ctx, k.TxKey("audited")).Val() == 3
		}, "fan-out writes not applied: %v", client.SMembers(ctx, k.TxKey("audited")).Val())
		require.ElementsMatch(t, []string{"a", "b", "flaky"}, client.SMembers(ctx, k.TxKey("audited")).Val())
		require.EqualValues(t, 5, runs.Load())
	})
}

// TestTxPlainCallUnchanged: a completion batch without staged writes has
// exactly the keys and arguments it always had (nothing extra per job).
func TestTxPlainCallUnchanged(t *testing.T) {
	client, _ := miniRedis(t)
	c, err := NewConsumer(client, "q", func(context.Context, *Message[string]) (string, error) { return "", nil },
		&ConsumerOptions{Logger: testLogger(t)})
	require.NoError(t, err)
	_, r := newSoloPool(c)
	fixed := r.completeFixedArgs(0)
	batch := []*completion{
		{s: &slot{entry: Entry{ID: "a", EntryID: "1-0"}}, code: keys.RecordResult, value: []byte("1")},
		{s: &slot{entry: Entry{ID: "b", EntryID: "2-0"}}, code: keys.RecordResult, value: []byte("2")},
	}
	ks, args := r.completeArgs(0, &fixed, batch)
	require.Len(t, ks, 3+len(batch)+1) // the stream, dead letters, fan-out marker, records, start counts
	require.Len(t, args, 9+6*len(batch))
	require.Equal(t, "0", args[8])
	tx := &Tx{}
	require.NoError(t, tx.Incr("n"))
	batch[1].s.tx = tx
	ks, args = r.completeArgs(0, &fixed, batch)
	require.Equal(t, "n", ks[len(ks)-1])
	require.Equal(t, "0/6", args[8], "item index, command count, header, argument count, INCR, n")
}

// TestTxCompleteScriptMixedBatch: one complete.lua call with a plain item,
// a staged item another consumer holds, and a staged item this consumer
// holds: the dropped one is left alone (taken out of the call), the others
// complete, each with its own record, and only the owned writes apply.
func TestTxCompleteScriptMixedBatch(t *testing.T) {
	backends(t, func(t *testing.T, client *redis.Client) {
		ctx := context.Background()
		q := queueName(t)
		k, _ := keys.New(q)
		require.NoError(t, client.XGroupCreateMkStream(ctx, k.Stream, DefaultGroup, "0").Err())
		starts := k.Starts(DefaultGroup)
		eids := map[string]string{}
		for _, id := range []string{"plain", "held", "mine"} {
			eid, err := client.XAdd(ctx, &redis.XAddArgs{Stream: k.Stream, Values: []any{"id", id, "p", "x"}}).Result()
			require.NoError(t, err)
			eids[id] = eid
			require.NoError(t, client.Set(ctx, k.Record(id), "P"+eid, time.Minute).Err())
			consumer := "me"
			if id == "held" {
				consumer = "thief"
			}
			require.NoError(t, client.XReadGroup(ctx, &redis.XReadGroupArgs{Group: DefaultGroup, Consumer: consumer,
				Streams: []string{k.Stream, ">"}, Count: 1, Block: -1}).Err())
			require.NoError(t, client.HSet(ctx, starts, eid, 1).Err())
		}
		ks := []string{k.Stream, k.DeadLetter, k.Fanout}
		args := []any{DefaultGroup, k.Channel, 60000, "1", 100, "me", 1, "PUBLISH", "0"}
		var txArgs []any
		var txKeys []string
		for i, id := range []string{"plain", "held", "mine"} {
			ks = append(ks, k.Record(id))
			args = append(args, eids[id], id, "R", `"`+id+`"`, "x", 1)
			if id != "plain" {
				tx := &Tx{}
				require.NoError(t, tx.RPush(k.TxKey("log"), id))
				txArgs, txKeys = tx.appendArgs(txArgs, txKeys, i+1)
			}
		}
		ks = append(append(ks, starts), txKeys...)
		args[8] = "0/" + strconv.Itoa(len(txArgs))
		args = append(args, txArgs...)
		v, err := scripts.Complete.Run(ctx, client, ks, args...).Result()
		require.NoError(t, err)
		require.Equal(t, []any{int64(0), int64(2), int64(0)}, v)
		require.Equal(t, []string{"mine"}, client.LRange(ctx, k.TxKey("log"), 0, -1).Val())
		require.Equal(t, `R"plain"`, client.Get(ctx, k.Record("plain")).Val())
		require.Equal(t, `R"mine"`, client.Get(ctx, k.Record("mine")).Val())
		require.Equal(t, "P"+eids["held"], client.Get(ctx, k.Record("held")).Val())
		require.Equal(t, map[string]string{eids["held"]: "1"}, client.HGetAll(ctx, starts).Val())
		msgs, err := client.XRange(ctx, k.Stream, "-", "+").Result()
		require.NoError(t, err)
		require.Len(t, msgs, 1)
		require.Equal(t, eids["held"], msgs[0].ID)
		pend, err := client.XPendingExt(ctx, &redis.XPendingExtArgs{Stream: k.Stream, Group: DefaultGroup, Start: "-", End: "+", Count: 10}).Result()
		require.NoError(t, err)
		require.Len(t, pend, 1)
		require.Equal(t, "thief", pend[0].Consumer)
	})
}

// TestTxResentCompletionAppliesOnce: the reply to the complete.lua call
// carrying staged writes is lost, and the call is sent again (by go-redis,
// or the committer's retry): the writes are applied once.
func TestTxResentCompletionAppliesOnce(t *testing.T) {
	t.Parallel()
	raw, proxied, proxy := resendSetup(t)
	ctx := context.Background()
	q := queueName(t)
	k, _ := keys.New(q)
	require.NoError(t, scripts.Complete.Load(ctx, raw).Err())
	proxy.DropReplyTo([]byte(scripts.Complete.Hash()))
	var runs atomic.Int64
	c, err := NewConsumer(proxied, q, func(_ context.Context, m *Message[string]) (string, error) {
		runs.Add(1)
		tx := m.Tx()
		if err := tx.IncrBy(tx.Key("total"), 10); err != nil {
			return "", err
		}
		if err := tx.RPush(tx.Key("log"), m.ID); err != nil {
			return "", err
		}
		return "ok", nil
	}, fastOpts(t, "resent", resendMinIdle))
	require.NoError(t, err)
	runConsumer(t, c)
	ids := seqIDs("job", 5)
	prs := produceAll(t, newStringProducer(t, raw, q), ids)
	requireDropped(t, proxy)
	for _, pr := range prs {
		got, err := pr.Wait(waitCtx(t, 30*time.Second))
		require.NoError(t, err)
		require.Equal(t, "ok", got)
	}
	require.Equal(t, "50", raw.Get(ctx, k.TxKey("total")).Val())
	require.ElementsMatch(t, ids, raw.LRange(ctx, k.TxKey("log"), 0, -1).Val())
	require.EqualValues(t, 5, runs.Load(), "no handler ran twice")
	requireDrained(t, raw, q)
}

// FuzzTxDo: whatever the arguments, Do stages the command or refuses it
// with ErrTxCommand or ErrTxSlot, never panics, and a refused command
// stages nothing.
func FuzzTxDo(f *testing.F) {
	f.Add("SET", "k", "v", "PX", int64(5), true)
	f.Add("hset", "h", "f", "", int64(0), false)
	f.Add("MSET", "a", "1", "b", int64(2), true)
	f.Add("XADD", "s", "MAXLEN", "~", int64(10), true)
	f.Add("GET", "k", "", "", int64(0), false)
	f.Add("DEL", "", "b", "c", int64(0), false)
	ks, err := keys.Shards("fz", 2)
	require.NoError(f, err)
	shards := newTxShards(ks, true)
	f.Fuzz(func(t *testing.T, name, a1, a2, a3 string, n int64, cluster bool) {
		m := &Message[string]{}
		if cluster {
			m.tx = shards[int(n&1)]
		}
		tx := m.Tx()
		var args []any
		for _, a := range []any{name, a1, a2, a3, n} {
			if s, ok := a.(string); ok && s == "" && len(args) > 2 {
				break
			}
			args = append(args, a)
		}
		err := tx.Do(args...)
		if err != nil {
			require.True(t, errors.Is(err, ErrTxCommand) || errors.Is(err, ErrTxSlot), "%v", err)
			require.Zero(t, tx.Len())
			return
		}
		cmds := tx.Commands()
		require.Len(t, cmds, 1)
		require.Len(t, cmds[0], len(args))
	})
}

// TestTxPriorityLevels: a request produced at another priority level (its
// own stream, same slot) applies its staged writes like any other.
func TestTxPriorityLevels(t *testing.T) {
	backends(t, func(t *testing.T, client *redis.Client) {
		ctx := context.Background()
		q := queueName(t)
		k, _ := keys.New(q)
		p := txQueue(t, client, q, nil, func(_ context.Context, m *Message[string]) (string, error) {
			tx := m.Tx()
			if err := tx.SAdd(tx.Key("done"), m.ID); err != nil {
				return "", err
			}
			return fmt.Sprint(m.Priority), nil
		})
		var prs []*Promise[string]
		for i, lv := range []PriorityLevel{PriorityHigh, PriorityNormal, PriorityLow} {
			pr, err := p.Produce(ctx, fmt.Sprint("job-", i), "x", Priority(lv))
			require.NoError(t, err)
			prs = append(prs, pr)
		}
		for _, pr := range prs {
			_, err := pr.Wait(waitCtx(t, 30*time.Second))
			require.NoError(t, err)
		}
		require.ElementsMatch(t, []string{"job-0", "job-1", "job-2"}, client.SMembers(ctx, k.TxKey("done")).Val())
	})
}

// TestTxFirstUsedAfterTheHandlerReturned: a goroutine of the handler that
// first calls Message.Tx after the handler returned stages nothing: every
// write fails with ErrTxClosed (none is silently dropped).
func TestTxFirstUsedAfterTheHandlerReturned(t *testing.T) {
	t.Parallel()
	client := realRedis(t)
	ctx := context.Background()
	q := queueName(t)
	later := make(chan struct{})
	res := make(chan error, 1)
	p := txQueue(t, client, q, nil, func(_ context.Context, m *Message[string]) (string, error) {
		go func() {
			<-later
			tx := m.Tx()
			res <- tx.Incr(tx.Key("late"))
		}()
		return "ok", nil
	})
	pr, err := p.Produce(ctx, "job", "x")
	require.NoError(t, err)
	_, err = pr.Wait(waitCtx(t, 30*time.Second))
	require.NoError(t, err)
	close(later)
	require.ErrorIs(t, <-res, ErrTxClosed)
}

// TestTxCountersCheckedAsRedisParsesThem stages an INCR, then an increment
// of a counter holding a value that Redis refuses to increment (though
// Lua's tonumber takes some of them): the request is dead-lettered before
// anything is written. Values Redis takes are applied.
func TestTxCountersCheckedAsRedisParsesThem(t *testing.T) {
	t.Parallel()
	client := realRedis(t)
	ctx := context.Background()
	q := queueName(t)
	k, _ := keys.New(q)
	type tc struct {
		value string
		stage func(tx *Tx, key string) error
	}
	incrByFloat := func(f float64) func(*Tx, string) error {
		return func(tx *Tx, key string) error { return tx.IncrByFloat(key, f) }
	}
	hincrByFloat := func(tx *Tx, key string) error { return tx.Do("HINCRBYFLOAT", key, "f", 1) }
	incrBy := func(n int64) func(*Tx, string) error {
		return func(tx *Tx, key string) error { return tx.IncrBy(key, n) }
	}
	refused := map[string]tc{
		"trailing-space": {"5 ", incrByFloat(1)}, "leading-space": {" 5", incrByFloat(1)},
		"inf": {"inf", incrByFloat(1)}, "neg-infinity": {"-Infinity", incrByFloat(1)}, "nan": {"nan", incrByFloat(1)},
		"hex-no-digits": {"0x", incrByFloat(1)}, "exp-no-digits": {"1e", incrByFloat(1)}, "overflow": {"1e5000", incrByFloat(1)},
		"underflow": {"1e-5000", incrByFloat(1)}, "empty": {"", incrByFloat(1)}, "nan-paren": {"nan(1)", incrByFloat(1)},
		"inf-increment": {"1", incrByFloat(math.Inf(1))}, "nan-increment": {"1", incrByFloat(math.NaN())},
		"hash-trailing-space": {"5 ", hincrByFloat},
		"int-too-big":         {"99999999999999999999", incrBy(1)}, "int-below-min": {"-9223372036854775809", incrBy(1)},
		"int-hex": {"0x10", incrBy(1)},
	}
	accepted := map[string]tc{
		"hex-float": {"0x10", incrByFloat(1)}, "plus": {"+5", incrByFloat(1)}, "dot-first": {".5", incrByFloat(1)},
		"dot-last": {"5.", incrByFloat(1)}, "exp": {"5e3", incrByFloat(1)}, "hex-exp": {"0x1.8p1", incrByFloat(1)},
		"int-max": {"9223372036854775807", incrBy(0)}, "int-min": {"-9223372036854775808", incrBy(0)},
	}
	p := txQueue(t, client, q, nil, func(_ context.Context, m *Message[string]) (string, error) {
		tx := m.Tx()
		require.NoError(t, tx.Incr(tx.Key("n-"+m.ID)))
		c, ok := refused[m.ID]
		if !ok {
			c = accepted[m.ID]
		}
		require.NoError(t, c.stage(tx, tx.Key("v-"+m.ID)))
		return "ok", nil
	})
	run := func(id string, c tc) error {
		key := k.TxKey("v-" + id)
		if strings.HasPrefix(id, "hash-") {
			require.NoError(t, client.HSet(ctx, key, "f", c.value).Err())
		} else {
			require.NoError(t, client.Set(ctx, key, c.value, 0).Err())
		}
		pr, err := p.Produce(ctx, id, "x")
		require.NoError(t, err)
		_, err = pr.Wait(waitCtx(t, 30*time.Second))
		return err
	}
	for id, c := range refused {
		err := run(id, c)
		require.ErrorIs(t, err, ErrDeadLettered, "%s: %q", id, c.value)
		require.ErrorContains(t, err, "nothing of this request's staged writes was applied", "%s: %q", id, c.value)
		require.Zero(t, client.Exists(ctx, k.TxKey("n-"+id)).Val(), "%s: %q: a write applied", id, c.value)
	}
	for id, c := range accepted {
		require.NoError(t, run(id, c), "%s: %q", id, c.value)
		require.Equal(t, "1", client.Get(ctx, k.TxKey("n-"+id)).Val(), id)
	}
}

// TestTxCounterSpoiledByAnotherRequestOfTheCall drives complete.lua with two
// requests: the first stages a SET that makes a counter non-numeric, the
// second an INCR of another key, then an INCR of that counter. The second is
// checked against what the first leaves: it is dead-lettered with nothing
// applied (the exception for the request's own earlier write does not
// extend to another request's).
func TestTxCounterSpoiledByAnotherRequestOfTheCall(t *testing.T) {
	t.Parallel()
	client := realRedis(t)
	ctx := context.Background()
	q := queueName(t)
	k, _ := keys.New(q)
	require.NoError(t, client.XGroupCreateMkStream(ctx, k.Stream, DefaultGroup, "0").Err())
	var eids []string
	for _, id := range []string{"a", "b"} {
		eid, err := client.XAdd(ctx, &redis.XAddArgs{Stream: k.Stream, Values: []any{"id", id, "p", "x"}}).Result()
		require.NoError(t, err)
		require.NoError(t, client.Set(ctx, k.Record(id), "P"+eid, time.Minute).Err())
		eids = append(eids, eid)
	}
	require.NoError(t, client.XReadGroup(ctx, &redis.XReadGroupArgs{Group: DefaultGroup, Consumer: "me",
		Streams: []string{k.Stream, ">"}, Count: 2, Block: -1}).Err())
	require.NoError(t, client.Set(ctx, k.TxKey("counter"), "1", 0).Err())
	first, second := &Tx{}, &Tx{}
	require.NoError(t, first.Set(k.TxKey("counter"), "abc", 0))
	require.NoError(t, second.Incr(k.TxKey("mine")))
	require.NoError(t, second.Incr(k.TxKey("counter")))
	txArgs, txKeys := first.appendArgs(nil, nil, 1)
	txArgs, txKeys = second.appendArgs(txArgs, txKeys, 2)
	ks := append([]string{k.Stream, k.DeadLetter, k.Fanout, k.Record("a"), k.Record("b"), k.Starts(DefaultGroup)}, txKeys...)
	args := append([]any{DefaultGroup, k.Channel, 60000, "1", 100, "me", 1, "PUBLISH", "0/" + strconv.Itoa(len(txArgs)),
		eids[0], "a", "R", `"ok"`, "x", 1, eids[1], "b", "R", `"ok"`, "x", 1}, txArgs...)
	v, err := scripts.Complete.Run(ctx, client, ks, args...).Result()
	require.NoError(t, err)
	out := v.([]any)
	require.Equal(t, int64(0), out[0])
	msg, _ := out[1].(string)
	require.Contains(t, msg, "nothing of this request's staged writes was applied")
	require.Zero(t, client.Exists(ctx, k.TxKey("mine")).Val(), "a write of the dead request applied")
	require.Equal(t, "abc", client.Get(ctx, k.TxKey("counter")).Val())
	require.True(t, strings.HasPrefix(client.Get(ctx, k.Record("b")).Val(), "L"))
}
