package idemlambda_test

import (
	"bytes"
	"context"
	"encoding/base64"
	"encoding/json"
	"encoding/pem"
	"errors"
	"log/slog"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/aws/aws-lambda-go/events"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemlambda"
)

// Every identity API Gateway establishes names a caller; the authorizer's
// wins over the request's headers; two sources never name one tenant.
func TestAPIGatewayTenantSources(t *testing.T) {
	v1 := func(mod func(*events.APIGatewayProxyRequest)) string {
		e := events.APIGatewayProxyRequest{}
		mod(&e)
		return idemlambda.APIGatewayTenant(e)
	}
	v2 := func(mod func(*events.APIGatewayV2HTTPRequest)) string {
		e := events.APIGatewayV2HTTPRequest{}
		mod(&e)
		return idemlambda.APIGatewayV2Tenant(e)
	}
	az := func(m map[string]any) func(*events.APIGatewayProxyRequest) {
		return func(e *events.APIGatewayProxyRequest) { e.RequestContext.Authorizer = m }
	}
	der := []byte("a certificate's DER bytes")
	certPEM := string(pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}))
	v2az := func(d events.APIGatewayV2HTTPRequestContextAuthorizerDescription) func(*events.APIGatewayV2HTTPRequest) {
		return func(e *events.APIGatewayV2HTTPRequest) { e.RequestContext.Authorizer = &d }
	}
	cases := []struct {
		name, got, prefix string
	}{
		{"v1 principalId", v1(az(map[string]any{"principalId": "alice", "integrationLatency": 3})), "principal:"},
		{"v1 claims.sub", v1(az(map[string]any{"claims": map[string]any{"sub": "alice", "email": "a@x"}})), "principal:"},
		{"v1 IAM", v1(func(e *events.APIGatewayProxyRequest) {
			e.RequestContext.Identity.UserArn = "arn:aws:iam::1:user/alice"
		}), "principal:"},
		{"v1 Cognito identity", v1(func(e *events.APIGatewayProxyRequest) { e.RequestContext.Identity.CognitoIdentityID = "us-east-1:abc" }), "principal:"},
		{"v1 Authorization", v1(func(e *events.APIGatewayProxyRequest) { e.Headers = map[string]string{"authorization": "Bearer alice"} }), "authz:"},
		{"v1 API key in MultiValueHeaders only", v1(func(e *events.APIGatewayProxyRequest) {
			e.MultiValueHeaders = map[string][]string{"X-API-KEY": {"alice"}}
		}), "apikey:"},
		{"v1 client certificate", v1(func(e *events.APIGatewayProxyRequest) {
			e.RequestContext.Identity.ClientCert = &events.APIGatewayCustomAuthorizerRequestTypeRequestIdentityClientCert{ClientCertPem: certPEM}
		}), "cert:"},
		{"v2 JWT sub", v2(v2az(events.APIGatewayV2HTTPRequestContextAuthorizerDescription{
			JWT: &events.APIGatewayV2HTTPRequestContextAuthorizerJWTDescription{Claims: map[string]string{"sub": "alice"}}})), "principal:"},
		{"v2 Lambda authorizer", v2(v2az(events.APIGatewayV2HTTPRequestContextAuthorizerDescription{
			Lambda: map[string]any{"user": "alice", "integrationLatency": 4}})), "principal:"},
		{"v2 IAM", v2(v2az(events.APIGatewayV2HTTPRequestContextAuthorizerDescription{
			IAM: &events.APIGatewayV2HTTPRequestContextAuthorizerIAMDescription{UserARN: "arn:aws:iam::1:user/alice"}})), "principal:"},
		{"v2 api-key", v2(func(e *events.APIGatewayV2HTTPRequest) { e.Headers = map[string]string{"api-key": "alice"} }), "apikey:"},
		{"v2 client certificate", v2(func(e *events.APIGatewayV2HTTPRequest) {
			e.RequestContext.Authentication.ClientCert.ClientCertPem = certPEM
		}), "cert:"},
	}
	seen := map[string]string{}
	for _, c := range cases {
		if !strings.HasPrefix(c.got, c.prefix) || strings.Contains(c.got, "alice") {
			t.Errorf("%s: tenant %q, want %q and a digest", c.name, c.got, c.prefix)
		}
		// One source in v1 and v2 (a sub, an IAM user, a certificate)
		// is one caller.
		if other, dup := seen[c.got]; dup && !(other[3:] == c.name[3:] || other == "v1 claims.sub" && c.name == "v2 JWT sub") {
			t.Errorf("%s and %s name one tenant %q", c.name, other, c.got)
		}
		seen[c.got] = c.name
	}
	// The same certificate is one caller in v1 and v2 (and idemhttp).
	if seen[cases[6].got] != "v2 client certificate" || cases[6].got != cases[11].got {
		t.Errorf("one certificate, two tenants: %q, %q", cases[6].got, cases[11].got)
	}
	if got := v1(func(*events.APIGatewayProxyRequest) {}); got != "" {
		t.Errorf("no identity: %q, want \"\"", got)
	}
	if got := v2(v2az(events.APIGatewayV2HTTPRequestContextAuthorizerDescription{Lambda: map[string]any{"integrationLatency": 4}})); got != "" {
		t.Errorf("a Lambda authorizer's context with only its latency: %q, want \"\"", got)
	}
	// The authorizer's principal names the caller whatever token it sent.
	p1 := v1(func(e *events.APIGatewayProxyRequest) {
		e.RequestContext.Authorizer = map[string]any{"principalId": "alice", "integrationLatency": 3}
		e.Headers = map[string]string{"Authorization": "Bearer t1"}
	})
	p2 := v1(func(e *events.APIGatewayProxyRequest) {
		e.RequestContext.Authorizer = map[string]any{"principalId": "alice", "integrationLatency": 9}
		e.Headers = map[string]string{"Authorization": "Bearer t2"}
	})
	if p1 != p2 || p1 != cases[0].got {
		t.Errorf("one principal with two tokens: %q and %q, want %q", p1, p2, cases[0].got)
	}
	l1 := v2(v2az(events.APIGatewayV2HTTPRequestContextAuthorizerDescription{Lambda: map[string]any{"user": "alice", "integrationLatency": 1}}))
	if l1 != cases[8].got {
		t.Errorf("a Lambda authorizer's context with another latency: %q, want %q", l1, cases[8].got)
	}
	// Header names in any case; the Authorization scheme in any case.
	h1 := v1(func(e *events.APIGatewayProxyRequest) {
		e.Headers = map[string]string{"AUTHORIZATION": "bearer  alice "}
	})
	h2 := v2(func(e *events.APIGatewayV2HTTPRequest) {
		e.Headers = map[string]string{"authorization": "Bearer alice"}
	})
	if h1 != cases[4].got || h2 != h1 {
		t.Errorf("one credential in three spellings: %q, %q, %q", cases[4].got, h1, h2)
	}
}

// apiHandler counts its runs and answers with private headers.
type apiHandler struct{ runs int }

func (h *apiHandler) v1(_ context.Context, e events.APIGatewayProxyRequest) (events.APIGatewayProxyResponse, error) {
	h.runs++
	return events.APIGatewayProxyResponse{StatusCode: 201, Body: strconv.Itoa(h.runs),
		Headers:           map[string]string{"set-cookie": "s=1", "X-Run": strconv.Itoa(h.runs), "Proxy-Connection": "x", "te": "trailers"},
		MultiValueHeaders: map[string][]string{"SET-COOKIE": {"s=2"}, "Trailer": {"x"}, "Vary": {"Accept"}},
	}, nil
}

func restRequest(key, method, path, body string, headers map[string]string) events.APIGatewayProxyRequest {
	h := map[string]string{"Idempotency-Key": key, "Authorization": "Bearer alice"}
	for k, v := range headers {
		h[k] = v
	}
	return events.APIGatewayProxyRequest{HTTPMethod: method, Resource: "/orders/{id}", Path: path, Headers: h, Body: body}
}

// The request is fingerprinted by default: a different method (the
// scope), path, query, content type or body under one key is a mismatch;
// one path spelled two ways, a body sent in base64 or not, and a new
// request id are the same request. Config.Payload replaces the default.
func TestAPIGatewayFingerprint(t *testing.T) {
	s := newStore(&clock{})
	ah := &apiHandler{}
	h, err := idemlambda.Wrap(s, idemlambda.Config[events.APIGatewayProxyRequest]{Namespace: "fn", Key: idemlambda.APIGatewayKey}, ah.v1)
	if err != nil {
		t.Fatal(err)
	}
	ctx := withDeadline(10 * time.Second)
	if r, err := h(ctx, restRequest("k", "POST", "/orders/1", `{"a":1}`, nil)); err != nil || r.Body != "1" {
		t.Fatalf("first: %v %v", r, err)
	}
	same := []events.APIGatewayProxyRequest{
		restRequest("k", "POST", "/orders/%31", `{"a":1}`, nil),
		func() events.APIGatewayProxyRequest {
			e := restRequest("k", "POST", "/orders/1", base64.StdEncoding.EncodeToString([]byte(`{"a":1}`)), nil)
			e.IsBase64Encoded = true
			e.RequestContext.RequestID = "another"
			return e
		}(),
	}
	for i, e := range same {
		if r, err := h(ctx, e); err != nil || r.Body != "1" {
			t.Errorf("same request %d: %+v %v, want the replay", i, r, err)
		}
	}
	other := map[string]events.APIGatewayProxyRequest{
		"path":         restRequest("k", "POST", "/orders/2", `{"a":1}`, nil),
		"body":         restRequest("k", "POST", "/orders/1", `{"a":2}`, nil),
		"content type": restRequest("k", "POST", "/orders/1", `{"a":1}`, map[string]string{"content-type": "text/plain"}),
		"query": func() events.APIGatewayProxyRequest {
			e := restRequest("k", "POST", "/orders/1", `{"a":1}`, nil)
			e.MultiValueQueryStringParameters = map[string][]string{"x": {"1"}}
			return e
		}(),
	}
	for what, e := range other {
		if _, err := h(ctx, e); !errors.Is(err, idem.ErrMismatch) {
			t.Errorf("another %s under the key: %v, want a *MismatchError", what, err)
		}
	}
	// Another method is another operation (the scope holds it).
	if r, err := h(ctx, restRequest("k", "PUT", "/orders/1", `{"a":1}`, nil)); err != nil || r.Body != "2" {
		t.Errorf("PUT after POST: %+v %v, want a run of its own", r, err)
	}
	// Config.Payload selects what must match instead.
	ah2 := &apiHandler{}
	h2, _ := idemlambda.Wrap(s, idemlambda.Config[events.APIGatewayProxyRequest]{Namespace: "fn2", Key: idemlambda.APIGatewayKey,
		Payload: func(e events.APIGatewayProxyRequest) any { return e.Body }}, ah2.v1)
	h2(ctx, restRequest("k", "POST", "/orders/1", `{"a":1}`, nil))
	if r, err := h2(ctx, restRequest("k", "POST", "/orders/2", `{"a":1}`, nil)); err != nil || r.Body != "1" {
		t.Errorf("with Config.Payload the body, another path: %+v %v, want the replay", r, err)
	}
}

// What is stored of a result never holds Set-Cookie nor a hop-by-hop
// header, in any case, for every HTTP response type, by value or
// pointer, and for a result of another type that encodes as one; the
// first caller's answer (and the handler's maps) keep them.
func TestStoredResultKeepsNoPrivateHeaders(t *testing.T) {
	ctx := withDeadline(10 * time.Second)
	ev := restRequest("k", "POST", "/orders/1", "{}", nil)
	check := func(t *testing.T, name string, first, replay any) {
		t.Helper()
		fb, _ := json.Marshal(first)
		rb, _ := json.Marshal(replay)
		if !bytes.Contains(bytes.ToLower(fb), []byte("set-cookie")) && !bytes.Contains(fb, []byte("s=1")) {
			t.Errorf("%s: the first answer lost its cookies: %s", name, fb)
		}
		low := strings.ToLower(string(rb))
		for _, h := range []string{"set-cookie", `"s=`, "proxy-connection", `"te"`, "trailer", "connection", "upgrade"} {
			if strings.Contains(low, h) {
				t.Errorf("%s: the replay holds %s: %s", name, h, rb)
			}
		}
		if !strings.Contains(low, "x-run") && !strings.Contains(low, "vary") {
			t.Errorf("%s: the replay lost its other headers: %s", name, rb)
		}
	}
	hdr := func() map[string]string {
		return map[string]string{"set-cookie": "s=1", "X-Run": "1", "Connection": "close", "UPGRADE": "h2c"}
	}
	mv := func() map[string][]string { return map[string][]string{"Set-Cookie": {"s=2"}, "Vary": {"Accept"}} }
	t.Run("v1 pointer", func(t *testing.T) {
		resp := &events.APIGatewayProxyResponse{StatusCode: 200, Headers: hdr(), MultiValueHeaders: mv()}
		h, _ := idemlambda.Wrap(newStore(&clock{}), idemlambda.Config[events.APIGatewayProxyRequest]{Namespace: "fn", Key: idemlambda.APIGatewayKey},
			func(context.Context, events.APIGatewayProxyRequest) (*events.APIGatewayProxyResponse, error) {
				return resp, nil
			})
		first, _ := h(ctx, ev)
		replay, err := h(ctx, ev)
		if err != nil || first != resp || resp.Headers["set-cookie"] != "s=1" || len(resp.MultiValueHeaders["Set-Cookie"]) != 1 {
			t.Fatalf("the handler's own response changed: %+v %v", resp, err)
		}
		check(t, "v1 pointer", first, replay)
	})
	t.Run("v2", func(t *testing.T) {
		v2ev := events.APIGatewayV2HTTPRequest{Headers: map[string]string{"idempotency-key": "k", "authorization": "Bearer a"}}
		h, _ := idemlambda.Wrap(newStore(&clock{}), idemlambda.Config[events.APIGatewayV2HTTPRequest]{Namespace: "fn", Key: idemlambda.APIGatewayV2Key},
			func(context.Context, events.APIGatewayV2HTTPRequest) (events.APIGatewayV2HTTPResponse, error) {
				return events.APIGatewayV2HTTPResponse{StatusCode: 200, Headers: hdr(), MultiValueHeaders: mv(), Cookies: []string{"s=3"}}, nil
			})
		first, _ := h(ctx, v2ev)
		replay, err := h(ctx, v2ev)
		if err != nil || len(first.Cookies) != 1 || replay.Cookies != nil {
			t.Fatalf("cookies: first %q, replay %q (%v); want the first's only", first.Cookies, replay.Cookies, err)
		}
		check(t, "v2", first, replay)
	})
	t.Run("ALB and function URL", func(t *testing.T) {
		type ev struct{ Key string }
		key := func(e ev) (string, error) { return e.Key, nil }
		ha, _ := idemlambda.Wrap(newStore(&clock{}), idemlambda.Config[ev]{Namespace: "fn", Key: key},
			func(context.Context, ev) (events.ALBTargetGroupResponse, error) {
				return events.ALBTargetGroupResponse{StatusCode: 200, Headers: hdr(), MultiValueHeaders: mv()}, nil
			})
		first, _ := ha(ctx, ev{"k"})
		replay, _ := ha(ctx, ev{"k"})
		check(t, "ALB", first, replay)
		hu, _ := idemlambda.Wrap(newStore(&clock{}), idemlambda.Config[ev]{Namespace: "fn", Key: key},
			func(context.Context, ev) (*events.LambdaFunctionURLResponse, error) {
				return &events.LambdaFunctionURLResponse{StatusCode: 200, Headers: hdr(), Cookies: []string{"s=3"}}, nil
			})
		f, _ := hu(ctx, ev{"k"})
		r, _ := hu(ctx, ev{"k"})
		if r.Cookies != nil {
			t.Errorf("function URL replay cookies %q", r.Cookies)
		}
		check(t, "function URL", f, r)
	})
	t.Run("another type for API Gateway", func(t *testing.T) {
		h, _ := idemlambda.Wrap(newStore(&clock{}), idemlambda.Config[events.APIGatewayProxyRequest]{Namespace: "fn", Key: idemlambda.APIGatewayKey},
			func(context.Context, events.APIGatewayProxyRequest) (map[string]any, error) {
				return map[string]any{"statusCode": 200, "headers": hdr(), "multiValueHeaders": mv(), "cookies": []string{"s=3"}}, nil
			})
		first, _ := h(ctx, ev)
		replay, err := h(ctx, ev)
		if err != nil || replay["cookies"] != nil || replay["statusCode"] != float64(200) {
			t.Fatalf("replay %v %v", replay, err)
		}
		check(t, "map", first, replay)
	})
}

// A caller that nothing identifies: a WARN once per route; with
// RefuseAnonymous, a 401 problem (or an *AnonymousError for a result that
// is not an HTTP response), the handler not run. Config.Tenant replaces
// the default, and a "" from it counts as anonymous for any event.
func TestAnonymousCallers(t *testing.T) {
	ctx := withDeadline(10 * time.Second)
	var logs bytes.Buffer
	log := slog.New(slog.NewTextHandler(&logs, nil))
	anon := func(key, path string) events.APIGatewayProxyRequest {
		return events.APIGatewayProxyRequest{HTTPMethod: "POST", Path: path, Headers: map[string]string{"Idempotency-Key": key}}
	}
	ah := &apiHandler{}
	h, _ := idemlambda.Wrap(newStore(&clock{}), idemlambda.Config[events.APIGatewayProxyRequest]{Namespace: "fn", Key: idemlambda.APIGatewayKey, Logger: log}, ah.v1)
	for _, e := range []events.APIGatewayProxyRequest{anon("a", "/x"), anon("b", "/x"), anon("c", "/y")} {
		if _, err := h(ctx, e); err != nil {
			t.Fatal(err)
		}
	}
	if n := strings.Count(logs.String(), "level=WARN"); n != 2 || !strings.Contains(logs.String(), `route="fn /y"`) {
		t.Errorf("%d WARN lines for three anonymous requests on two routes, want 2:\n%s", n, logs.String())
	}
	// Without a key (AllowMissingKey) nothing is said.
	logs.Reset()
	ha, _ := idemlambda.Wrap(newStore(&clock{}), idemlambda.Config[events.APIGatewayProxyRequest]{Namespace: "fn", Key: idemlambda.APIGatewayKey,
		Logger: log, AllowMissingKey: true, RefuseAnonymous: true}, ah.v1)
	if r, err := ha(ctx, events.APIGatewayProxyRequest{Path: "/z"}); err != nil || r.StatusCode != 201 || logs.Len() != 0 {
		t.Errorf("an unkeyed anonymous request: %+v %v %s, want it run unprotected, unlogged", r, err, logs.String())
	}

	runs := ah.runs
	for name, h := range map[string]func(context.Context, events.APIGatewayProxyRequest) (int, string, error){
		"v1": func(ctx context.Context, e events.APIGatewayProxyRequest) (int, string, error) {
			r, err := ha(ctx, e)
			return r.StatusCode, r.Headers["Content-Type"] + " " + r.Body, err
		},
		"v1 pointer": func() func(context.Context, events.APIGatewayProxyRequest) (int, string, error) {
			hp, _ := idemlambda.Wrap(newStore(&clock{}), idemlambda.Config[*events.APIGatewayProxyRequest]{Namespace: "fn", RefuseAnonymous: true, Logger: log,
				Key: func(e *events.APIGatewayProxyRequest) (string, error) { return idemlambda.APIGatewayKey(*e) }},
				func(ctx context.Context, e *events.APIGatewayProxyRequest) (*events.APIGatewayProxyResponse, error) {
					r, err := ah.v1(ctx, *e)
					return &r, err
				})
			return func(ctx context.Context, e events.APIGatewayProxyRequest) (int, string, error) {
				r, err := hp(ctx, &e)
				if r == nil {
					return 0, "", err
				}
				return r.StatusCode, r.Headers["Content-Type"] + " " + r.Body, err
			}
		}(),
		"v2": func() func(context.Context, events.APIGatewayProxyRequest) (int, string, error) {
			h2, _ := idemlambda.Wrap(newStore(&clock{}), idemlambda.Config[events.APIGatewayV2HTTPRequest]{Namespace: "fn", Key: idemlambda.APIGatewayV2Key, RefuseAnonymous: true, Logger: log},
				func(context.Context, events.APIGatewayV2HTTPRequest) (events.APIGatewayV2HTTPResponse, error) {
					ah.runs++
					return events.APIGatewayV2HTTPResponse{StatusCode: 201}, nil
				})
			return func(ctx context.Context, e events.APIGatewayProxyRequest) (int, string, error) {
				r, err := h2(ctx, events.APIGatewayV2HTTPRequest{Headers: map[string]string{"idempotency-key": e.Headers["Idempotency-Key"]}})
				return r.StatusCode, r.Headers["Content-Type"] + " " + r.Body, err
			}
		}(),
	} {
		status, got, err := h(ctx, anon("k", "/x"))
		if err != nil || status != 401 || !strings.HasPrefix(got, "application/problem+json ") || !strings.Contains(got, `"type":"urn:idem:problem:anonymous"`) {
			t.Errorf("%s: RefuseAnonymous answered %d %q %v, want 401 application/problem+json of type urn:idem:problem:anonymous", name, status, got, err)
		}
	}
	if ah.runs != runs {
		t.Errorf("the handler ran %d times for refused requests", ah.runs-runs)
	}

	// Config.Tenant, for an event of another kind: its "" is anonymous,
	// refused with an *AnonymousError when the result is no HTTP response.
	f := &fn{}
	cfg := orderConfig()
	cfg.Logger = log
	cfg.Tenant = func(_ context.Context, o order) string { return o.Note }
	cfg.RefuseAnonymous = true
	ho := wrap(t, newStore(&clock{}), cfg, f)
	var ae *idemlambda.AnonymousError
	if _, err := ho(ctx, order{Key: "k", Amount: 1}); !errors.As(err, &ae) || f.runs.Load() != 0 {
		t.Fatalf("Config.Tenant said \"\": %v after %d runs, want an *AnonymousError and no run", err, f.runs.Load())
	}
	r1, _ := ho(ctx, order{Key: "k", Amount: 1, Note: "alice"})
	r2, _ := ho(ctx, order{Key: "k", Amount: 1, Note: "bob"})
	r3, _ := ho(ctx, order{Key: "k", Amount: 1, Note: "alice"})
	if r1.ID != 1 || r2.ID != 2 || r3.ID != 1 {
		t.Errorf("Config.Tenant alice, bob, alice: runs %d %d %d, want 1 2 1", r1.ID, r2.ID, r3.ID)
	}
	// Without Config.Tenant, an event that is not API Gateway's is not
	// anonymous: no WARN, no refusal.
	logs.Reset()
	cfg.Tenant = nil
	if _, err := wrap(t, newStore(&clock{}), cfg, &fn{})(ctx, order{Key: "k", Amount: 1}); err != nil || logs.Len() != 0 {
		t.Errorf("a direct invocation: %v %s, want it run, unlogged", err, logs.String())
	}
}
