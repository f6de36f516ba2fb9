package idemlambda_test

// Callers through API Gateway under the runtime emulator: the function
// (internal/testfn, modes "apigw" and "apigwv2") is wrapped with the
// defaults, and its handler answers with a session cookie and hop-by-hop
// headers in every spelling a handler may write them.

import (
	"encoding/json"
	"fmt"
	"slices"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/aws/aws-lambda-go/events"
)

var requestIDs atomic.Int64

// restEvent is a REST API (v1) request to POST /orders.
func restEvent(key, body string, headers map[string]string) events.APIGatewayProxyRequest {
	h := map[string]string{"Content-Type": "application/json"}
	if key != "" {
		h["Idempotency-Key"] = key
	}
	for k, v := range headers {
		h[k] = v
	}
	mv := map[string][]string{}
	for k, v := range h {
		mv[k] = []string{v}
	}
	return events.APIGatewayProxyRequest{
		Resource: "/orders", Path: "/orders", HTTPMethod: "POST",
		Headers: h, MultiValueHeaders: mv, Body: body,
		// A request id and a time that change on every delivery, as API
		// Gateway's do: not part of the fingerprint.
		RequestContext: events.APIGatewayProxyRequestContext{
			RequestID: fmt.Sprint("req-", requestIDs.Add(1)), RequestTimeEpoch: requestIDs.Load(),
			ResourcePath: "/orders", HTTPMethod: "POST", Stage: "prod",
		},
	}
}

// httpEvent is an HTTP API (v2) request to POST /orders, its header
// names in lower case as API Gateway sends them.
func httpEvent(key, body string, headers map[string]string, sub string) events.APIGatewayV2HTTPRequest {
	h := map[string]string{"content-type": "application/json", "idempotency-key": key}
	for k, v := range headers {
		h[strings.ToLower(k)] = v
	}
	e := events.APIGatewayV2HTTPRequest{
		Version: "2.0", RouteKey: "POST /orders", RawPath: "/orders", Headers: h, Body: body,
		RequestContext: events.APIGatewayV2HTTPRequestContext{
			RouteKey: "POST /orders", RequestID: fmt.Sprint("req-", requestIDs.Add(1)),
			HTTP: events.APIGatewayV2HTTPRequestContextHTTPDescription{Method: "POST", Path: "/orders"},
		},
	}
	if sub != "" {
		e.RequestContext.Authorizer = &events.APIGatewayV2HTTPRequestContextAuthorizerDescription{
			JWT: &events.APIGatewayV2HTTPRequestContextAuthorizerJWTDescription{Claims: map[string]string{"sub": sub}},
		}
	}
	return e
}

// restAnswer is the REST function's answer.
type restAnswer struct {
	raw  string
	resp events.APIGatewayProxyResponse
	err  string // the errorType of a failed invocation
}

func (in *instance) rest(e events.APIGatewayProxyRequest) restAnswer {
	in.t.Helper()
	r := in.invoke(e)
	a := restAnswer{raw: string(r.raw), err: r.ErrorType}
	if a.err == "" {
		if err := json.Unmarshal(r.raw, &a.resp); err != nil {
			in.t.Fatalf("answer %s: %v", r.raw, err)
		}
	}
	return a
}

// run is the run of the handler that made the answer (its X-Run).
func (a restAnswer) run() string { return a.resp.Headers["X-Run"] }

// replayable are the answer's header names that a repeat may get: none
// of Set-Cookie and the hop-by-hop headers, in any case.
func checkNoPrivateHeaders(t *testing.T, who string, raw string) {
	t.Helper()
	low := strings.ToLower(raw)
	for _, h := range []string{"set-cookie", "session=", "connection", "keep-alive", "transfer-encoding", "upgrade"} {
		if strings.Contains(low, `"`+h) || strings.Contains(low, h+`"`) || (h == "session=" && strings.Contains(low, h)) {
			t.Errorf("%s: the replay holds %q: %s", who, h, raw)
		}
	}
}

// Alice, Bob and an anonymous caller use one key with one body: three
// executions, and nobody gets Alice's session cookie; Alice's own retry
// is a replay without it. The anonymous caller is logged once per route.
func TestRIEAPIGatewayCallersDoNotShare(t *testing.T) {
	rs, db := startRedis(t)
	in := startInstance(t, rs.Addr(), 10, "IDEMTEST_MODE=apigw")
	const body = `{"amount":5}`
	alice := in.rest(restEvent("k", body, map[string]string{"Authorization": "Bearer alice"}))
	if alice.err != "" || alice.resp.StatusCode != 201 || alice.run() != "1" {
		t.Fatalf("Alice: %s", alice.raw)
	}
	// The first answer is the handler's, cookies included: they are hers.
	if alice.resp.Headers["set-cookie"] != "session=run1" || !slices.Equal(alice.resp.MultiValueHeaders["Set-Cookie"], []string{"session=run1-canonical"}) {
		t.Fatalf("Alice's own answer lost its cookies: %s", alice.raw)
	}
	again := in.rest(restEvent("k", body, map[string]string{"Authorization": "Bearer alice"}))
	if again.err != "" || again.run() != "1" || again.resp.Body != alice.resp.Body {
		t.Fatalf("Alice's retry: %s, want the replay of run 1", again.raw)
	}
	checkNoPrivateHeaders(t, "Alice's retry", again.raw)
	if !slices.Equal(again.resp.MultiValueHeaders["x-multi"], []string{"1", "2"}) || again.resp.Headers["Content-Type"] != "application/json" {
		t.Errorf("Alice's retry lost its other headers: %s", again.raw)
	}
	bob := in.rest(restEvent("k", body, map[string]string{"Authorization": "Bearer bob"}))
	anon := in.rest(restEvent("k", body, nil))
	for _, a := range []struct {
		who string
		a   restAnswer
		run string
	}{{"Bob", bob, "2"}, {"anonymous", anon, "3"}} {
		if a.a.err != "" || a.a.run() != a.run || strings.Contains(a.a.raw, "session=run1") {
			t.Errorf("%s: %s; want run %s, and never Alice's session", a.who, a.a.raw, a.run)
		}
	}
	if n := db.int("runs:k"); n != 3 {
		t.Fatalf("%d executions for Alice, Bob and an anonymous caller, want 3", n)
	}
	in.rest(restEvent("k2", body, nil))
	in.waitLog("caller nothing identifies")
	if n := strings.Count(in.log.String(), "caller nothing identifies"); n != 1 {
		t.Errorf("%d WARN lines for two anonymous requests to one route, want 1:\n%s", n, in.log.String())
	}
}

// One credential spelled five ways (the scheme's case, whitespace, the
// header name's case, in Headers or MultiValueHeaders) is one caller: one
// execution; another token is another caller.
func TestRIEAPIGatewayCredentialSpellings(t *testing.T) {
	rs, db := startRedis(t)
	in := startInstance(t, rs.Addr(), 10, "IDEMTEST_MODE=apigw")
	spellings := []struct{ name, value string }{
		{"Authorization", "Bearer tokA"},
		{"authorization", "bearer tokA"},
		{"AUTHORIZATION", "Bearer  tokA"},
		{"Authorization", "Bearer tokA "},
		{"aUthorization", "  Bearer tokA"},
	}
	for i, s := range spellings {
		a := in.rest(restEvent("k", `{"amount":5}`, map[string]string{s.name: s.value}))
		if a.err != "" || a.run() != "1" {
			t.Fatalf("spelling %d (%s: %q): %s, want run 1", i+1, s.name, s.value, a.raw)
		}
	}
	if b := in.rest(restEvent("k", `{"amount":5}`, map[string]string{"Authorization": "Bearer tokB"})); b.run() != "2" {
		t.Fatalf("Bearer tokB: %s, want its own run", b.raw)
	}
	if n := db.int("runs:k"); n != 2 {
		t.Fatalf("%d executions, want 2 (tokA once, tokB once)", n)
	}
}

// A different body under one key, from the same caller, is a mismatch,
// not a replay; so is another query.
func TestRIEAPIGatewayBodyMismatch(t *testing.T) {
	rs, db := startRedis(t)
	in := startInstance(t, rs.Addr(), 10, "IDEMTEST_MODE=apigw")
	auth := map[string]string{"Authorization": "Bearer alice"}
	if a := in.rest(restEvent("k", `{"amount":5}`, auth)); a.run() != "1" {
		t.Fatalf("first: %s", a.raw)
	}
	if a := in.rest(restEvent("k", `{"amount":500}`, auth)); a.err != "MismatchError" {
		t.Fatalf("another body under the key: %s, want errorType MismatchError", a.raw)
	}
	e := restEvent("k", `{"amount":5}`, auth)
	e.QueryStringParameters = map[string]string{"currency": "EUR"}
	if a := in.rest(e); a.err != "MismatchError" {
		t.Fatalf("another query under the key: %s, want errorType MismatchError", a.raw)
	}
	if n := db.int("runs:k"); n != 1 {
		t.Fatalf("%d executions, want 1", n)
	}
}

// X-Api-Key alice and bob are two callers; the header's name in another
// case is the same caller.
func TestRIEAPIGatewayAPIKeys(t *testing.T) {
	rs, db := startRedis(t)
	in := startInstance(t, rs.Addr(), 10, "IDEMTEST_MODE=apigw")
	a := in.rest(restEvent("k", `{}`, map[string]string{"X-Api-Key": "alice-secret"}))
	b := in.rest(restEvent("k", `{}`, map[string]string{"X-Api-Key": "bob-secret"}))
	a2 := in.rest(restEvent("k", `{}`, map[string]string{"x-api-key": "alice-secret"}))
	if a.run() != "1" || b.run() != "2" || a2.run() != "1" {
		t.Fatalf("runs %q %q %q, want alice 1, bob 2, alice again 1:\n%s\n%s\n%s", a.run(), b.run(), a2.run(), a.raw, b.raw, a2.raw)
	}
	if strings.Contains(b.raw, "session=run1") {
		t.Fatalf("Bob got Alice's session: %s", b.raw)
	}
	if n := db.int("runs:k"); n != 2 {
		t.Fatalf("%d executions, want 2", n)
	}
}

// HTTP API (v2): Cookies and a lower-case set-cookie header are not
// replayed; the JWT authorizer's sub names the caller whatever token it
// sent.
func TestRIEAPIGatewayV2CookiesAndClaims(t *testing.T) {
	rs, db := startRedis(t)
	in := startInstance(t, rs.Addr(), 10, "IDEMTEST_MODE=apigwv2")
	call := func(auth, sub string) (events.APIGatewayV2HTTPResponse, string) {
		t.Helper()
		r := in.invoke(httpEvent("k", `{"amount":5}`, map[string]string{"Authorization": auth}, sub))
		var resp events.APIGatewayV2HTTPResponse
		if r.ErrorType != "" || json.Unmarshal(r.raw, &resp) != nil {
			t.Fatalf("answer %s", r.raw)
		}
		return resp, string(r.raw)
	}
	first, raw := call("Bearer t1", "alice")
	if first.Headers["x-run"] != "1" || !slices.Equal(first.Cookies, []string{"session=run1", "theme=dark"}) || first.Headers["set-cookie"] == "" {
		t.Fatalf("Alice's own answer: %s, want run 1 with her cookies", raw)
	}
	again, raw := call("Bearer t2", "alice") // a fresh token, the same sub
	if again.Headers["x-run"] != "1" {
		t.Fatalf("Alice with another token: %s, want the replay of run 1", raw)
	}
	if len(again.Cookies) != 0 {
		t.Errorf("the replay's cookies: %q, want none", again.Cookies)
	}
	checkNoPrivateHeaders(t, "Alice's retry", raw)
	if bob, raw := call("Bearer t1", "bob"); bob.Headers["x-run"] != "2" || strings.Contains(raw, "session=run1") {
		t.Fatalf("Bob (sub bob, Alice's token): %s, want his own run", raw)
	}
	if n := db.int("runs:k"); n != 2 {
		t.Fatalf("%d executions, want 2", n)
	}
}

// RefuseAnonymous: a keyed request that nothing identifies gets 401
// problem+json and does not run; an identified caller runs.
func TestRIEAPIGatewayRefuseAnonymous(t *testing.T) {
	rs, db := startRedis(t)
	in := startInstance(t, rs.Addr(), 10, "IDEMTEST_MODE=apigw", "IDEMTEST_REFUSE_ANONYMOUS=1")
	a := in.rest(restEvent("k", `{}`, nil))
	var p struct {
		Type   string `json:"type"`
		Status int    `json:"status"`
	}
	if a.err != "" || a.resp.StatusCode != 401 || a.resp.Headers["Content-Type"] != "application/problem+json" ||
		json.Unmarshal([]byte(a.resp.Body), &p) != nil || p.Type != "urn:idem:problem:anonymous" || p.Status != 401 {
		t.Fatalf("anonymous: %s, want 401 application/problem+json of type urn:idem:problem:anonymous", a.raw)
	}
	if n := db.int("runs:k"); n != 0 {
		t.Fatalf("the handler ran %d times for a refused request", n)
	}
	e := restEvent("k", `{}`, nil)
	e.RequestContext.Authorizer = map[string]any{"principalId": "user-1", "integrationLatency": 12}
	if a := in.rest(e); a.err != "" || a.run() != "1" {
		t.Fatalf("a caller with an authorizer's principal: %s, want it run", a.raw)
	}
}
