package idemlambda

import (
	"encoding/base64"
	"encoding/json"
	"encoding/pem"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"strings"

	"github.com/aws/aws-lambda-go/events"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/internal/ident"
)

// ProblemAnonymous is the problem type (RFC 9457) of the 401 answered to
// a keyed request from a caller that nothing identifies, when
// Config.RefuseAnonymous is set.
const ProblemAnonymous = "urn:idem:problem:anonymous"

// ProblemResponseUnreadable is the problem type (RFC 9457) of the 500
// answered, when the result is an HTTP response, to a repeat of a request
// whose stored result is sealed (Config.Seal) and cannot be opened:
// the handler ran once and does not run again. idemhttp's
// ProblemResponseUnreadable.
const ProblemResponseUnreadable = idemhttp.ProblemResponseUnreadable

// AnonymousError is the error of a keyed invocation refused by
// Config.RefuseAnonymous when its result type is not an API Gateway
// response (which gets a 401 instead): Config.Tenant named no caller. The
// handler did not run. Lambda reports its errorType as "AnonymousError".
type AnonymousError struct{}

func (*AnonymousError) Error() string {
	return "idemlambda: a keyed request from a caller that nothing identifies, refused (Config.RefuseAnonymous)"
}

// APIGatewayTenant returns the caller of an API Gateway REST API (or v1
// payload) request, the default Config.Tenant for such events: the
// identity API Gateway established, if any, in this order: the Lambda
// authorizer's principalId (requestContext.authorizer.principalId), the
// Cognito user pool authorizer's "sub" claim
// (requestContext.authorizer.claims.sub), IAM's user ARN and the Cognito
// identity (requestContext.identity.userArn, cognitoIdentityId); else the
// credentials the request carries, as idemhttp reads them (ident.Tenant):
// Authorization in its normal form (scheme in any case, whitespace not
// part of the credential) and the API-key headers X-Api-Key, Api-Key and
// X-Auth-Token, their names in any case, from MultiValueHeaders when it
// holds the name, else Headers; else the verified client certificate of
// mutual TLS. Each source is a prefix and a digest ("principal:…",
// "authz:…", "apikey:…", "cert:…"), never the raw value, so two sources
// never name one tenant. "" when nothing identifies the caller.
func APIGatewayTenant(e events.APIGatewayProxyRequest) string {
	return tenantV1(&e)
}

// APIGatewayV2Tenant is APIGatewayTenant for an HTTP API (payload 2.0)
// request: the JWT authorizer's "sub" claim
// (requestContext.authorizer.jwt.claims.sub), the Lambda authorizer's
// context (its "principalId" or "sub" member, else the whole context but
// integrationLatency), IAM's user ARN (requestContext.authorizer.iam);
// else the request's credentials (Authorization, the API-key headers);
// else the client certificate.
func APIGatewayV2Tenant(e events.APIGatewayV2HTTPRequest) string {
	return tenantV2(&e)
}

func principal(source, value string) string {
	return "principal:" + ident.Digest(source, value)
}

func tenantV1(e *events.APIGatewayProxyRequest) string {
	az := e.RequestContext.Authorizer
	if p, ok := az["principalId"].(string); ok && p != "" {
		return principal("principalId", p)
	}
	if claims, ok := az["claims"].(map[string]any); ok {
		if sub, ok := claims["sub"].(string); ok && sub != "" {
			return principal("sub", sub)
		}
	}
	id := &e.RequestContext.Identity
	if id.UserArn != "" {
		return principal("iam", id.UserArn)
	}
	if id.CognitoIdentityID != "" {
		return principal("cognito-identity", id.CognitoIdentityID)
	}
	if t := ident.Tenant(headerValues(e.Headers, e.MultiValueHeaders)); t != "" {
		return t
	}
	if id.ClientCert != nil {
		return certTenant(id.ClientCert.ClientCertPem)
	}
	return ""
}

func tenantV2(e *events.APIGatewayV2HTTPRequest) string {
	if az := e.RequestContext.Authorizer; az != nil {
		if az.JWT != nil {
			if sub := az.JWT.Claims["sub"]; sub != "" {
				return principal("sub", sub)
			}
		}
		if t := lambdaAuthorizer(az.Lambda); t != "" {
			return t
		}
		if az.IAM != nil && az.IAM.UserARN != "" {
			return principal("iam", az.IAM.UserARN)
		}
	}
	if t := ident.Tenant(headerValues(e.Headers, nil)); t != "" {
		return t
	}
	return certTenant(e.RequestContext.Authentication.ClientCert.ClientCertPem)
}

// lambdaAuthorizer names the caller of an HTTP API's Lambda authorizer
// context: its principalId or sub, else the whole context (JSON sorts
// the members) without integrationLatency, which changes on every call.
func lambdaAuthorizer(c map[string]any) string {
	for _, name := range []string{"principalId", "sub"} {
		if s, ok := c[name].(string); ok && s != "" {
			return principal(name, s)
		}
	}
	rest := make(map[string]any, len(c))
	for k, v := range c {
		if k != "integrationLatency" {
			rest[k] = v
		}
	}
	if len(rest) == 0 {
		return ""
	}
	b, err := json.Marshal(rest)
	if err != nil {
		return ""
	}
	return principal("lambda-context", string(b))
}

// certTenant is the tenant of a client certificate in PEM, as idemhttp
// names a verified certificate (ident.Cert over its DER bytes).
func certTenant(p string) string {
	if p == "" {
		return ""
	}
	if b, _ := pem.Decode([]byte(p)); b != nil {
		return ident.Cert(b.Bytes)
	}
	return "cert:" + ident.Digest(p)
}

// headerValues reads an event's headers by name whatever their case (API
// Gateway v1 keeps the client's case, v2 lower-cases): every value of
// every spelling of the name in multi, in the order of the spellings, or
// in single when multi has none.
func headerValues(single map[string]string, multi map[string][]string) func(string) []string {
	return func(name string) []string {
		var names []string
		for k := range multi {
			if strings.EqualFold(k, name) {
				names = append(names, k)
			}
		}
		if len(names) > 0 {
			slices.Sort(names)
			var vs []string
			for _, k := range names {
				vs = append(vs, multi[k]...)
			}
			return vs
		}
		for k := range single {
			if strings.EqualFold(k, name) {
				names = append(names, k)
			}
		}
		slices.Sort(names)
		vs := make([]string, 0, len(names))
		for _, k := range names {
			vs = append(vs, single[k])
		}
		return vs
	}
}

// httpRequest is what scopes and fingerprints an API Gateway request.
type httpRequest struct {
	method, route string
	path, query   string
	contentType   string
	body          []byte
	tenant        func() string
}

// httpRequestOf returns the request of an API Gateway event (v1 or v2,
// by value or pointer).
func httpRequestOf(e any) (httpRequest, bool) {
	switch v := e.(type) {
	case events.APIGatewayProxyRequest:
		return requestV1(&v), true
	case *events.APIGatewayProxyRequest:
		if v != nil {
			return requestV1(v), true
		}
	case events.APIGatewayV2HTTPRequest:
		return requestV2(&v), true
	case *events.APIGatewayV2HTTPRequest:
		if v != nil {
			return requestV2(v), true
		}
	}
	return httpRequest{}, false
}

func requestV1(e *events.APIGatewayProxyRequest) httpRequest {
	r := httpRequest{
		method: cmpOr(e.HTTPMethod, e.RequestContext.HTTPMethod),
		path:   ident.Path(e.Path),
		body:   body(e.Body, e.IsBase64Encoded),
		tenant: func() string { return tenantV1(e) },
	}
	// The resource is the route API Gateway matched ("/orders/{id}"); the
	// path is in the fingerprint.
	r.route = cmpOr(e.Resource, e.RequestContext.ResourcePath, r.path)
	if vs := headerValues(e.Headers, e.MultiValueHeaders)("Content-Type"); len(vs) > 0 {
		r.contentType = vs[0]
	}
	// v1 has no raw query: its parameters, sorted by name, each name's
	// values in order.
	q := url.Values{}
	if len(e.MultiValueQueryStringParameters) > 0 {
		for k, vs := range e.MultiValueQueryStringParameters {
			q[k] = vs
		}
	} else {
		for k, v := range e.QueryStringParameters {
			q[k] = []string{v}
		}
	}
	r.query = q.Encode()
	return r
}

func requestV2(e *events.APIGatewayV2HTTPRequest) httpRequest {
	r := httpRequest{
		method: e.RequestContext.HTTP.Method,
		path:   ident.Path(cmpOr(e.RawPath, e.RequestContext.HTTP.Path)),
		query:  e.RawQueryString,
		body:   body(e.Body, e.IsBase64Encoded),
		tenant: func() string { return tenantV2(e) },
	}
	// The route key is "POST /orders/{id}" or "$default".
	rk := cmpOr(e.RouteKey, e.RequestContext.RouteKey)
	if _, p, ok := strings.Cut(rk, " "); ok {
		r.route = p
	} else {
		r.route = cmpOr(rk, r.path)
	}
	if vs := headerValues(e.Headers, nil)("Content-Type"); len(vs) > 0 {
		r.contentType = vs[0]
	}
	return r
}

func cmpOr(vs ...string) string {
	for _, v := range vs {
		if v != "" {
			return v
		}
	}
	return ""
}

func body(s string, b64 bool) []byte {
	if b64 {
		if b, err := base64.StdEncoding.DecodeString(s); err == nil {
			return b
		}
	}
	return []byte(s)
}

// fingerprint is idemhttp.DefaultFingerprint's for the request: method,
// path, query, Content-Type and body.
func (r *httpRequest) fingerprint() idem.Fingerprint {
	return idem.SumFingerprint(r.body, r.method, r.path, r.query, r.contentType)
}

// deniedHeaders are the response headers never stored nor replayed, as
// in idemhttp: Set-Cookie, and the headers that describe one connection.
var deniedHeaders = []string{
	"Set-Cookie", "Connection", "Keep-Alive", "Proxy-Connection", "Transfer-Encoding",
	"Upgrade", "Te", "Trailer", "Proxy-Authenticate", "Proxy-Authorization", idemhttp.HeaderReplayed,
}

func denied(name string) bool {
	name = strings.TrimSpace(name)
	for _, d := range deniedHeaders {
		if strings.EqualFold(name, d) {
			return true
		}
	}
	return false
}

// keep returns m without its denied names (m itself when it has none:
// the handler's maps are never changed).
func keep[V any](m map[string]V) map[string]V {
	n := 0
	for k := range m {
		if denied(k) {
			n++
		}
	}
	if n == 0 {
		return m
	}
	c := make(map[string]V, len(m))
	for k, v := range m {
		if !denied(k) {
			c[k] = v
		}
	}
	return c
}

// storable returns what is stored of a result: an HTTP response (API
// Gateway v1 or v2, ALB, function URL; by value or pointer) without
// Set-Cookie (in Headers, MultiValueHeaders or Cookies) and the
// hop-by-hop headers, their names in any case; other results as they are.
func storable[O any](out O) (any, bool) {
	switch v := any(out).(type) {
	case events.APIGatewayProxyResponse:
		v.Headers, v.MultiValueHeaders = keep(v.Headers), keep(v.MultiValueHeaders)
		return v, true
	case *events.APIGatewayProxyResponse:
		if v != nil {
			c := *v
			c.Headers, c.MultiValueHeaders = keep(c.Headers), keep(c.MultiValueHeaders)
			return &c, true
		}
	case events.APIGatewayV2HTTPResponse:
		v.Headers, v.MultiValueHeaders, v.Cookies = keep(v.Headers), keep(v.MultiValueHeaders), nil
		return v, true
	case *events.APIGatewayV2HTTPResponse:
		if v != nil {
			c := *v
			c.Headers, c.MultiValueHeaders, c.Cookies = keep(c.Headers), keep(c.MultiValueHeaders), nil
			return &c, true
		}
	case events.ALBTargetGroupResponse:
		v.Headers, v.MultiValueHeaders = keep(v.Headers), keep(v.MultiValueHeaders)
		return v, true
	case *events.ALBTargetGroupResponse:
		if v != nil {
			c := *v
			c.Headers, c.MultiValueHeaders = keep(c.Headers), keep(c.MultiValueHeaders)
			return &c, true
		}
	case events.LambdaFunctionURLResponse:
		v.Headers, v.Cookies = keep(v.Headers), nil
		return v, true
	case *events.LambdaFunctionURLResponse:
		if v != nil {
			c := *v
			c.Headers, c.Cookies = keep(c.Headers), nil
			return &c, true
		}
	}
	return out, false
}

// stripJSON is storable for a result of another type that encodes as an
// HTTP response (a JSON object with a statusCode member), for an API
// Gateway event: its headers, multiValueHeaders and cookies members are
// filtered the same way. b is returned as it is when nothing is removed.
func stripJSON(b []byte) []byte {
	if len(b) == 0 || b[0] != '{' {
		return b
	}
	var obj map[string]json.RawMessage
	if json.Unmarshal(b, &obj) != nil {
		return b
	}
	if _, ok := obj["statusCode"]; !ok {
		return b
	}
	changed := false
	for _, member := range []string{"headers", "multiValueHeaders"} {
		var h map[string]json.RawMessage
		if raw, ok := obj[member]; !ok || json.Unmarshal(raw, &h) != nil {
			continue
		}
		for k := range h {
			if denied(k) {
				delete(h, k)
				changed = true
			}
		}
		obj[member], _ = json.Marshal(h)
	}
	if raw, ok := obj["cookies"]; ok && string(raw) != "null" {
		delete(obj, "cookies")
		changed = true
	}
	if !changed {
		return b
	}
	out, err := json.Marshal(obj)
	if err != nil {
		return b
	}
	return out
}

// refusal sets *out to the 401 answered to a refused anonymous request,
// when O is an HTTP response type; false otherwise.
func refusal[O any](out *O) bool {
	const body = `{"type":"` + ProblemAnonymous + `","title":"Caller not identified","status":401,` +
		`"detail":"This request carries an Idempotency-Key but nothing that identifies its caller (an authorizer's principal, an Authorization header or an API key); keyed requests must be authenticated."}`
	return problemResponse(out, http.StatusUnauthorized, body, nil)
}

// unreadable sets *out to the 500 answered to a repeat of a request whose
// stored result is sealed and cannot be opened, as idemhttp answers it
// (ProblemResponseUnreadable, Idempotent-Replayed: true), when O is an
// HTTP response type; false otherwise.
func unreadable[O any](out *O) bool {
	const body = `{"type":"` + ProblemResponseUnreadable + `","title":"Response executed but unreadable","status":500,` +
		`"detail":"This request was executed and will not be executed again, but its stored response is sealed and cannot be opened ` +
		`(it was altered in the store, or the key that sealed it is no longer configured). It cannot be replayed; ` +
		`a retry with this key gets this answer until the record expires."}`
	return problemResponse(out, http.StatusInternalServerError, body, map[string]string{idemhttp.HeaderReplayed: "true"})
}

// problemResponse sets *out to an application/problem+json answer of
// status with body and the headers extra, when O is an HTTP response
// type; false otherwise.
func problemResponse[O any](out *O, status int, body string, extra map[string]string) bool {
	h := func() map[string]string {
		m := map[string]string{"Content-Type": "application/problem+json", "Cache-Control": "no-store"}
		for k, v := range extra {
			m[k] = v
		}
		return m
	}
	desc := strconv.Itoa(status) + " " + http.StatusText(status)
	switch p := any(out).(type) {
	case *events.APIGatewayProxyResponse:
		*p = events.APIGatewayProxyResponse{StatusCode: status, Headers: h(), Body: body}
	case **events.APIGatewayProxyResponse:
		*p = &events.APIGatewayProxyResponse{StatusCode: status, Headers: h(), Body: body}
	case *events.APIGatewayV2HTTPResponse:
		*p = events.APIGatewayV2HTTPResponse{StatusCode: status, Headers: h(), Body: body}
	case **events.APIGatewayV2HTTPResponse:
		*p = &events.APIGatewayV2HTTPResponse{StatusCode: status, Headers: h(), Body: body}
	case *events.ALBTargetGroupResponse:
		*p = events.ALBTargetGroupResponse{StatusCode: status, StatusDescription: desc, Headers: h(), Body: body}
	case **events.ALBTargetGroupResponse:
		*p = &events.ALBTargetGroupResponse{StatusCode: status, StatusDescription: desc, Headers: h(), Body: body}
	case *events.LambdaFunctionURLResponse:
		*p = events.LambdaFunctionURLResponse{StatusCode: status, Headers: h(), Body: body}
	case **events.LambdaFunctionURLResponse:
		*p = &events.LambdaFunctionURLResponse{StatusCode: status, Headers: h(), Body: body}
	default:
		return false
	}
	return true
}
