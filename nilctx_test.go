package streamq

import (
	"bytes"
	"context"
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"sort"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// nilCtxChildEnv makes the test binary run TestNilContextConsumerRun's child
// part: Consumer.Run(nil) in a process of its own, so that a panic in a
// background goroutine (which no recover can stop) ends that process, not
// the test run.
const nilCtxChildEnv = "STREAMQ_TEST_NILCTX_CHILD"

// Consumer.Run(nil) panics in the caller's goroutine, where the caller can
// recover it, and starts nothing. It used to start its set-up goroutine
// first, whose Redis call panicked on the nil context and killed the process.
func TestNilContextConsumerRun(t *testing.T) {
	if os.Getenv(nilCtxChildEnv) == "1" {
		nilContextConsumerRunChild(t)
		return
	}
	cmd := exec.Command(os.Args[0], "-test.run=^TestNilContextConsumerRun$", "-test.v", "-test.count=1")
	cmd.Env = append(os.Environ(), nilCtxChildEnv+"=1")
	out, err := cmd.CombinedOutput()
	require.NoError(t, err, "the child process failed; its output:\n%s", out)
	require.Contains(t, string(out), "recovered: streamq: nil Context passed to Consumer.Run", "child output:\n%s", out)
}

func nilContextConsumerRunChild(t *testing.T) {
	client, _ := miniRedis(t)
	c, err := NewConsumer(client, queueName(t), func(ctx context.Context, m *Message[string]) (string, error) {
		return m.Payload, nil
	}, &ConsumerOptions{Logger: testLogger(t)})
	require.NoError(t, err)
	got := func() (v any) {
		defer func() { v = recover() }()
		//lint:ignore SA1012 a nil context on purpose
		_ = c.Run(nil) //nolint:staticcheck // a nil context on purpose
		return nil
	}()
	// Whatever Run started must end without crashing the process.
	c.waitBackground()
	fmt.Printf("recovered: %v\n", got)
	require.Equal(t, "streamq: nil Context passed to Consumer.Run; use context.Background()", got)

	// The consumer is still usable: a Run with a context starts and stops.
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	<-c.Ready()
	cancel()
	require.NoError(t, <-done)
	c.waitBackground()
}

// nilCtxReceivers are values of every type whose exported methods take a
// context, as a caller gets them. TestNilContextEveryMethod walks their
// methods by reflection and checks against the source that no type is
// missing.
func nilCtxReceivers(t *testing.T) []any {
	client, _ := miniRedis(t)
	q := queueName(t)
	ctx := context.Background()
	p, err := NewProducer[string, string](client, q, &ProducerOptions{Logger: testLogger(t)})
	require.NoError(t, err)
	t.Cleanup(func() { _ = p.Close() })
	promise, err := p.Produce(ctx, "one", "x")
	require.NoError(t, err)
	t.Cleanup(promise.Release)
	c, err := NewConsumer(client, q, func(ctx context.Context, m *Message[string]) (string, error) {
		return m.Payload, nil
	}, &ConsumerOptions{Logger: testLogger(t)})
	require.NoError(t, err)
	a, err := NewAdmin(client, q, nil)
	require.NoError(t, err)
	pd, err := NewPeriodic(p, &PeriodicOptions{Logger: testLogger(t)})
	require.NoError(t, err)
	c2, err := NewConsumer(client, q+"-2", func(ctx context.Context, m *Message[string]) (string, error) {
		return m.Payload, nil
	}, &ConsumerOptions{Logger: testLogger(t)})
	require.NoError(t, err)
	mc, err := NewMultiConsumer(nil, MultiQueue{Consumer: c2})
	require.NoError(t, err)
	fetched := func(ctx context.Context, e Entry) ([]byte, error) { return e.Data, nil }
	return []any{
		mc,
		p,
		promise,
		c,
		a,
		pd,
		NewQueue[string, string](q),
		InlineFetcher{},
		FetcherFunc(fetched),
		&CacheFetcher{Client: client, DeleteOnComplete: true},
		WrapFetcher(&CacheFetcher{Client: client, DeleteOnComplete: true}, nil),
		&Message[string]{},
	}
}

// nilCtxFuncs holds every exported package-level function that takes a
// context, called with a nil one. TestNilContextEveryMethod checks the list
// against the source.
func nilCtxFuncs(t *testing.T) map[string]func() {
	client, _ := miniRedis(t)
	return map[string]func(){
		"Queues": func() { _, _ = Queues(nil, client) }, //nolint:staticcheck // a nil context on purpose
	}
}

var contextType = reflect.TypeFor[context.Context]()

// Every exported method or function that takes a context panics in the
// caller's goroutine when given a nil one, with the message of mustContext
// naming it, before it does anything else, as the producer's methods always
// did. The methods are found by reflection over nilCtxReceivers, and the
// source files are read to check that every such method and function
// declared in the package is covered, so a new one fails here until it
// checks its context.
func TestNilContextEveryMethod(t *testing.T) {
	declared := declaredContextFuncs(t)
	covered := map[string]bool{}
	call := func(name string, fn func()) {
		t.Helper()
		covered[name] = true
		got := func() (v any) {
			defer func() { v = recover() }()
			fn()
			return nil
		}()
		want := "streamq: nil Context passed to " + name + "; use context.Background()"
		if got != want {
			t.Errorf("%s(nil, ...): got panic %v, want %q", name, got, want)
		}
	}
	for _, recv := range nilCtxReceivers(t) {
		v := reflect.ValueOf(recv)
		rt := v.Type()
		if rt.Kind() == reflect.Pointer {
			rt = rt.Elem()
		}
		typeName := rt.Name()
		if i := strings.Index(typeName, "["); i >= 0 {
			typeName = typeName[:i] // Producer[string,string] -> Producer
		}
		for i := range v.NumMethod() {
			m := v.Type().Method(i)
			mt := m.Type // with the receiver first
			if mt.NumIn() < 2 || mt.In(1) != contextType {
				continue
			}
			args := make([]reflect.Value, mt.NumIn()-1)
			for j := range args {
				args[j] = reflect.Zero(mt.In(j + 1))
			}
			method := v.Method(i)
			call(typeName+"."+m.Name, func() {
				if mt.IsVariadic() {
					method.CallSlice(args)
				} else {
					method.Call(args)
				}
			})
		}
	}
	for name, fn := range nilCtxFuncs(t) {
		call(name, fn)
	}
	var missing []string
	for name := range declared {
		if !covered[name] {
			missing = append(missing, name)
		}
	}
	sort.Strings(missing)
	require.Empty(t, missing, "exported functions or methods taking a context that no value of nilCtxReceivers or entry of nilCtxFuncs reaches: add them")
}

// declaredContextFuncs parses the package's non-test source files and returns
// every exported function and every exported method (on any receiver type:
// an unexported one can be reached through an interface) with a
// context.Context parameter, as "Func" or "Type.Method". It fails the test
// when the context is not the first parameter.
func declaredContextFuncs(t *testing.T) map[string]bool {
	t.Helper()
	files, err := filepath.Glob("*.go")
	require.NoError(t, err)
	fset := token.NewFileSet()
	found := map[string]bool{}
	for _, name := range files {
		if strings.HasSuffix(name, "_test.go") {
			continue
		}
		f, err := parser.ParseFile(fset, name, nil, parser.SkipObjectResolution)
		require.NoError(t, err)
		for _, d := range f.Decls {
			fd, ok := d.(*ast.FuncDecl)
			if !ok || !fd.Name.IsExported() {
				continue
			}
			first, pos := -1, 0
			for _, field := range fd.Type.Params.List {
				if isContextExpr(field.Type) && first < 0 {
					first = pos
				}
				pos += max(len(field.Names), 1)
			}
			if first < 0 {
				continue
			}
			full := fd.Name.Name
			if fd.Recv != nil {
				full = receiverName(fd.Recv.List[0].Type) + "." + full
			}
			if first != 0 {
				t.Errorf("%s: %s takes a context.Context that is not its first parameter", fset.Position(fd.Pos()), full)
			}
			found[full] = true
		}
	}
	require.NotEmpty(t, found)
	return found
}

// isContextExpr reports whether e is context.Context.
func isContextExpr(e ast.Expr) bool {
	sel, ok := e.(*ast.SelectorExpr)
	if !ok {
		return false
	}
	pkg, ok := sel.X.(*ast.Ident)
	return ok && pkg.Name == "context" && sel.Sel.Name == "Context"
}

// receiverName returns the type name of a receiver expression: T, *T, T[A],
// *T[A, B] all give T.
func receiverName(e ast.Expr) string {
	for {
		switch x := e.(type) {
		case *ast.StarExpr:
			e = x.X
		case *ast.IndexExpr:
			e = x.X
		case *ast.IndexListExpr:
			e = x.X
		case *ast.ParenExpr:
			e = x.X
		case *ast.Ident:
			return x.Name
		default:
			var b bytes.Buffer
			_ = ast.Fprint(&b, nil, e, nil)
			return b.String()
		}
	}
}
