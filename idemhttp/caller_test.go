package idemhttp_test

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/cookiejar"
	"net/url"
	"strings"
	"sync/atomic"
	"testing"

	"go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/memstore"
)

// send is one keyed POST with the host and header lines given ("Name:
// value"; a name written as it must go on the wire, in any case).
func (s *server) send(t *testing.T, host, path, key, body string, header ...string) answer {
	t.Helper()
	req, err := http.NewRequest("POST", s.URL+path, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	if host != "" {
		req.Host = host
	}
	req.Header.Set(idemhttp.HeaderKey, key)
	for _, l := range header {
		name, value, _ := strings.Cut(l, ":")
		req.Header[name] = append(req.Header[name], strings.TrimPrefix(value, " "))
	}
	resp, err := s.Client().Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return answer{resp.StatusCode, resp.Header, string(b)}
}

// account answers 201 with a session token and a cookie for the caller
// (its run number): what must never reach another caller.
func account(runs *atomic.Int64) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		n := runs.Add(1)
		w.Header().Set("X-Session-Token", fmt.Sprintf("tok-%d", n))
		http.SetCookie(w, &http.Cookie{Name: "session", Value: fmt.Sprintf("s%d", n)})
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, `{"run":%d}`, n)
	}
}

// Callers told apart by each credential style: Alice's record is never
// Bob's or an anonymous caller's, and her headers stay hers.
func TestCallersByCredential(t *testing.T) {
	eachStore(t, func(t *testing.T, store idem.Store) {
		var runs atomic.Int64
		s := newServer(t, store, idemhttp.Config{Logger: quietLogger()}, account(&runs))
		for _, c := range []struct{ name, alice, bob string }{
			{"bearer", "Authorization: Bearer alice", "Authorization: Bearer bob"},
			{"x-api-key", "X-Api-Key: alice-secret", "X-Api-Key: bob-secret"},
			{"api-key", "Api-Key: alice-secret", "Api-Key: bob-secret"},
			{"x-auth-token", "X-Auth-Token: alice-secret", "X-Auth-Token: bob-secret"},
			{"lower-case x-api-key", "x-api-key: alice-secret", "x-api-key: bob-secret"},
		} {
			key := "charge-" + strings.ReplaceAll(c.name, " ", "-")
			before := runs.Load()
			a := s.send(t, "", "/charges", key, `{"amount":1}`, c.alice)
			again := s.send(t, "", "/charges", key, `{"amount":1}`, c.alice)
			b := s.send(t, "", "/charges", key, `{"amount":1}`, c.bob)
			anon := s.send(t, "", "/charges", key, `{"amount":1}`)
			if got := runs.Load() - before; got != 3 {
				t.Errorf("%s: %d executions for Alice, her retry, Bob and an anonymous caller; want 3", c.name, got)
			}
			if again.header.Get(idemhttp.HeaderReplayed) != "true" || again.body != a.body {
				t.Errorf("%s: Alice's retry got %d %q, want the replay of %q", c.name, again.status, again.body, a.body)
			}
			for who, got := range map[string]answer{"Bob": b, "anonymous": anon} {
				if got.header.Get(idemhttp.HeaderReplayed) != "" || got.body == a.body ||
					got.header.Get("X-Session-Token") == a.header.Get("X-Session-Token") {
					t.Errorf("%s: %s got %q with token %q: Alice's", c.name, who, got.body, got.header.Get("X-Session-Token"))
				}
			}
		}
	})
}

// One credential spelled several ways is one caller; another credential
// is another.
func TestCredentialSpellings(t *testing.T) {
	eachStore(t, func(t *testing.T, store idem.Store) {
		var runs atomic.Int64
		s := newServer(t, store, idemhttp.Config{Logger: quietLogger()}, account(&runs))
		for _, spelling := range []string{"Bearer tokA", "bearer tokA", "Bearer  tokA", "Bearer tokA ", "  Bearer tokA", "BEARER\ttokA"} {
			s.send(t, "", "/pay", "spell-1", "{}", "Authorization: "+spelling)
		}
		if n := runs.Load(); n != 1 {
			t.Errorf("six spellings of one credential: %d executions, want 1", n)
		}
		if a := s.send(t, "", "/pay", "spell-1", "{}", "Authorization: Bearer TOKA"); a.header.Get(idemhttp.HeaderReplayed) != "" {
			t.Errorf("Bearer TOKA (another token) got the replay of Bearer tokA")
		}
	})
}

// Virtual hosts never share records; one host reached by address, by
// name in another case, or on another port is one.
func TestVirtualHosts(t *testing.T) {
	eachStore(t, func(t *testing.T, store idem.Store) {
		var runs atomic.Int64
		s := newServer(t, store, idemhttp.Config{Logger: quietLogger()}, account(&runs))
		auth := "Authorization: Bearer shop-admin"
		a := s.send(t, "shop-a.example", "/orders", "o-1", "{}", auth)
		if b := s.send(t, "shop-b.example", "/orders", "o-1", "{}", auth); b.header.Get(idemhttp.HeaderReplayed) != "" || b.body == a.body {
			t.Errorf("shop-b.example got shop-a.example's %q", b.body)
		}
		for _, same := range []string{"Shop-A.example", "shop-a.example:8443", "shop-a.example."} {
			if g := s.send(t, same, "/orders", "o-1", "{}", auth); g.header.Get(idemhttp.HeaderReplayed) != "true" || g.body != a.body {
				t.Errorf("Host %s: got %d %q, want shop-a.example's replay", same, g.status, g.body)
			}
		}
		// Instances reached by address: one service.
		first := s.send(t, "127.0.0.1:8080", "/orders", "o-2", "{}", auth)
		if g := s.send(t, "10.0.0.2:8081", "/orders", "o-2", "{}", auth); g.body != first.body {
			t.Errorf("Host by address: got %q, want the replay of %q", g.body, first.body)
		}
		if n := runs.Load(); n != 3 {
			t.Errorf("executions: got %d, want 3 (shop-a, shop-b, by address)", n)
		}
	})
}

// The route is the path the upstream sees: an escaped unreserved
// character is the same path, and the same request.
func TestPathEscapes(t *testing.T) {
	eachStore(t, func(t *testing.T, store idem.Store) {
		var runs atomic.Int64
		var s *server
		s = newServer(t, store, idemhttp.Config{Logger: quietLogger()}, account(&runs))
		auth := "Authorization: Bearer a"
		a := s.send(t, "", "/acct/pay", "p-1", "{}", auth)
		for _, p := range []string{"/acct/%70ay", "/acct/%70%61%79", "/%61cct/pay"} {
			if g := s.send(t, "", p, "p-1", "{}", auth); g.header.Get(idemhttp.HeaderReplayed) != "true" || g.body != a.body {
				t.Errorf("%s: got %d %q, want the replay of /acct/pay's %q", p, g.status, g.body, a.body)
			}
		}
		if n := runs.Load(); n != 1 {
			t.Errorf("executions: got %d, want 1", n)
		}
	})
}

// setsHeaders writes response headers as map keys in lower case, which
// net/http sends as written.
func setsHeaders(w http.ResponseWriter, r *http.Request) {
	h := w.Header()
	h["set-cookie"] = []string{"session=secret-1"}
	h["SET-COOKIE"] = []string{"other=secret-2"}
	h["x-private"] = []string{"p"}
	h["connection"] = []string{"x-hop"}
	h["x-hop"] = []string{"hop"}
	h["keep-alive"] = []string{"timeout=5"}
	h["proxy-authenticate"] = []string{"Basic"}
	h["idempotent-replayed"] = []string{"forged"}
	h["x-kept"] = []string{"kept"}
	w.WriteHeader(http.StatusCreated)
	io.WriteString(w, "ok")
}

// A header named in any case is denied alike.
func TestDeniedHeadersInAnyCase(t *testing.T) {
	eachStore(t, func(t *testing.T, store idem.Store) {
		s := newServer(t, store, idemhttp.Config{Logger: quietLogger(), ReplayHeaderDenylist: []string{"X-Private"}}, setsHeaders)
		s.send(t, "", "/h", "h-1", "{}", "Authorization: Bearer a")
		rec, ok, err := store.Get(context.Background(), storedKey(t, "Bearer a", "POST", "/", "h-1"))
		if err != nil || !ok {
			t.Fatalf("the record: %v, %v", ok, err)
		}
		for name := range rec.Response.Header {
			switch strings.ToLower(name) {
			case "set-cookie", "x-private", "connection", "x-hop", "keep-alive", "proxy-authenticate", "idempotent-replayed":
				t.Errorf("stored header %q: %q", name, rec.Response.Header[name])
			}
		}
		g := s.send(t, "", "/h", "h-1", "{}", "Authorization: Bearer a")
		if g.header.Get(idemhttp.HeaderReplayed) != "true" || g.header.Get("X-Kept") != "kept" {
			t.Fatalf("replay: got %d %v, want a replay with X-Kept", g.status, g.header)
		}
		for _, name := range []string{"Set-Cookie", "X-Private", "X-Hop", "Keep-Alive", "Proxy-Authenticate"} {
			if v := g.header.Values(name); len(v) > 0 {
				t.Errorf("replayed %s: %q", name, v)
			}
		}
	})
}

// storedKey is the key the middleware derives for a request of the test
// server (whose Host is an address: no authority) with Authorization auth.
func storedKey(t *testing.T, auth, method, route, key string) idem.Key {
	t.Helper()
	r, _ := http.NewRequest(method, "http://127.0.0.1/", nil)
	r.Header.Set("Authorization", auth)
	k, err := idem.Scope{Tenant: idemhttp.DefaultTenant(r), Method: method, Route: route}.Key(key)
	if err != nil {
		t.Fatal(err)
	}
	return k
}

// A caller no credential names: reported once per route, counted, and
// refused with RefuseAnonymous before anything is stored.
func TestAnonymousCallers(t *testing.T) {
	var logs bytes.Buffer
	var counted atomic.Int64
	reader := metric.NewManualReader()
	cfg := idemhttp.Config{Logger: slog.New(slog.NewTextHandler(&logs, nil)), OnAnonymous: func(*http.Request) { counted.Add(1) },
		MeterProvider: metric.NewMeterProvider(metric.WithReader(reader))}
	var runs atomic.Int64
	s := newServer(t, memstore.New(memstore.Options{}), cfg, account(&runs))
	s.send(t, "", "/a", "k1", "{}")
	s.send(t, "", "/a", "k2", "{}")
	s.send(t, "", "/b", "k3", "{}")
	s.send(t, "", "/a", "k4", "{}", "Authorization: Bearer x")
	if n := strings.Count(logs.String(), "unidentified caller"); n != 2 {
		t.Errorf("warnings: got %d, want 2 (once per route)\n%s", n, logs.String())
	}
	if n := counted.Load(); n != 3 {
		t.Errorf("OnAnonymous: got %d calls, want 3", n)
	}
	var rm metricdata.ResourceMetrics
	reader.Collect(context.Background(), &rm)
	if n := counterSum(rm, "idem.anonymous"); n != 3 {
		t.Errorf("idem.anonymous: got %d, want 3", n)
	}

	store := memstore.New(memstore.Options{})
	refusing := newServer(t, store, idemhttp.Config{Logger: quietLogger(), RefuseAnonymous: true}, account(&runs))
	before := runs.Load()
	a := refusing.send(t, "", "/a", "k1", "{}")
	if a.status != http.StatusUnauthorized || !strings.Contains(a.body, idemhttp.ProblemAnonymous) {
		t.Errorf("RefuseAnonymous: got %d %q, want 401 %s", a.status, a.body, idemhttp.ProblemAnonymous)
	}
	if ok := refusing.send(t, "", "/a", "k1", "{}", "X-Api-Key: k"); ok.status != http.StatusCreated {
		t.Errorf("RefuseAnonymous, with an API key: got %d, want 201", ok.status)
	}
	if n := runs.Load() - before; n != 1 {
		t.Errorf("RefuseAnonymous: %d executions, want 1 (the identified caller's)", n)
	}
	if unkeyed, _ := refusing.try("POST", "/a", "", "{}"); unkeyed.status != http.StatusCreated {
		t.Errorf("RefuseAnonymous, a request without a key: got %d, want it passed through", unkeyed.status)
	}
}

func counterSum(rm metricdata.ResourceMetrics, name string) int64 {
	var n int64
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			if sum, ok := m.Data.(metricdata.Sum[int64]); ok && m.Name == name {
				for _, dp := range sum.DataPoints {
					n += dp.Value
				}
			}
		}
	}
	return n
}

// An anonymous caller with a cookie jar (net/http's, as Python's
// requests.Session and browsers keep one): its first response sets a
// session cookie, its retry carries it, and replays; a load balancer's
// rotating stickiness cookie changes nothing; another browser's cookies,
// or none, are a mismatch.
func TestAnonymousCookies(t *testing.T) {
	eachStore(t, func(t *testing.T, store idem.Store) {
		var runs atomic.Int64
		s := newServer(t, store, idemhttp.Config{Logger: quietLogger()}, account(&runs))
		jar, _ := cookiejar.New(nil)
		u, _ := url.Parse(s.URL)
		client := &http.Client{Jar: jar}
		post := func(key string, lb int) answer {
			// The load balancer's cookie, rotated on every response.
			jar.SetCookies(u, []*http.Cookie{{Name: "AWSALB", Value: fmt.Sprintf("lb-%d", lb)}})
			req, _ := http.NewRequest("POST", s.URL+"/cart", strings.NewReader("{}"))
			req.Header.Set(idemhttp.HeaderKey, key)
			resp, err := client.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			defer resp.Body.Close()
			b, _ := io.ReadAll(resp.Body)
			return answer{resp.StatusCode, resp.Header, string(b)}
		}
		first := post("jar-1", 1) // no session yet; the 201 sets session=s1
		retry := post("jar-1", 2) // session=s1, another AWSALB
		if retry.status != http.StatusCreated || retry.header.Get(idemhttp.HeaderReplayed) != "true" || retry.body != first.body {
			t.Errorf("cookie-jar retry: got %d %q, want the replay of %q", retry.status, retry.body, first.body)
		}
		// Now with a session: its record remembers it.
		second := post("jar-2", 3)
		if again := post("jar-2", 4); again.header.Get(idemhttp.HeaderReplayed) != "true" || again.body != second.body {
			t.Errorf("retry with the session cookie and a new AWSALB: got %d %q, want the replay of %q", again.status, again.body, second.body)
		}
		for name, cookie := range map[string]string{"another browser": "session=s999", "no cookies": "", "a tracking cookie only": "_ga=GA1.1"} {
			var h []string
			if cookie != "" {
				h = []string{"Cookie: " + cookie}
			}
			if g := s.send(t, "", "/cart", "jar-2", "{}", h...); g.status != http.StatusUnprocessableEntity || strings.Contains(g.body, `"run"`) {
				t.Errorf("%s under the session's key: got %d %q, want 422", name, g.status, g.body)
			}
		}
		if n := runs.Load(); n != 2 {
			t.Errorf("executions: got %d, want 2", n)
		}
	})
}

// A session the response rotated: the retry carries the new value.
func TestAnonymousCookieRotated(t *testing.T) {
	var runs atomic.Int64
	s := newServer(t, memstore.New(memstore.Options{}), idemhttp.Config{Logger: quietLogger()}, account(&runs)) // sets session=sN
	a := s.send(t, "", "/login", "rot-1", "{}", "Cookie: session=old")
	g := s.send(t, "", "/login", "rot-1", "{}", "Cookie: session=s1")
	if g.header.Get(idemhttp.HeaderReplayed) != "true" || g.body != a.body {
		t.Errorf("retry with the cookie the response set: got %d %q, want the replay", g.status, g.body)
	}
	if v := g.header.Get("Idempotent-Caller-Cookies"); v != "" {
		t.Errorf("the record's cookies were replayed: %q", v)
	}
	if g = s.send(t, "", "/login", "rot-1", "{}", "Cookie: session=old"); g.header.Get(idemhttp.HeaderReplayed) != "true" {
		t.Errorf("retry with the cookie it had: got %d %q, want the replay", g.status, g.body)
	}
	if g = s.send(t, "", "/login", "rot-1", "{}", "Cookie: session=s2"); g.status != http.StatusUnprocessableEntity {
		t.Errorf("another session: got %d %q, want 422", g.status, g.body)
	}
}

// The denylist holds at replay too: a record stored before a header was
// denied (v1.0 stored h["set-cookie"]) replays without it.
func TestDeniedAtReplay(t *testing.T) {
	store := memstore.New(memstore.Options{})
	before := newServer(t, store, idemhttp.Config{Logger: quietLogger()}, setsHeaders)
	before.send(t, "", "/h", "d-1", "{}", "Authorization: Bearer a")
	after := newServer(t, store, idemhttp.Config{Logger: quietLogger(), ReplayHeaderDenylist: []string{"x-PRIVATE"}}, setsHeaders)
	g := after.send(t, "", "/h", "d-1", "{}", "Authorization: Bearer a")
	if g.header.Get(idemhttp.HeaderReplayed) != "true" {
		t.Fatalf("got %d %v, want a replay", g.status, g.header)
	}
	if v := g.header.Values("X-Private"); len(v) > 0 {
		t.Errorf("replayed X-Private %q, denied since it was stored", v)
	}
}

// A publishable API key, the same in every browser of a site, does not
// make two browsers one caller: their cookies are checked as an
// anonymous caller's are.
func TestSharedAPIKeyCookies(t *testing.T) {
	var runs atomic.Int64
	s := newServer(t, memstore.New(memstore.Options{}), idemhttp.Config{Logger: quietLogger()}, account(&runs))
	pk := "X-Api-Key: pk_live_shared"
	a := s.send(t, "", "/cart", "pk-1", "{}", pk, "Cookie: session=alice")
	if g := s.send(t, "", "/cart", "pk-1", "{}", pk, "Cookie: session=alice; _ga=1"); g.header.Get(idemhttp.HeaderReplayed) != "true" || g.body != a.body {
		t.Errorf("Alice's retry: got %d %q, want her replay", g.status, g.body)
	}
	if g := s.send(t, "", "/cart", "pk-1", "{}", pk, "Cookie: session=bob"); g.status != http.StatusUnprocessableEntity {
		t.Errorf("Bob with the same publishable key: got %d %q, want 422", g.status, g.body)
	}
	if n := runs.Load(); n != 1 {
		t.Errorf("executions: got %d, want 1", n)
	}
}
