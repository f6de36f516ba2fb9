package main

import (
	"maps"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
)

// testSupport matches the import path of a test-support package of the
// project: one whose name ends in "test" (internal/redistest,
// internal/proctest, internal/nettest, storetest, idemmsg/adaptertest,
// ...). Tests import them; no binary may link one.
var testSupport = regexp.MustCompile(`^github\.com/idemkit/idem(/.*)?/[a-z0-9]*test$`)

// TestBinariesLinkNoTestPackages lists with `go list -deps` what the
// binaries the project ships or documents link (the idem command, Caddy
// with caddyidem, the benchmarks' peers, the examples) and fails naming
// every test-support package among it and the packages that import it.
// What a binary needs of a test helper (idem bench's private
// redis-server) lives in a package of its own (internal/redisserver).
func TestBinariesLinkNoTestPackages(t *testing.T) {
	root := filepath.Join("..", "..")
	for _, b := range []struct {
		dir      string // the module's directory, from the module root
		patterns []string
	}{
		{".", []string{"./cmd/idem", "./examples/...", "./internal/bench/grpcupstream"}},
		{"caddyidem", []string{"./cmd/idem-caddy"}},
		{"internal/benchpeers", []string{"."}},
		{"examples/frameworks", []string{"./..."}},
	} {
		t.Run(b.dir, func(t *testing.T) {
			t.Parallel()
			// One line a package: its path, then the paths it imports.
			args := append([]string{"list", "-deps", "-f", `{{.ImportPath}} {{join .Imports " "}}`}, b.patterns...)
			cmd := exec.Command("go", args...)
			cmd.Dir = filepath.Join(root, b.dir)
			out, err := cmd.Output()
			if err != nil {
				msg := err.Error()
				if ee, ok := err.(*exec.ExitError); ok {
					msg += "\n" + string(ee.Stderr)
				}
				t.Fatalf("go %s in %s: %s", strings.Join(args, " "), b.dir, msg)
			}
			importers := map[string][]string{} // test-support package → the packages that import it
			n := 0
			for line := range strings.Lines(string(out)) {
				fields := strings.Fields(line)
				if len(fields) == 0 {
					continue
				}
				n++
				for _, imp := range fields[1:] {
					if testSupport.MatchString(imp) {
						importers[imp] = append(importers[imp], fields[0])
					}
				}
			}
			if n < 10 {
				t.Fatalf("go list -deps %s in %s listed %d packages; want the binaries' dependencies:\n%s", strings.Join(b.patterns, " "), b.dir, n, out)
			}
			for _, pkg := range slices.Sorted(maps.Keys(importers)) {
				t.Errorf("%s (in %s) links the test-support package %s, imported by %s: move what the binary needs into a package that is not test support",
					strings.Join(b.patterns, " "), b.dir, pkg, strings.Join(importers[pkg], ", "))
			}
		})
	}
}

func TestTestSupportPattern(t *testing.T) {
	for path, want := range map[string]bool{
		"github.com/idemkit/idem/internal/redistest":       true,
		"github.com/idemkit/idem/internal/proctest":        true,
		"github.com/idemkit/idem/storetest":                true,
		"github.com/idemkit/idem/idemmsg/internal/msgtest": true,
		"github.com/idemkit/idem/internal/redisserver":     false,
		"github.com/idemkit/idem/internal/childproc":       false,
		"github.com/idemkit/idem/internal/bench":           false,
		"github.com/idemkit/idem/redisstore":               false,
		"github.com/other/x/internal/redistest":            false,
		"testing":                                          false,
	} {
		if got := testSupport.MatchString(path); got != want {
			t.Errorf("testSupport matches %s: %v, want %v", path, got, want)
		}
	}
}
