package streamq

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/streamq/streamq/internal/keys"
)

// redisUsec returns the server's CPU time spent in commands so far (INFO
// commandstats), in microseconds.
func redisUsec(b *testing.B, client *redis.Client) float64 {
	info, err := client.Info(context.Background(), "commandstats").Result()
	require.NoError(b, err)
	var sum float64
	for _, line := range strings.Split(info, "\n") {
		if _, stats, ok := strings.Cut(strings.TrimSpace(line), ":"); ok && strings.HasPrefix(line, "cmdstat_") {
			for _, f := range strings.Split(stats, ",") {
				if v, ok := strings.CutPrefix(f, "usec="); ok {
					n, _ := strconv.ParseFloat(v, 64)
					sum += n
				}
			}
		}
	}
	return sum
}

// BenchmarkConsumeTx is BenchmarkConsume with each handler staging cmds
// writes (INCRBY, alternating over 16 keys, in the queue's slot): the
// difference per job between cmds=0 and cmds=N, over N, is the cost of one
// staged command. One op is one job; redis-us/job is the server's CPU time
// per job (INFO commandstats), steadier than the wall time on a shared
// machine (the server is shared with the package's other benchmarks: run
// one at a time).
//
//	go test -run '^$' -bench ConsumeTx -benchtime 20000x -count 3 .
func BenchmarkConsumeTx(b *testing.B) {
	for _, cmds := range []int{0, 1, 4, 16} {
		b.Run(fmt.Sprint("cmds=", cmds), func(b *testing.B) {
			client := benchRedis(b)
			ctx := context.Background()
			q := queueName(b)
			k, _ := keys.New(q)
			p, err := NewProducer[benchReq, int](client, q, &ProducerOptions{Logger: testLogger(b)})
			require.NoError(b, err)
			jobs := make([]Job[benchReq], 0, 500)
			for i := 0; i < b.N; {
				jobs = jobs[:0]
				for ; i < b.N && len(jobs) < cap(jobs); i++ {
					jobs = append(jobs, Job[benchReq]{ID: "c-" + strconv.Itoa(i), Request: newBenchReq(i)})
				}
				_, err := p.ProduceBatch(ctx, jobs)
				require.NoError(b, err)
			}
			require.NoError(b, p.Close())
			names := make([]string, 16)
			for i := range names {
				names[i] = k.TxKey("n" + strconv.Itoa(i))
			}
			var handled atomic.Int64
			c, err := NewConsumer(client, q, func(_ context.Context, m *Message[benchReq]) (int, error) {
				handled.Add(1)
				if cmds > 0 {
					tx := m.Tx()
					for j := range cmds {
						if err := tx.IncrBy(names[(m.Payload.Seq+j)%len(names)], 1); err != nil {
							return 0, err
						}
					}
				}
				return 0, nil
			}, &ConsumerOptions{Workers: 4, DiscardResults: true, Logger: testLogger(b), ReadBlock: 200 * time.Millisecond})
			require.NoError(b, err)
			b.ReportAllocs()
			before := redisUsec(b, client)
			b.ResetTimer()
			stop := runConsumer(b, c)
			for client.XLen(ctx, benchStream(q)).Val() > 0 {
				time.Sleep(200 * time.Microsecond) // Redis state offers no signal to wait on
			}
			b.StopTimer()
			b.ReportMetric((redisUsec(b, client)-before)/float64(b.N), "redis-us/job")
			stop()
			require.EqualValues(b, b.N, handled.Load())
			var sum int64
			for _, n := range names {
				v, _ := client.Get(ctx, n).Int64()
				sum += v
			}
			require.EqualValues(b, int64(b.N)*int64(cmds), sum, "staged writes applied once each")
		})
	}
}
