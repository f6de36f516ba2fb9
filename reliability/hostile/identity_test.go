package hostile

import (
	"encoding/base64"
	"fmt"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/reltest"
)

// callerKind is one way a client names itself: Alice's headers, the
// same caller written another way (a lower-case name, a lower-case
// scheme, another cookie beside it) for her retry, and Bob's headers.
type callerKind struct {
	name                string
	alice, retry, bob   [][2]string
	proxyArgs, caddyCfg []string // the tenant source it needs, if any
}

func bearer(tok string) string { return "Bearer " + tok }

func basic(user string) string {
	return "Basic " + base64.StdEncoding.EncodeToString([]byte(user+":pw"))
}

var callerKinds = []callerKind{
	{name: "Authorization: Bearer",
		alice: [][2]string{{"Authorization", bearer("alice-tok")}}, retry: [][2]string{{"authorization", "bearer  alice-tok"}},
		bob: [][2]string{{"Authorization", bearer("bob-tok")}}},
	{name: "Authorization: Basic",
		alice: [][2]string{{"Authorization", basic("alice")}}, retry: [][2]string{{"AUTHORIZATION", strings.Replace(basic("alice"), "Basic", "BASIC", 1)}},
		bob: [][2]string{{"Authorization", basic("bob")}}},
	{name: "X-Api-Key",
		alice: [][2]string{{"X-Api-Key", "alice-secret"}}, retry: [][2]string{{"x-api-key", "alice-secret"}},
		bob: [][2]string{{"X-Api-Key", "bob-secret"}}},
	{name: "Api-Key",
		alice: [][2]string{{"Api-Key", "alice-secret"}}, retry: [][2]string{{"api-key", "alice-secret"}},
		bob: [][2]string{{"Api-Key", "bob-secret"}}},
	{name: "X-Auth-Token",
		alice: [][2]string{{"X-Auth-Token", "alice-secret"}}, retry: [][2]string{{"x-auth-token", "alice-secret"}},
		bob: [][2]string{{"X-Auth-Token", "bob-secret"}}},
	{name: "--tenant-header X-Tenant-Id", proxyArgs: []string{"--tenant-header", "X-Tenant-Id"}, caddyCfg: []string{"tenant_header X-Tenant-Id"},
		alice: [][2]string{{"X-Tenant-Id", "acct-alice"}}, retry: [][2]string{{"x-tenant-id", "acct-alice"}},
		bob: [][2]string{{"X-Tenant-Id", "acct-bob"}}},
	{name: "--tenant-cookie sid", proxyArgs: []string{"--tenant-cookie", "sid"}, caddyCfg: []string{"tenant_cookie sid"},
		alice: [][2]string{{"Cookie", "sid=alice-sess"}}, retry: [][2]string{{"Cookie", "theme=dark; sid=alice-sess; _ga=GA1.2.3"}},
		bob: [][2]string{{"Cookie", "sid=bob-sess"}}},
}

// targetsFor starts the systems under test of a scenario: `idem proxy`
// with proxyArgs and Caddy with caddyCfg, both in front of upstream.
func targetsFor(t *testing.T, upstream string, proxyArgs, caddyCfg []string) []*idemTarget {
	return []*idemTarget{startProxyTarget(t, upstream, proxyArgs...), startCaddyTarget(t, upstream, caddyCfg...)}
}

// tally is what a scenario counts for its row.
type tally struct {
	requests, executions, replays, leaked int
	errs                                  map[string]int
}

func (c *tally) add(a answer) answer {
	c.requests++
	if a.replayed() {
		c.replays++
	}
	if a.status >= 300 {
		if c.errs == nil {
			c.errs = map[string]int{}
		}
		c.errs[fmt.Sprint(a.status)]++
	}
	return a
}

// TestCallerCredentialStyles sends the same key and body as Alice and
// then as Bob, for every way a caller is identified: Authorization
// (Bearer and Basic), the API-key headers X-Api-Key, Api-Key and
// X-Auth-Token, and the proxy's --tenant-header and --tenant-cookie
// (Caddy's tenant_header, tenant_cookie). Alice's retry, written another
// way (a lower-case name, scheme or extra cookies), replays her answer;
// Bob gets his own execution, never her body or her X-Session-Token.
// A client certificate is not here: neither the proxy nor this Caddy
// site terminates TLS (see TestClientCertificateCaddy).
func TestCallerCredentialStyles(t *testing.T) {
	t.Parallel()
	up := startCallerUpstream(t)
	client := newClient(10 * time.Second)
	byTarget := map[string]*tally{}
	for _, kind := range []string{"idem proxy", "Caddy"} {
		byTarget[kind] = &tally{}
	}
	started := map[string][]*idemTarget{}
	for _, ck := range callerKinds {
		source := strings.Join(ck.proxyArgs, " ")
		if started[source] == nil {
			started[source] = targetsFor(t, up.url, ck.proxyArgs, ck.caddyCfg)
		}
		for _, tg := range started[source] {
			c := byTarget[tg.name]
			key := "cred-" + strings.NewReplacer(" ", "", ":", "").Replace(ck.name) + "-" + randomToken()
			body := `{"amount":100}`
			before := up.count()
			first := c.add(send(t, client, tg.url+"/charges", key, body, ck.alice))
			retry := c.add(send(t, client, tg.url+"/charges", key, body, ck.retry))
			bob := c.add(send(t, client, tg.url+"/charges", key, body, ck.bob))
			again := c.add(send(t, client, tg.url+"/charges", key, body, ck.alice))
			execs := up.count() - before
			c.executions += execs
			aliceToken := first.header.Get("X-Session-Token")
			where := fmt.Sprintf("%s, %s", tg.name, ck.name)
			switch {
			case first.status != http.StatusCreated || first.replayed() || aliceToken == "":
				t.Errorf("%s: got Alice's first answer %d (replayed %v, X-Session-Token %q), want an execution's 201 with a token", where, first.status, first.replayed(), aliceToken)
			case retry.status != http.StatusCreated || !retry.replayed() || retry.body != first.body:
				t.Errorf("%s: got Alice's retry (%v) %d %q (replayed %v), want the replay of %q", where, ck.retry, retry.status, retry.body, retry.replayed(), first.body)
			case again.body != first.body || !again.replayed():
				t.Errorf("%s: got Alice's retry after Bob %q (replayed %v), want her replay %q", where, again.body, again.replayed(), first.body)
			}
			if bob.replayed() || bob.body == first.body || strings.Contains(bob.body, aliceToken) ||
				slices.Contains(bob.header.Values("X-Session-Token"), aliceToken) {
				c.leaked++
				t.Errorf("%s: got Bob's answer %d %q (replayed %v, X-Session-Token %q), want his own execution, nothing of Alice's %q",
					where, bob.status, bob.body, bob.replayed(), bob.header.Values("X-Session-Token"), first.body)
			} else if bob.status != http.StatusCreated {
				t.Errorf("%s: got Bob's answer %d %q, want his own 201", where, bob.status, bob.body)
			}
			if execs != 2 {
				t.Errorf("%s: the upstream ran %d times for Alice (twice), Bob and Alice again on one key, want 2", where, execs)
			}
		}
	}
	for _, name := range []string{"idem proxy", "Caddy"} {
		c := byTarget[name]
		reltest.Report(t, reltest.Row{
			Scenario: "hostile: another caller, every credential style (" + name + ")", Store: "redis (single)",
			Fault: fmt.Sprintf("same key and body from Alice (twice, the retry spelled another way), Bob, Alice: %d styles (Bearer, Basic, X-Api-Key, Api-Key, X-Auth-Token, tenant header, tenant cookie)",
				len(callerKinds)),
			Requests: c.requests, Keys: len(callerKinds), Duplicates: c.executions - 2*len(callerKinds), ClientErrors: c.errs,
			Notes: fmt.Sprintf("%d executions (one per caller), %d replays, each to its own caller; leaked to another caller: %d (body or X-Session-Token); client certificate: see its own row",
				c.executions, c.replays, c.leaked),
		})
	}
}

// TestVirtualHosts sends one key and body, with one credential, to two
// virtual hosts: shop-a.example and shop-b.example each run once, and the
// same hosts written another way (Shop-A.example:8080, a trailing dot,
// upper case) replay their own host's answer, never the other's.
func TestVirtualHosts(t *testing.T) {
	t.Parallel()
	up := startCallerUpstream(t)
	client := newClient(10 * time.Second)
	for _, tg := range targetsFor(t, up.url, nil, nil) {
		var c tally
		key, body := "vhost-"+randomToken(), `{"sku":"X1"}`
		auth := [2]string{"Authorization", bearer("shop-client")}
		before := up.count()
		a := c.add(send(t, client, tg.url+"/orders", key, body, [][2]string{{"Host", "shop-a.example"}, auth}))
		b := c.add(send(t, client, tg.url+"/orders", key, body, [][2]string{{"Host", "shop-b.example"}, auth}))
		if a.status != http.StatusCreated || a.replayed() {
			t.Errorf("%s: got shop-a's first answer %d (replayed %v) %q, want an execution", tg.name, a.status, a.replayed(), a.body)
		}
		if b.replayed() || b.body == a.body || b.header.Get("X-Session-Token") == a.header.Get("X-Session-Token") {
			c.leaked++
			t.Errorf("%s: got shop-b's answer %d %q (replayed %v), want its own execution, not shop-a's %q", tg.name, b.status, b.body, b.replayed(), a.body)
		}
		for _, v := range []struct{ host, want string }{
			{"Shop-A.example:8080", a.body}, {"shop-a.example.", a.body}, {"SHOP-B.EXAMPLE", b.body}, {"shop-b.example:443", b.body},
		} {
			got := c.add(send(t, client, tg.url+"/orders", key, body, [][2]string{{"Host", v.host}, auth}))
			if !got.replayed() || got.body != v.want {
				t.Errorf("%s: got Host %s %d %q (replayed %v), want the replay %q", tg.name, v.host, got.status, got.body, got.replayed(), v.want)
				if got.body != v.want && got.replayed() {
					c.leaked++
				}
			}
		}
		c.executions = up.count() - before
		if c.executions != 2 {
			t.Errorf("%s: the upstream ran %d times for 2 virtual hosts, want 2", tg.name, c.executions)
		}
		reltest.Report(t, reltest.Row{
			Scenario: "hostile: virtual hosts (" + tg.name + ")", Store: "redis (single)",
			Fault:    "same key, body and credential to Host shop-a.example and shop-b.example, then Shop-A.example:8080, shop-a.example., SHOP-B.EXAMPLE, shop-b.example:443",
			Requests: c.requests, Keys: 1, Duplicates: c.executions - 2, ClientErrors: c.errs,
			Notes: fmt.Sprintf("%d executions (one per host), %d replays, each its own host's; leaked to the other host: %d", c.executions, c.replays, c.leaked),
		})
	}
}

// TestCredentialSpellings sends one credential in the spellings RFC 9110
// makes equal (the scheme in any case, spaces around and inside), byte
// for byte over raw sockets and with curl (Go's client would trim them):
// one execution, every other spelling a replay. Another token, or the
// same token in another case (a credential is case-sensitive), runs.
func TestCredentialSpellings(t *testing.T) {
	t.Parallel()
	up := startCallerUpstream(t)
	for _, tg := range targetsFor(t, up.url, nil, nil) {
		var c tally
		key, body := "spell-"+randomToken(), `{"amount":5}`
		kl := "Idempotency-Key: " + key
		before := up.count()
		first := c.add(rawPost(t, tg.addr, "/charges", []string{kl, "Authorization: Bearer tokA"}, body))
		if first.status != http.StatusCreated || first.replayed() {
			t.Fatalf("%s: got the first answer %d %q (replayed %v), want an execution", tg.name, first.status, first.body, first.replayed())
		}
		spellings := []string{
			"Authorization: bearer tokA",
			"Authorization: Bearer  tokA",
			"Authorization: Bearer tokA ",
			"Authorization:   Bearer tokA",
			"authorization: BEARER tokA",
			"Authorization: Bearer\ttokA",
		}
		for _, s := range spellings {
			got := c.add(rawPost(t, tg.addr, "/charges", []string{kl, s}, body))
			if !got.replayed() || got.body != first.body {
				t.Errorf("%s: got %q %d %q (replayed %v), want the replay of %q", tg.name, s, got.status, got.body, got.replayed(), first.body)
			}
		}
		for _, s := range []string{"bearer   tokA", "  BeArEr tokA  "} {
			got := c.add(curlPost(t, tg.url+"/charges", key, body, "-H", "Authorization: "+s))
			if !got.replayed() || got.body != first.body {
				t.Errorf("%s: got curl with %q %d %q (replayed %v), want the replay of %q", tg.name, s, got.status, got.body, got.replayed(), first.body)
			}
		}
		for _, s := range []string{"Authorization: Bearer tokB", "Authorization: Bearer TOKA"} {
			got := c.add(rawPost(t, tg.addr, "/charges", []string{kl, s}, body))
			if got.replayed() || got.body == first.body || got.status != http.StatusCreated {
				c.leaked++
				t.Errorf("%s: got %q %d %q (replayed %v), want its own execution", tg.name, s, got.status, got.body, got.replayed())
			}
		}
		c.executions = up.count() - before
		if c.executions != 3 {
			t.Errorf("%s: the upstream ran %d times for tokA in %d spellings, tokB and TOKA, want 3", tg.name, c.executions, 1+len(spellings)+2)
		}
		reltest.Report(t, reltest.Row{
			Scenario: "hostile: one credential spelled many ways (" + tg.name + ")", Store: "redis (single)",
			Fault:    fmt.Sprintf("one key and body with Authorization Bearer tokA in %d spellings (scheme case, spaces, tab; raw sockets and curl), then tokB and TOKA", 1+len(spellings)+2),
			Requests: c.requests, Keys: 1, Duplicates: c.executions - 3, ClientErrors: c.errs,
			Notes: fmt.Sprintf("%d executions (tokA once, tokB, TOKA), %d replays; another token given tokA's answer: %d", c.executions, c.replays, c.leaked),
		})
	}
}

// TestPathEscapes sends one key and body to one path in several escapes
// (curl --path-as-is, so the escapes reach idem as written): /acct/pay,
// /acct/%70ay, /acct/pa%79 and /%61cct/p%61y run once, and the upstream
// sees one path; /acct/pay%2Fx and /acct/pay%2fx (an escaped slash,
// which servers tell from /) are another route, once.
func TestPathEscapes(t *testing.T) {
	t.Parallel()
	up := startCallerUpstream(t)
	for _, tg := range targetsFor(t, up.url, nil, nil) {
		var c tally
		key, body := "path-"+randomToken(), `{"amount":9}`
		auth := []string{"-H", "Authorization: Bearer path-client"}
		before := up.count()
		var pay, slash answer
		for i, p := range []string{"/acct/pay", "/acct/%70ay", "/acct/pa%79", "/%61cct/p%61y"} {
			got := c.add(curlPost(t, tg.url+p, key, body, auth...))
			if i == 0 {
				pay = got
				if got.status != http.StatusCreated || got.replayed() {
					t.Fatalf("%s: got %s %d %q (replayed %v), want an execution", tg.name, p, got.status, got.body, got.replayed())
				}
			} else if !got.replayed() || got.body != pay.body {
				t.Errorf("%s: got %s %d %q (replayed %v), want the replay of /acct/pay's %q", tg.name, p, got.status, got.body, got.replayed(), pay.body)
			}
		}
		for i, p := range []string{"/acct/pay%2Fx", "/acct/pay%2fx"} {
			got := c.add(curlPost(t, tg.url+p, key, body, auth...))
			if i == 0 {
				slash = got
				if got.replayed() || got.body == pay.body {
					t.Errorf("%s: got %s %d %q (replayed %v), want its own execution", tg.name, p, got.status, got.body, got.replayed())
				}
			} else if !got.replayed() || got.body != slash.body {
				t.Errorf("%s: got %s %d %q (replayed %v), want the replay of %q", tg.name, p, got.status, got.body, got.replayed(), slash.body)
			}
		}
		runs := up.since(before)
		c.executions = len(runs)
		paths := map[string]bool{}
		var uris []string
		for _, r := range runs {
			paths[r.path] = true
			uris = append(uris, r.uri)
		}
		if c.executions != 2 || len(paths) != 2 {
			t.Errorf("%s: the upstream ran %d times, on paths %v (sent as %q), want twice: /acct/pay once and /acct/pay/x once", tg.name, c.executions, paths, uris)
		}
		reltest.Report(t, reltest.Row{
			Scenario: "hostile: path escapes (" + tg.name + ")", Store: "redis (single)",
			Fault:    "one key and body to /acct/pay, /acct/%70ay, /acct/pa%79, /%61cct/p%61y, /acct/pay%2Fx, /acct/pay%2fx (curl --path-as-is)",
			Requests: c.requests, Keys: 1, Duplicates: c.executions - 2, ClientErrors: c.errs,
			Notes: fmt.Sprintf("%d executions: /acct/pay once (the upstream saw one path for its 4 spellings), /acct/pay%%2Fx once; %d replays; the upstream was sent %s",
				c.executions, c.replays, strings.Join(uris, " and ")),
		})
	}
}
