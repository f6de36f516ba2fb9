package ident

import (
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
