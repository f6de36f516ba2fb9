package main

import (
	"bytes"
	"context"
	"encoding/json"
	"encoding/xml"
	"errors"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/redistest"
)

// TestBench runs idem bench --quick in-process at a tiny size against a
// private redis-server and checks the JSON, the markdown and the SVG.
func TestBench(t *testing.T) {
	srv, err := redistest.StartServer()
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Stop()
	dir := t.TempDir()
	jsonPath, svgPath := filepath.Join(dir, "bench.json"), filepath.Join(dir, "bench.svg")
	var stdout, stderr bytes.Buffer
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	// 200 requests: in (a) 20 keys of 10 copies sent at once to a handler
	// sleeping 50 ms, in (c) 10 keys of 20 copies (5 ms): the copies of a
	// key reach naive's GET long before its SET, so it runs them all.
	code := run(ctx, []string{"bench", "--quick", "--requests", "200", "--redis", "redis://" + srv.Addr(),
		"--json", jsonPath, "--svg", svgPath}, &stdout, &stderr)
	if code != 0 {
		t.Fatalf("exit status %d\nstderr:\n%s", code, stderr.String())
	}

	raw, err := os.ReadFile(jsonPath)
	if err != nil {
		t.Fatal(err)
	}
	var rs []benchResult
	if err := json.Unmarshal(raw, &rs); err != nil {
		t.Fatalf("JSON: %v", err)
	}
	got := map[string]benchResult{}
	for _, r := range rs {
		got[r.Impl+"/"+r.Scenario] = r
	}
	for _, sc := range []string{"a", "b", "c", "d"} {
		for _, impl := range benchImpls {
			r, ok := got[impl+"/"+sc]
			if impl == "none" && sc != "b" {
				if ok {
					t.Errorf("none ran in scenario %s", sc)
				}
				continue
			}
			if !ok {
				t.Errorf("no result for %s in scenario %s", impl, sc)
				continue
			}
			if r.Requests != 200 || r.RPS <= 0 || r.P50ms <= 0 || r.P99ms < r.P50ms || len(r.Errors) != 0 {
				t.Errorf("%s/%s: implausible result %+v", impl, sc, r)
			}
			if impl != "none" && r.RedisCmdsPerReq <= 0 {
				t.Errorf("%s/%s: no Redis commands counted", impl, sc)
			}
			if strings.HasPrefix(impl, "idem-") && r.Duplicates != 0 {
				t.Errorf("%s/%s: %d duplicate executions", impl, sc, r.Duplicates)
			}
		}
	}
	if got["naive/a"].Duplicates == 0 && got["naive/c"].Duplicates == 0 {
		t.Errorf("naive shows no duplicates in (a) nor (c)")
	}
	if got["lua/a"].Executions != got["lua/a"].Keys || got["watch/c"].Duplicates != 0 {
		t.Errorf("a locking baseline ran a key twice: lua/a %+v, watch/c %+v", got["lua/a"], got["watch/c"])
	}

	md := stdout.String()
	for _, want := range []string{"| scenario | implementation |", "| a | idem-rueidis |", "| b | none |", "### Targets"} {
		if !strings.Contains(md, want) {
			t.Errorf("markdown lacks %q:\n%s", want, md)
		}
	}

	svg, err := os.ReadFile(svgPath)
	if err != nil {
		t.Fatal(err)
	}
	dec := xml.NewDecoder(bytes.NewReader(svg))
	for {
		_, err := dec.Token()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			t.Fatalf("SVG is not well-formed XML: %v", err)
		}
	}
	if !bytes.Contains(svg, []byte("<svg")) || !bytes.Contains(svg, []byte("idem-goredis")) {
		t.Errorf("SVG lacks the chart")
	}
}

func TestBenchUsage(t *testing.T) {
	for _, args := range [][]string{
		{"bench", "--impls", "bogus"},
		{"bench", "--scenarios", "z"},
		{"bench", "--rate", "-1"},
	} {
		var out, errb bytes.Buffer
		if code := run(context.Background(), args, &out, &errb); code != 2 {
			t.Errorf("%v: exit status %d, want 2 (%s)", args, code, errb.String())
		}
	}
}

func TestMakePlan(t *testing.T) {
	p := makePlan(benchScenario{copies: 10}, 25, "k")
	if len(p.keys) != 25 || p.distinct != 3 || p.keys[9] != "k0" || p.keys[10] != "k1" {
		t.Errorf("copies plan: %+v", p)
	}
	p = makePlan(benchScenario{replay: 0.95}, 1000, "k")
	if len(p.warm) != 100 || len(p.keys) != 1000 {
		t.Errorf("replay plan: %d warm, %d keys", len(p.warm), len(p.keys))
	}
	var fresh int
	for _, k := range p.keys {
		if strings.HasPrefix(k, "kn") {
			fresh++
		}
	}
	if fresh < 20 || fresh > 90 {
		t.Errorf("replay plan: %d new keys of 1000, want about 50", fresh)
	}
}
