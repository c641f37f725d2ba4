package streamq

import (
	"context"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/streamq/streamq/internal/keys"
	"github.com/stretchr/testify/require"
)

// TestDeadLetterKeepsItsLevel: a request that fails for good at a priority
// level is dead-lettered with that level (field "pr", DeadLetter.Priority,
// JobSummary.Priority), and Requeue appends it to that level's stream with
// "pr", where a consumer runs it at its level and the caller attached to the
// requeued request gets the result. A default-level dead letter is as
// before: no "pr", requeued to the default stream. Before, every dead letter
// lost its level and a requeued one ran at PriorityNormal.
func TestDeadLetterKeepsItsLevel(t *testing.T) {
	backends(t, func(t *testing.T, client *redis.Client) {
		ctx := context.Background()
		q := queueName(t)
		streams := levelStreams(q)
		dead := "streamq:{" + q + "}:dead"
		var mu sync.Mutex
		failed := map[string]bool{}
		ran := map[string][]PriorityLevel{}
		handler := func(ctx context.Context, m *Message[string]) (string, error) {
			mu.Lock()
			defer mu.Unlock()
			ran[m.ID] = append(ran[m.ID], m.Priority)
			if !failed[m.ID] {
				failed[m.ID] = true
				return "", Permanent(errors.New("fails once"))
			}
			return m.Payload + "@" + m.Priority.String(), nil
		}
		newConsumer := func(name string) *Consumer[string, string] {
			c, err := NewConsumer(client, q, handler, fastOpts(t, name, time.Second))
			require.NoError(t, err)
			return c
		}
		p := newStringProducer(t, client, q)
		levels := map[string]PriorityLevel{"h-dead": PriorityHigh, "l-dead": PriorityLow, "n-dead": PriorityNormal}
		prs := map[string]*Promise[string]{}
		for id, lvl := range levels {
			prs[id] = mustProduce(t, p, id, "x", Priority(lvl))
		}
		stop := runConsumer(t, newConsumer("first"))
		for id, pr := range prs {
			_, err := pr.Wait(waitCtx(t, 20*time.Second))
			require.ErrorIs(t, err, ErrDeadLettered, id)
		}
		stop()

		// The dead letters: "pr" for a level's, none for the default's.
		raw, err := client.XRange(ctx, dead, "-", "+").Result()
		require.NoError(t, err)
		require.Len(t, raw, len(levels))
		for _, m := range raw {
			id, _ := m.Values["id"].(string)
			pr, has := m.Values[keys.FieldPriority]
			if levels[id] == PriorityNormal {
				require.False(t, has, "a default-level dead letter has no %q field: %v", keys.FieldPriority, m.Values)
			} else {
				require.Equal(t, levels[id].String(), pr, id)
			}
		}
		admin, err := NewAdmin(client, q, nil)
		require.NoError(t, err)
		dls, err := admin.DeadLetters(ctx, "", 10)
		require.NoError(t, err)
		require.Len(t, dls, len(levels))
		for _, d := range dls {
			require.Equal(t, levels[d.ID], d.Priority, "DeadLetters: %s", d.ID)
			one, err := admin.DeadLetter(ctx, d.DeadLetterID)
			require.NoError(t, err)
			require.Equal(t, levels[d.ID], one.Priority, "DeadLetter: %s", d.ID)
		}
		page, err := admin.Jobs(ctx, JobsQuery{State: JobDeadLettered})
		require.NoError(t, err)
		require.Len(t, page.Jobs, len(levels))
		for _, j := range page.Jobs {
			require.Equal(t, levels[j.ID], j.Priority, "Jobs: %s", j.ID)
		}

		// Requeue (no consumer runs): each goes to its level's stream, and
		// only a level's entry carries "pr".
		for _, d := range dls {
			entry, err := admin.Requeue(ctx, d.DeadLetterID)
			require.NoError(t, err)
			l := levelOf[d.Priority]
			msgs, err := client.XRange(ctx, streams[l], entry, entry).Result()
			require.NoError(t, err)
			require.Len(t, msgs, 1, "%s is requeued to %s", d.ID, streams[l])
			require.Equal(t, d.ID, msgs[0].Values["id"])
			pr, has := msgs[0].Values[keys.FieldPriority]
			if l == levelNormal {
				require.False(t, has, "a default-level requeue has no %q field: %v", keys.FieldPriority, msgs[0].Values)
			} else {
				require.Equal(t, d.Priority.String(), pr)
			}
			// Asking again returns the same entry and adds nothing.
			again, err := admin.Requeue(ctx, d.DeadLetterID)
			require.NoError(t, err)
			require.Equal(t, entry, again)
			require.Len(t, entriesOf(t, client, streams[l], d.ID), 1)
		}
		require.Zero(t, client.XLen(ctx, dead).Val())

		// Callers attach to the requeued requests; a consumer runs each at
		// its level.
		for id := range levels {
			prs[id] = mustProduce(t, p, id, "again")
			require.Equal(t, DedupInflight, prs[id].Deduplicated(), id)
		}
		runConsumer(t, newConsumer("second"))
		for id, pr := range prs {
			got, err := pr.Wait(waitCtx(t, 20*time.Second))
			require.NoError(t, err, id)
			require.Equal(t, "x@"+levels[id].String(), got, "%s ran at its level", id)
		}
		mu.Lock()
		defer mu.Unlock()
		for id, lvl := range levels {
			require.Equal(t, []PriorityLevel{lvl, lvl}, ran[id], id)
		}
	})
}

// TestDeadLetterLevelOfAFanoutGroup: a fan-out group's dead letter of a
// high-priority request records the level too, and its requeue goes back to
// the high stream for that group only.
func TestDeadLetterLevelOfAFanoutGroup(t *testing.T) {
	backends(t, func(t *testing.T, client *redis.Client) {
		ctx := context.Background()
		q := queueName(t)
		streams := levelStreams(q)
		var mu sync.Mutex
		var audit []PriorityLevel
		failOnce := true
		answer, err := NewConsumer(client, q, func(ctx context.Context, m *Message[string]) (string, error) {
			return "ok", nil
		}, fastOpts(t, "answer", time.Second))
		require.NoError(t, err)
		auditOpts := fastOpts(t, "audit", time.Second)
		auditOpts.Group, auditOpts.Fanout = "audit", true
		auditor, err := NewConsumer(client, q, func(ctx context.Context, m *Message[string]) (string, error) {
			mu.Lock()
			defer mu.Unlock()
			audit = append(audit, m.Priority)
			if failOnce {
				failOnce = false
				return "", Permanent(errors.New("audit refused it"))
			}
			return "", nil
		}, auditOpts)
		require.NoError(t, err)
		runConsumer(t, answer)
		runConsumer(t, auditor)
		p := newStringProducer(t, client, q)
		_, err = mustProduce(t, p, "fan", "x", Priority(PriorityHigh)).Wait(waitCtx(t, 20*time.Second))
		require.NoError(t, err)

		admin, err := NewAdmin(client, q, &AdminOptions{Group: "audit"})
		require.NoError(t, err)
		var dls []DeadLetter
		eventually(t, 10*time.Second, func() bool {
			dls, err = admin.DeadLetters(ctx, "", 10)
			return err == nil && len(dls) == 1
		}, "the audit group's failure is its dead letter")
		require.Equal(t, PriorityHigh, dls[0].Priority)
		raw, err := client.XRange(ctx, "streamq:{"+q+"}:dead:audit", "-", "+").Result()
		require.NoError(t, err)
		require.Len(t, raw, 1)
		require.Equal(t, "high", raw[0].Values[keys.FieldPriority])

		entry, err := admin.Requeue(ctx, dls[0].DeadLetterID)
		require.NoError(t, err)
		require.True(t, strings.Contains(entry, "-"), entry)
		eventually(t, 10*time.Second, func() bool {
			mu.Lock()
			defer mu.Unlock()
			return len(audit) == 2
		}, "the audit group reruns the requeued request")
		mu.Lock()
		require.Equal(t, []PriorityLevel{PriorityHigh, PriorityHigh}, audit)
		mu.Unlock()
		// The requeued entry went to the high stream (the fan-out marker
		// keeps entries until the trim, which these consumers do not run).
		msgs, err := client.XRange(ctx, streams[levelHigh], entry, entry).Result()
		require.NoError(t, err)
		require.Len(t, msgs, 1)
		require.Equal(t, "high", msgs[0].Values[keys.FieldPriority])
		require.Equal(t, "audit", msgs[0].Values["g"])
	})
}

// TestAdminJobReportsItsPriority: Admin.Job gives the level of a scheduled,
// retrying, queued and running request, and normal for the default level
// and once the request finished; streamq job prints it.
func TestAdminJobReportsItsPriority(t *testing.T) {
	backends(t, func(t *testing.T, client *redis.Client) {
		ctx := context.Background()
		q := queueName(t)
		p := newStringProducer(t, client, q)
		admin, err := NewAdmin(client, q, nil)
		require.NoError(t, err)
		level := func(id string) (JobState, PriorityLevel) {
			t.Helper()
			info, err := admin.Job(ctx, id)
			require.NoError(t, err)
			return info.State, info.Priority
		}
		mustProduce(t, p, "later", "x", Priority(PriorityLow), After(time.Hour))
		mustProduce(t, p, "queued", "x", Priority(PriorityHigh))
		mustProduce(t, p, "plain", "x")
		st, lvl := level("later")
		require.Equal(t, JobScheduled, st)
		require.Equal(t, PriorityLow, lvl)
		st, lvl = level("queued")
		require.Equal(t, JobQueued, st)
		require.Equal(t, PriorityHigh, lvl)
		st, lvl = level("plain")
		require.Equal(t, JobQueued, st)
		require.Equal(t, PriorityNormal, lvl)

		// Running, then a retry waiting for its back-off: still high.
		started, release := make(chan struct{}), make(chan struct{})
		c, err := NewConsumer(client, q, func(ctx context.Context, m *Message[string]) (string, error) {
			if m.ID == "queued" && m.Deliveries == 1 {
				close(started)
				<-release
				return "", RetryAfter(errors.New("again"), time.Hour)
			}
			return "ok", nil
		}, fastOpts(t, "levels", 10*time.Second))
		require.NoError(t, err)
		stop := runConsumer(t, c)
		<-started
		st, lvl = level("queued")
		require.Equal(t, JobRunning, st)
		require.Equal(t, PriorityHigh, lvl)
		close(release)
		require.Eventually(t, func() bool {
			st, lvl = level("queued")
			return st == JobRetrying
		}, 10*time.Second, 5*time.Millisecond)
		require.Equal(t, PriorityHigh, lvl)
		require.Eventually(t, func() bool {
			st, _ = level("plain")
			return st == JobSucceeded
		}, 10*time.Second, 5*time.Millisecond)
		_, lvl = level("plain")
		require.Equal(t, PriorityNormal, lvl)
		stop()
	})
}
