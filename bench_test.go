package streamq

import (
	"context"
	"encoding/json"
	"fmt"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/streamq/streamq/internal/keys"
	"github.com/streamq/streamq/internal/redistest"
	"github.com/streamq/streamq/internal/scripts"
)

// Benchmarks of the hot paths. The ones that need Redis run against the
// package's shared real redis-server and skip when redis-server is not
// installed. They are not run by plain `go test`; run them with
//
//	go test -run '^$' -bench . -benchtime 2000x .
//
// cmd/streamq-bench compares whole scenarios with a hand-written baseline.

// benchRedis returns a client of the shared real redis-server, or skips.
func benchRedis(b *testing.B) *redis.Client {
	b.Helper()
	if _, err := redistest.ServerBinary(); err != nil {
		b.Skipf("redis-server not on PATH (apt-get install redis-server): %v", err)
	}
	return realRedis(b)
}

// benchReq is a request of about 100 bytes once encoded, like the ones of
// cmd/streamq-bench.
type benchReq struct {
	Seq int    `json:"seq"`
	T   int64  `json:"t"`
	Pad string `json:"pad"`
}

func newBenchReq(i int) benchReq {
	return benchReq{Seq: i, T: 1_700_000_000_000_000_000, Pad: strings.Repeat("x", 56)}
}

func benchStream(q string) string { return "streamq:{" + q + "}:stream" }

// BenchmarkProduceWait is one sequential round trip: Produce, a consumer with
// one worker handles it, Wait returns the result.
func BenchmarkProduceWait(b *testing.B) {
	client := benchRedis(b)
	ctx := context.Background()
	q := queueName(b)
	p, err := NewProducer[benchReq, int](client, q, &ProducerOptions{Logger: testLogger(b)})
	require.NoError(b, err)
	defer p.Close()
	c, err := NewConsumer(client, q, func(_ context.Context, m *Message[benchReq]) (int, error) {
		return m.Payload.Seq, nil
	}, &ConsumerOptions{Logger: testLogger(b), ReadBlock: 200 * time.Millisecond})
	require.NoError(b, err)
	runConsumer(b, c)
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; b.Loop(); i++ {
		pr, err := p.Produce(ctx, "rt-"+strconv.Itoa(i), newBenchReq(i))
		if err != nil {
			b.Fatal(err)
		}
		got, err := pr.Wait(ctx)
		if err != nil || got != i {
			b.Fatalf("Wait: %d, %v; want %d", got, err, i)
		}
	}
}

// BenchmarkEnqueueOne is one caller enqueuing one request at a time (the
// one-job-per-call path: an idle producer, a direct send), with the
// process's CPU time per call (cpu-us/op, getrusage: the hand-offs the
// scheduler pays are in it, as they are not in ns/op).
func BenchmarkEnqueueOne(b *testing.B) {
	client := benchRedis(b)
	ctx := context.Background()
	q := queueName(b)
	defer client.Unlink(ctx, benchStream(q))
	p, err := NewProducer[benchReq, int](client, q, &ProducerOptions{Logger: testLogger(b)})
	require.NoError(b, err)
	defer p.Close()
	require.NoError(b, p.Enqueue(ctx, "warm", newBenchReq(0)))
	b.ReportAllocs()
	b.ResetTimer()
	cpu0 := processCPU()
	for i := 0; i < b.N; i++ {
		if err := p.Enqueue(ctx, "e-"+strconv.Itoa(i), newBenchReq(i)); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportMetric(float64((processCPU()-cpu0).Microseconds())/float64(b.N), "cpu-us/op")
	b.StopTimer()
	require.EqualValues(b, b.N+1, client.XLen(ctx, benchStream(q)).Val())
}

// BenchmarkEnqueueParallel appends fire-and-forget requests from many
// goroutines through one producer, so concurrent calls coalesce.
func BenchmarkEnqueueParallel(b *testing.B) {
	client := benchRedis(b)
	ctx := context.Background()
	q := queueName(b)
	defer client.Unlink(ctx, benchStream(q))
	p, err := NewProducer[benchReq, int](client, q, &ProducerOptions{Logger: testLogger(b)})
	require.NoError(b, err)
	defer p.Close()
	var seq atomic.Int64
	b.ReportAllocs()
	b.SetParallelism(16)
	b.ResetTimer()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			i := int(seq.Add(1))
			if err := p.Enqueue(ctx, "e-"+strconv.Itoa(i), newBenchReq(i)); err != nil {
				b.Error(err)
				return
			}
		}
	})
	b.StopTimer()
	require.EqualValues(b, b.N, client.XLen(ctx, benchStream(q)).Val())
}

// BenchmarkProduceBatch appends batches of 100 requests; one op is one batch.
func BenchmarkProduceBatch(b *testing.B) {
	const size = 100
	client := benchRedis(b)
	ctx := context.Background()
	q := queueName(b)
	defer client.Unlink(ctx, benchStream(q))
	p, err := NewProducer[benchReq, int](client, q, &ProducerOptions{Logger: testLogger(b)})
	require.NoError(b, err)
	defer p.Close()
	jobs := make([]Job[benchReq], size)
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; b.Loop(); i++ {
		for j := range jobs {
			jobs[j] = Job[benchReq]{ID: fmt.Sprintf("b-%d-%d", i, j), Request: newBenchReq(j)}
		}
		if _, err := p.ProduceBatch(ctx, jobs); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*size), "ns/job")
}

// BenchmarkConsume handles a pre-filled stream with a no-op handler, four
// workers and results discarded; one op is one job, from the consumer's
// start until every entry is acknowledged and deleted.
func BenchmarkConsume(b *testing.B) {
	client := benchRedis(b)
	ctx := context.Background()
	q := queueName(b)
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

	var handled atomic.Int64
	c, err := NewConsumer(client, q, func(_ context.Context, m *Message[benchReq]) (int, error) {
		handled.Add(1)
		return 0, nil
	}, &ConsumerOptions{Workers: 4, DiscardResults: true, Logger: testLogger(b), ReadBlock: 200 * time.Millisecond})
	require.NoError(b, err)
	b.ReportAllocs()
	b.ResetTimer()
	stop := runConsumer(b, c)
	for client.XLen(ctx, benchStream(q)).Val() > 0 {
		time.Sleep(200 * time.Microsecond) // Redis state offers no signal to wait on
	}
	b.StopTimer()
	stop()
	require.EqualValues(b, b.N, handled.Load())
}

// BenchmarkCodec measures request encoding and decoding with the default
// JSON codec, and the []byte pass-through.
func BenchmarkCodec(b *testing.B) {
	req := newBenchReq(42)
	data, err := json.Marshal(req)
	require.NoError(b, err)
	raw := []byte(strings.Repeat("x", 100))
	b.Run("encode-json", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			if _, err := encode(JSONCodec{}, req); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("decode-json", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			if _, err := decode[benchReq](JSONCodec{}, data); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("encode-bytes", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			if _, err := encode(JSONCodec{}, raw); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("decode-bytes", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			if _, err := decode[[]byte](JSONCodec{}, raw); err != nil {
				b.Fatal(err)
			}
		}
	})
}

// BenchmarkParseNotice splits completion notices of 1 and 100 requests.
func BenchmarkParseNotice(b *testing.B) {
	for _, n := range []int{1, 100} {
		var sb strings.Builder
		for i := range n {
			id := "request-" + strconv.Itoa(i)
			rec := "R" + strconv.Itoa(i*7)
			fmt.Fprintf(&sb, "%d:%s%d:%s", len(id), id, len(rec), rec)
		}
		notice := sb.String()
		b.Run(fmt.Sprintf("items=%d", n), func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				count := 0
				if err := parseNotice(notice, func(id, record string) { count++ }); err != nil || count != n {
					b.Fatalf("parseNotice: %d items, %v", count, err)
				}
			}
		})
	}
}

// BenchmarkCompleteScript measures what complete.lua costs Redis per call,
// for 1, 4 and 16 outcomes (successful results, no flows, no staged
// writes: the one-job path's calls), as Redis's own INFO commandstats
// count it (server-us/call and server-us/item; the client's time per op is
// not the point). Each op first appends, reads and charges its entries in
// a separate pipeline, as a consumer would, and the script's figures are
// read around its call only. The ",quiet" cases complete requests recorded
// quiet (produced by Enqueue: no notice is made).
func BenchmarkCompleteScript(b *testing.B) {
	benchRedis(b)             // skips without redis-server
	client := privateRedis(b) // no other benchmark's keys on it
	ctx := context.Background()
	type shape struct {
		n     int
		quiet bool
	}
	for _, sh := range []shape{{1, false}, {4, false}, {16, false}, {1, true}, {4, true}, {16, true}} {
		n, mark, name := sh.n, "", fmt.Sprintf("items=%d", sh.n)
		if sh.quiet {
			mark, name = "+", name+",quiet"
		}
		b.Run(name, func(b *testing.B) {
			q := queueName(b)
			k, err := keys.New(q)
			require.NoError(b, err)
			require.NoError(b, client.XGroupCreateMkStream(ctx, k.Stream, "g", "0").Err())
			pad := strings.Repeat("x", 80)
			var server time.Duration
			for i := 0; i < b.N; i++ {
				pipe := client.Pipeline()
				adds := make([]*redis.StringCmd, n)
				for j := range adds {
					adds[j] = pipe.XAdd(ctx, &redis.XAddArgs{Stream: k.Stream, Values: []any{"id", fmt.Sprintf("%d-%d", i, j), "p", pad}})
				}
				pipe.XReadGroup(ctx, &redis.XReadGroupArgs{Group: "g", Consumer: "c", Streams: []string{k.Stream, ">"}, Count: int64(n)})
				_, err = pipe.Exec(ctx)
				require.NoError(b, err)
				keyList := []string{k.Stream, k.DeadLetter, k.Fanout}
				args := []any{"g", k.Channel, 60_000, "1", 1000, "c", time.Now().UnixMilli(), "PUBLISH", "0"}
				pipe = client.Pipeline()
				starts := make([]any, 0, 2*n)
				for j, add := range adds {
					id, eid := fmt.Sprintf("%d-%d", i, j), add.Val()
					pipe.Set(ctx, k.Record(id), "P"+eid+mark, time.Minute)
					starts = append(starts, eid, 1)
					keyList = append(keyList, k.Record(id))
					args = append(args, eid, id, "R", `{"ok":true}`, "", 1)
				}
				pipe.HSet(ctx, k.Starts("g"), starts...)
				_, err = pipe.Exec(ctx)
				require.NoError(b, err)
				keyList = append(keyList, k.Starts("g"))
				before := evalshaUsec(b, client)
				require.NoError(b, scripts.Complete.Run(ctx, client, keyList, args...).Err())
				server += evalshaUsec(b, client) - before
			}
			b.ReportMetric(float64(server.Microseconds())/float64(b.N), "server-us/call")
			b.ReportMetric(float64(server.Microseconds())/float64(b.N*n), "server-us/item")
		})
	}
}

// evalshaUsec returns the server time all EVALSHA calls took so far, from
// INFO commandstats.
func evalshaUsec(b *testing.B, client *redis.Client) time.Duration {
	info, err := client.Info(context.Background(), "commandstats").Result()
	require.NoError(b, err)
	for _, line := range strings.Split(info, "\r\n") {
		rest, ok := strings.CutPrefix(line, "cmdstat_evalsha:")
		if !ok {
			continue
		}
		for _, f := range strings.Split(rest, ",") {
			if v, ok := strings.CutPrefix(f, "usec="); ok {
				us, err := strconv.ParseInt(v, 10, 64)
				require.NoError(b, err)
				return time.Duration(us) * time.Microsecond
			}
		}
	}
	return 0
}

// BenchmarkProduceScript reports the time Redis spends in produce.lua per
// job (server-us/job, INFO commandstats' EVALSHA time): one Enqueue, a
// ProduceBatch of 16 new ids (atomic) and 16 new ids in one independent call
// (as coalesced Enqueues send them), all three in the script's plain form,
// and a ProduceBatch of 16 ids already in flight (answered from their
// records).
func BenchmarkProduceScript(b *testing.B) {
	const size = 16
	benchRedis(b)             // skips without redis-server
	client := privateRedis(b) // no other benchmark's keys on it: ProduceBatch's half a million records doubled these figures
	ctx := context.Background()
	newProducer := func(b *testing.B) *Producer[benchReq, int] {
		q := queueName(b)
		b.Cleanup(func() { client.Unlink(ctx, benchStream(q)) })
		p, err := NewProducer[benchReq, int](client, q, &ProducerOptions{Logger: testLogger(b)})
		require.NoError(b, err)
		b.Cleanup(func() { p.Close() })
		require.NoError(b, p.Enqueue(ctx, "warm", newBenchReq(0)))
		return p
	}
	jobsOf := func(prefix string, i int) []Job[benchReq] {
		jobs := make([]Job[benchReq], size)
		for j := range jobs {
			jobs[j] = Job[benchReq]{ID: prefix + strconv.Itoa(i) + "-" + strconv.Itoa(j), Request: newBenchReq(j)}
		}
		return jobs
	}
	report := func(b *testing.B, server time.Duration, jobs int) {
		b.ReportMetric(float64(server.Nanoseconds())/1000/float64(b.N*jobs), "server-us/job")
	}
	b.Run("enqueue", func(b *testing.B) {
		p := newProducer(b)
		b.ResetTimer()
		before := evalshaUsec(b, client)
		for i := 0; i < b.N; i++ {
			if err := p.Enqueue(ctx, "e-"+strconv.Itoa(i), newBenchReq(i)); err != nil {
				b.Fatal(err)
			}
		}
		report(b, evalshaUsec(b, client)-before, 1)
	})
	b.Run(fmt.Sprintf("batch=%d", size), func(b *testing.B) {
		p := newProducer(b)
		b.ResetTimer()
		var server time.Duration
		for i := 0; i < b.N; i++ {
			jobs := jobsOf("b-", i)
			before := evalshaUsec(b, client)
			if _, err := p.ProduceBatch(ctx, jobs); err != nil {
				b.Fatal(err)
			}
			server += evalshaUsec(b, client) - before
		}
		report(b, server, size)
	})
	b.Run(fmt.Sprintf("independent=%d", size), func(b *testing.B) {
		p := newProducer(b)
		b.ResetTimer()
		var server time.Duration
		for i := 0; i < b.N; i++ {
			items, err := p.batchItems(ctx, jobsOf("i-", i), nil)
			require.NoError(b, err)
			before := evalshaUsec(b, client)
			_, errs := p.runShards(ctx, items, false)
			server += evalshaUsec(b, client) - before
			for _, err := range errs {
				if err != nil {
					b.Fatal(err)
				}
			}
		}
		report(b, server, size)
	})
	b.Run(fmt.Sprintf("duplicates=%d", size), func(b *testing.B) {
		p := newProducer(b)
		jobs := jobsOf("d-", 0)
		_, err := p.ProduceBatch(ctx, jobs)
		require.NoError(b, err)
		b.ResetTimer()
		var server time.Duration
		for i := 0; i < b.N; i++ {
			before := evalshaUsec(b, client)
			if _, err := p.ProduceBatch(ctx, jobs); err != nil {
				b.Fatal(err)
			}
			server += evalshaUsec(b, client) - before
		}
		report(b, server, size)
	})
}
