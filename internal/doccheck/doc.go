// Package doccheck holds the tests that keep the repository's Markdown
// documents honest; it has no API.
//
// TestLinks checks that every relative link and image in every Markdown file
// of the repository (README.md, docs/, DESIGN.md, CHANGELOG.md, the nested
// modules' READMEs) names a file or directory that exists and, for a
// "#fragment" into a Markdown file, a heading of that file (GitHub's anchor
// rules). External links are not fetched.
//
// TestGoBlocks checks that every ```go block of README.md and docs/*.md
// compiles. A block is one of:
//
//   - a complete file (its first code line is a package clause): it is
//     written into a directory of its own under a temporary directory inside
//     the root module (named ".doccheck-*", so ./... never sees it) and all
//     of them are checked with one `go vet`;
//   - an excerpt, marked with <!-- excerpt: PATH [FUNC] --> on the line above
//     the fence: every non-blank line of the block, leading white space
//     ignored, must appear in that order in the function FUNC of the Go file
//     PATH (relative to the repository root), or in the whole file without
//     FUNC. A line "..." or "// ..." stands for omitted code. The excerpted
//     file is itself compiled by `go vet ./...` of its module. Code that
//     imports a nested module (streamqotel, streamqdash...) is shown this
//     way: the root module cannot resolve those imports offline.
//
// A failure names the Markdown file and line of the link or block. Run them
// with `go test ./internal/doccheck` (they are part of `make test`).
package doccheck
