package streamq_test

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"

	"github.com/streamq/streamq"
)

type tenantKey struct{}

// A producer interceptor copies a tenant from the context into the request's
// headers; a consumer middleware, written once for every queue type, puts it
// back into the handler's context and reports each run.
func ExampleMiddleware() {
	srv := miniredis.NewMiniRedis()
	if err := srv.Start(); err != nil {
		panic(err)
	}
	defer srv.Close()
	client := redis.NewClient(&redis.Options{Addr: srv.Addr()})
	defer client.Close()
	ctx := context.Background()

	tenantHeader := func(ctx context.Context, msgs []*streamq.Outgoing, next func(context.Context) error) error {
		if t, ok := ctx.Value(tenantKey{}).(string); ok {
			for _, m := range msgs {
				if m.Headers == nil {
					m.Headers = map[string]string{}
				}
				m.Headers["tenant"] = t
			}
		}
		return next(ctx)
	}
	report := func(ctx context.Context, d *streamq.Delivery, next func(context.Context) error) error {
		err := next(context.WithValue(ctx, tenantKey{}, d.Headers["tenant"]))
		fmt.Printf("%s %s delivery %d: err=%v final=%v\n", d.Queue, d.ID, d.Deliveries, err, d.Final(err))
		return err
	}

	p, err := streamq.NewProducer[resizeRequest, resizeResult](client, "thumbnails", &streamq.ProducerOptions{
		Interceptors: []streamq.ProduceInterceptor{tenantHeader}})
	if err != nil {
		panic(err)
	}
	defer p.Close()
	c, err := streamq.NewConsumer(client, "thumbnails", func(ctx context.Context, m *streamq.Message[resizeRequest]) (resizeResult, error) {
		if m.Payload.Width <= 0 {
			return resizeResult{}, streamq.Permanent(errors.New("width must be positive"))
		}
		return resizeResult{Thumbnail: fmt.Sprintf("%s/%s@%dw", ctx.Value(tenantKey{}), m.Payload.Image, m.Payload.Width)}, nil
	}, &streamq.ConsumerOptions{Middleware: []streamq.Middleware{report}, Logger: quiet})
	if err != nil {
		panic(err)
	}
	stop := startConsumer(c)
	defer stop()

	tctx := context.WithValue(ctx, tenantKey{}, "acme")
	for _, job := range []struct {
		id string
		w  int
	}{{"cat", 64}, {"dog", 0}} {
		pr, err := p.Produce(tctx, job.id, resizeRequest{Image: job.id + ".png", Width: job.w})
		if err != nil {
			panic(err)
		}
		res, err := pr.Wait(ctx)
		fmt.Printf("%s: %q %v\n", job.id, res.Thumbnail, err)
	}
	// Output:
	// thumbnails cat delivery 1: err=<nil> final=true
	// cat: "acme/cat.png@64w" <nil>
	// thumbnails dog delivery 1: err=width must be positive final=true
	// dog: "" streamq: request dead-lettered: width must be positive
}

// A request with a deadline that has passed never runs: its callers get
// ErrDeadlineExceeded.
func ExampleDeadline() {
	srv := miniredis.NewMiniRedis()
	if err := srv.Start(); err != nil {
		panic(err)
	}
	defer srv.Close()
	client := redis.NewClient(&redis.Options{Addr: srv.Addr()})
	defer client.Close()
	ctx := context.Background()

	p, err := streamq.NewProducer[resizeRequest, resizeResult](client, "thumbnails", nil)
	if err != nil {
		panic(err)
	}
	defer p.Close()
	pr, err := p.Produce(ctx, "late", resizeRequest{Image: "late.png", Width: 64}, streamq.Deadline(time.Now().Add(-time.Minute)))
	if err != nil {
		panic(err)
	}
	c, err := streamq.NewConsumer(client, "thumbnails", resize, &streamq.ConsumerOptions{Logger: quiet})
	if err != nil {
		panic(err)
	}
	stop := startConsumer(c)
	defer stop()
	_, err = pr.Wait(ctx)
	fmt.Println(errors.Is(err, streamq.ErrDeadlineExceeded), errors.Is(err, streamq.ErrDeadLettered))
	// Output:
	// true true
}
