package main

import (
	"bytes"
	"fmt"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	"go.yaml.in/yaml/v3"
)

// TestProxyDocConfigFiles runs each --config file of docs/proxy.md (its
// yaml blocks that start with routes:) as written, through the binary, in
// front of a counting upstream: the proxy starts with it, and each route
// behaves as the file says. A keyed request to a covered route runs once
// and is replayed byte for byte (and without a key gets 400 where the
// route has require_key); on a route with methods: [] the same keyed
// request runs each time (not covered).
func TestProxyDocConfigFiles(t *testing.T) {
	t.Parallel()
	var files []string
	for _, b := range docsBlocks(t, "../../docs/proxy.md", "yaml") {
		if strings.HasPrefix(b, "routes:\n") {
			files = append(files, b)
		}
	}
	if len(files) < 2 {
		t.Fatalf("docs/proxy.md has %d --config files (yaml blocks starting with routes:), want the gRPC and Routes sections' 2", len(files))
	}
	param := regexp.MustCompile(`\{[^}]*\}`)
	for n, file := range files {
		t.Run(fmt.Sprint(n+1), func(t *testing.T) {
			t.Parallel()
			var cfg struct {
				Routes []struct {
					Match      string
					Methods    *[]string
					RequireKey bool `yaml:"require_key"`
				}
			}
			if err := yaml.Unmarshal([]byte(file), &cfg); err != nil {
				t.Fatalf("docs/proxy.md, --config file %d: %v\n%s", n+1, err, file)
			}
			path := filepath.Join(t.TempDir(), "routes.yaml")
			writeFile(t, path, file)
			up := newTestUpstream(t)
			p := startProxy(t, nil, "--upstream", up.URL, "--config", path)
			for i, r := range cfg.Routes {
				method, pattern, ok := strings.Cut(r.Match, " ")
				if !ok {
					method, pattern = "POST", r.Match
				}
				url := p.url(param.ReplaceAllString(pattern, "7"))
				covered := r.Methods == nil || slices.Contains(*r.Methods, method)
				key := fmt.Sprintf("doc-config-%d-%d", n+1, i)
				first := mustSend(t, method, url, key, `{"amount":4200}`)
				again := mustSend(t, method, url, key, `{"amount":4200}`)
				switch {
				case first.status != 201 || first.replayed():
					t.Errorf("route %q: %s %s: got %d (replayed %t) %s, want the upstream's 201", r.Match, method, url, first.status, first.replayed(), first.body)
				case covered && (!again.replayed() || !bytes.Equal(again.body, first.body) || up.runsOf(key) != 1):
					t.Errorf("route %q (covered): the repeat got %d (replayed %t), %d executions; want the replay and 1", r.Match, again.status, again.replayed(), up.runsOf(key))
				case !covered && (again.replayed() || up.runsOf(key) != 2):
					t.Errorf("route %q (methods %v: not covered): the repeat got %d (replayed %t), %d executions; want it run again, 2",
						r.Match, *r.Methods, again.status, again.replayed(), up.runsOf(key))
				}
				if r.RequireKey {
					if unkeyed := mustSend(t, method, url, "", `{"amount":4200}`); unkeyed.status != 400 || up.runsOf("") != 0 {
						t.Errorf("route %q (require_key): without a key got %d, %d executions; want 400 and none", r.Match, unkeyed.status, up.runsOf(""))
					}
				}
			}
		})
	}
}
