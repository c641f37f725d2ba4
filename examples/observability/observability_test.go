package observability_test

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/streamq/streamq/examples/observability"
)

// TestExample runs the producer's and the consumer's wiring on miniredis:
// each process's exporter writes its spans, the consumer's spans are in the
// producer's traces, and /metrics serves the handler and queue metrics.
func TestExample(t *testing.T) {
	m := miniredis.RunT(t)
	rdb := redis.NewClient(&redis.Options{Addr: m.Addr()})
	defer rdb.Close()
	ctx, cancel := context.WithCancel(context.Background())

	var consumerSpans, producerSpans, results bytes.Buffer
	cinst, cshutdown, err := observability.Tracing(&consumerSpans)
	require.NoError(t, err)
	reg := prometheus.NewRegistry()
	ran := make(chan error, 1)
	go func() { ran <- observability.Consume(ctx, rdb, cinst, reg) }()

	pinst, pshutdown, err := observability.Tracing(&producerSpans)
	require.NoError(t, err)
	pctx, pcancel := context.WithTimeout(ctx, 20*time.Second)
	defer pcancel()
	require.NoError(t, observability.Produce(pctx, rdb, pinst, 5, &results))
	require.NoError(t, pshutdown(ctx))
	require.Contains(t, results.String(), `job-0: "HELLO 0" <nil>`)
	require.Contains(t, results.String(), `job-3: "" streamq: request dead-lettered`)

	srv := httptest.NewServer(observability.MetricsHandler(reg))
	defer srv.Close()
	resp, err := srv.Client().Get(srv.URL + "/metrics")
	require.NoError(t, err)
	body, _ := io.ReadAll(resp.Body)
	_ = resp.Body.Close()
	for _, line := range []string{
		`streamq_jobs_processed_total{outcome="ok",queue="observability-example"} 4`,
		`streamq_jobs_processed_total{outcome="dead_letter",queue="observability-example"} 1`,
		`streamq_job_duration_seconds_count{queue="observability-example"} 5`,
		`streamq_dead_letter_entries{queue="observability-example"} 1`,
	} {
		require.Contains(t, string(body), line)
	}
	cancel()
	require.NoError(t, <-ran)
	require.NoError(t, cshutdown(context.Background()))

	traces := func(b *bytes.Buffer, name string) map[string]bool {
		ids := map[string]bool{}
		dec := json.NewDecoder(strings.NewReader(b.String()))
		for dec.More() {
			var s struct {
				Name        string
				SpanContext struct{ TraceID string }
			}
			require.NoError(t, dec.Decode(&s))
			if s.Name == name {
				ids[s.SpanContext.TraceID] = true
			}
		}
		return ids
	}
	sent := traces(&producerSpans, "send "+observability.Queue)
	processed := traces(&consumerSpans, "process "+observability.Queue)
	require.Len(t, sent, 5)
	require.Equal(t, sent, processed, "each consumer span is in its producer's trace")
}
