package idemhttp

import (
	"context"
	"crypto/sha256"
	"encoding/base64"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/memstore"
)

// v1.0 stored keys from Idempotency-Key only: a record under v1.0's key
// answers for that header (Config.V1Scopes), and never for a key of
// another source that happens to have the same value.
func TestKeySourceV1Records(t *testing.T) {
	const body = `{"id":"evt_1"}`
	for _, c := range []struct {
		name     string
		src      KeySource
		header   string
		replayed bool
	}{
		{"Idempotency-Key", KeySource{}, HeaderKey, true},
		{"KeyFromHeader(Idempotency-Key)", KeyFromHeader("idempotency-key"), HeaderKey, true},
		{"KeyFromHeader(X-Delivery)", KeyFromHeader("X-Delivery"), "X-Delivery", false},
		{"KeyFromJSON", KeyFromJSON("/id"), "", false},
	} {
		t.Run(c.name, func(t *testing.T) {
			// As a store v1.0 used too (Redis, say): a *memstore.Store is
			// never looked up for v1.0's keys (it holds nothing of v1.0).
			store := struct{ idem.Store }{memstore.New(memstore.Options{})}
			newReq := func() *http.Request {
				r := httptest.NewRequest("POST", "/hooks", strings.NewReader(body))
				r.Header.Set("Authorization", "Bearer tenant-1")
				if c.header != "" {
					r.Header.Set(c.header, "evt_1")
				}
				return r
			}
			// The record v1.0 stored for this request, had it come with
			// Idempotency-Key: evt_1.
			old, oldFP := v1Derivation{}.derive(newReq(), request{route: "/hooks", clientKey: "evt_1"}, []byte(body))
			ctx := context.Background()
			a, err := store.Acquire(ctx, idem.AcquireRequest{Key: old, Fingerprint: oldFP, LeaseID: idem.NewLeaseID(), TTL: time.Minute})
			if err != nil || a.Outcome != idem.Acquired {
				t.Fatalf("got %+v, %v", a, err)
			}
			if err := store.Complete(ctx, a.Lease, &idem.Response{Status: 201, Header: http.Header{}, Body: []byte("stored by v1.0")}, time.Hour); err != nil {
				t.Fatal(err)
			}
			mw, err := NewMiddleware(store, Config{KeySource: c.src, Logger: slog.New(slog.DiscardHandler)})
			if err != nil {
				t.Fatal(err)
			}
			h := mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "ran") }))
			rec := httptest.NewRecorder()
			h.ServeHTTP(rec, newReq())
			if got := rec.Body.String() == "stored by v1.0"; got != c.replayed {
				t.Errorf("got %d %q, want replayed=%v", rec.Code, rec.Body.String(), c.replayed)
			}
		})
	}
}

// v1.0's tenant of a request, as v1.0 computed it: "authz:" and the first
// 128 bits of SHA-256 over the Authorization header as written.
func v1AuthzTenant(auth string) string {
	sum := sha256.Sum256([]byte(auth))
	return "authz:" + base64.RawURLEncoding.EncodeToString(sum[:16])
}

// A record v1.0 stored under its tenant (the Authorization header as
// written) replays, whether today's tenant is the same string (a header in
// normal form, no API key) or not, and whatever the header is when the
// record is looked for (an OnKey that rewrites it).
func TestV1TenantRecords(t *testing.T) {
	const body = `{"amount":1}`
	for _, c := range []struct {
		name   string
		header http.Header
		onKey  func(r *http.Request, key idem.Key)
		v1     string // the Authorization v1.0 hashed
	}{
		{"normal form", http.Header{"Authorization": {"Bearer tenant-1"}}, nil, "Bearer tenant-1"},
		{"not normal", http.Header{"Authorization": {"bearer   tenant-1"}}, nil, "bearer   tenant-1"},
		{"with an API key", http.Header{"Authorization": {"Bearer tenant-1"}, "X-Api-Key": {"k"}}, nil, "Bearer tenant-1"},
		{"two values", http.Header{"Authorization": {"Bearer tenant-1", "Bearer tenant-2"}}, nil, "Bearer tenant-1"},
		{"rewritten after the tenant", http.Header{"Authorization": {"Bearer tenant-1"}},
			func(r *http.Request, _ idem.Key) { r.Header.Set("Authorization", "Bearer tenant-9") }, "Bearer tenant-9"},
		{"added after the tenant", http.Header{"Authorization": {"Bearer tenant-1"}},
			func(r *http.Request, _ idem.Key) { r.Header.Set("Authorization", "Bearer tenant-1") }, "Bearer tenant-1"},
	} {
		t.Run(c.name, func(t *testing.T) {
			store := struct{ idem.Store }{memstore.New(memstore.Options{})} // as a store v1.0 used too (see TestKeySourceV1Records)
			newReq := func() *http.Request {
				r := httptest.NewRequest("POST", "/charges", strings.NewReader(body))
				for k, vs := range c.header {
					r.Header[k] = append([]string(nil), vs...)
				}
				r.Header.Set(HeaderKey, "k1")
				return r
			}
			old, _ := idem.Scope{Tenant: v1AuthzTenant(c.v1), Method: "POST", Route: "/charges"}.Key("k1")
			oldFP := v1Fingerprint(newReq(), []byte(body))
			ctx := context.Background()
			a, err := store.Acquire(ctx, idem.AcquireRequest{Key: old, Fingerprint: oldFP, LeaseID: idem.NewLeaseID(), TTL: time.Minute})
			if err != nil || a.Outcome != idem.Acquired {
				t.Fatalf("got %+v, %v", a, err)
			}
			if err := store.Complete(ctx, a.Lease, &idem.Response{Status: 201, Header: http.Header{}, Body: []byte("stored by v1.0")}, time.Hour); err != nil {
				t.Fatal(err)
			}
			mw, err := NewMiddleware(store, Config{OnKey: c.onKey, Logger: slog.New(slog.DiscardHandler)})
			if err != nil {
				t.Fatal(err)
			}
			h := mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "ran") }))
			rec := httptest.NewRecorder()
			h.ServeHTTP(rec, newReq())
			if rec.Body.String() != "stored by v1.0" {
				t.Errorf("got %d %q, want v1.0's record replayed", rec.Code, rec.Body.String())
			}
		})
	}
}
