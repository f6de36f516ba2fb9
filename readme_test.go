package idem_test

import (
	"bufio"
	"bytes"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"unicode"
)

// docFiles are the markdown files whose Go snippets must be compiled:
// README.md, ARCHITECTURE.md and every docs/*.md.
func docFiles(t *testing.T) []string {
	t.Helper()
	more, err := filepath.Glob(filepath.Join("docs", "*.md"))
	if err != nil {
		t.Fatal(err)
	}
	if len(more) == 0 {
		t.Fatal("no docs/*.md")
	}
	return append([]string{"README.md", "ARCHITECTURE.md"}, more...)
}

// Every Go snippet of the docs (docFiles) must come from code that the test
// command compiles (an Example, or a program under examples/), so that a
// snippet cannot drift from the API: its lines, without comments and blank
// lines, must appear in that order and next to each other in one such file.
func TestREADMESnippetsAreCompiled(t *testing.T) {
	var sources [][]string
	err := filepath.WalkDir(".", func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() && path != "." && strings.HasPrefix(d.Name(), ".") {
			return filepath.SkipDir
		}
		if d.IsDir() || !strings.HasSuffix(path, ".go") {
			return nil
		}
		src, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		if strings.HasPrefix(path, "examples"+string(filepath.Separator)) || bytes.Contains(src, []byte("\nfunc Example")) {
			sources = append(sources, codeLines(string(src)))
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	for _, file := range docFiles(t) {
		md, err := os.ReadFile(file)
		if err != nil {
			t.Fatal(err)
		}
		blocks := goBlocks(string(md))
		if file == "README.md" && len(blocks) < 2 {
			t.Fatalf("README.md: got %d Go snippets, want the quick starts' (at least 2)", len(blocks))
		}
		for _, b := range blocks {
			lines := codeLines(b)
			found := false
			for _, src := range sources {
				if containsRun(src, lines) {
					found = true
					break
				}
			}
			if !found {
				t.Errorf("%s: this snippet is in no Example and no file under examples/; copy it from one:\n%s", file, b)
			}
		}
	}
}

// goBlocks returns the text of md's ```go blocks.
func goBlocks(md string) []string {
	var blocks []string
	var cur *strings.Builder
	sc := bufio.NewScanner(strings.NewReader(md))
	for sc.Scan() {
		line := sc.Text()
		switch {
		case cur == nil && strings.HasPrefix(line, "```go"):
			cur = &strings.Builder{}
		case cur != nil && strings.HasPrefix(line, "```"):
			blocks = append(blocks, cur.String())
			cur = nil
		case cur != nil:
			cur.WriteString(line + "\n")
		}
	}
	return blocks
}

var (
	lineComment = regexp.MustCompile(`(^|\s)//.*$`) // not the // of a URL
	spaces      = regexp.MustCompile(`\s+`)
)

// codeLines returns src's lines without comments and blank lines, with
// runs of spaces collapsed (gofmt aligns comments differently).
func codeLines(src string) []string {
	var out []string
	for line := range strings.Lines(src) {
		line = strings.TrimSuffix(line, "\n") // else $ in lineComment never matches
		line = strings.TrimSpace(spaces.ReplaceAllString(lineComment.ReplaceAllString(line, ""), " "))
		if line != "" {
			out = append(out, line)
		}
	}
	return out
}

// containsRun reports whether want appears in have as a contiguous run.
func containsRun(have, want []string) bool {
	for i := 0; i+len(want) <= len(have); i++ {
		match := true
		for j := range want {
			if have[i+j] != want[j] {
				match = false
				break
			}
		}
		if match {
			return true
		}
	}
	return false
}

// ARCHITECTURE.md's package table must match the tree: every package of
// the module outside examples/ is named in it, and every name is a package.
func TestArchitecturePackageTable(t *testing.T) {
	arch, err := os.ReadFile("ARCHITECTURE.md")
	if err != nil {
		t.Fatal(err)
	}
	_, table, found := strings.Cut(string(arch), "\n## Packages\n")
	if !found {
		t.Fatal("ARCHITECTURE.md has no section \"## Packages\"")
	}
	table, _, _ = strings.Cut(table, "\n## ")
	named := map[string]bool{}
	for line := range strings.Lines(table) {
		first, _, ok := strings.Cut(strings.TrimPrefix(line, "| "), " |")
		if !ok || !strings.HasPrefix(line, "| `") {
			continue
		}
		for _, m := range regexp.MustCompile("`([^`]+)`").FindAllStringSubmatch(first, -1) {
			named[m[1]] = true
		}
	}
	tree := map[string]bool{}
	err = filepath.WalkDir(".", func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() && (path == "examples" || path == "testdata" || strings.HasPrefix(d.Name(), ".") && path != ".") {
			return filepath.SkipDir
		}
		if d.IsDir() && path != "." {
			if _, err := os.Stat(filepath.Join(path, "go.mod")); err == nil {
				return filepath.SkipDir // a module of its own (internal/benchpeers)
			}
		}
		if !d.IsDir() && strings.HasSuffix(path, ".go") { // test-only packages too
			dir := filepath.ToSlash(filepath.Dir(path))
			if dir == "." {
				dir = "idem"
			}
			tree[dir] = true
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	for pkg := range tree {
		if !named[pkg] {
			t.Errorf("ARCHITECTURE.md's package table does not name package %s", pkg)
		}
	}
	for pkg := range named {
		if !tree[pkg] {
			t.Errorf("ARCHITECTURE.md's package table names %s, which is not a package of the module", pkg)
		}
	}
}

// Every relative link of the project's markdown files names a file that
// exists and, with #anchor, a heading of that file (GitHub's anchors).
func TestREADMELinks(t *testing.T) {
	files := append(docFiles(t), "CONTRIBUTING.md", "BENCHMARKS.md", "RELIABILITY.md", "CHANGELOG.md")
	link := regexp.MustCompile(`\]\(([^)\s]+)\)`)
	for _, file := range files {
		md, err := os.ReadFile(file)
		if err != nil {
			t.Fatal(err)
		}
		for _, m := range link.FindAllStringSubmatch(proseOf(string(md)), -1) {
			target := m[1]
			if strings.Contains(target, "://") || strings.HasPrefix(target, "mailto:") {
				continue
			}
			path, anchor, _ := strings.Cut(target, "#")
			dest := file
			if path != "" {
				dest = filepath.Join(filepath.Dir(file), path)
				if _, err := os.Stat(dest); err != nil {
					t.Errorf("%s: link %s: no such file %s", file, target, dest)
					continue
				}
			}
			if anchor == "" {
				continue
			}
			if !strings.HasSuffix(dest, ".md") {
				t.Errorf("%s: link %s: an anchor into a file that is not markdown", file, target)
				continue
			}
			destMD, err := os.ReadFile(dest)
			if err != nil {
				t.Fatal(err)
			}
			if !anchors(string(destMD))[anchor] {
				t.Errorf("%s: link %s: %s has no heading with anchor #%s", file, target, dest, anchor)
			}
		}
	}
}

// proseOf returns md without its fenced code blocks.
func proseOf(md string) string {
	var b strings.Builder
	inCode := false
	for line := range strings.Lines(md) {
		if strings.HasPrefix(line, "```") {
			inCode = !inCode
			continue
		}
		if !inCode {
			b.WriteString(line)
		}
	}
	return b.String()
}

// anchors returns the anchors GitHub gives md's headings: lower case,
// punctuation dropped, spaces as hyphens, repeats numbered.
func anchors(md string) map[string]bool {
	out := map[string]bool{}
	seen := map[string]int{}
	for line := range strings.Lines(proseOf(md)) {
		if !strings.HasPrefix(line, "#") {
			continue
		}
		title := strings.TrimSpace(strings.TrimLeft(line, "#"))
		var b strings.Builder
		for _, r := range strings.ToLower(title) {
			switch {
			case r == ' ':
				b.WriteRune('-')
			case r == '-' || r == '_' || unicode.IsLetter(r) || unicode.IsDigit(r):
				b.WriteRune(r)
			}
		}
		a := b.String()
		if n := seen[a]; n > 0 {
			out[fmt.Sprintf("%s-%d", a, n)] = true
		} else {
			out[a] = true
		}
		seen[a]++
	}
	return out
}
