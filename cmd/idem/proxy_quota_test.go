package main

import (
	"encoding/json"
	"fmt"
	"net/http"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/idemkit/idem/idemhttp"
)

// floodResult is what testdata/quota_flood.py prints.
type floodResult struct {
	AttackerStored int `json:"attacker_stored"`
	AttackerStop   *struct {
		Status      int    `json:"status"`
		RetryAfter  string `json:"retry_after"`
		ContentType string `json:"content_type"`
		Problem     string `json:"problem"`
	} `json:"attacker_stop"`
	Victim []struct {
		Key     string `json:"key"`
		Answers []struct {
			Status   int    `json:"status"`
			Replayed bool   `json:"replayed"`
			Body     string `json:"body"`
		} `json:"answers"`
	} `json:"victim"`
}

// runFlood runs testdata/quota_flood.py (Python requests) against p.
func runFlood(t *testing.T, p *proxyProc, maxKeys, bodyBytes int) floodResult {
	t.Helper()
	out, err := exec.Command("python3", "testdata/quota_flood.py", p.url(""), strconv.Itoa(maxKeys), strconv.Itoa(bodyBytes)).Output()
	if ee, ok := err.(*exec.ExitError); ok {
		t.Fatalf("quota_flood.py: %v\n%s", err, ee.Stderr)
	} else if err != nil {
		t.Fatalf("quota_flood.py: %v (python3 with requests: scripts/test.sh installs it)", err)
	}
	var res floodResult
	if err := json.Unmarshal(out, &res); err != nil {
		t.Fatalf("quota_flood.py printed %q: %v", out, err)
	}
	return res
}

// The reproduced defect, from outside: on the default memory store (128
// MiB), one client's flood of new keys with 700 KB bodies filled the store
// after 191 requests, and from then on every new key of every client got
// 503 store-full for the retention; with --fail-open, a victim's three
// retries of one key ran three times. With the default quota each tenant
// holds at most an eighth of --memory-limit: the attacker gets 429 with
// Retry-After (nothing forwarded), and the victim, another Authorization,
// stores new keys whose retries replay, upstream run once, with and
// without --fail-open.
func TestProxyQuotaFlood(t *testing.T) {
	for _, failOpen := range []bool{false, true} {
		t.Run(fmt.Sprintf("fail-open=%t", failOpen), func(t *testing.T) {
			t.Parallel()
			up := newTestUpstream(t)
			args := []string{"--upstream", up.URL}
			if failOpen {
				args = append(args, "--fail-open")
			}
			p := startProxy(t, nil, args...)
			if log := p.logText(); !strings.Contains(log, `"quota":"in_flight=32 bytes=16777216"`) {
				t.Errorf("start-up line: want quota in_flight=32 bytes=16777216 (an eighth of 128 MiB) in\n%s", log)
			}
			const maxKeys, body = 400, 700_000 // 400 such keys hold more than 128 MiB, compressed or not
			res := runFlood(t, p, maxKeys, body)

			stop := res.AttackerStop
			if stop == nil || stop.Status != http.StatusTooManyRequests || stop.Problem != idemhttp.ProblemQuotaExceeded ||
				stop.ContentType != "application/problem+json" {
				t.Errorf("attacker: %d keys stored, then %+v; want 429 %s (problem+json) before the store fills", res.AttackerStored, stop, idemhttp.ProblemQuotaExceeded)
			} else if ra, err := strconv.Atoi(stop.RetryAfter); err != nil || ra < 1 {
				t.Errorf("attacker's 429: Retry-After %q, want a number of seconds", stop.RetryAfter)
			}
			// An eighth of 128 MiB, in records of about 700 KB: 24, and
			// the one that took it past.
			if max := (128 << 20 / 8 / body) + 1; res.AttackerStored > max {
				t.Errorf("attacker stored %d keys, want at most %d", res.AttackerStored, max)
			}
			if up.runsOf(fmt.Sprint("flood-", res.AttackerStored)) != 0 {
				t.Errorf("the refused key reached the upstream")
			}
			for _, v := range res.Victim {
				a := v.Answers
				if a[0].Status != http.StatusCreated || a[0].Replayed {
					t.Errorf("victim's %s: got %d (replayed %t) %s, want 201 executed", v.Key, a[0].Status, a[0].Replayed, a[0].Body)
					continue
				}
				for i, r := range a[1:] {
					if r.Status != http.StatusCreated || !r.Replayed || r.Body != a[0].Body {
						t.Errorf("victim's retry %d of %s: got %d (replayed %t), want the replay", i+1, v.Key, r.Status, r.Replayed)
					}
				}
				if n := up.runsOf(v.Key); n != 1 {
					t.Errorf("victim's %s: the upstream ran it %d times, want 1", v.Key, n)
				}
			}
			if n := p.metric(`idem_quota_exceeded_total{limit="bytes"}`); n != 1 {
				t.Errorf(`idem_quota_exceeded_total{limit="bytes"}: got %v, want 1`, n)
			}
			if n := p.metric(`idem_requests_total{outcome="quota_exceeded"}`); n != 1 {
				t.Errorf(`idem_requests_total{outcome="quota_exceeded"}: got %v, want 1`, n)
			}
			if n := p.metric(`idem_memory_refused_total`); n != 0 {
				t.Errorf("idem_memory_refused_total: got %v, want 0 (the store never filled)", n)
			}
		})
	}
}

// A --config route with quota settings has its own limits and counts:
// its tenant's records there do not use the flags' quota, and the flags'
// routes do not use its. Bad quota settings are usage errors that say
// what is wanted.
func TestProxyQuotaPerRoute(t *testing.T) {
	t.Parallel()
	up := newTestUpstream(t)
	cfg := filepath.Join(t.TempDir(), "routes.yaml")
	writeFile(t, cfg, "routes:\n  - match: \"POST /tight/\"\n    methods: [POST]\n    quota_records: 1\n")
	p := startProxy(t, nil, "--upstream", up.URL, "--config", cfg, "--quota-records", "2")
	wantStatus(t, "first /tight/ key", mustSend(t, "POST", p.url("/tight/a"), "t1", "{}"), http.StatusCreated, "")
	r := mustSend(t, "POST", p.url("/tight/a"), "t2", "{}")
	wantStatus(t, "second /tight/ key", r, http.StatusTooManyRequests, idemhttp.ProblemQuotaExceeded)
	if r.header.Get("Retry-After") == "" || up.runsOf("t2") != 0 {
		t.Errorf("second /tight/ key: Retry-After %q, upstream runs %d; want a Retry-After and none", r.header.Get("Retry-After"), up.runsOf("t2"))
	}
	if again := mustSend(t, "POST", p.url("/tight/a"), "t1", "{}"); !again.replayed() {
		t.Errorf("the stored /tight/ key over its quota: got %d, want its replay", again.status)
	}
	for _, k := range []string{"o1", "o2"} {
		wantStatus(t, "a key elsewhere ("+k+")", mustSend(t, "POST", p.url("/orders"), k, "{}"), http.StatusCreated, "")
	}
	wantStatus(t, "a third key elsewhere", mustSend(t, "POST", p.url("/orders"), "o3", "{}"), http.StatusTooManyRequests, idemhttp.ProblemQuotaExceeded)
	wantStatus(t, "another tenant elsewhere", mustSend(t, "POST", p.url("/orders"), "o3", "{}", "Authorization: Bearer b"), http.StatusCreated, "")
	if n := p.metric(`idem_quota_exceeded_total{limit="records"}`); n != 2 {
		t.Errorf(`idem_quota_exceeded_total{limit="records"}: got %v, want 2`, n)
	}

	for _, c := range []struct {
		file string
		args []string
		want string
	}{
		{"routes:\n  - match: \"POST /x\"\n    methods: [POST]\n    quota_in_flight: -1\n", nil, "quota_in_flight -1: must not be negative (0: no limit)"},
		{"routes:\n  - match: \"POST /x\"\n    methods: [POST]\n    quota_bytes: lots\n", nil, `"lots" is not a size`},
		{"", []string{"--quota-tenants", "0"}, "--quota-tenants 0: want at least 1"},
	} {
		args := append([]string{"proxy", "--upstream", up.URL}, c.args...)
		if c.file != "" {
			f := filepath.Join(t.TempDir(), "bad.yaml")
			writeFile(t, f, c.file)
			args = append(args, "--config", f)
		}
		if code, stderr := runIdem(t, nil, args...); code != 2 || !strings.Contains(stderr, c.want) {
			t.Errorf("idem %q: exit %d, stderr %q; want 2 and %q", args, code, stderr, c.want)
		}
	}
}
