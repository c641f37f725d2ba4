package streamqotel_test

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/streamq/streamq"
	"github.com/streamq/streamq/streamqotel"
)

// Environment of the producer subprocess (TestProducerProcess).
const (
	envRedis = "STREAMQOTEL_TEST_REDIS"
	envQueue = "STREAMQOTEL_TEST_QUEUE"
)

// tracing returns an in-memory exporter and a provider that exports to it
// synchronously, shut down with the test.
func tracing(t *testing.T) (*tracetest.InMemoryExporter, *sdktrace.TracerProvider) {
	exp := tracetest.NewInMemoryExporter()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSyncer(exp))
	t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
	return exp, tp
}

func client(t *testing.T, addr string) *redis.Client {
	c := redis.NewClient(&redis.Options{Addr: addr})
	t.Cleanup(func() { _ = c.Close() })
	return c
}

// TestProducerProcess is the producer of TestTraceAcrossProcesses, run in a
// subprocess; run directly, it does nothing. It produces one request with its
// own tracer provider and prints the send span's context.
func TestProducerProcess(t *testing.T) {
	addr := os.Getenv(envRedis)
	if addr == "" {
		t.Skip("the producer subprocess of TestTraceAcrossProcesses")
	}
	exp, tp := tracing(t)
	inst, err := streamqotel.New(streamqotel.WithTracerProvider(tp), streamqotel.WithPropagators(propagation.TraceContext{}))
	require.NoError(t, err)
	p, err := streamq.NewProducer[string, string](client(t, addr), os.Getenv(envQueue),
		&streamq.ProducerOptions{Interceptors: []streamq.ProduceInterceptor{inst.Interceptor()}})
	require.NoError(t, err)
	defer p.Close()
	require.NoError(t, p.Enqueue(context.Background(), "job-1", "hello"))
	spans := exp.GetSpans()
	require.Len(t, spans, 1)
	sc := spans[0].SpanContext
	fmt.Printf("SPAN %s %s %s %s\n", spans[0].Name, spans[0].SpanKind, sc.TraceID(), sc.SpanID())
	for _, a := range spans[0].Attributes {
		fmt.Printf("ATTR %s=%s\n", a.Key, a.Value.Emit())
	}
}

// TestTraceAcrossProcesses: a request produced in another process is handled
// here under a process span linked to the producer's send span; names and
// attributes follow the messaging conventions.
func TestTraceAcrossProcesses(t *testing.T) {
	for _, parent := range []bool{false, true} {
		t.Run(fmt.Sprintf("parent=%v", parent), func(t *testing.T) {
			m := miniredis.RunT(t)
			q := "traced"
			cmd := exec.Command(os.Args[0], "-test.run=^TestProducerProcess$", "-test.v")
			cmd.Env = append(os.Environ(), envRedis+"="+m.Addr(), envQueue+"="+q)
			out, err := cmd.CombinedOutput()
			require.NoError(t, err, "%s", out)
			var sendName, sendKind, traceID, spanID string
			sendAttrs := map[string]string{}
			sc := bufio.NewScanner(strings.NewReader(string(out)))
			for sc.Scan() {
				f := strings.Fields(sc.Text())
				switch {
				case len(f) == 6 && f[0] == "SPAN":
					sendName, sendKind, traceID, spanID = f[1]+" "+f[2], f[3], f[4], f[5]
				case len(f) == 2 && f[0] == "ATTR":
					k, v, _ := strings.Cut(f[1], "=")
					sendAttrs[k] = v
				}
			}
			require.NotEmpty(t, spanID, "producer output: %s", out)
			require.Equal(t, "send "+q, sendName)
			require.Equal(t, "producer", sendKind)
			require.Equal(t, map[string]string{
				"messaging.system": "streamq", "messaging.operation.name": "send", "messaging.operation.type": "send",
				"messaging.destination.name": q, "messaging.message.id": "job-1",
				"messaging.streamq.message.entry_id": sendAttrs["messaging.streamq.message.entry_id"],
			}, sendAttrs)
			require.NotEmpty(t, sendAttrs["messaging.streamq.message.entry_id"])

			exp, tp := tracing(t)
			inst, err := streamqotel.New(streamqotel.WithTracerProvider(tp), streamqotel.WithPropagators(propagation.TraceContext{}),
				streamqotel.WithProcessParent(parent), streamqotel.WithMeterProvider(sdkmetric.NewMeterProvider()))
			require.NoError(t, err)
			done := make(chan string, 1)
			c, err := streamq.NewConsumer(client(t, m.Addr()), q, func(ctx context.Context, msg *streamq.Message[string]) (string, error) {
				done <- trace.SpanContextFromContext(ctx).TraceID().String()
				return "ok", nil
			}, &streamq.ConsumerOptions{Name: "c1", Middleware: []streamq.Middleware{inst.Middleware()}})
			require.NoError(t, err)
			ctx, cancel := context.WithCancel(context.Background())
			ran := make(chan error, 1)
			go func() { ran <- c.Run(ctx) }()
			var handlerTrace string
			select {
			case handlerTrace = <-done:
			case <-time.After(10 * time.Second):
				t.Fatal("the request was not handled")
			}
			cancel()
			require.NoError(t, <-ran)

			spans := exp.GetSpans()
			require.Len(t, spans, 1)
			s := spans[0]
			require.Equal(t, "process "+q, s.Name)
			require.Equal(t, trace.SpanKindConsumer, s.SpanKind)
			require.Equal(t, handlerTrace, s.SpanContext.TraceID().String(), "the handler runs in the process span")
			require.Len(t, s.Links, 1)
			require.Equal(t, traceID, s.Links[0].SpanContext.TraceID().String())
			require.Equal(t, spanID, s.Links[0].SpanContext.SpanID().String())
			if parent {
				require.Equal(t, traceID, s.SpanContext.TraceID().String(), "one trace from producer to consumer")
				require.Equal(t, spanID, s.Parent.SpanID().String())
			} else {
				require.NotEqual(t, traceID, s.SpanContext.TraceID().String(), "a new trace, linked")
				require.False(t, s.Parent.IsValid())
			}
			attrs := map[attribute.Key]attribute.Value{}
			for _, a := range s.Attributes {
				attrs[a.Key] = a.Value
			}
			require.Equal(t, "streamq", attrs["messaging.system"].AsString())
			require.Equal(t, "process", attrs["messaging.operation.name"].AsString())
			require.Equal(t, "process", attrs["messaging.operation.type"].AsString())
			require.Equal(t, q, attrs["messaging.destination.name"].AsString())
			require.Equal(t, streamq.DefaultGroup, attrs["messaging.consumer.group.name"].AsString())
			require.Equal(t, "c1", attrs["messaging.client.id"].AsString())
			require.Equal(t, "0", attrs["messaging.destination.partition.id"].AsString())
			require.Equal(t, "job-1", attrs["messaging.message.id"].AsString())
			require.Equal(t, sendAttrs["messaging.streamq.message.entry_id"], attrs["messaging.streamq.message.entry_id"].AsString())
			require.EqualValues(t, 1, attrs["messaging.streamq.message.delivery_count"].AsInt64())
			require.Equal(t, "ok", attrs["messaging.streamq.outcome"].AsString())
			require.Equal(t, codes.Unset, s.Status.Code)
		})
	}
}

// TestBatchSpansAndFailures: a batch gets a send CLIENT span and a create
// PRODUCER span per message, whose contexts the messages carry; failures
// set error.type and the outcome.
func TestBatchSpansAndFailures(t *testing.T) {
	m := miniredis.RunT(t)
	rdb := client(t, m.Addr())
	exp, tp := tracing(t)
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	inst, err := streamqotel.New(streamqotel.WithTracerProvider(tp), streamqotel.WithMeterProvider(mp),
		streamqotel.WithPropagators(propagation.TraceContext{}))
	require.NoError(t, err)
	q := "batch"
	ctx := context.Background()
	p, err := streamq.NewProducer[string, string](rdb, q, &streamq.ProducerOptions{Interceptors: []streamq.ProduceInterceptor{inst.Interceptor()}})
	require.NoError(t, err)
	defer p.Close()
	prs, err := p.ProduceBatch(ctx, []streamq.Job[string]{{ID: "ok", Request: "x"}, {ID: "panic", Request: "x"}, {ID: "fail", Request: "x"}})
	require.NoError(t, err)
	spans := exp.GetSpans()
	require.Len(t, spans, 4)
	creates := map[trace.SpanID]bool{}
	var send tracetest.SpanStub
	for _, s := range spans {
		switch s.Name {
		case "create " + q:
			require.Equal(t, trace.SpanKindProducer, s.SpanKind)
			creates[s.SpanContext.SpanID()] = true
		case "send " + q:
			require.Equal(t, trace.SpanKindClient, s.SpanKind)
			send = s
		}
	}
	require.Len(t, creates, 3)
	require.Contains(t, send.Attributes, attribute.Int("messaging.batch.message_count", 3))
	exp.Reset()

	links := make(chan trace.SpanID, 4)
	c, err := streamq.NewConsumer(rdb, q, func(ctx context.Context, msg *streamq.Message[string]) (string, error) {
		links <- trace.SpanContextFromContext(propagation.TraceContext{}.Extract(ctx, propagation.MapCarrier(msg.Headers))).SpanID()
		switch msg.ID {
		case "panic":
			panic("boom")
		case "fail":
			return "", streamq.Permanent(errors.New("no"))
		}
		return "done", nil
	}, &streamq.ConsumerOptions{Middleware: []streamq.Middleware{inst.Middleware()}, MaxDeliveries: 2, RetryBackoff: time.Millisecond})
	require.NoError(t, err)
	cctx, cancel := context.WithCancel(ctx)
	ran := make(chan error, 1)
	go func() { ran <- c.Run(cctx) }()
	wctx, wcancel := context.WithTimeout(ctx, 10*time.Second)
	defer wcancel()
	for _, pr := range prs {
		_, err := pr.Wait(wctx)
		if pr.ID() != "ok" {
			require.ErrorIs(t, err, streamq.ErrDeadLettered)
		}
	}
	cancel()
	require.NoError(t, <-ran)
	for range 4 { // the panicking request runs twice
		require.True(t, creates[<-links], "each message carries its create span's context")
	}
	byID := map[string]tracetest.SpanStub{}
	for _, s := range exp.GetSpans() {
		for _, a := range s.Attributes {
			if a.Key == "messaging.message.id" {
				byID[a.Value.AsString()] = s
			}
		}
	}
	require.Len(t, byID, 3)
	require.Equal(t, codes.Error, byID["panic"].Status.Code)
	require.Contains(t, byID["panic"].Attributes, attribute.String("error.type", "panic"))
	require.Contains(t, byID["panic"].Attributes, attribute.String("messaging.streamq.outcome", "dead_letter"), "the last run")
	require.Contains(t, byID["fail"].Attributes, attribute.String("error.type", "_OTHER"))
	require.Contains(t, byID["fail"].Attributes, attribute.String("messaging.streamq.outcome", "dead_letter"))
	require.Contains(t, byID["ok"].Attributes, attribute.String("messaging.streamq.outcome", "ok"))

	var rm metricdata.ResourceMetrics
	require.NoError(t, reader.Collect(ctx, &rm))
	got := map[string]metricdata.Aggregation{}
	for _, sm := range rm.ScopeMetrics {
		require.Equal(t, streamqotel.ScopeName, sm.Scope.Name)
		for _, mm := range sm.Metrics {
			got[mm.Name] = mm.Data
		}
	}
	sent := got["messaging.client.sent.messages"].(metricdata.Sum[int64])
	require.EqualValues(t, 3, sent.DataPoints[0].Value)
	outcomes := map[string]int64{}
	for _, dp := range got["streamq.process.messages"].(metricdata.Sum[int64]).DataPoints {
		v, _ := dp.Attributes.Value("messaging.streamq.outcome")
		outcomes[v.AsString()] += dp.Value
	}
	require.Equal(t, map[string]int64{"ok": 1, "retry": 1, "dead_letter": 2}, outcomes)
	var processed uint64
	for _, dp := range got["messaging.process.duration"].(metricdata.Histogram[float64]).DataPoints {
		processed += dp.Count
	}
	require.EqualValues(t, outcomes["ok"]+outcomes["dead_letter"]+outcomes["retry"], processed)
	var waited uint64
	for _, dp := range got["streamq.queue.wait.duration"].(metricdata.Histogram[float64]).DataPoints {
		waited += dp.Count
	}
	require.EqualValues(t, processed, waited)
}

// TestQueueGauges: the observable gauges equal Admin.Stats.
func TestQueueGauges(t *testing.T) {
	m := miniredis.RunT(t)
	rdb := client(t, m.Addr())
	ctx := context.Background()
	q := "gauged"
	p, err := streamq.NewProducer[string, string](rdb, q, nil)
	require.NoError(t, err)
	defer p.Close()
	for i := range 7 {
		require.NoError(t, p.Enqueue(ctx, fmt.Sprint(i), "x"))
	}
	require.NoError(t, p.Enqueue(ctx, "later", "x", streamq.After(time.Hour)))
	c, err := streamq.NewConsumer(rdb, q, func(ctx context.Context, msg *streamq.Message[string]) (string, error) { return "", nil }, nil)
	require.NoError(t, err)
	_ = c // not run: the group does not exist yet, so lag and pending are not reported
	a, err := streamq.NewAdmin(rdb, q, nil)
	require.NoError(t, err)
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	inst, err := streamqotel.New(streamqotel.WithMeterProvider(mp), streamqotel.WithStatsMaxAge(0))
	require.NoError(t, err)
	reg, err := inst.ObserveQueues(a)
	require.NoError(t, err)
	defer reg.Unregister()

	require.NoError(t, a.Cancel(ctx, "later"))
	st, err := a.Stats(ctx)
	require.NoError(t, err)
	require.EqualValues(t, 1, st.Canceled)
	var rm metricdata.ResourceMetrics
	require.NoError(t, reader.Collect(ctx, &rm))
	got := map[string]int64{}
	for _, sm := range rm.ScopeMetrics {
		for _, mm := range sm.Metrics {
			switch d := mm.Data.(type) {
			case metricdata.Gauge[int64]:
				for _, dp := range d.DataPoints {
					got[mm.Name] += dp.Value
				}
			case metricdata.Sum[int64]: // streamq.queue.canceled, a counter
				for _, dp := range d.DataPoints {
					got[mm.Name] += dp.Value
				}
			}
		}
	}
	require.EqualValues(t, 7, st.Length)
	require.Equal(t, st.Length, got["streamq.queue.length"])
	require.Equal(t, st.DeadLetters, got["streamq.queue.dead_letters"])
	require.Equal(t, st.Scheduled, got["streamq.queue.scheduled"])
	_, exported := got["streamq.queue.canceled"]
	require.True(t, exported, "streamq.queue.canceled is exported")
	require.Equal(t, st.Canceled, got["streamq.queue.canceled"])
}

// TestFlowSpans: a flow is one send span with a create span per request
// (the parent, and each child with its own queue); every request's handler,
// the parent's included, reads the context of its own create span, all in
// the send span's trace.
func TestFlowSpans(t *testing.T) {
	m := miniredis.RunT(t)
	rdb := client(t, m.Addr())
	exp, tp := tracing(t)
	inst, err := streamqotel.New(streamqotel.WithTracerProvider(tp), streamqotel.WithPropagators(propagation.TraceContext{}))
	require.NoError(t, err)
	ctx := context.Background()
	parentQ := streamq.NewQueue[string, string]("flowparent")
	childQ := streamq.NewQueue[string, string]("flowchild")
	p, err := parentQ.NewProducer(rdb, &streamq.ProducerOptions{Interceptors: []streamq.ProduceInterceptor{inst.Interceptor()}})
	require.NoError(t, err)
	defer p.Close()
	pr, err := p.ProduceFlow(ctx, "parent", "x", []streamq.Child{
		streamq.ChildOf(childQ, "c1", "x"), streamq.ChildOf(childQ, "c2", "x", streamq.Priority(streamq.PriorityHigh)),
	}, nil)
	require.NoError(t, err)
	creates := map[string]trace.SpanContext{} // request id -> its create span
	names := map[string]string{}              // request id -> its create span's name
	var send tracetest.SpanStub
	for _, s := range exp.GetSpans() {
		switch s.Name {
		case "create flowparent", "create flowchild":
			for _, a := range s.Attributes {
				if a.Key == "messaging.message.id" {
					creates[a.Value.AsString()] = s.SpanContext
					names[a.Value.AsString()] = s.Name
				}
			}
		case "send flowparent":
			send = s
		}
	}
	require.Equal(t, map[string]string{"parent": "create flowparent", "c1": "create flowchild", "c2": "create flowchild"}, names,
		"a create span per request of the flow, named by its queue")
	require.True(t, send.SpanContext.IsValid())
	type seen struct {
		id string
		sc trace.SpanContext
	}
	got := make(chan seen, 3)
	handler := func(ctx context.Context, msg *streamq.Message[string]) (string, error) {
		got <- seen{msg.ID, trace.SpanContextFromContext(propagation.TraceContext{}.Extract(ctx, propagation.MapCarrier(msg.Headers)))}
		return "", nil
	}
	cctx, cancel := context.WithCancel(ctx)
	defer cancel()
	for _, q := range []streamq.Queue[string, string]{parentQ, childQ} {
		c, err := q.NewConsumer(rdb, handler, nil)
		require.NoError(t, err)
		go func() { _ = c.Run(cctx) }()
	}
	wctx, wcancel := context.WithTimeout(ctx, 10*time.Second)
	defer wcancel()
	_, err = pr.Wait(wctx)
	require.NoError(t, err)
	for range 3 {
		s := <-got
		require.Equal(t, creates[s.id].SpanID(), s.sc.SpanID(), "%s carries its create span's context", s.id)
		require.Equal(t, send.SpanContext.TraceID(), s.sc.TraceID(), "%s is in the flow's trace", s.id)
	}
}
