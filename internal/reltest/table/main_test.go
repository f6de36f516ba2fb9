package main

import (
	"strings"
	"testing"
)

func TestTable(t *testing.T) {
	in := `{"scenario":"zombie","store":"redis","fault":"a|b","requests":3,"keys":1,"client_errors":{"503":2,"409":1}}

{"scenario":"crash","store":"redis","fault":"kill","requests":10,"keys":5,"duplicates":2,"notes":"line\nbreak"}
{"scenario":"crash","store":"postgres","fault":"kill","requests":9,"keys":5}
`
	var out strings.Builder
	if err := run(strings.NewReader(in), &out); err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(strings.TrimSpace(out.String()), "\n")
	want := []string{
		"| crash | postgres | kill | 9 | 5 | 0 | 0 | 0 | none |  |",
		"| crash | redis | kill | 10 | 5 | 2 | 0 | 0 | none | line break |",
		`| zombie | redis | a\|b | 3 | 1 | 0 | 0 | 0 | 409×1, 503×2 |  |`,
	}
	if len(lines) != 2+len(want) {
		t.Fatalf("got %d lines, want %d:\n%s", len(lines), 2+len(want), out.String())
	}
	for i, w := range want {
		if lines[2+i] != w {
			t.Errorf("row %d:\n got %s\nwant %s", i, lines[2+i], w)
		}
	}
	if err := run(strings.NewReader("{not json\n"), &out); err == nil || !strings.Contains(err.Error(), "line 1") {
		t.Errorf("bad input: got %v, want an error naming line 1", err)
	}
}
