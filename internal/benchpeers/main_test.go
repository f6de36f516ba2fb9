package main

import (
	"bytes"
	"context"
	"flag"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/bench"
	"github.com/idemkit/idem/internal/redisserver"
	"github.com/idemkit/idem/internal/redistest"
)

var srv *redisserver.Server

func TestMain(m *testing.M) { os.Exit(redistest.Run(m, &srv)) }

// options parses idem bench's flags over the peers' catalog.
func options(t *testing.T, args ...string) bench.Options {
	t.Helper()
	fs := flag.NewFlagSet("bench", flag.ContinueOnError)
	f := bench.NewFlags(fs, Catalog())
	if err := fs.Parse(args); err != nil {
		t.Fatal(err)
	}
	o, err := f.Options()
	if err != nil {
		t.Fatal(err)
	}
	return o
}

// TestBenchQuick is idem bench --quick, at a small size, with every
// implementation and peer: every run answers every request, idem and
// fiber in one instance run each key once, and the report checks the
// targets against the peers.
func TestBenchQuick(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	dir := t.TempDir()
	o := options(t, "--quick", "--requests", "200", "--redis", "redis://"+srv.Addr(), "--targets",
		"--json", filepath.Join(dir, "bench.json"), "--svg", filepath.Join(dir, "bench.svg"))
	var stdout, stderr bytes.Buffer
	results, meta, err := bench.Run(ctx, o, &stderr)
	if err != nil {
		t.Fatalf("%v\nstderr:\n%s", err, stderr.String())
	}
	bench.WriteMarkdown(&stdout, results, meta, o)
	got := map[string]bench.Result{}
	for _, r := range results {
		got[r.Impl+"/"+r.Scenario] = r
		if r.Requests != 200 || len(r.Errors) != 0 || r.RPS <= 0 {
			t.Errorf("%s/%s: implausible result %+v", r.Impl, r.Scenario, r)
		}
		if r.Impl != "naive" && r.Duplicates != 0 {
			t.Errorf("%s/%s: %d duplicates in one instance", r.Impl, r.Scenario, r.Duplicates)
		}
	}
	for _, key := range []string{"fiber/a", "fiber/b", "fiber/c", "fiber/d", "fiber-none/b", "idem-fiber/a", "idem-fiber/d"} {
		if _, ok := got[key]; !ok {
			t.Errorf("no result for %s", key)
		}
	}
	if _, ok := got["fiber-none/a"]; ok {
		t.Errorf("fiber-none ran outside scenario b")
	}
	md := stdout.String()
	for _, want := range []string{"| a | fiber |", "vs fiber: throughput", "idem-rueidis, (d): throughput ≥ every peer's", "fiber duplicates as measured"} {
		if !strings.Contains(md, want) {
			t.Errorf("markdown lacks %q:\n%s", want, md)
		}
	}
	if svg := bench.RenderSVG(results, meta); !strings.Contains(svg, ">fiber<") {
		t.Errorf("SVG lacks fiber")
	}
}

// TestBenchTwoInstances: fiber's lock lives in one process, so with two
// instances the copies of a key in the retry storm run on both; idem's
// lease is in Redis, so they do not.
func TestBenchTwoInstances(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	o := options(t, "--quick", "--requests", "200", "--redis", "redis://"+srv.Addr(), "--instances", "2",
		"--impls", "idem-rueidis,idem-wait,fiber", "--scenarios", "a")
	results, _, err := bench.Run(ctx, o, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range results {
		switch {
		case r.Requests != 200 || len(r.Errors) != 0 || r.Instances != 2:
			t.Errorf("%s: implausible result %+v", r.Impl, r)
		case r.Impl == "fiber" && r.Duplicates == 0:
			t.Errorf("fiber: no duplicates across two instances (executions %d, keys %d)", r.Executions, r.Keys)
		case r.Impl != "fiber" && r.Duplicates != 0:
			t.Errorf("%s: %d duplicates across two instances", r.Impl, r.Duplicates)
		}
	}
}

// TestConsume runs both consumer runs at a small size: idem has no
// duplicate and loses nothing; watermill without the Deduplicator runs
// every published copy; what watermill-dedup does is logged.
func TestConsume(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	const n = 500
	results, _, err := consumeAll(ctx, "redis://"+srv.Addr(), consumerImpls, []consumeRun{speedRun, correctnessRun}, n, time.Minute, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	var md bytes.Buffer
	writeConsume(&md, results, "test", n)
	t.Log("\n" + md.String())
	for _, r := range results {
		if r.Messages != n || r.Entries < n || r.Rate <= 0 {
			t.Errorf("%s/%s: implausible result %+v", r.Impl, r.Run, r)
		}
		switch {
		case strings.HasPrefix(r.Impl, "idem") && (r.Duplicates != 0 || r.Lost != 0 || r.Effects != n):
			t.Errorf("%s/%s: %d effects, %d duplicates, %d lost", r.Impl, r.Run, r.Effects, r.Duplicates, r.Lost)
		case r.Impl == "watermill" && (r.Lost != 0 || r.Duplicates != r.Entries-n):
			t.Errorf("watermill/%s: %d duplicates of %d copies published, %d lost", r.Run, r.Duplicates, r.Entries-n, r.Lost)
		case r.Run == "speed" && (r.Duplicates != 0 || r.Lost != 0):
			t.Errorf("%s/speed: %d duplicates, %d lost", r.Impl, r.Duplicates, r.Lost)
		}
	}
}

func TestUsage(t *testing.T) {
	for _, args := range [][]string{
		{},
		{"nope"},
		{"bench", "--impls", "bogus"},
		{"consume", "--impls", "bogus"},
		{"consume", "--runs", "bogus"},
		{"consume", "--messages", "5"},
	} {
		var out, errb bytes.Buffer
		if code := run(context.Background(), args, &out, &errb); code != 2 {
			t.Errorf("%v: exit status %d, want 2 (%s)", args, code, errb.String())
		}
	}
}
