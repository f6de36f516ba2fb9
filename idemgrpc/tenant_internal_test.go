package idemgrpc

import (
	"context"
	"testing"

	"google.golang.org/grpc/metadata"
)

// DefaultTenant keeps v1.0's tenant (v1Tenant) for a single authorization
// value in normal form, so that records v1.0 stored under it stay
// reachable; the tenants that changed are those of API-key callers (""
// in v1.0), of other spellings of authorization, and of several values.
func TestDefaultTenantSinceV1(t *testing.T) {
	in := func(kv ...string) context.Context {
		return metadata.NewIncomingContext(context.Background(), metadata.Pairs(kv...))
	}
	for _, kv := range [][]string{
		{"authorization", "Bearer tok"},
		{"authorization", "Basic YWxpY2U6cHc="},
		{"x-request-id", "r-1"}, // anonymous then and now
	} {
		if now, v1 := DefaultTenant(in(kv...)), v1Tenant(in(kv...)); now != v1 {
			t.Errorf("%q: got %q, want v1.0's %q", kv, now, v1)
		}
	}
	normal := v1Tenant(in("authorization", "Bearer tok"))
	for _, kv := range [][]string{
		{"authorization", "bearer tok"},
		{"authorization", "Bearer  tok "},
	} {
		if now, v1 := DefaultTenant(in(kv...)), v1Tenant(in(kv...)); now != normal || v1 == normal {
			t.Errorf("%q: got %q (v1.0 %q), want the normal form's %q (v1.0 another)", kv, now, v1, normal)
		}
	}
	for _, kv := range [][]string{
		{"x-api-key", "alice-secret"},
		{"authorization", "Bearer a", "authorization", "Bearer b"},
	} {
		if now, v1 := DefaultTenant(in(kv...)), v1Tenant(in(kv...)); now == "" || v1 != "" {
			t.Errorf("%q: got %q (v1.0 %q), want a tenant where v1.0 had none", kv, now, v1)
		}
	}
	// Metadata built by hand, with keys in upper case, names the caller too.
	upper := metadata.NewIncomingContext(context.Background(), metadata.MD{"X-Api-Key": {"alice-secret"}})
	if got, want := DefaultTenant(upper), DefaultTenant(in("x-api-key", "alice-secret")); got != want {
		t.Errorf("X-Api-Key in an MD literal: got %q, want %q", got, want)
	}
}

// The cost of DefaultTenant against v1.0's, on a call with a bearer token
// and a few other metadata (the reads of the API-key metadata it adds).
func BenchmarkDefaultTenant(b *testing.B) {
	ctx := metadata.NewIncomingContext(context.Background(), metadata.Pairs(
		"authorization", "Bearer eyJhbGciOiJIUzI1NiJ9.e30.sig", "content-type", "application/grpc",
		"user-agent", "grpc-go/1.85.0", "idempotency-key", "k-1", ":authority", "127.0.0.1:50051"))
	for _, f := range []struct {
		name string
		fn   func(context.Context) string
	}{{"v1.0", v1Tenant}, {"now", DefaultTenant}} {
		b.Run(f.name, func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				if f.fn(ctx) == "" {
					b.Fatal("no tenant")
				}
			}
		})
	}
}
