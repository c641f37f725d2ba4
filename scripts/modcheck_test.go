// Package scripts holds the repository's developer scripts; its tests check
// the scripts' failure paths on small throwaway git repositories.
package scripts

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// gitRepo makes a git repository in a temporary directory with a core module
// and one nested module whose go.mod requires the core module at the version
// requireVersion returns, given the hash of the first (core-only) commit.
func gitRepo(t *testing.T, requireVersion func(first string) string) string {
	t.Helper()
	if _, err := exec.LookPath("git"); err != nil {
		t.Skip("git not installed")
	}
	dir := t.TempDir()
	run := func(args ...string) string {
		t.Helper()
		cmd := exec.Command(args[0], args[1:]...)
		cmd.Dir = dir
		cmd.Env = append(os.Environ(), "GIT_AUTHOR_NAME=t", "GIT_AUTHOR_EMAIL=t@example.com",
			"GIT_COMMITTER_NAME=t", "GIT_COMMITTER_EMAIL=t@example.com", "TZ=UTC")
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("%v: %v\n%s", args, err, out)
		}
		return strings.TrimSpace(string(out))
	}
	write := func(name, text string) {
		t.Helper()
		p := filepath.Join(dir, name)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte(text), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	run("git", "init", "-q")
	write("go.mod", "module github.com/streamq/streamq\n\ngo 1.22\n")
	write("core.go", "package streamq\n")
	run("git", "add", ".")
	run("git", "commit", "-q", "-m", "core")
	first := run("git", "rev-parse", "HEAD")
	write("nested/go.mod", "module github.com/streamq/streamq/nested\n\ngo 1.22\n\n"+
		"require github.com/streamq/streamq "+requireVersion(first)+"\n\n"+
		"replace github.com/streamq/streamq => ../\n")
	write("nested/nested.go", "package nested\n\nimport _ \"github.com/streamq/streamq\"\n")
	run("git", "add", ".")
	run("git", "commit", "-q", "-m", "nested")
	return dir
}

func modcheck(t *testing.T, dir string) (string, error) {
	t.Helper()
	script, err := filepath.Abs("modcheck.sh")
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command("bash", script, "check")
	cmd.Dir = dir
	out, err := cmd.CombinedOutput()
	return string(out), err
}

func TestModcheckRefusesPlaceholder(t *testing.T) {
	dir := gitRepo(t, func(string) string { return "v0.0.0-00010101000000-000000000000" })
	out, err := modcheck(t, dir)
	if err == nil {
		t.Fatalf("modcheck passed a nested module at the placeholder version:\n%s", out)
	}
	if !strings.Contains(out, "placeholder") || !strings.Contains(out, "make pin") {
		t.Fatalf("modcheck output does not name the placeholder and `make pin`:\n%s", out)
	}
}

func TestModcheckRefusesUnknownCommit(t *testing.T) {
	dir := gitRepo(t, func(string) string { return "v0.0.0-20260101000000-0123456789ab" })
	out, err := modcheck(t, dir)
	if err == nil {
		t.Fatalf("modcheck passed a pin to a commit that does not exist:\n%s", out)
	}
	if !strings.Contains(out, "no commit 0123456789ab") || !strings.Contains(out, "make pin") {
		t.Fatalf("modcheck output does not name the missing commit and `make pin`:\n%s", out)
	}
}

func TestModcheckRefusesWrongTimestamp(t *testing.T) {
	dir := gitRepo(t, func(first string) string { return "v0.0.0-20000101000000-" + first[:12] })
	out, err := modcheck(t, dir)
	if err == nil {
		t.Fatalf("modcheck passed a pseudo-version with a wrong time:\n%s", out)
	}
	if !strings.Contains(out, "pseudo-version is v0.0.0-") {
		t.Fatalf("modcheck output does not give the right pseudo-version:\n%s", out)
	}
}

// TestPinWritesHeadPseudoVersion pins the nested module with `pin` and checks
// that go.mod then requires HEAD and keeps the development replace. (The go
// get stage of `check` runs in `make modcheck` on the real repository.)
func TestPinWritesHeadPseudoVersion(t *testing.T) {
	dir := gitRepo(t, func(string) string { return "v0.0.0-00010101000000-000000000000" })
	script, _ := filepath.Abs("modcheck.sh")
	cmd := exec.Command("bash", script, "pin")
	cmd.Dir = dir
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("pin: %v\n%s", err, out)
	}
	head, err := exec.Command("git", "-C", dir, "rev-parse", "--short=12", "HEAD").Output()
	if err != nil {
		t.Fatal(err)
	}
	gomod, err := os.ReadFile(filepath.Join(dir, "nested", "go.mod"))
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(gomod), "-"+strings.TrimSpace(string(head))) {
		t.Fatalf("pin did not require HEAD (%s):\n%s", head, gomod)
	}
	if !strings.Contains(string(gomod), "replace github.com/streamq/streamq => ../") {
		t.Fatalf("pin dropped the development replace:\n%s", gomod)
	}
}
