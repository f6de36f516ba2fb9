package main

import (
	"encoding/json"
	"path/filepath"
	"strings"
	"testing"
)

// idem demo --blob: without a blob store the reports' replays come
// without their body; with one, every copy gets the whole report, each
// generated once. On memory and on a directory.
func TestDemoBlob(t *testing.T) {
	for _, blob := range []string{"mem://", "file://" + filepath.Join(t.TempDir(), "blobs")} {
		code, out, errOut := inspectExec(t, "demo", "--json", "--payments", "5", "--copies", "3", "--blob", blob)
		if code != 0 {
			t.Fatalf("demo --blob %s: exit %d\n%s\n%s", blob, code, out, errOut)
		}
		var got struct {
			Large []demoLargeResult `json:"large_responses"`
			OK    bool              `json:"ok"`
		}
		if err := json.Unmarshal([]byte(out), &got); err != nil || len(got.Large) != 2 || !got.OK {
			t.Fatalf("demo --blob %s --json: %v\n%s", blob, err, out)
		}
		const requests = demoReports * 3
		without, with := got.Large[0], got.Large[1]
		if without.Generated != demoReports || without.Whole != demoReports || without.Omitted != requests-demoReports {
			t.Errorf("without a blob store: %+v, want %d generated, %d whole, %d omitted", without, demoReports, demoReports, requests-demoReports)
		}
		if with.Generated != demoReports || with.Whole != requests || with.Omitted != 0 || with.Replays != requests-demoReports {
			t.Errorf("with the blob store: %+v, want %d generated, all %d whole, %d replays", with, demoReports, requests, requests-demoReports)
		}
	}
	code, out, _ := inspectExec(t, "demo", "--payments", "2", "--copies", "2", "--blob", "mem://")
	if code != 0 || !strings.Contains(out, "all 8 copies got it whole") {
		t.Errorf("demo --blob mem://: exit %d\n%s", code, out)
	}
}
