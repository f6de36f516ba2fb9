package idemhttp

import (
	"context"
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
