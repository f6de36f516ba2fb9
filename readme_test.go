package idem_test

import (
	"bufio"
	"bytes"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// Every Go snippet of README.md must come from code that the test command
// compiles (an Example, or a program under examples/), so that a snippet
// cannot drift from the API: its lines, without comments and blank lines,
// must appear in that order and next to each other in one such file.
func TestREADMESnippetsAreCompiled(t *testing.T) {
	readme, err := os.ReadFile("README.md")
	if err != nil {
		t.Fatal(err)
	}
	var sources [][]string
	err = filepath.WalkDir(".", func(path string, d fs.DirEntry, err error) error {
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
	blocks := goBlocks(string(readme))
	if len(blocks) < 4 {
		t.Fatalf("README.md: got %d Go snippets, want the usual ones (at least 4)", len(blocks))
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
			t.Errorf("README.md: this snippet is in no Example and no file under examples/; copy it from one:\n%s", b)
		}
	}
}

// goBlocks returns the text of README's ```go blocks.
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

// The README's package table must match the tree: every package of the
// module outside examples/ is named in it, and every name is a package.
func TestREADMEPackageTable(t *testing.T) {
	readme, err := os.ReadFile("README.md")
	if err != nil {
		t.Fatal(err)
	}
	_, table, _ := strings.Cut(string(readme), "\n## Packages\n")
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
			t.Errorf("README.md's package table does not name package %s", pkg)
		}
	}
	for pkg := range named {
		if !tree[pkg] {
			t.Errorf("README.md's package table names %s, which is not a package of the module", pkg)
		}
	}
}
