package ident

import "testing"

func TestAuthorization(t *testing.T) {
	for _, spelling := range []string{"Bearer tokA", "bearer tokA", "Bearer  tokA", "Bearer tokA ", "  Bearer tokA", "BEARER\ttokA", "\tbearer \t tokA\t"} {
		if got := Authorization(spelling); got != "Bearer tokA" {
			t.Errorf("Authorization(%q): got %q, want %q", spelling, got, "Bearer tokA")
		}
	}
	for in, want := range map[string]string{
		"Bearer TOKA":                     "Bearer TOKA",
		"Digest  user=a,   realm=\"b c\"": "Digest user=a, realm=\"b c\"",
		"token":                           "Token",
		"":                                "",
		"   ":                             "",
	} {
		if got := Authorization(in); got != want {
			t.Errorf("Authorization(%q): got %q, want %q", in, got, want)
		}
	}
}

func headers(h map[string][]string) func(string) []string {
	return func(name string) []string { return h[name] }
}

func TestTenant(t *testing.T) {
	// v1.0's DefaultTenant of "Bearer tokA": authz: and the hash of the
	// raw header, which is its normal form.
	if got, want := Tenant(headers(map[string][]string{"Authorization": {"bearer  tokA "}})), "authz:"+hash("Bearer tokA"); got != want {
		t.Errorf("Tenant: got %q, want v1.0's %q", got, want)
	}
	seen := map[string]string{}
	for name, h := range map[string]map[string][]string{
		"none":       {},
		"alice":      {"X-Api-Key": {"alice-secret"}},
		"bob":        {"X-Api-Key": {"bob-secret"}},
		"api-key":    {"Api-Key": {"alice-secret"}},
		"auth-token": {"X-Auth-Token": {"alice-secret"}},
		"bearer":     {"Authorization": {"Bearer alice-secret"}},
		"both":       {"Authorization": {"Bearer alice-secret"}, "X-Api-Key": {"alice-secret"}},
		"two keys":   {"X-Api-Key": {"alice-secret", "bob-secret"}},
	} {
		got := Tenant(headers(h))
		if prev, dup := seen[got]; dup {
			t.Errorf("%s and %s share the tenant %q", name, prev, got)
		}
		seen[got] = name
		if (got == "") != (name == "none") {
			t.Errorf("%s: got tenant %q", name, got)
		}
	}
	if a, b := Tenant(headers(map[string][]string{"X-Api-Key": {" k "}})), Tenant(headers(map[string][]string{"X-Api-Key": {"k"}})); a != b {
		t.Errorf("an API key's surrounding whitespace makes another tenant: %q, %q", a, b)
	}
	if got := Tenant(headers(map[string][]string{"Authorization": {""}, "X-Api-Key": {" "}})); got != "" {
		t.Errorf("empty credentials: got tenant %q, want none", got)
	}
}

func TestPath(t *testing.T) {
	for in, want := range map[string]string{
		"/acct/pay":       "/acct/pay",
		"/acct/%70ay":     "/acct/pay",
		"/acct/%70%61%79": "/acct/pay",
		"/a%2fb":          "/a%2Fb",
		"/a%2Fb":          "/a%2Fb",
		"/%7euser":        "/~user",
		"/caf%C3%A9":      "/caf%C3%A9",
		"/bad%zz":         "/bad%zz",
		"/end%7":          "/end%7",
		"/end%":           "/end%",
		"":                "",
	} {
		if got := Path(in); got != want {
			t.Errorf("Path(%q): got %q, want %q", in, got, want)
		}
	}
}

func TestHost(t *testing.T) {
	for in, want := range map[string]string{
		"Shop-A.example":      "shop-a.example",
		"shop-a.example:80":   "shop-a.example",
		"shop-a.example:8443": "shop-a.example",
		"shop-a.example.":     "shop-a.example",
		"shop-a.example.:443": "shop-a.example",
		"127.0.0.1:8080":      "",
		"10.0.0.7":            "",
		"[::1]:8080":          "",
		"[2001:db8::1]":       "",
		"localhost:8080":      "localhost",
		"":                    "",
	} {
		if got := Host(in); got != want {
			t.Errorf("Host(%q): got %q, want %q", in, got, want)
		}
	}
}

// A value already in normal form is returned without a copy, and every
// value's normal form is in normal form.
func TestAuthorizationNormalForm(t *testing.T) {
	for _, v := range []string{"Bearer tokA", "bearer tokA", "Bearer  tokA", "Bearer tokA ", " Bearer tokA", "BEARER x", "Token", "token", "Bearer a b", "Bearer a  b", "Bearer\ta", "Bearer a\t", "", " ", "Digest a=b, c=d"} {
		n := Authorization(v)
		if Authorization(n) != n {
			t.Errorf("Authorization(%q) = %q, which is not in normal form (%q)", v, n, Authorization(n))
		}
		if normalAuthorization(v) && n != v {
			t.Errorf("%q is taken for normal, but its normal form is %q", v, n)
		}
	}
	if n := testing.AllocsPerRun(100, func() { Authorization("Bearer tokA") }); n != 0 {
		t.Errorf("Authorization of a normal value: %v allocations, want 0", n)
	}
}

func BenchmarkTenant(b *testing.B) {
	h := headers(map[string][]string{"Authorization": {"Bearer 8f14e45fceea167a5a36dedd4bea2543"}})
	b.ReportAllocs()
	for b.Loop() {
		Tenant(h)
	}
}
