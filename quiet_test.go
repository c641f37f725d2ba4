package streamq

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/streamq/streamq/internal/keys"
)

// noticeWatch subscribes to queue q's completion notices and returns the
// request ids they announce, in the order Redis published them.
func noticeWatch(t *testing.T, client *redis.Client, q string) <-chan string {
	t.Helper()
	ctx := context.Background()
	ks, err := keys.Shards(q, 1)
	require.NoError(t, err)
	ps := client.Subscribe(ctx, ks[0].Channel)
	t.Cleanup(func() { _ = ps.Close() })
	_, err = ps.Receive(ctx) // the subscription's confirmation
	require.NoError(t, err)
	ids := make(chan string, 1000)
	msgs := ps.Channel()
	go func() {
		for m := range msgs {
			if strings.HasPrefix(m.Payload, "~") {
				continue // a progress notice
			}
			_ = parseNotice(m.Payload, func(id, _ string) { ids <- id })
		}
	}()
	return ids
}

// noticesUntil reads ids from watch until want arrives and returns the ids
// announced before it.
func noticesUntil(t *testing.T, watch <-chan string, want string) []string {
	t.Helper()
	var before []string
	timeout := time.After(20 * time.Second)
	for {
		select {
		case id := <-watch:
			if id == want {
				return before
			}
			before = append(before, id)
		case <-timeout:
			t.Fatalf("no notice of %q (heard before it: %v)", want, before)
		}
	}
}

// record returns the record of request id of queue q.
func record(t *testing.T, client *redis.Client, q, id string) string {
	t.Helper()
	ks, err := keys.Shards(q, 1)
	require.NoError(t, err)
	v, err := client.Get(context.Background(), ks[0].Record(id)).Result()
	require.NoError(t, err)
	return v
}

// TestEnqueuedRequestsAreNotAnnounced: the outcome of a request produced by
// Enqueue, EnqueueBatch or Send, which nobody waits for, is recorded but not
// published. The notices come in the order they were published, so once a
// request produced later by Produce is announced, every earlier completion's
// notice, had there been one, has arrived.
func TestEnqueuedRequestsAreNotAnnounced(t *testing.T) {
	backends(t, func(t *testing.T, client *redis.Client) {
		p, q, runs := noticeRig(t, client)
		ctx := context.Background()
		watch := noticeWatch(t, client, q)

		quiet := []string{"e1", "e2", "b1", "b2", "s1"}
		require.NoError(t, p.Enqueue(ctx, "e1", "x"))
		require.NoError(t, p.Enqueue(ctx, "e2", "x", Priority(PriorityHigh))) // the script's general form
		require.NoError(t, p.EnqueueBatch(ctx, []Job[string]{{ID: "b1", Request: "x"}, {ID: "b2", Request: "x"}}))
		require.NoError(t, p.Send(ctx, "s1", "x"))
		require.NoError(t, p.Flush(ctx))
		eventually(t, 20*time.Second, func() bool { return runs.Load() == int64(len(quiet)) }, "not every job ran")
		for _, id := range quiet {
			eventually(t, 20*time.Second, func() bool { return strings.HasPrefix(record(t, client, q, id), "R") },
				"request %s has no outcome", id)
		}

		pr, err := p.Produce(ctx, "w1", "y")
		require.NoError(t, err)
		got, err := waitFor(t, pr)
		require.NoError(t, err)
		require.Equal(t, "r-y", got)
		require.Empty(t, noticesUntil(t, watch, "w1"), "requests nobody waits for were announced")
	})
}

// TestWaiterAttachingToEnqueuedRequestIsAnnounced: a caller that waits and
// attaches to a request produced by Enqueue (a duplicate id), by any path of
// produce.lua or flow.lua, makes its outcome announced again. The producer
// that waits never runs its backstop (an hour), and its check after the
// subscription ran before the request completed, so only the notice can
// answer it.
func TestWaiterAttachingToEnqueuedRequestIsAnnounced(t *testing.T) {
	attach := map[string]func(ctx context.Context, p *Producer[string, string], id string) (*Promise[string], error){
		"Produce": func(ctx context.Context, p *Producer[string, string], id string) (*Promise[string], error) {
			return p.Produce(ctx, id, "again")
		},
		"Produce with a level": func(ctx context.Context, p *Producer[string, string], id string) (*Promise[string], error) {
			return p.Produce(ctx, id, "again", Priority(PriorityLow))
		},
		"Throttle": func(ctx context.Context, p *Producer[string, string], id string) (*Promise[string], error) {
			return p.Produce(ctx, id, "again", Throttle(time.Minute))
		},
		"Debounce": func(ctx context.Context, p *Producer[string, string], id string) (*Promise[string], error) {
			return p.Produce(ctx, id, "again", Debounce(time.Second, time.Minute))
		},
		"ProduceFlow": func(ctx context.Context, p *Producer[string, string], id string) (*Promise[string], error) {
			return p.ProduceFlow(ctx, id, "again", []Child{ChildOf(NewQueue[string, string](p.queue), id+"-child", "c")}, nil)
		},
	}
	for name, fn := range attach {
		t.Run(name, func(t *testing.T) {
			backends(t, func(t *testing.T, client *redis.Client) {
				q := queueName(t)
				ctx := context.Background()
				watch := noticeWatch(t, client, q)
				enq, err := NewProducer[string, string](client, q, &ProducerOptions{Logger: testLogger(t)})
				require.NoError(t, err)
				t.Cleanup(func() { _ = enq.Close() })
				waiter, err := NewProducer[string, string](client, q, &ProducerOptions{BackstopInterval: time.Hour, Logger: testLogger(t)})
				require.NoError(t, err)
				t.Cleanup(func() { _ = waiter.Close() })

				require.NoError(t, enq.Enqueue(ctx, "a", "first"))
				rec := record(t, client, q, "a")
				require.True(t, strings.HasPrefix(rec, "P") && strings.HasSuffix(rec, "+"), "record %q is not quiet", rec)

				pr, err := fn(ctx, waiter, "a")
				require.NoError(t, err)
				require.Equal(t, DedupInflight, pr.Deduplicated())
				require.Equal(t, strings.TrimSuffix(rec[1:], "+"), pr.EntryID(), "the entry id has the record's mark")
				require.Equal(t, strings.TrimSuffix(rec, "+"), record(t, client, q, "a"), "the record still says nobody waits")
				// The waiter's check of its waiting records after it
				// subscribed has run once this second Produce returns.
				pr2, err := waiter.Produce(ctx, "fence", "f")
				require.NoError(t, err)
				defer pr2.Release()

				c, err := NewConsumer(client, q, func(ctx context.Context, m *Message[string]) (string, error) {
					return "r-" + m.Payload, nil
				}, fastOpts(t, "w", 10*time.Second))
				require.NoError(t, err)
				runConsumer(t, c)
				got, err := waitFor(t, pr)
				require.NoError(t, err)
				require.Equal(t, "r-first", got)
				noticesUntil(t, watch, "a")
			})
		})
	}
}

// readyProducer returns a producer of queue q whose queue metadata is
// written, so that its script calls can be made directly (runProduce).
func readyProducer(t *testing.T, client *redis.Client, q string) *Producer[string, string] {
	t.Helper()
	p, err := NewProducer[string, string](client, q, &ProducerOptions{Logger: testLogger(t)})
	require.NoError(t, err)
	t.Cleanup(func() { _ = p.Close() })
	require.NoError(t, p.ensureMeta(context.Background()))
	return p
}

// TestQuietAndWaitingItemsOfOneCall: when one produce.lua call carries a
// request twice, first from Enqueue and then from a caller that waits (the
// coalescer joins the calls of one producer), the second makes the record
// announced; the other way round it stays announced.
func TestQuietAndWaitingItemsOfOneCall(t *testing.T) {
	backends(t, func(t *testing.T, client *redis.Client) {
		q := queueName(t)
		ctx := context.Background()
		p := readyProducer(t, client, q)
		for _, order := range []string{"quiet first", "waiting first"} {
			id := strings.ReplaceAll(order, " ", "-")
			items := make([]*produceItem, 2)
			for i := range items {
				it, err := p.newItem(ctx, id, "x", nil, nil, false)
				require.NoError(t, err)
				items[i] = it
			}
			quiet := items[0]
			if order == "waiting first" {
				quiet = items[1]
			}
			quiet.hush()
			for _, atomic := range []bool{false, true} {
				require.NoError(t, client.Del(ctx, p.shards[0].Record(id)).Err())
				outs, err := p.runProduce(ctx, client, 0, items, atomic)
				require.NoError(t, err)
				require.EqualValues(t, outcomeAppended, outs[0].code)
				require.EqualValues(t, outcomeInflight, outs[1].code)
				require.Equal(t, "P"+outs[0].data, record(t, client, q, id), fmt.Sprintf("%s, atomic %v", order, atomic))
			}
		}
	})
}

// TestBatchProducedBeforeListeningIsAnnouncedOnceWaited: a producer that
// does not listen appends its batches quiet; its first Wait subscribes, and
// the check that follows makes the records of its waiting requests announced
// (hear.lua), so their promises resolve by notice (the backstop runs once an
// hour here). Batches produced by other goroutines while the subscription
// starts resolve too.
func TestBatchProducedBeforeListeningIsAnnouncedOnceWaited(t *testing.T) {
	backends(t, func(t *testing.T, client *redis.Client) {
		q := queueName(t)
		ctx := context.Background()
		p, err := NewProducer[string, string](client, q, &ProducerOptions{BackstopInterval: time.Hour, Logger: testLogger(t)})
		require.NoError(t, err)
		t.Cleanup(func() { _ = p.Close() })

		first, err := p.ProduceBatch(ctx, []Job[string]{{ID: "a", Request: "x"}, {ID: "b", Request: "y"}})
		require.NoError(t, err)
		for _, id := range []string{"a", "b"} {
			rec := record(t, client, q, id)
			require.True(t, strings.HasSuffix(rec, "+"), "record %q of a batch nobody listens to is not quiet", rec)
		}

		// The first Wait subscribes while other goroutines produce batches.
		const batches = 20
		all := make(chan []*Promise[string], batches)
		waited := make(chan error, 1)
		go func() {
			wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
			defer cancel()
			_, err := first[0].Wait(wctx)
			waited <- err
		}()
		errs := make(chan error, batches)
		for i := range batches {
			go func() {
				prs, err := p.ProduceBatch(ctx, []Job[string]{{ID: fmt.Sprintf("c%d-1", i), Request: "z"}, {ID: fmt.Sprintf("c%d-2", i), Request: "z"}})
				errs <- err
				all <- prs
			}()
		}
		for range batches {
			require.NoError(t, <-errs)
		}
		eventually(t, 20*time.Second, func() bool { return p.subscribed.Load() }, "Wait did not subscribe")
		for _, id := range []string{"a", "b"} {
			eventually(t, 20*time.Second, func() bool { return !strings.HasSuffix(record(t, client, q, id), "+") },
				"the record of waiting request %s is still quiet", id)
		}

		c, err := NewConsumer(client, q, func(ctx context.Context, m *Message[string]) (string, error) {
			return "r-" + m.Payload, nil
		}, fastOpts(t, "w", 10*time.Second))
		require.NoError(t, err)
		runConsumer(t, c)
		require.NoError(t, <-waited)
		got, err := waitFor(t, first[1])
		require.NoError(t, err)
		require.Equal(t, "r-y", got)
		for range batches {
			for _, pr := range <-all {
				got, err := waitFor(t, pr)
				require.NoError(t, err)
				require.Equal(t, "r-z", got)
			}
		}
	})
}

// TestEnqueuedProgressIsNotAnnounced: the progress a handler reports for a
// request nobody waits for is stored but not published; a request produced
// by Produce, reported after it, is announced. The notices come in publish
// order, so the quiet one's would have come first.
func TestEnqueuedProgressIsNotAnnounced(t *testing.T) {
	backends(t, func(t *testing.T, client *redis.Client) {
		q := queueName(t)
		ctx := context.Background()
		ks, err := keys.Shards(q, 1)
		require.NoError(t, err)
		ps := client.Subscribe(ctx, ks[0].Channel)
		t.Cleanup(func() { _ = ps.Close() })
		_, err = ps.Receive(ctx)
		require.NoError(t, err)
		msgs := ps.Channel()

		p, err := NewProducer[string, string](client, q, &ProducerOptions{Logger: testLogger(t)})
		require.NoError(t, err)
		t.Cleanup(func() { _ = p.Close() })
		var reported atomic.Int64
		c, err := NewConsumer(client, q, func(ctx context.Context, m *Message[string]) (string, error) {
			if err := m.Progress(ctx, []byte("half")); err != nil {
				return "", err
			}
			reported.Add(1)
			return "done", nil
		}, fastOpts(t, "w", 10*time.Second))
		require.NoError(t, err)
		runConsumer(t, c)

		require.NoError(t, p.Enqueue(ctx, "quiet", "x"))
		eventually(t, 20*time.Second, func() bool { return reported.Load() == 1 }, "the handler did not report")
		v, err := client.Get(ctx, ks[0].Progress("quiet")).Result()
		require.NoError(t, err)
		require.Equal(t, "1:half", v, "the quiet request's progress is not stored")

		pr, err := p.Produce(ctx, "heard", "y")
		require.NoError(t, err)
		_, err = waitFor(t, pr)
		require.NoError(t, err)
		timeout := time.After(20 * time.Second)
		for {
			select {
			case m := <-msgs:
				if !strings.HasPrefix(m.Payload, "~") {
					continue
				}
				id, _, _, err := parseProgressNotice(m.Payload[1:])
				require.NoError(t, err)
				require.NotEqual(t, "quiet", id, "the progress of a request nobody waits for was announced")
				if id == "heard" {
					return
				}
			case <-timeout:
				t.Fatal("no progress notice of the request produced by Produce")
			}
		}
	})
}

// TestDelayedAndRetriedEnqueuesStayQuiet: a request produced by Enqueue stays
// quiet while it waits in the schedule, delayed (After) or retried after a
// failure: its record says so ("P@<due>+"), its outcome is not announced, and
// a caller that waits and attaches to it while it waits makes it announced.
func TestDelayedAndRetriedEnqueuesStayQuiet(t *testing.T) {
	backends(t, func(t *testing.T, client *redis.Client) {
		q := queueName(t)
		ctx := context.Background()
		watch := noticeWatch(t, client, q)
		p, err := NewProducer[string, string](client, q, &ProducerOptions{Logger: testLogger(t)})
		require.NoError(t, err)
		t.Cleanup(func() { _ = p.Close() })

		require.NoError(t, p.Enqueue(ctx, "later", "x", After(time.Hour)))
		rec := record(t, client, q, "later")
		require.True(t, strings.HasPrefix(rec, "P@") && strings.HasSuffix(rec, "+"), "record %q of a delayed Enqueue is not quiet", rec)
		require.NoError(t, p.Enqueue(ctx, "held", "x", After(time.Hour)))
		pr, err := p.Produce(ctx, "held", "again")
		require.NoError(t, err)
		pr.Release()
		rec = record(t, client, q, "held")
		require.True(t, strings.HasPrefix(rec, "P@") && !strings.HasSuffix(rec, "+"), "record %q still says nobody waits", rec)

		var failedOnce atomic.Bool
		c, err := NewConsumer(client, q, func(ctx context.Context, m *Message[string]) (string, error) {
			if m.ID == "retried" && failedOnce.CompareAndSwap(false, true) {
				return "", errors.New("the first attempt fails")
			}
			return "r-" + m.Payload, nil
		}, fastOpts(t, "w", 10*time.Second))
		require.NoError(t, err)
		runConsumer(t, c)
		require.NoError(t, p.Enqueue(ctx, "delayed", "x", After(100*time.Millisecond)))
		require.NoError(t, p.Enqueue(ctx, "retried", "x"))
		for _, id := range []string{"delayed", "retried"} {
			eventually(t, 20*time.Second, func() bool { return strings.HasPrefix(record(t, client, q, id), "R") },
				"request %s has no outcome", id)
		}
		require.True(t, failedOnce.Load(), "the first attempt did not run")

		w, err := p.Produce(ctx, "fence", "y")
		require.NoError(t, err)
		_, err = waitFor(t, w)
		require.NoError(t, err)
		require.Empty(t, noticesUntil(t, watch, "fence"), "delayed or retried requests nobody waits for were announced")
	})
}

// TestWaiterAttachingToDelayedEnqueueIsAnnounced: a caller that waits and
// attaches to a quiet request waiting in the schedule ("P@<due>+") makes it
// announced, by every path that attaches there: Produce, Replace, a
// ProduceFlow root, and a Produce in the same produce.lua call as the
// delayed Enqueue.
func TestWaiterAttachingToDelayedEnqueueIsAnnounced(t *testing.T) {
	backends(t, func(t *testing.T, client *redis.Client) {
		q := queueName(t)
		ctx := context.Background()
		p := readyProducer(t, client, q)
		attach := map[string]func(id string) (*Promise[string], error){
			"Produce": func(id string) (*Promise[string], error) { return p.Produce(ctx, id, "again") },
			"Replace": func(id string) (*Promise[string], error) { return p.Produce(ctx, id, "again", Replace()) },
			"ProduceFlow": func(id string) (*Promise[string], error) {
				return p.ProduceFlow(ctx, id, "again", []Child{ChildOf(NewQueue[string, string](q), id+"-child", "c")}, nil)
			},
		}
		for name, fn := range attach {
			id := "later-" + name
			require.NoError(t, p.Enqueue(ctx, id, "x", After(time.Hour)))
			require.True(t, strings.HasSuffix(record(t, client, q, id), "+"), "%s: the delayed Enqueue is not quiet", name)
			pr, err := fn(id)
			require.NoError(t, err, name)
			pr.Release()
			rec := record(t, client, q, id)
			assert.True(t, strings.HasPrefix(rec, "P@") && !strings.HasSuffix(rec, "+"), "%s: record %q still says nobody waits", name, rec)
		}

		// One call: the delayed Enqueue, then a Produce of the same id.
		items := make([]*produceItem, 2)
		for i := range items {
			var opts []ProduceOption
			if i == 0 {
				opts = []ProduceOption{After(time.Hour)}
			}
			it, err := p.newItem(ctx, "one-call", "x", opts, nil, false)
			require.NoError(t, err)
			items[i] = it
		}
		items[0].hush()
		outs, err := p.runProduce(ctx, client, 0, items, false)
		require.NoError(t, err)
		require.EqualValues(t, outcomeAppended, outs[0].code)
		require.EqualValues(t, outcomeInflight, outs[1].code)
		rec := record(t, client, q, "one-call")
		require.True(t, strings.HasPrefix(rec, "P@") && !strings.HasSuffix(rec, "+"), "record %q still says nobody waits", rec)
	})
}
