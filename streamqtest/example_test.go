package streamqtest_test

import (
	"context"
	"fmt"

	"github.com/streamq/streamq"
	"github.com/streamq/streamq/streamqtest"
)

// exampleT stands in for the *testing.T of a real test, which an Example
// does not have: it prints failures and runs cleanups when the Example ends.
type exampleT struct{ cleanups []func() }

func (e *exampleT) Helper()                           {}
func (e *exampleT) Cleanup(f func())                  { e.cleanups = append(e.cleanups, f) }
func (e *exampleT) Logf(format string, args ...any)   { fmt.Printf(format+"\n", args...) }
func (e *exampleT) Fatalf(format string, args ...any) { panic(fmt.Sprintf(format, args...)) }
func (e *exampleT) done() {
	for i := len(e.cleanups) - 1; i >= 0; i-- {
		e.cleanups[i]()
	}
}

// A user's test: produce, drain the queue with the consumer under test, then
// assert what happened. In a real test, pass the test's *testing.T as t.
func Example() {
	t := &exampleT{} // in a real test: func TestGreetings(t *testing.T)
	defer t.done()
	ctx := context.Background()
	client, _ := streamqtest.NewMiniredis(t) // or NewClient(t): a real redis-server when installed

	c, _ := streamq.NewConsumer(client, "greetings", func(ctx context.Context, m *streamq.Message[string]) (string, error) {
		return "hello, " + m.Payload, nil
	}, nil)
	p, _ := streamq.NewProducer[string, string](client, "greetings", nil)
	defer p.Close()
	promise, _ := p.Produce(ctx, "greet-1", "ada")
	streamqtest.RequireProduced(ctx, t, client, "greetings", "greet-1", &streamqtest.RequireOptions{Payload: "ada"})

	streamqtest.Drain(ctx, t, client, "greetings", c, nil)

	got, err := promise.Wait(ctx)
	fmt.Println(got, err)
	info := streamqtest.RequireProduced(ctx, t, client, "greetings", "greet-1", nil)
	fmt.Println(info.State)
	streamqtest.RequireNotProduced(ctx, t, client, "greetings", "greet-2")
	// Output:
	// hello, ada <nil>
	// succeeded
}
