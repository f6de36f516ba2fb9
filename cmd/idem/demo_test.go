package main

import (
	"encoding/json"
	"strings"
	"testing"

	"github.com/idemkit/idem/internal/pgtest"
	"github.com/idemkit/idem/internal/redisserver"
)

// demoOutput is what demo --json prints.
type demoOutput struct {
	Store    string       `json:"store"`
	Payments int          `json:"payments"`
	Copies   int          `json:"copies"`
	Runs     []demoResult `json:"runs"`
	OK       bool         `json:"ok"`
}

// demoJSON runs demo --json with args and parses its output.
func demoJSON(t *testing.T, args ...string) demoOutput {
	t.Helper()
	code, out, errOut := inspectExec(t, append([]string{"demo", "--json"}, args...)...)
	if code != 0 {
		t.Fatalf("demo %q: exit %d, want 0; stdout:\n%s\nstderr:\n%s", args, code, out, errOut)
	}
	var got demoOutput
	if err := json.Unmarshal([]byte(out), &got); err != nil {
		t.Fatalf("demo --json: %v\n%s", err, out)
	}
	return got
}

// checkDemo checks both runs of a demo of payments × copies requests.
func checkDemo(t *testing.T, got demoOutput, payments, copies int, mode string) {
	t.Helper()
	if len(got.Runs) != 2 {
		t.Fatalf("runs: got %d, want 2", len(got.Runs))
	}
	requests := payments * copies
	want := []demoResult{
		// Unprotected, every copy charges the card.
		{Mode: "unprotected", Requests: requests, Charges: requests, Duplicates: requests - payments},
		// Through idem, one charge per payment; every other copy is a replay.
		{Mode: mode, Requests: requests, Charges: payments, Replays: requests - payments},
	}
	for i, r := range got.Runs {
		w := want[i]
		w.Conflicts, w.TimeMS = r.Conflicts, r.TimeMS
		if r != w {
			t.Errorf("run %d: got %+v, want %+v", i, r, w)
		}
		if r.TimeMS <= 0 {
			t.Errorf("run %d: time %vms, want > 0", i, r.TimeMS)
		}
	}
	if got.Runs[0].Conflicts != 0 {
		t.Errorf("unprotected: got %d conflicts, want 0", got.Runs[0].Conflicts)
	}
	if !got.OK || got.Payments != payments || got.Copies != copies {
		t.Errorf("got ok %v, %d payments, %d copies; want true, %d, %d", got.OK, got.Payments, got.Copies, payments, copies)
	}
}

func TestDemoMemory(t *testing.T) {
	t.Setenv("IDEM_STORE", "memory") // whatever the environment says
	got := demoJSON(t, "--payments", "30", "--copies", "4")
	if got.Store != "memstore" {
		t.Errorf("store: got %q, want memstore", got.Store)
	}
	checkDemo(t, got, 30, 4, "idem (memstore)")
}

func TestDemoTable(t *testing.T) {
	t.Setenv("IDEM_STORE", "memory") // whatever the environment says
	code, out, errOut := inspectExec(t, "demo", "--payments", "10", "--copies", "3")
	if code != 0 {
		t.Fatalf("demo: exit %d, want 0; stderr: %s", code, errOut)
	}
	lines := strings.Split(out, "\n")
	if len(lines) < 6 {
		t.Fatalf("demo: got\n%s\nwant a table and a verdict", out)
	}
	if got := strings.Join(strings.Fields(lines[0]), " "); got != "mode requests charges duplicate charges replays conflicts time" {
		t.Errorf("header: got %q", got)
	}
	// mode, requests, charges, duplicate charges, replays (conflicts and
	// time vary).
	for i, want := range []string{"unprotected 30 30 20 0 0", "idem (memstore) 30 10 0 20"} {
		if got := strings.Join(strings.Fields(lines[1+i]), " "); !strings.HasPrefix(got, want+" ") {
			t.Errorf("row %d: got %q, want it to start with %q", i+1, got, want)
		}
	}
	if !strings.Contains(out, "20 of them duplicates") || !strings.Contains(out, "every payment charged exactly once") {
		t.Errorf("verdict: got\n%s", out)
	}
}

func TestDemoRedis(t *testing.T) {
	srv, err := redisserver.StartServer()
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Stop()
	// Twice on the same Redis: each run uses keys of its own, so the
	// second one charges again rather than replaying the first.
	for range 2 {
		got := demoJSON(t, "--store", "redis://"+srv.Addr(), "--payments", "25", "--copies", "4")
		if got.Store != "redis" {
			t.Errorf("store: got %q, want redis", got.Store)
		}
		checkDemo(t, got, 25, 4, "idem (redis)")
	}
}

func TestDemoFlags(t *testing.T) {
	for _, args := range [][]string{
		{"--payments", "0"},
		{"--copies", "-1"},
		{"--copies", "101"},
		{"--payments", "1000001"},
		{"--payments", "x"},
		{"--store", "ftp://x"},
	} {
		code, _, errOut := inspectExec(t, append([]string{"demo"}, args...)...)
		if code != 2 || errOut == "" {
			t.Errorf("demo %q: got exit %d, stderr %q; want 2 and a message", args, code, errOut)
		}
	}
	// An unreachable store fails at once, before the runs.
	srv, err := redisserver.StartServer()
	if err != nil {
		t.Fatal(err)
	}
	addr := srv.Addr()
	srv.Stop()
	code, out, errOut := inspectExec(t, "demo", "--store", "redis://"+addr)
	if code != 1 || out != "" || !strings.Contains(errOut, "--store") {
		t.Errorf("demo on a stopped Redis: got exit %d, %q, %q; want 1 and a --store error", code, out, errOut)
	}
}

func TestDemoStoreName(t *testing.T) {
	for spec, want := range map[string]string{
		"":                             "memstore",
		"memory":                       "memstore",
		"redis://u:secret@h:6379/0":    "redis",
		"rediss://h:6379":              "redis, TLS",
		"postgres://u:secret@h/db":     "postgres",
		"postgresql://h/db?sslmode=no": "postgres",
		"redis://h:6379 postgres://u:secret@h/db": "tiered: redis + postgres",
	} {
		if got := demoStoreName(spec); got != want || strings.Contains(got, "secret") {
			t.Errorf("demoStoreName(%q): got %q, want %q", spec, got, want)
		}
	}
}

func TestDemoPostgres(t *testing.T) {
	pool := pgtest.New(t) // a private database, dropped at the end
	got := demoJSON(t, "--store", pool.Config().ConnString(), "--payments", "20", "--copies", "3")
	if got.Store != "postgres" {
		t.Errorf("store: got %q, want postgres", got.Store)
	}
	checkDemo(t, got, 20, 3, "idem (postgres)")
}
