package streamq

import (
	"context"
	"net"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"
)

// roundTrips counts a client's round trips: each command sent alone, and
// each pipeline, is one.
type roundTrips struct{ n atomic.Int64 }

func (h *roundTrips) DialHook(next redis.DialHook) redis.DialHook {
	return func(ctx context.Context, network, addr string) (net.Conn, error) { return next(ctx, network, addr) }
}

func (h *roundTrips) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		h.n.Add(1)
		return next(ctx, cmd)
	}
}

func (h *roundTrips) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		h.n.Add(1)
		return next(ctx, cmds)
	}
}

// BenchmarkAdminJobs measures Admin.Jobs on a queue of 4 shards holding
// 100,000 jobs in each state (seeded straight into Redis, pipelined: a few
// seconds), against a real redis-server: the first page, a page 50,000 jobs
// deep (Next), a Prev page from there, and for retries and dead letters a
// filtered page that matches nothing (the whole scan window). It reports
// round trips and milliseconds per page. Run it with
//
//	go test -run '^$' -bench BenchmarkAdminJobs -benchtime 20x .
func BenchmarkAdminJobs(b *testing.B) {
	client := realRedis(b)
	q := queueName(b)
	const perState = 100_000
	start := time.Now()
	seedJobs(b, client, q, 4, perState)
	b.Logf("seeded %d jobs in each of 5 states in %v", perState, time.Since(start).Round(time.Millisecond))
	rt := &roundTrips{}
	counted := sameServer(client)
	counted.AddHook(rt)
	b.Cleanup(func() { _ = counted.Close() })
	a, err := NewAdmin(counted, q, nil)
	require.NoError(b, err)
	ctx := context.Background()
	for _, state := range []JobState{JobScheduled, JobRetrying, JobQueued, JobRunning, JobDeadLettered} {
		// A cursor 50,000 jobs deep.
		deep := ""
		for range 50 {
			page, err := a.Jobs(ctx, JobsQuery{State: state, Limit: 1000, Cursor: deep})
			require.NoError(b, err)
			require.Len(b, page.Jobs, 1000)
			deep = page.Next
		}
		deepPage, err := a.Jobs(ctx, JobsQuery{State: state, Cursor: deep})
		require.NoError(b, err)
		cases := []struct {
			name string
			q    JobsQuery
		}{
			{"first", JobsQuery{State: state}},
			{"deep-next", JobsQuery{State: state, Cursor: deep}},
			{"deep-prev", JobsQuery{State: state, Cursor: deepPage.Prev}},
			{"first-1000", JobsQuery{State: state, Limit: 1000}},
		}
		if state == JobRetrying || state == JobDeadLettered {
			cases = append(cases, struct {
				name string
				q    JobsQuery
			}{"filter-none", JobsQuery{State: state, ErrorContains: "no such error"}})
		}
		for _, c := range cases {
			b.Run(string(state)+"/"+c.name, func(b *testing.B) {
				rt.n.Store(0)
				var jobs int
				for b.Loop() {
					page, err := a.Jobs(ctx, c.q)
					if err != nil {
						b.Fatal(err)
					}
					jobs = len(page.Jobs)
				}
				b.ReportMetric(float64(rt.n.Load())/float64(b.N), "roundtrips/page")
				b.ReportMetric(float64(b.Elapsed().Microseconds())/1000/float64(b.N), "ms/page")
				b.ReportMetric(float64(jobs), "jobs/page")
			})
		}
	}
}
