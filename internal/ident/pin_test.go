package ident

import (
	"crypto/sha256"
	"encoding/base64"
	"encoding/binary"
	"net"
	"strings"
	"testing"
)

// The tenants and digests that records are stored under: pinned, byte
// for byte, as the releases that stored them computed them. A change
// here orphans every stored record.
func TestTenantPinned(t *testing.T) {
	long := "Basic dXNlcjpwYXNzd29yZGxvbmdlcmxvbmdlcmxvbmdlcmxvbmdlcmxvbmdlcmxvbmdlcmxvbmdlcmxvbmdlcmxvbmdlcmxvbmdlcmxvbmdlcmxvbmdlcmxvbmdlcmxvbmdlcmxvbmdlcmxvbmdlcmxvbmdlcmxvbmdlcmxvbmdlcmxvbmdlcmxvbmdlcmxvbmdlcmxvbmdlcmxvbmdlcmxvbmdlcmxvbmdlcmxvbmdlcg=="
	for _, c := range []struct {
		h    map[string][]string
		want string
	}{
		{map[string][]string{}, ""},
		{map[string][]string{"Authorization": {"Bearer sk_test_4eC39HqLyjWDarjtT1zdp7dc"}}, "authz:LQrY59AJOQYz1O7X5bmVug"},
		{map[string][]string{"Authorization": {"bearer  tokA "}}, "authz:e2zOXhBfSlb7izTPh2dSVw"},
		{map[string][]string{"Authorization": {"Bearer tokA"}}, "authz:e2zOXhBfSlb7izTPh2dSVw"},
		{map[string][]string{"Authorization": {long}}, "authz:oyZqRwD_4D1ab7nURb_tTw"},
		{map[string][]string{"Authorization": {"Bearer a", "Bearer  b"}}, "authz:peITsxRmdR0Aj7iTieHiLQ"},
		{map[string][]string{"Authorization": {""}}, ""},
		{map[string][]string{"Authorization": {"   "}}, ""},
		{map[string][]string{"Authorization": {"Bearer x"}, "X-Api-Key": {"k1"}}, "authz:uTem_WB082UJMN2ajD6lHw apikey:k7HMmmWNn9OjjsiuPvKZzA"},
		{map[string][]string{"X-Api-Key": {" k "}}, "apikey:0f12w-QaObW0R2RsDTFrwg"},
		{map[string][]string{"X-Api-Key": {"a", "b"}}, "apikey:37dqz1qtp0yxXrRngZ4Udg"},
		{map[string][]string{"Api-Key": {"k"}, "X-Auth-Token": {"t"}}, "apikey:sk_4CuD1fmiUFja_E4G2sA apikey:q5-Z6HiTBM6t6fo39nVmSw"},
		{map[string][]string{"Api-Key": {"k"}, "X-Api-Key": {""}}, "apikey:sk_4CuD1fmiUFja_E4G2sA"},
		{map[string][]string{"Authorization": {"Bearer é✓"}, "X-Auth-Token": {"t", " "}}, "authz:g0U4MfZqP6DmJ4f60jFPfQ apikey:BMcT1F__kGM2bFI4OxZc9Q"},
	} {
		if got := Tenant(headers(c.h)); got != c.want {
			t.Errorf("Tenant(%v): got %q, want %q", c.h, got, c.want)
		}
	}
	for _, c := range []struct {
		fields []string
		want   string
	}{
		{[]string{}, "47DEQpj8HBSa-_TImW-5JA"},
		{[]string{""}, "bjQLnP-zepicpUTmu3gKLA"},
		{[]string{"a"}, "4yVOphwJ6tWgHTvwfpRqVg"},
		{[]string{"a", "b"}, "-ko1D1kGAh4nssrxlAkxng"},
		{[]string{"sid", "abcdef0123456789"}, "zr14F7x1KuXwdjTbKF-JUQ"},
		{[]string{strings.Repeat("\x00", 300)}, "eXzdimuW_HsD_TaqtUBf5A"},
	} {
		if got := Digest(c.fields...); got != c.want {
			t.Errorf("Digest(%q): got %q, want %q", c.fields, got, c.want)
		}
	}
	for der, want := range map[string]string{"": "cert:47DEQpj8HBSa-_TImW-5JA", "x": "cert:LXEWQrcmsEQBYnyp-6wy9Q", strings.Repeat("\x00", 1000): "cert:VBs-naoJsgv4X6Jz5cvT6A"} {
		if got := Cert([]byte(der)); got != want {
			t.Errorf("Cert(%.8q): got %q, want %q", der, got, want)
		}
	}
}

// hostBefore is Host as it was before its fast path, the reference the
// fast path must agree with.
func hostBefore(hostport string) string {
	host := hostport
	if h, _, err := net.SplitHostPort(hostport); err == nil {
		host = h
	}
	host = strings.TrimSuffix(strings.ToLower(strings.Trim(host, "[]")), ".")
	if net.ParseIP(host) != nil {
		return ""
	}
	return host
}

func TestHostAsBefore(t *testing.T) {
	for _, in := range []string{
		"", ".", "..", "a", "A", "api.example", "API.Example.", "api.example..", "1", "1.2.3.4", "1.2.3.4.", "01.2.3.4", "1.2.3", "256.1.1.1",
		"1.2.3.4:80", "[1.2.3.4]", "[api.example]", "[api", "api]", "[]", "::1", "[::1]", "[::1]:80", "fe80::1%eth0", "[fe80::1%25eth0]:1",
		"1.2.3.4%eth0", "%", "a%b", "ÉCOLE.example", "İ.example", "x:y:z", ":80", "host:", "0x7f.1", "1..2.3", "١.٢.٣.٤", "1.2.3.4\x00",
		"127.0.0.1", "localhost", "LOCALHOST.", "a-b_c.example", "\u212a.example",
	} {
		if got, want := Host(in), hostBefore(in); got != want {
			t.Errorf("Host(%q): got %q, want %q (as before)", in, got, want)
		}
	}
}

func FuzzHostAsBefore(f *testing.F) {
	for _, s := range []string{"api.example", "1.2.3.4", "[::1]:80", "A.B.", "1.2.3.4."} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, in string) {
		if got, want := Host(in), hostBefore(in); got != want {
			t.Errorf("Host(%q): got %q, want %q (as before)", in, got, want)
		}
	})
}
func TestTenantAllocs(t *testing.T) {
	h := headers(map[string][]string{"Authorization": {"Bearer sk_test_4eC39HqLyjWDarjtT1zdp7dc"}})
	if n := testing.AllocsPerRun(100, func() { Tenant(h) }); n > 1 {
		t.Errorf("Tenant of one Authorization value: %v allocations, want at most 1", n)
	}
	if n := testing.AllocsPerRun(100, func() { Host("api.example") }); n != 0 {
		t.Errorf("Host of a plain name: %v allocations, want 0", n)
	}
}

// tenantBefore, digestBefore and hashBefore are Tenant, Digest and hash
// as they were before they built their strings on the stack: the
// reference they must agree with, byte for byte.
func tenantBefore(values func(name string) []string) string {
	var parts []string
	switch vs := values("Authorization"); len(vs) {
	case 0:
	case 1:
		if v := Authorization(vs[0]); v != "" {
			parts = append(parts, "authz:"+hashBefore(v))
		}
	default:
		norm := make([]string, len(vs))
		for i, v := range vs {
			norm[i] = Authorization(v)
		}
		parts = append(parts, "authz:"+hashBefore(strings.Join(norm, "\n")))
	}
	for _, name := range APIKeyHeaders {
		vs := values(name)
		if len(vs) == 0 || (len(vs) == 1 && strings.TrimSpace(vs[0]) == "") {
			continue
		}
		fields := make([]string, 0, len(vs)+1)
		fields = append(fields, strings.ToLower(name))
		for _, v := range vs {
			fields = append(fields, strings.TrimSpace(v))
		}
		parts = append(parts, "apikey:"+digestBefore(fields...))
	}
	if len(parts) == 1 {
		return parts[0]
	}
	return strings.Join(parts, " ")
}

func hashBefore(s string) string {
	sum := sha256.Sum256([]byte(s))
	return base64.RawURLEncoding.EncodeToString(sum[:16])
}

func digestBefore(fields ...string) string {
	h := sha256.New()
	var n [binary.MaxVarintLen64]byte
	for _, f := range fields {
		h.Write(binary.AppendUvarint(n[:0], uint64(len(f))))
		h.Write([]byte(f))
	}
	sum := h.Sum(nil)
	return base64.RawURLEncoding.EncodeToString(sum[:16])
}

// FuzzTenantAsBefore: headers split from one string ("\x00" between
// headers, "\x01" between values), long values included.
func FuzzTenantAsBefore(f *testing.F) {
	f.Add("Bearer tok", "", "", "", 1)
	f.Add("bearer  a\x01Bearer b", "k", " k2 \x01x", "", 3)
	f.Add("", "", "", "t", 300)
	f.Fuzz(func(t *testing.T, authz, xapi, api, token string, repeat int) {
		repeat = max(1, min(repeat, 400))
		h := map[string][]string{}
		for name, v := range map[string]string{"Authorization": authz, "X-Api-Key": xapi, "Api-Key": api, "X-Auth-Token": token} {
			if v != "" {
				h[name] = strings.Split(strings.Repeat(v, repeat), "\x01")
			}
		}
		if got, want := Tenant(headers(h)), tenantBefore(headers(h)); got != want {
			t.Errorf("Tenant(%q): got %q, want %q (as before)", h, got, want)
		}
		for _, vs := range h {
			if got, want := Digest(vs...), digestBefore(vs...); got != want {
				t.Errorf("Digest(%q): got %q, want %q (as before)", vs, got, want)
			}
			if got, want := Cert([]byte(vs[0])), "cert:"+hashBefore(vs[0]); got != want {
				t.Errorf("Cert(%q): got %q, want %q (as before)", vs[0], got, want)
			}
		}
	})
}

func TestAPIKeyNamesNotASCII(t *testing.T) {
	saved := APIKeyHeaders
	defer func() { APIKeyHeaders = saved }()
	APIKeyHeaders = []string{"X-Ключ", "İ-Key"}
	h := headers(map[string][]string{"X-Ключ": {"a"}, "İ-Key": {"b"}})
	if got, want := Tenant(h), tenantBefore(h); got != want {
		t.Errorf("got %q, want %q (as before)", got, want)
	}
}
