package idem_test

import (
	"errors"
	"strings"
	"testing"

	"github.com/idemkit/idem"
)

func TestValidateKey(t *testing.T) {
	good := []string{"a", "550e8400-e29b-41d4-a716-446655440000", strings.Repeat("k", idem.MaxKeyLen), "with space", "{x}", `"quoted"`}
	for _, k := range good {
		if err := idem.ValidateKey(k); err != nil {
			t.Errorf("ValidateKey(%q): got %v, want nil", k, err)
		}
	}
	bad := []string{"", strings.Repeat("k", idem.MaxKeyLen+1), "caf\u00e9", "tab\there", "nul\x00", "del\x7f", "line\nbreak"}
	for _, k := range bad {
		err := idem.ValidateKey(k)
		if !errors.Is(err, idem.ErrInvalidKey) {
			t.Errorf("ValidateKey(%q): got %v, want ErrInvalidKey", k, err)
		}
		if _, err := (idem.Scope{}).Key(k); !errors.Is(err, idem.ErrInvalidKey) {
			t.Errorf("Scope.Key(%q): got %v, want ErrInvalidKey", k, err)
		}
	}
}

func TestScopeKeyDistinct(t *testing.T) {
	// Tuples whose plain concatenations collide must still differ.
	scopes := []struct {
		s   idem.Scope
		key string
	}{
		{idem.Scope{Tenant: "ab", Method: "POST", Route: "/x"}, "k"},
		{idem.Scope{Tenant: "a", Method: "bPOST", Route: "/x"}, "k"},
		{idem.Scope{Tenant: "a", Method: "b", Route: "POST/x"}, "k"},
		{idem.Scope{Tenant: "", Method: "POST", Route: "/x"}, "k"},
		{idem.Scope{Tenant: "B", Method: "POST", Route: "/x"}, "k"},
		{idem.Scope{Tenant: "ab", Method: "PATCH", Route: "/x"}, "k"},
		{idem.Scope{Tenant: "ab", Method: "POST", Route: "/x"}, "K"},
		{idem.Scope{Tenant: "ab", Method: "POST", Route: "/x"}, "kk"},
		{idem.Scope{Tenant: "ab", Method: "POST", Route: "/xk"}, "k"},
		{idem.Scope{Tenant: "ab", Method: "POST", Route: "/x", Authority: "shop-a.example"}, "k"},
		{idem.Scope{Tenant: "ab", Method: "POST", Route: "/x", Authority: "shop-b.example"}, "k"},
		{idem.Scope{Tenant: "ab", Method: "POST", Route: "/x", Authority: "k"}, "k"},
		{idem.Scope{Tenant: "ab", Method: "POST", Route: "/", Authority: "x"}, "k"},
	}
	seen := map[idem.Key]int{}
	for i, sc := range scopes {
		k, err := sc.s.Key(sc.key)
		if err != nil {
			t.Fatal(err)
		}
		if j, dup := seen[k]; dup {
			t.Errorf("scopes %d and %d give the same key %s", j, i, k)
		}
		seen[k] = i
		again, _ := sc.s.Key(sc.key)
		if again != k {
			t.Errorf("scope %d: key not deterministic", i)
		}
	}
}

// TestScopeKeyV1 pins the keys of v1.0.0: a Scope without Authority
// derives the key it did then, so records stored by v1.0 stay reachable.
func TestScopeKeyV1(t *testing.T) {
	k, err := idem.Scope{Tenant: "authz:x", Method: "POST", Route: "/charges"}.Key("order-1")
	if err != nil {
		t.Fatal(err)
	}
	// Computed by the v1.0.0 code (commit fd7d5db).
	if got, want := k.String(), "GS2olm99K8CzDDtEG813lw"; got != want {
		t.Errorf("Scope.Key without Authority: got %s, want v1.0's %s", got, want)
	}
	withHost, _ := idem.Scope{Tenant: "authz:x", Method: "POST", Route: "/charges", Authority: "shop.example"}.Key("order-1")
	if withHost == k {
		t.Error("Scope.Key: an Authority does not change the key")
	}
}

func TestKeyString(t *testing.T) {
	k, _ := idem.Scope{Tenant: "t"}.Key("abc")
	s := k.String()
	if len(s) != 22 || strings.ContainsAny(s, "{}+/=") {
		t.Fatalf("Key.String: got %q, want 22 base64url characters", s)
	}
	back, err := idem.ParseKey(s)
	if err != nil || back != k {
		t.Fatalf("ParseKey(%q): got %v, %v; want %v", s, back, err, k)
	}
	// The last is s with its final character's unused low bits set: a
	// second spelling of the same bytes, refused.
	last := strings.IndexByte("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_", s[21])
	other := s[:21] + string("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"[last^1])
	for _, bad := range []string{"", "short", s + "x", strings.Repeat("*", 22), other} {
		if _, err := idem.ParseKey(bad); err == nil {
			t.Errorf("ParseKey(%q): got nil error, want one", bad)
		}
	}
}

func TestFingerprint(t *testing.T) {
	if idem.SumFingerprint(nil, "ab", "c") == idem.SumFingerprint(nil, "a", "bc") {
		t.Error("fields are not delimited: (ab, c) and (a, bc) collide")
	}
	if idem.SumFingerprint([]byte("c"), "ab") == idem.SumFingerprint(nil, "ab", "c") {
		t.Error("the body and a field collide")
	}
	if idem.SumFingerprint([]byte("x"), "POST") != idem.SumFingerprint([]byte("x"), "POST") {
		t.Error("fingerprint not deterministic")
	}
	if n := testing.AllocsPerRun(100, func() { idem.Scope{Tenant: "t", Method: "POST", Route: "/r"}.Key("k") }); n != 0 {
		t.Errorf("Scope.Key: got %v allocations, want 0", n)
	}
}

// FuzzScopeKey: no panic; distinct client keys in one scope give distinct
// keys. (No raw client bytes can reach a key: it is a digest.)
func FuzzScopeKey(f *testing.F) {
	f.Add("tenant", "POST", "/charges", "key-1", "key-2")
	f.Add("", "", "", "{slot}", "{slot}x")
	f.Fuzz(func(t *testing.T, tenant, method, route, a, b string) {
		s := idem.Scope{Tenant: tenant, Method: method, Route: route}
		ka, errA := s.Key(a)
		kb, errB := s.Key(b)
		if errA != nil || errB != nil {
			return
		}
		if a != b && ka == kb {
			t.Fatalf("keys %q and %q collide", a, b)
		}
		if back, err := idem.ParseKey(ka.String()); err != nil || back != ka {
			t.Fatalf("ParseKey(String()) = %v, %v; want %v", back, err, ka)
		}
	})
}
