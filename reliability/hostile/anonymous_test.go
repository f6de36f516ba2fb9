package hostile

import (
	"encoding/json"
	"fmt"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/reltest"
)

const anonymousSeries = "idem_anonymous_requests_total"

// TestAnonymousCallers sends keyed requests that nothing identifies (no
// Authorization, no API key, no tenant header or cookie) to two routes,
// one of them also spelled with an escape (/anon/%61 is /anon/a), beside
// an identified keyed request and an unkeyed one. Served by default: one
// WARN per route in the log, and idem_anonymous_requests_total counts the
// anonymous keyed requests only (the proxy's admin endpoint, Caddy's
// metrics). With --refuse-anonymous (Caddy: refuse_anonymous) they get
// 401 problem+json urn:idem:problem:anonymous and never reach the
// upstream, still counted; identified and unkeyed requests pass.
func TestAnonymousCallers(t *testing.T) {
	t.Parallel()
	up := startCallerUpstream(t)
	client := newClient(10 * time.Second)
	served := targetsFor(t, up.url, nil, nil)
	refusing := targetsFor(t, up.url, []string{"--refuse-anonymous"}, []string{"refuse_anonymous"})
	for i, tg := range served {
		var c tally
		before, m0 := up.count(), tg.metric(t, anonymousSeries)
		anonymous := 0
		for _, p := range []string{"/anon/a", "/anon/a", "/anon/a", "/anon/b", "/anon/b", "/anon/%61"} {
			got := c.add(curlPost(t, tg.url+p, "anon-"+randomToken(), "{}"))
			anonymous++
			if got.status != http.StatusCreated || got.replayed() {
				t.Errorf("%s: got an anonymous keyed POST %s %d %q, want it served (201)", tg.name, p, got.status, got.body)
			}
		}
		c.add(send(t, client, tg.url+"/anon/a", "anon-"+randomToken(), "{}", [][2]string{{"X-Api-Key", "k1"}}))
		c.add(send(t, client, tg.url+"/anon/a", "", "{}", nil))
		c.executions = up.count() - before
		if c.executions != anonymous+2 {
			t.Errorf("%s: the upstream ran %d times for %d requests, want each once", tg.name, c.executions, anonymous+2)
		}
		counted := tg.metric(t, anonymousSeries) - m0
		if counted != float64(anonymous) {
			t.Errorf("%s: got %s +%v, want +%d (the anonymous keyed requests only)", tg.name, anonymousSeries, counted, anonymous)
		}
		var warns []string
		waitFor(5*time.Second, func() bool { warns = tg.anonymousWarnings(); return len(warns) >= 2 })
		slices.Sort(warns)
		if len(warns) != 2 {
			t.Errorf("%s: got %d WARNs about unidentified callers (routes %q), want one per route (/anon/a, /anon/b)", tg.name, len(warns), warns)
		}

		// Refused.
		rf := refusing[i]
		var r tally
		before, m0 = up.count(), rf.metric(t, anonymousSeries)
		for _, p := range []string{"/anon/a", "/anon/b"} {
			got := r.add(curlPost(t, rf.url+p, "anon-"+randomToken(), "{}"))
			var prob struct{ Type string }
			json.Unmarshal([]byte(got.body), &prob)
			if got.status != http.StatusUnauthorized || !strings.HasPrefix(got.header.Get("Content-Type"), "application/problem+json") || prob.Type != "urn:idem:problem:anonymous" {
				t.Errorf("%s --refuse-anonymous: got an anonymous keyed POST %s %d %q (%s), want 401 problem+json urn:idem:problem:anonymous",
					rf.name, p, got.status, got.body, got.header.Get("Content-Type"))
			}
		}
		reached := up.count() - before
		if reached != 0 {
			t.Errorf("%s --refuse-anonymous: the upstream ran %d times for refused requests, want 0", rf.name, reached)
		}
		ok := r.add(send(t, client, rf.url+"/anon/a", "anon-"+randomToken(), "{}", [][2]string{{"Authorization", bearer("known")}}))
		unkeyed := r.add(send(t, client, rf.url+"/anon/a", "", "{}", nil))
		if ok.status != http.StatusCreated || unkeyed.status != http.StatusCreated {
			t.Errorf("%s --refuse-anonymous: got an identified keyed POST %d and an unkeyed one %d, want both served (201)", rf.name, ok.status, unkeyed.status)
		}
		r.executions = up.count() - before
		if got := rf.metric(t, anonymousSeries) - m0; got != 2 {
			t.Errorf("%s --refuse-anonymous: got %s +%v, want +2", rf.name, anonymousSeries, got)
		}
		flag := "--refuse-anonymous"
		if tg.name == "Caddy" {
			flag = "refuse_anonymous"
		}
		reltest.Report(t, reltest.Row{
			Scenario: "hostile: anonymous keyed requests (" + tg.name + ")", Store: "redis (single)",
			Fault: fmt.Sprintf("%d keyed POSTs without identity on /anon/a, /anon/b, /anon/%%61, one with X-Api-Key, one unkeyed; then with %s: 2 anonymous, 1 identified, 1 unkeyed",
				anonymous, flag),
			Requests: c.requests + r.requests, Keys: anonymous + 1 + 3, ClientErrors: r.errs,
			Notes: fmt.Sprintf("served: %d executions, %d WARNs (one per route), %s +%v; %s: 401 urn:idem:problem:anonymous, the upstream reached %d times for them, counted +2; identified and unkeyed ran (%d executions)",
				c.executions, len(warns), anonymousSeries, counted, flag, reached, r.executions),
		})
	}
}
