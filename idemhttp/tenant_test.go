package idemhttp_test

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"io"
	"math/big"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/memstore"
)

// replayed reports whether a was a replay.
func (a answer) replayed() bool { return a.header.Get(idemhttp.HeaderReplayed) == "true" }

// A web app whose clients authenticate with a session cookie, behind the
// default tenant: one key from two browsers never hands one the other's
// response (the reproduced defect: Mallory got Alice's 201), and a retry
// from the same browser still replays.
func TestCookieClientsIsolated(t *testing.T) {
	eachStore(t, func(t *testing.T, store idem.Store) {
		s := newServer(t, store, idemhttp.Config{}, charge)
		const body = `{"order":1001}`
		alice := s.do(t, "POST", "/orders", "order-1001", body, "Cookie", "session=alice")
		if alice.status != http.StatusCreated || alice.replayed() {
			t.Fatalf("alice: got %d %v, want 201 executed", alice.status, alice.header)
		}
		mallory := s.do(t, "POST", "/orders", "order-1001", body, "Cookie", "session=mallory")
		if mallory.replayed() || mallory.body == alice.body {
			t.Fatalf("mallory got alice's response: %d %q %v", mallory.status, mallory.body, mallory.header)
		}
		if mallory.status != http.StatusUnprocessableEntity || !strings.Contains(mallory.body, idemhttp.ProblemMismatch) ||
			!strings.Contains(mallory.body, "cookies") {
			t.Errorf("mallory: got %d %s, want 422 %s naming the cookies", mallory.status, mallory.body, idemhttp.ProblemMismatch)
		}
		again := s.do(t, "POST", "/orders", "order-1001", body, "Cookie", "session=alice")
		if !again.replayed() || again.body != alice.body {
			t.Errorf("alice's retry: got %d %q %v, want the replay of %q", again.status, again.body, again.header, alice.body)
		}
		noCookie := s.do(t, "POST", "/orders", "order-1001", body)
		if noCookie.replayed() {
			t.Errorf("a request without cookies got alice's response: %q", noCookie.body)
		}
		if n := s.runs.Load(); n != 1 {
			t.Errorf("executions: got %d, want 1 (mismatches never run)", n)
		}
	})
}

// The cookies are mixed in after Config.Fingerprint, so a custom
// fingerprint (here one that ignores everything) gets them too; a Tenant
// that names the client opts out.
func TestCookieFingerprintAfterCustom(t *testing.T) {
	zero := func(*http.Request, []byte) idem.Fingerprint { return idem.Fingerprint{} }
	s := newServer(t, memstore.New(memstore.Options{}), idemhttp.Config{Fingerprint: zero}, charge)
	s.do(t, "POST", "/orders", "k", "{}", "Cookie", "session=alice")
	if a := s.do(t, "POST", "/orders", "k", "{}", "Cookie", "session=mallory"); a.status != http.StatusUnprocessableEntity {
		t.Errorf("custom fingerprint, other cookies: got %d %q, want 422", a.status, a.body)
	}
	if a := s.do(t, "POST", "/orders", "k", "other body", "Cookie", "session=alice"); !a.replayed() {
		t.Errorf("custom fingerprint, same cookies: got %d %q, want a replay", a.status, a.body)
	}

	// A Tenant of its own: the cookies play no part.
	account := func(r *http.Request) string { return r.Header.Get("X-Account") }
	s = newServer(t, memstore.New(memstore.Options{}), idemhttp.Config{Tenant: account}, charge)
	s.do(t, "POST", "/orders", "k", "{}", "X-Account", "acme", "Cookie", "tracking=1")
	if a := s.do(t, "POST", "/orders", "k", "{}", "X-Account", "acme", "Cookie", "tracking=2"); !a.replayed() {
		t.Errorf("custom tenant, other cookies: got %d %q, want a replay", a.status, a.body)
	}
}

// Bearer tokens and requests that carry nothing, as before.
func TestTenantByAuthorizationAndNone(t *testing.T) {
	s := newServer(t, memstore.New(memstore.Options{}), idemhttp.Config{}, charge)
	a := s.do(t, "POST", "/orders", "k", "{}", "Authorization", "Bearer a")
	b := s.do(t, "POST", "/orders", "k", "{}", "Authorization", "Bearer b")
	if b.replayed() || b.body == a.body || b.status != http.StatusCreated {
		t.Errorf("second token: got %d %q %v, want its own execution", b.status, b.body, b.header)
	}
	if again := s.do(t, "POST", "/orders", "k", "{}", "Authorization", "Bearer a"); !again.replayed() || again.body != a.body {
		t.Errorf("first token's retry: got %q, want the replay of %q", again.body, a.body)
	}
	// With a token, cookies do not matter (the token names the client).
	if again := s.do(t, "POST", "/orders", "k", "{}", "Authorization", "Bearer a", "Cookie", "x=1"); !again.replayed() {
		t.Errorf("first token with a cookie: got %d %q, want a replay", again.status, again.body)
	}
	first := s.do(t, "POST", "/orders", "anon", "{}")
	if again := s.do(t, "POST", "/orders", "anon", "{}"); !again.replayed() || again.body != first.body {
		t.Errorf("no credentials, no cookies: got %d %q, want the replay of %q", again.status, again.body, first.body)
	}
	if n := s.runs.Load(); n != 3 {
		t.Errorf("executions: got %d, want 3", n)
	}
}

// TenantFromCookie: the named cookie is the tenant; other cookies may
// change between retries (a rotated tracking cookie) and still replay.
func TestTenantFromCookie(t *testing.T) {
	s := newServer(t, memstore.New(memstore.Options{}), idemhttp.Config{Tenant: idemhttp.TenantFromCookie("session")}, charge)
	alice := s.do(t, "POST", "/orders", "k", "{}", "Cookie", "session=alice; tracking=1")
	again := s.do(t, "POST", "/orders", "k", "{}", "Cookie", "tracking=2; session=alice")
	if !again.replayed() || again.body != alice.body {
		t.Errorf("same session, other tracking cookie: got %d %q, want the replay of %q", again.status, again.body, alice.body)
	}
	mallory := s.do(t, "POST", "/orders", "k", "{}", "Cookie", "session=mallory; tracking=1")
	if mallory.replayed() || mallory.status != http.StatusCreated {
		t.Errorf("other session: got %d %q %v, want its own execution", mallory.status, mallory.body, mallory.header)
	}
	// Without the cookie: DefaultTenant, then the fail-safe.
	bearer := s.do(t, "POST", "/orders", "k", "{}", "Authorization", "Bearer x", "Cookie", "tracking=1")
	if bearer.replayed() {
		t.Errorf("no session cookie, a bearer token: got a replay %q", bearer.body)
	}
	if n := s.runs.Load(); n != 3 {
		t.Errorf("executions: got %d, want 3", n)
	}

	for _, bad := range []string{"", "a b", "a;b"} {
		func() {
			defer func() {
				if recover() == nil {
					t.Errorf("TenantFromCookie(%q) did not panic", bad)
				}
			}()
			idemhttp.TenantFromCookie(bad)
		}()
	}
}

// TenantFromHeader hashes every value of the header: a client adding its
// own header beside the gateway's does not share the gateway's tenant.
func TestTenantFromHeader(t *testing.T) {
	tenant := idemhttp.TenantFromHeader("x-account")
	req := func(vals ...string) *http.Request {
		r := httptest.NewRequest("POST", "/", nil)
		for _, v := range vals {
			r.Header.Add("X-Account", v)
		}
		return r
	}
	a, a2, b, both := tenant(req("acme")), tenant(req("acme")), tenant(req("other")), tenant(req("acme", "other"))
	if a != a2 || a == b || both == a || both == b || !strings.HasPrefix(a, "hdr:") || strings.Contains(a, "acme") {
		t.Errorf("tenants: acme %q twice %q, other %q, both %q; want equal for equal values, distinct otherwise, hdr: and no raw value", a, a2, b, both)
	}
	if got := tenant(req()); got != "" {
		t.Errorf("no header, no credentials: got %q, want \"\"", got)
	}
	r := req()
	r.Header.Set("Authorization", "Bearer t")
	if got := tenant(r); got != idemhttp.DefaultTenant(r) || got == "" {
		t.Errorf("no header: got %q, want DefaultTenant's %q", got, idemhttp.DefaultTenant(r))
	}
	// The authz: tenant is the one records were written with before.
	if got := idemhttp.DefaultTenant(r); got != "authz:Y6JaJkZMMQ4w8-T5C38hUw" {
		t.Errorf("DefaultTenant of Bearer t: got %q, want the value earlier releases derived", got)
	}
}

// A TLS client certificate is the tenant when there is no Authorization
// header: two certificates never share a record, over a real TLS
// connection.
func TestTenantByClientCertificate(t *testing.T) {
	s := &server{}
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		s.runs.Add(1)
		charge(w, r)
	})
	s.Server = httptest.NewUnstartedServer(idemhttp.Middleware(memstore.New(memstore.Options{}), idemhttp.Config{})(h))
	s.TLS = &tls.Config{ClientAuth: tls.RequestClientCert}
	s.StartTLS()
	t.Cleanup(s.Close)

	client := func(cert *tls.Certificate) *http.Client {
		c := *s.Client() // a copy: s.Client() is shared
		tr := c.Transport.(*http.Transport).Clone()
		if cert != nil {
			tr.TLSClientConfig.Certificates = []tls.Certificate{*cert}
		}
		c.Transport = tr
		return &c
	}
	post := func(c *http.Client) answer {
		t.Helper()
		req, _ := http.NewRequest("POST", s.URL+"/orders", strings.NewReader("{}"))
		req.Header.Set(idemhttp.HeaderKey, "k")
		resp, err := c.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, err := io.ReadAll(resp.Body)
		if err != nil {
			t.Fatal(err)
		}
		return answer{resp.StatusCode, resp.Header, string(b)}
	}
	alice, bob := client(clientCert(t, "alice")), client(clientCert(t, "bob"))
	first := post(alice)
	if first.status != http.StatusCreated || first.replayed() {
		t.Fatalf("alice: got %d %v, want 201 executed", first.status, first.header)
	}
	if b := post(bob); b.replayed() || b.header.Get("X-Token") == first.header.Get("X-Token") {
		t.Errorf("bob got alice's response: %d %q %v", b.status, b.body, b.header)
	}
	if a := post(alice); !a.replayed() || a.body != first.body {
		t.Errorf("alice's retry: got %d %q, want the replay of %q", a.status, a.body, first.body)
	}
	if n := post(client(nil)); n.replayed() {
		t.Errorf("a client without a certificate got a replay: %q", n.body)
	}
	if n := s.runs.Load(); n != 3 {
		t.Errorf("executions: got %d, want 3 (alice, bob, the client without one)", n)
	}
}

// clientCert makes a self-signed client certificate.
func clientCert(t *testing.T, name string) *tls.Certificate {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: name},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	return &tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key}
}
