package idem_test

import (
	"bufio"
	"bytes"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"unicode"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/dynamostore"
	"github.com/idemkit/idem/memstore"
	"github.com/idemkit/idem/mysqlstore"
	"github.com/idemkit/idem/pgstore"
	"github.com/idemkit/idem/redisstore"
	"github.com/idemkit/idem/tieredstore"
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

// storeTypes holds a value of each store package's Store type, for the
// type assertions of TestArchitectureStoreTable. A new store package goes
// here too (the test fails until it does).
var storeTypes = map[string]idem.Store{
	"memstore":    (*memstore.Store)(nil),
	"redisstore":  (*redisstore.Store)(nil),
	"pgstore":     (*pgstore.Store)(nil),
	"mysqlstore":  (*mysqlstore.Store)(nil),
	"dynamostore": (*dynamostore.Store)(nil),
	"tieredstore": (*tieredstore.Store)(nil),
}

// storeMethod finds a store: a type with idem.Store's Acquire.
var storeMethod = regexp.MustCompile(`(?m)^func \(\w+ \*?\w+\) Acquire\(ctx context\.Context, \w+ idem\.AcquireRequest\) \(idem\.Acquisition, error\)`)

// ARCHITECTURE.md's table of the stores must say of each store what its
// type does: a row per store package of the module (a package outside
// cmd/ and internal/ whose code has an Acquire of idem.Store), and in the
// columns `idem.BatchStore` and `idem.Namespacer` "yes" exactly when the
// store's type implements that interface. blob.go's doc of Namespacer
// says that every store of the module implements it: so must the code.
func TestArchitectureStoreTable(t *testing.T) {
	arch, err := os.ReadFile("ARCHITECTURE.md")
	if err != nil {
		t.Fatal(err)
	}
	_, section, found := strings.Cut(string(arch), "\n## The stores\n")
	if !found {
		t.Fatal("ARCHITECTURE.md has no section \"## The stores\"")
	}
	section, _, _ = strings.Cut(section, "\n## ")
	var header []string
	rows := map[string]int{}
	for line := range strings.Lines(section) {
		if !strings.HasPrefix(line, "|") || strings.HasPrefix(line, "|---") {
			continue
		}
		cells := strings.Split(strings.Trim(strings.TrimSpace(line), "|"), " | ")
		for i := range cells {
			cells[i] = strings.TrimSpace(cells[i])
		}
		if header == nil {
			header = cells
			continue
		}
		if len(cells) != len(header) {
			t.Errorf("ARCHITECTURE.md's store table: got %d cells, want %d (the header's), in: %s", len(cells), len(header), line)
			continue
		}
		m := regexp.MustCompile("^`([a-z]+)`").FindStringSubmatch(cells[0])
		if m == nil {
			t.Errorf("ARCHITECTURE.md's store table: a row's first cell is %q, want a package in backquotes", cells[0])
			continue
		}
		pkg := m[1]
		rows[pkg]++
		store, ok := storeTypes[pkg]
		if !ok {
			t.Errorf("ARCHITECTURE.md's store table has a row for %s, which is not a store package (storeTypes)", pkg)
			continue
		}
		for i, col := range header {
			var implements bool
			switch col {
			case "`idem.BatchStore`":
				_, implements = store.(idem.BatchStore)
			case "`idem.Namespacer`":
				_, implements = store.(idem.Namespacer)
			default:
				continue
			}
			var says bool
			switch {
			case strings.HasPrefix(cells[i], "yes"):
				says = true
			case strings.HasPrefix(cells[i], "no"):
			default:
				t.Errorf("ARCHITECTURE.md's store table: %s, column %s: got %q, want it to start with yes or no", pkg, col, cells[i])
				continue
			}
			if says != implements {
				want, does := "no", "does not implement it"
				if implements {
					want, does = "yes", "implements it"
				}
				t.Errorf("ARCHITECTURE.md's store table: %s, column %s: got %q, want %s: %T %s", pkg, col, cells[i], want, store, does)
			}
		}
	}
	for _, col := range []string{"`idem.BatchStore`", "`idem.Namespacer`"} {
		if !slices.Contains(header, col) {
			t.Errorf("ARCHITECTURE.md's store table: no column %s in its header %q", col, header)
		}
	}
	for pkg, store := range storeTypes {
		if rows[pkg] == 0 {
			t.Errorf("ARCHITECTURE.md's store table has no row for %s", pkg)
		}
		if _, ok := store.(idem.Namespacer); !ok {
			t.Errorf("%T does not implement idem.Namespacer; blob.go's doc of Namespacer says every store of the module does", store)
		}
	}

	// Every store package of the tree is in storeTypes.
	err = filepath.WalkDir(".", func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() && path != "." && (strings.HasPrefix(d.Name(), ".") || d.Name() == "internal" || d.Name() == "cmd" || d.Name() == "examples" || d.Name() == "testdata") {
			return filepath.SkipDir
		}
		if d.IsDir() || !strings.HasSuffix(path, ".go") || strings.HasSuffix(path, "_test.go") {
			return nil
		}
		src, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		if pkg := filepath.ToSlash(filepath.Dir(path)); storeMethod.Match(src) && storeTypes[pkg] == nil {
			t.Errorf("%s has a Store (%s): add it to storeTypes in readme_test.go and a row to ARCHITECTURE.md's store table", pkg, path)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}

// The users' tables of the stores, docs/stores.md's choice and
// docs/guarantee.md's "What each store adds", have a row for every store
// package (storeTypes) and no other.
func TestDocsStoreTables(t *testing.T) {
	for _, tc := range []struct{ file, section string }{
		{"docs/stores.md", "# Stores: which to choose"},
		{"docs/guarantee.md", "## What each store adds"},
	} {
		md, err := os.ReadFile(tc.file)
		if err != nil {
			t.Fatal(err)
		}
		_, section, found := strings.Cut(string(md), tc.section+"\n")
		if !found {
			t.Errorf("%s has no heading %q", tc.file, tc.section)
			continue
		}
		section, _, _ = strings.Cut(section, "\n## ")
		named := map[string]bool{}
		for line := range strings.Lines(section) {
			if m := regexp.MustCompile("^\\| `([a-z]+)`").FindStringSubmatch(line); m != nil {
				named[m[1]] = true
				if storeTypes[m[1]] == nil {
					t.Errorf("%s: the table under %q has a row for %s, which is not a store package (storeTypes)", tc.file, tc.section, m[1])
				}
			}
		}
		for pkg := range storeTypes {
			if !named[pkg] {
				t.Errorf("%s: the table under %q has no row for %s", tc.file, tc.section, pkg)
			}
		}
	}
}

// CONTRIBUTING.md says what the test command changes on the machine: it
// must name everything scripts/test.sh installs (each package of its
// apt-get list, each "test.sh: installing ..." of its other installs).
func TestDocsContributingNamesInstalls(t *testing.T) {
	script, err := os.ReadFile("scripts/test.sh")
	if err != nil {
		t.Fatal(err)
	}
	contributing, err := os.ReadFile("CONTRIBUTING.md")
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, m := range regexp.MustCompile(`missing\+=\(([^)]+)\)`).FindAllStringSubmatch(string(script), -1) {
		names = append(names, m[1])
	}
	for _, m := range regexp.MustCompile(`"test\.sh: installing ([^"$][^"(]*)`).FindAllStringSubmatch(string(script), -1) {
		for _, item := range regexp.MustCompile(`, | and `).Split(strings.TrimSpace(m[1]), -1) {
			names = append(names, strings.Fields(item)[0]) // "versitygw v1.8.0": versitygw
		}
	}
	if len(names) < 10 {
		t.Fatalf("scripts/test.sh: found %d things it installs (%q), want at least 10: has its form changed?", len(names), names)
	}
	for _, name := range names {
		if !strings.Contains(string(contributing), name) {
			t.Errorf("scripts/test.sh installs %s, which CONTRIBUTING.md does not name (\"It changes the machine as follows\")", name)
		}
	}
}
