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

	"github.com/streamq/streamq/internal/redistest"
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
