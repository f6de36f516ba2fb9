package main

import (
	"bytes"
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/redisserver"
)

// The harness and its full test are in internal/bench; these test the
// command's wiring: flags, usage errors, the environment, the outputs.

func TestBenchUsage(t *testing.T) {
	for _, args := range [][]string{
		{"bench", "--impls", "bogus"},
		{"bench", "--scenarios", "z"},
		{"bench", "--rate", "-1"},
		{"bench", "--instances", "0"},
		{"bench", "--rounds", "0"},
		{"bench", "stray"},
	} {
		var out, errb bytes.Buffer
		if code := run(context.Background(), args, &out, &errb); code != 2 {
			t.Errorf("%v: exit status %d, want 2 (%s)", args, code, errb.String())
		}
	}
	var out, errb bytes.Buffer
	if code := run(context.Background(), []string{"bench", "-h"}, &out, &errb); code != 0 ||
		!strings.Contains(errb.String(), "usage: idem bench") || !strings.Contains(errb.String(), "-instances") ||
		!strings.Contains(errb.String(), "-rounds") {
		t.Errorf("bench -h: exit status %d\n%s", code, errb.String())
	}
}

// TestBenchCommand runs one small scenario through the command, with a
// flag from the environment, and checks the markdown and the JSON.
func TestBenchCommand(t *testing.T) {
	srv, err := redisserver.StartServer()
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Stop()
	jsonPath := filepath.Join(t.TempDir(), "bench.json")
	t.Setenv("IDEM_REQUESTS", "50")
	var stdout, stderr bytes.Buffer
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	code := run(ctx, []string{"bench", "--quick", "--redis", "redis://" + srv.Addr(),
		"--impls", "none,idem-rueidis", "--scenarios", "b", "--json", jsonPath}, &stdout, &stderr)
	if code != 0 {
		t.Fatalf("exit status %d\nstderr:\n%s", code, stderr.String())
	}
	// Three rounds by default: the medians, their spread in brackets.
	if md := stdout.String(); !strings.Contains(md, "| b | idem-rueidis | 50 |") || !strings.Contains(md, "| b | none | 50 |") ||
		!strings.Contains(md, "3 rounds per scenario") {
		t.Errorf("markdown:\n%s", md)
	}
	raw, err := os.ReadFile(jsonPath)
	if err != nil {
		t.Fatal(err)
	}
	var rs []struct {
		Impl     string `json:"impl"`
		Requests int    `json:"requests"`
		Rounds   int    `json:"rounds"`
		PerRound []any  `json:"per_round"`
	}
	if err := json.Unmarshal(raw, &rs); err != nil || len(rs) != 2 || rs[1].Impl != "idem-rueidis" || rs[1].Requests != 50 || rs[1].Rounds != 3 || len(rs[1].PerRound) != 3 {
		t.Errorf("JSON %s (%v)", raw, err)
	}
}
