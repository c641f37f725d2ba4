package doccheck

import (
	"bytes"
	"context"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
)

// repoRoot is the root module's directory: the nearest parent of the test's
// directory whose go.mod declares the root module.
func repoRoot(t *testing.T) string {
	t.Helper()
	dir, err := os.Getwd()
	if err != nil {
		t.Fatal(err)
	}
	for {
		data, err := os.ReadFile(filepath.Join(dir, "go.mod"))
		if err == nil && regexp.MustCompile(`(?m)^module github\.com/streamq/streamq\s*$`).Match(data) {
			return dir
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			t.Fatal("no go.mod of github.com/streamq/streamq above the test's directory")
		}
		dir = parent
	}
}

// markdownFiles lists every Markdown file of the repository, relative to
// root, skipping .git, testdata, node_modules and hidden directories.
func markdownFiles(t *testing.T, root string) []string {
	t.Helper()
	var files []string
	err := filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		name := d.Name()
		if d.IsDir() {
			if p != root && (name == "testdata" || name == "node_modules" || strings.HasPrefix(name, ".") || strings.HasPrefix(name, "_")) {
				return filepath.SkipDir
			}
			return nil
		}
		if strings.EqualFold(filepath.Ext(name), ".md") {
			rel, err := filepath.Rel(root, p)
			if err != nil {
				return err
			}
			files = append(files, filepath.ToSlash(rel))
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	sort.Strings(files)
	return files
}

// docCache parses each Markdown file once.
type docCache struct {
	root string
	mu   sync.Mutex
	docs map[string]Doc
}

func (c *docCache) get(rel string) (Doc, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if d, ok := c.docs[rel]; ok {
		return d, nil
	}
	data, err := os.ReadFile(filepath.Join(c.root, rel))
	if err != nil {
		return Doc{}, err
	}
	d := Parse(data)
	c.docs[rel] = d
	return d, nil
}

// TestLinks checks every relative link of every Markdown file.
func TestLinks(t *testing.T) {
	root := repoRoot(t)
	cache := &docCache{root: root, docs: map[string]Doc{}}
	files := markdownFiles(t, root)
	for _, want := range []string{"README.md", "DESIGN.md", "CHANGELOG.md"} {
		if !contains(files, want) {
			t.Errorf("%s is missing", want)
		}
	}
	checked := 0
	for _, f := range files {
		d, err := cache.get(f)
		if err != nil {
			t.Fatal(err)
		}
		for _, l := range d.Links {
			checked++
			if msg := CheckLink(root, f, l.Target, cache.get); msg != "" {
				t.Errorf("%s:%d: broken link: %s", f, l.Line, msg)
			}
		}
	}
	t.Logf("%d links in %d Markdown files", checked, len(files))
}

// TestLinkCheckerFindsBreakage proves that the link checker fails on a
// missing file, a missing heading and a link out of the repository, and
// follows GitHub's anchor rules.
func TestLinkCheckerFindsBreakage(t *testing.T) {
	root := t.TempDir()
	write := func(rel, text string) {
		t.Helper()
		p := filepath.Join(root, rel)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte(text), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	write("docs/guide.md", "# The guide\n\n## Redis requirements\n\n## `Admin.Jobs` and the CLI\n\n## Twice\n\n## Twice\n\n```sh\n# not a heading\n```\n")
	write("docs/images/a.png", "png")
	write("README.md", "x")
	cache := &docCache{root: root, docs: map[string]Doc{}}
	for target, ok := range map[string]bool{
		"docs/guide.md":                            true,
		"docs/guide.md#redis-requirements":         true,
		"docs/guide.md#adminjobs-and-the-cli":      true,
		"docs/guide.md#twice-1":                    true,
		"docs/guide.md#twice-2":                    false,
		"docs/guide.md#not-a-heading":              false,
		"docs/guide.md#the-guide":                  true,
		"docs/guide.md#security":                   false,
		"docs/images/a.png":                        true,
		"docs/images/b.png":                        false,
		"docs/":                                    true,
		"docs/missing.md":                          false,
		"../outside.md":                            false,
		"https://example.com/nowhere#x":            true,
		"#top":                                     false,
		"docs/guide.md#Redis-Requirements":         true,
		"docs/guide.md?plain=1#redis-requirements": false,
	} {
		msg := CheckLink(root, "README.md", target, cache.get)
		if (msg == "") != ok {
			t.Errorf("CheckLink(%q) = %q, want ok=%v", target, msg, ok)
		}
	}
	d := Parse([]byte("See [a](x.md), ![b](img/b.png \"title\"), `[not](a-link.md)`, [c](<y z.md>) and [d][ref].\n\n[ref]: docs/r.md\n\n```md\n[in](code.md)\n```\n<img src=\"i.png\">\n"))
	var got []string
	for _, l := range d.Links {
		got = append(got, fmt.Sprintf("%d:%s", l.Line, l.Target))
	}
	want := "1:x.md 1:img/b.png 1:y z.md 3:docs/r.md 8:i.png"
	if strings.Join(got, " ") != want {
		t.Errorf("links = %v, want %s", got, want)
	}
}

// goBlockFiles are the Markdown files whose ```go blocks must compile.
func goBlockFiles(t *testing.T, root string) []string {
	files := []string{"README.md"}
	more, err := filepath.Glob(filepath.Join(root, "docs", "*.md"))
	if err != nil {
		t.Fatal(err)
	}
	for _, m := range more {
		rel, _ := filepath.Rel(root, m)
		files = append(files, filepath.ToSlash(rel))
	}
	return files
}

// compiled is one Go block written out as a file to vet.
type compiled struct {
	where string // "README.md:12": the block's opening fence
	dir   string // the block's package directory, relative to its module
	code  string
}

// TestGoBlocks checks that every Go block of README.md and docs/*.md
// compiles: complete files with `go vet`, excerpts against their source.
func TestGoBlocks(t *testing.T) {
	root := repoRoot(t)
	var files []compiled // complete files, vetted in the root module
	blocks := 0
	for _, f := range goBlockFiles(t, root) {
		data, err := os.ReadFile(filepath.Join(root, f))
		if err != nil {
			t.Fatal(err)
		}
		for _, b := range Parse(data).Blocks {
			if b.Lang != "go" && b.Lang != "golang" {
				continue
			}
			blocks++
			where := fmt.Sprintf("%s:%d", f, b.Line)
			m := ParseMarker(b.Marker)
			switch {
			case m.Kind == "excerpt":
				if len(m.Args) < 1 || len(m.Args) > 2 {
					t.Errorf("%s: the marker is <!-- excerpt: PATH [FUNC] -->, not <!-- %s -->", where, b.Marker)
					continue
				}
				fn := ""
				if len(m.Args) == 2 {
					fn = m.Args[1]
				}
				if i, msg := CheckExcerpt(b.Code, filepath.Join(root, filepath.FromSlash(m.Args[0])), fn); msg != "" {
					t.Errorf("%s:%d: the excerpt differs from its source: %s", f, b.Line+1+max(i, 0), strings.ReplaceAll(msg, root+string(filepath.Separator), ""))
				}
			case !IsFile(b.Code):
				t.Errorf("%s: a Go block must be a complete file (starting with a package clause) or carry <!-- excerpt: PATH [FUNC] --> on the line above it", where)
			default:
				files = append(files, compiled{where: where, code: b.Code})
			}
		}
	}
	if blocks == 0 {
		t.Fatal("no Go block found: is the test looking at the right files?")
	}
	if len(files) > 0 {
		for _, msg := range vetBlocks(t, root, files) {
			t.Error(msg)
		}
	}
	t.Logf("%d Go blocks", blocks)
}

// vetBlocks writes each block into a directory of its own under a hidden
// temporary directory of the module in modDir (the root module) and runs one `go vet` over
// them, offline. It returns the problems found, each naming the Markdown
// file and line.
func vetBlocks(t *testing.T, modDir string, blocks []compiled) []string {
	t.Helper()
	tmp, err := os.MkdirTemp(modDir, ".doccheck-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(tmp) })
	args := []string{"vet"}
	for i := range blocks {
		name := fmt.Sprintf("b%03d", i)
		blocks[i].dir = name
		if err := os.Mkdir(filepath.Join(tmp, name), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(tmp, name, "block.go"), []byte(blocks[i].code), 0o644); err != nil {
			t.Fatal(err)
		}
		args = append(args, "./"+filepath.Base(tmp)+"/"+name)
	}
	goCmd, err := exec.LookPath("go")
	if err != nil {
		goCmd = filepath.Join(os.Getenv("GOROOT"), "bin", "go")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, goCmd, args...)
	cmd.Dir = modDir
	cmd.Env = append(os.Environ(), "GOFLAGS=-mod=readonly", "GOPROXY=off", "GOWORK=off", "GOTOOLCHAIN=local")
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Run(); err == nil {
		return nil
	}
	return mapVetOutput(out.String(), filepath.Base(tmp), blocks)
}

// mapVetOutput turns `go vet` output about .doccheck-*/bNNN/block.go:L:C into
// messages naming the Markdown file and line of the block's code.
func mapVetOutput(out, tmpName string, blocks []compiled) []string {
	re := regexp.MustCompile(regexp.QuoteMeta(tmpName) + `/b(\d{3})/block\.go:(\d+)(?::\d+)?:\s*(.*)`)
	var msgs []string
	for _, line := range strings.Split(out, "\n") {
		m := re.FindStringSubmatch(line)
		if m == nil {
			continue
		}
		i, _ := strconv.Atoi(m[1])
		l, _ := strconv.Atoi(m[2])
		if i >= len(blocks) {
			continue
		}
		file, fence, _ := strings.Cut(blocks[i].where, ":")
		start, _ := strconv.Atoi(fence)
		msgs = append(msgs, fmt.Sprintf("%s:%d: the Go block does not compile: %s", file, start+l, m[3]))
	}
	if len(msgs) == 0 {
		msgs = append(msgs, "go vet of the Go blocks failed:\n"+out)
	}
	return msgs
}

// TestBlockCheckerFindsBreakage proves that a block that does not compile,
// an excerpt that is not in its source and an unmarked fragment are caught,
// with the Markdown line.
func TestBlockCheckerFindsBreakage(t *testing.T) {
	root := repoRoot(t)
	if testing.Short() {
		t.Skip("runs go vet")
	}
	msgs := vetBlocks(t, root, []compiled{
		{where: "docs/x.md:10", code: "package x\n\nimport \"github.com/streamq/streamq\"\n\nvar _ = streamq.NoSuchThing\n"},
		{where: "docs/x.md:30", code: "package y\n\nfunc f() {}\n"},
	})
	if len(msgs) != 1 || !strings.HasPrefix(msgs[0], "docs/x.md:15: the Go block does not compile") {
		t.Errorf("vet messages = %q, want one at docs/x.md:15", msgs)
	}
	src := filepath.Join(t.TempDir(), "src.go")
	if err := os.WriteFile(src, []byte("package p\n\nfunc F() {\n\ta := 1\n\tb := a\n\t_ = b\n}\n\nfunc G() { c := 2; _ = c }\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		code, fn string
		ok       bool
	}{
		{"a := 1\n...\n_ = b\n", "F", true},
		{"_ = b\na := 1\n", "F", false}, // order
		{"a := 1\n", "G", false},
		{"a := 1\n", "", true},
		{"a := 2\n", "", false},
		{"a := 1\n", "H", false},
	} {
		if _, msg := CheckExcerpt(tc.code, src, tc.fn); (msg == "") != tc.ok {
			t.Errorf("CheckExcerpt(%q, %q) = %q, want ok=%v", tc.code, tc.fn, msg, tc.ok)
		}
	}
	if IsFile("x := 1\n") || !IsFile("// Comment.\n\npackage main\n") {
		t.Error("IsFile is wrong")
	}
	if m := ParseMarker("excerpt: example_test.go ExampleNewQueue"); m.Kind != "excerpt" || len(m.Args) != 2 {
		t.Errorf("ParseMarker = %+v", m)
	}
}

func contains(list []string, s string) bool {
	for _, x := range list {
		if x == s {
			return true
		}
	}
	return false
}
