package doccheck

import (
	"bufio"
	"bytes"
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"net/url"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"unicode"
)

// Link is one link or image target found in a Markdown file.
type Link struct {
	Line   int    // 1-based line in the file
	Target string // as written
}

// Block is one fenced code block of a Markdown file.
type Block struct {
	Line   int    // 1-based line of the opening fence
	Lang   string // first word of the info string
	Marker string // the <!-- ... --> comment on the line above the fence, if any
	Code   string // the lines between the fences
}

// Doc is what the checks need of one Markdown file.
type Doc struct {
	Links   []Link
	Blocks  []Block
	Anchors map[string]bool // heading slugs and explicit ids/names
}

var (
	fenceRE   = regexp.MustCompile("^ {0,3}(`{3,}|~{3,})\\s*([^`\\s]*)")
	headingRE = regexp.MustCompile(`^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$`)
	// [text](target "title") and ![alt](target); the text may hold brackets
	// one level deep ([`x`], [![badge](img)](url) yields both targets).
	linkRE   = regexp.MustCompile(`\]\(\s*(<[^>]*>|[^()\s]*(?:\([^()\s]*\)[^()\s]*)*)(?:\s+(?:"[^"]*"|'[^']*'))?\s*\)`)
	refDefRE = regexp.MustCompile(`^ {0,3}\[[^\]]+\]:\s*(\S+)`)
	htmlRE   = regexp.MustCompile(`(?i)\b(?:href|src)\s*=\s*"([^"]*)"`)
	idRE     = regexp.MustCompile(`(?i)<a\s[^>]*\b(?:name|id)\s*=\s*"([^"]*)"`)
	markerRE = regexp.MustCompile(`^\s*<!--\s*(.*?)\s*-->\s*$`)
	codeRE   = regexp.MustCompile("(`+)(.*?)(?:`+)")
)

// Parse reads a Markdown document.
func Parse(src []byte) Doc {
	d := Doc{Anchors: map[string]bool{}}
	seen := map[string]int{}
	var (
		inFence   bool
		fence     string
		block     *Block
		code      strings.Builder
		prevLine  string // last non-blank line outside a fence
		prevBlank bool
	)
	sc := bufio.NewScanner(bytes.NewReader(src))
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	n := 0
	for sc.Scan() {
		n++
		line := sc.Text()
		if inFence {
			trimmed := strings.TrimSpace(line)
			if strings.HasPrefix(trimmed, fence[:1]) && strings.Trim(trimmed, fence[:1]) == "" && len(trimmed) >= len(fence) {
				inFence = false
				block.Code = code.String()
				d.Blocks = append(d.Blocks, *block)
				block = nil
				prevLine, prevBlank = "", false
				continue
			}
			code.WriteString(line)
			code.WriteByte('\n')
			continue
		}
		if m := fenceRE.FindStringSubmatch(line); m != nil {
			inFence, fence = true, m[1]
			block = &Block{Line: n, Lang: m[2]}
			if mm := markerRE.FindStringSubmatch(prevLine); mm != nil && !prevBlank {
				block.Marker = mm[1]
			}
			code.Reset()
			continue
		}
		if strings.TrimSpace(line) == "" {
			prevBlank = true
			continue
		}
		prevLine, prevBlank = line, false
		if m := headingRE.FindStringSubmatch(line); m != nil {
			s := Slug(m[2])
			if k, ok := seen[s]; ok {
				seen[s] = k + 1
				s = fmt.Sprintf("%s-%d", s, k+1)
			} else {
				seen[s] = 0
			}
			d.Anchors[s] = true
		}
		for _, m := range idRE.FindAllStringSubmatch(line, -1) {
			d.Anchors[m[1]] = true
		}
		text := codeRE.ReplaceAllString(line, "")
		for _, m := range linkRE.FindAllStringSubmatch(text, -1) {
			d.Links = append(d.Links, Link{Line: n, Target: strings.Trim(m[1], "<>")})
		}
		if m := refDefRE.FindStringSubmatch(text); m != nil {
			d.Links = append(d.Links, Link{Line: n, Target: strings.Trim(m[1], "<>")})
		}
		for _, m := range htmlRE.FindAllStringSubmatch(text, -1) {
			d.Links = append(d.Links, Link{Line: n, Target: m[1]})
		}
	}
	if inFence && block != nil {
		block.Code = code.String()
		d.Blocks = append(d.Blocks, *block)
	}
	return d
}

var inlineLinkRE = regexp.MustCompile(`!?\[([^\]]*)\]\([^)]*\)`)
var tagRE = regexp.MustCompile(`<[^>]*>`)

// Slug is the anchor GitHub gives a heading with this text: the rendered
// text, lower-cased, with every character that is not a letter, a digit, a
// space, '-' or '_' removed, and spaces turned into '-'.
func Slug(heading string) string {
	s := inlineLinkRE.ReplaceAllString(heading, "$1")
	s = tagRE.ReplaceAllString(s, "")
	s = strings.NewReplacer("`", "", "*", "").Replace(s)
	s = strings.ToLower(s)
	var b strings.Builder
	for _, r := range s {
		switch {
		case unicode.IsLetter(r), unicode.IsDigit(r), unicode.IsMark(r), r == '_', r == '-':
			b.WriteRune(r)
		case r == ' ':
			b.WriteByte('-')
		}
	}
	return b.String()
}

// CheckLink reports what is wrong with target, a link found in the Markdown
// file at path (both relative to root), or "" when it resolves. docs caches
// the parsed Markdown files by path.
func CheckLink(root, path, target string, docs func(string) (Doc, error)) string {
	if target == "" {
		return "empty link"
	}
	if u, err := url.Parse(target); err == nil && u.Scheme != "" {
		return "" // http, https, mailto: not fetched
	}
	if strings.HasPrefix(target, "//") {
		return ""
	}
	file, frag, _ := strings.Cut(target, "#")
	file, err := url.PathUnescape(file)
	if err != nil {
		return fmt.Sprintf("bad escape in %q", target)
	}
	var rel string
	switch {
	case file == "":
		rel = path
	case strings.HasPrefix(file, "/"):
		rel = filepath.Clean(strings.TrimPrefix(file, "/"))
	default:
		rel = filepath.Clean(filepath.Join(filepath.Dir(path), file))
	}
	if rel == ".." || strings.HasPrefix(rel, "../") {
		return fmt.Sprintf("%s leaves the repository", target)
	}
	fi, err := os.Stat(filepath.Join(root, rel))
	if err != nil {
		return fmt.Sprintf("%s: no file %s", target, rel)
	}
	if frag == "" || fi.IsDir() || !strings.EqualFold(filepath.Ext(rel), ".md") {
		return ""
	}
	d, err := docs(rel)
	if err != nil {
		return err.Error()
	}
	if !d.Anchors[strings.ToLower(frag)] && !d.Anchors[frag] {
		return fmt.Sprintf("%s: %s has no heading with anchor #%s", target, rel, frag)
	}
	return ""
}

// Marker is a parsed <!-- kind: args --> comment above a code block.
type Marker struct {
	Kind string   // "excerpt" or "" (none)
	Args []string // path [func]
}

// ParseMarker reads a block's marker; a comment of another kind is ignored.
func ParseMarker(s string) Marker {
	kind, rest, ok := strings.Cut(s, ":")
	if !ok {
		return Marker{}
	}
	kind = strings.TrimSpace(kind)
	if kind != "excerpt" {
		return Marker{}
	}
	return Marker{Kind: kind, Args: strings.Fields(rest)}
}

// IsFile reports whether code is a complete Go file: its first line that is
// neither blank nor a comment is a package clause.
func IsFile(code string) bool {
	for _, l := range strings.Split(code, "\n") {
		l = strings.TrimSpace(l)
		if l == "" || strings.HasPrefix(l, "//") {
			continue
		}
		return strings.HasPrefix(l, "package ")
	}
	return false
}

// CheckExcerpt reports, for a block excerpted from function fn ("" for the
// whole file; "T.M" or "M" for a method) of the Go file at src, the first
// line of code absent from it (in order), as the 0-based line of code and a
// message; -1 and "" when every line is there.
func CheckExcerpt(code, src, fn string) (int, string) {
	data, err := os.ReadFile(src)
	if err != nil {
		return 0, err.Error()
	}
	text := string(data)
	if fn != "" {
		fset := token.NewFileSet()
		f, err := parser.ParseFile(fset, src, data, parser.ParseComments)
		if err != nil {
			return 0, err.Error()
		}
		text = ""
		for _, decl := range f.Decls {
			fd, ok := decl.(*ast.FuncDecl)
			if !ok || !funcNamed(fd, fn) {
				continue
			}
			start := fset.Position(fd.Pos()).Offset
			if fd.Doc != nil {
				start = fset.Position(fd.Doc.Pos()).Offset
			}
			text = string(data[start:fset.Position(fd.End()).Offset])
			break
		}
		if text == "" {
			return 0, fmt.Sprintf("%s has no function %s", src, fn)
		}
	}
	var have []string
	for _, l := range strings.Split(text, "\n") {
		have = append(have, strings.TrimSpace(l))
	}
	j := 0
	for i, l := range strings.Split(code, "\n") {
		l = strings.TrimSpace(l)
		if l == "" || l == "..." || l == "// ..." {
			continue
		}
		for j < len(have) && have[j] != l {
			j++
		}
		if j == len(have) {
			where := "file"
			if fn != "" {
				where = fn
			}
			return i, fmt.Sprintf("line %q is not in %s of %s (after the lines before it)", l, where, src)
		}
		j++
	}
	return -1, ""
}

func funcNamed(fd *ast.FuncDecl, name string) bool {
	if fd.Name.Name == name {
		return true
	}
	if fd.Recv == nil || len(fd.Recv.List) == 0 {
		return false
	}
	t := fd.Recv.List[0].Type
	if s, ok := t.(*ast.StarExpr); ok {
		t = s.X
	}
	switch x := t.(type) {
	case *ast.IndexExpr:
		t = x.X
	case *ast.IndexListExpr:
		t = x.X
	}
	if id, ok := t.(*ast.Ident); ok {
		return id.Name+"."+fd.Name.Name == name
	}
	return false
}
