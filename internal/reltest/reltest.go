// Package reltest is shared by the reliability suites under reliability/:
// the size of a run (short in the normal test command, long behind
// `make reliability`) and one format for the rows of RELIABILITY.md.
package reltest

import (
	"encoding/json"
	"fmt"
	"os"
	"slices"
	"strings"
	"sync"
	"testing"
)

// Long reports whether the long versions of the reliability scenarios run:
// IDEM_RELIABILITY=long (set by `make reliability`).
func Long() bool { return os.Getenv("IDEM_RELIABILITY") == "long" }

// Scale returns short in the normal test command and long under Long.
func Scale(short, long int) int {
	if Long() {
		return long
	}
	return short
}

// Row is one line of RELIABILITY.md's table.
type Row struct {
	Scenario   string `json:"scenario"`   // e.g. "crash: SIGKILL mid-handler"
	Store      string `json:"store"`      // e.g. "redis (single)", "postgres", "redis cluster"
	Fault      string `json:"fault"`      // what was done to the system
	Requests   int    `json:"requests"`   // operations attempted (requests, messages, calls)
	Keys       int    `json:"keys"`       // distinct idempotency keys
	Duplicates int    `json:"duplicates"` // effects beyond the first, summed over keys
	Lost       int    `json:"lost"`       // completions acknowledged to a client and later missing
	Stuck      int    `json:"stuck"`      // keys still in flight after lease + grace
	// ClientErrors counts what clients saw besides success, e.g.
	// {"503": 12, "timeout": 3}.
	ClientErrors map[string]int `json:"client_errors,omitempty"`
	Notes        string         `json:"notes,omitempty"`
}

var mu sync.Mutex

// Report logs r with t.Log in a fixed format and, when IDEM_RELIABILITY_OUT
// names a file, appends r to it as one JSON line (scripts/reliability.sh
// turns those lines into the table of RELIABILITY.md).
func Report(t testing.TB, r Row) {
	t.Helper()
	t.Logf("RELIABILITY | %s | %s | %s | %d requests | %d keys | %d duplicates | %d lost | %d stuck | %s | %s",
		r.Scenario, r.Store, r.Fault, r.Requests, r.Keys, r.Duplicates, r.Lost, r.Stuck, FormatErrors(r.ClientErrors), r.Notes)
	path := os.Getenv("IDEM_RELIABILITY_OUT")
	if path == "" {
		return
	}
	line, err := json.Marshal(r)
	if err != nil {
		t.Errorf("reltest: %v", err)
		return
	}
	mu.Lock()
	defer mu.Unlock()
	f, err := os.OpenFile(path, os.O_APPEND|os.O_CREATE|os.O_WRONLY, 0o644)
	if err != nil {
		t.Errorf("reltest: %v", err)
		return
	}
	defer f.Close()
	if _, err := f.Write(append(line, '\n')); err != nil {
		t.Errorf("reltest: %v", err)
	}
}

// FormatErrors renders client errors as "503×12, timeout×3" in a stable
// order, or "none".
func FormatErrors(m map[string]int) string {
	if len(m) == 0 {
		return "none"
	}
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	parts := make([]string, len(keys))
	for i, k := range keys {
		parts[i] = fmt.Sprintf("%s×%d", k, m[k])
	}
	return strings.Join(parts, ", ")
}

// Parallel runs fn over items with workers goroutines and returns when
// every item is done.
func Parallel[T any](items []T, workers int, fn func(T)) {
	ch := make(chan T)
	var wg sync.WaitGroup
	for range workers {
		wg.Go(func() {
			for it := range ch {
				fn(it)
			}
		})
	}
	for _, it := range items {
		ch <- it
	}
	close(ch)
	wg.Wait()
}
