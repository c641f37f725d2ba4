package streamqtest_test

import (
	"go/ast"
	"go/parser"
	"go/token"
	"path/filepath"
	"sort"
	"strings"
	"testing"

	"github.com/streamq/streamq/streamqtest"
)

// Every exported function of the package that takes a context panics in the
// caller's goroutine when given a nil one, naming itself, before it does
// anything, as streamq's methods do. The table is checked against the source
// files, so a new function fails here until it is added (and checks its
// context).
func TestNilContextEveryFunction(t *testing.T) {
	client, _ := streamqtest.NewMiniredis(t)
	// Nil contexts on purpose (staticcheck SA1012 flags them, rightly).
	calls := map[string]func(){
		"Drain": func() { streamqtest.Drain(nil, t, client, "q", idle{}, nil) },
		"RequireProduced": func() {
			streamqtest.RequireProduced(nil, t, client, "q", "id", nil)
		},
		"RequireNotProduced":  func() { streamqtest.RequireNotProduced(nil, t, client, "q", "id") },
		"RequireDeadLettered": func() { streamqtest.RequireDeadLettered(nil, t, client, "q", "id") },
	}
	for name, fn := range calls {
		got := func() (v any) {
			defer func() { v = recover() }()
			fn()
			return nil
		}()
		want := "streamqtest: nil Context passed to " + name + "; use context.Background()"
		if got != want {
			t.Errorf("%s(nil, ...): got panic %v, want %q", name, got, want)
		}
	}

	files, err := filepath.Glob("*.go")
	if err != nil {
		t.Fatal(err)
	}
	fset := token.NewFileSet()
	var missing []string
	for _, name := range files {
		if strings.HasSuffix(name, "_test.go") {
			continue
		}
		f, err := parser.ParseFile(fset, name, nil, parser.SkipObjectResolution)
		if err != nil {
			t.Fatal(err)
		}
		for _, d := range f.Decls {
			fd, ok := d.(*ast.FuncDecl)
			if !ok || !fd.Name.IsExported() || !takesContext(fd.Type) {
				continue
			}
			full := fd.Name.Name
			if fd.Recv != nil {
				full = "method " + full // no table entry can cover it: add a receiver walk
			}
			if calls[full] == nil {
				missing = append(missing, fset.Position(fd.Pos()).String()+": "+full)
			}
		}
	}
	sort.Strings(missing)
	if len(missing) > 0 {
		t.Errorf("exported functions taking a context missing from the table: %v", missing)
	}
}

// takesContext reports whether a function type has a context.Context
// parameter.
func takesContext(ft *ast.FuncType) bool {
	for _, field := range ft.Params.List {
		if sel, ok := field.Type.(*ast.SelectorExpr); ok {
			if pkg, ok := sel.X.(*ast.Ident); ok && pkg.Name == "context" && sel.Sel.Name == "Context" {
				return true
			}
		}
	}
	return false
}
