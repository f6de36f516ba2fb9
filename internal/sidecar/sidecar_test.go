package sidecar

import (
	"net/http"
	"testing"
)

func TestTenantAndHints(t *testing.T) {
	r, _ := http.NewRequest("POST", "http://x/", nil)
	r.Header.Add("X-Tenant", "a")
	if got := TenantFunc("X-Tenant", "")(r); got != "hdr:a" {
		t.Errorf("one header value: tenant %q, want hdr:a", got)
	}
	r.Header.Add("X-Tenant", "b")
	if got := TenantFunc("X-Tenant", "")(r); got != "hdr:a\nb" {
		t.Errorf("two header values: tenant %q, want both", got)
	}
	h := http.Header{"Idempotency-Key": {"k"}, "Content-Type": {"a/b"}}
	out := HideReplayHints(h)
	if out["idempotency-key"][0] != "k" || out.Get("Content-Type") != "a/b" || h["Idempotency-Key"][0] != "k" {
		t.Errorf("HideReplayHints: got %v (and the original %v), want the key under its lower-case name in a copy", out, h)
	}
	if _, ok := out["Idempotency-Key"]; ok {
		t.Errorf("HideReplayHints kept the canonical name: %v", out)
	}
}
