package sidecar

import (
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"reflect"
	"strings"
	"sync"
	"testing"

	"github.com/idemkit/idem/idemhttp"
)

// holdUpstream answers 201 (a gRPC call: 200 and grpc-status 0,
// trailers-only), but first waits for release when the body is "hold",
// after it said so on held.
func holdUpstream(held chan<- struct{}, release <-chan struct{}) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		if string(b) == "hold" {
			held <- struct{}{}
			<-release
		}
		if IsGRPC(r) {
			w.Header().Set("Content-Type", "application/grpc")
			w.Header().Set("Grpc-Status", "0")
			w.WriteHeader(http.StatusOK)
			return
		}
		w.WriteHeader(http.StatusCreated)
	})
}

// conflicts sends, with extra headers, a request under key "m" then
// another body under it (the mismatch), and a request under key "f"
// held in the upstream while a second one comes (the key in flight).
func conflicts(t *testing.T, rt *testRoute, held <-chan struct{}, release chan<- struct{}, extra ...string) (mismatch, inFlight answer) {
	t.Helper()
	h := func(key string) []string { return append([]string{"Idempotency-Key", key}, extra...) }
	rt.post(t, "a", h("m")...)
	mismatch = rt.post(t, "b", h("m")...)
	var wg sync.WaitGroup
	wg.Go(func() { rt.post(t, "hold", h("f")...) })
	<-held
	inFlight = rt.post(t, "hold", h("f")...)
	release <- struct{}{}
	wg.Wait()
	return mismatch, inFlight
}

// TestProfiles: each profile's mismatch and in-flight answers (status,
// application/json or problem+json, body, Retry-After on the key in
// flight, Cache-Control: no-store); the other problems are problem+json
// whatever the profile.
func TestProfiles(t *testing.T) {
	const conflictMsg, inFlightMsg = "used with a different request", "is being processed"
	for _, c := range []struct {
		profile                  string
		mismatchSt, inFlightSt   int
		contentType              string
		mismatchBody, inFlightBy map[string]any // their "message" (at any depth) checked apart, then removed
	}{
		{"", 422, 409, "application/problem+json",
			map[string]any{"type": idemhttp.ProblemMismatch, "title": "Idempotency-Key reused", "status": 422.0},
			map[string]any{"type": idemhttp.ProblemInFlight, "title": "Request in progress", "status": 409.0}},
		{"ietf", 422, 409, "application/problem+json",
			map[string]any{"type": idemhttp.ProblemMismatch, "title": "Idempotency-Key reused", "status": 422.0},
			map[string]any{"type": idemhttp.ProblemInFlight, "title": "Request in progress", "status": 409.0}},
		{"acp", 409, 409, "application/json",
			map[string]any{"type": "invalid_request", "code": "idempotency_conflict"},
			map[string]any{"type": "invalid_request", "code": "idempotency_in_flight"}},
		{"stripe", 400, 409, "application/json",
			map[string]any{"error": map[string]any{"type": "idempotency_error"}},
			map[string]any{"error": map[string]any{"type": "idempotency_error", "code": "idempotency_key_in_use"}}},
	} {
		s := DefaultSettings()
		s.Profile, s.Wait = c.profile, 0
		held, release := make(chan struct{}), make(chan struct{})
		rt := newRoute(t, s, Env{}, func(*http.Request) string { return "t" }, holdUpstream(held, release))
		mismatch, inFlight := conflicts(t, rt, held, release)
		for _, a := range []struct {
			what   string
			got    answer
			status int
			body   map[string]any
			msg    string
			retry  string
		}{
			{"mismatch", mismatch, c.mismatchSt, c.mismatchBody, conflictMsg, ""},
			{"in flight", inFlight, c.inFlightSt, c.inFlightBy, inFlightMsg, "1"},
		} {
			h := a.got.header
			if a.got.status != a.status || h.Get("Content-Type") != c.contentType || h.Get("Cache-Control") != "no-store" || h.Get("Retry-After") != a.retry {
				t.Errorf("profile %q, %s: got %d %v, want %d %s, Cache-Control no-store, Retry-After %q", c.profile, a.what, a.got.status, h, a.status, c.contentType, a.retry)
			}
			var body map[string]any
			if err := json.Unmarshal([]byte(a.got.body), &body); err != nil {
				t.Errorf("profile %q, %s: body %q: %v", c.profile, a.what, a.got.body, err)
				continue
			}
			msgKey := "message"
			if c.contentType == "application/problem+json" {
				msgKey = "detail"
			}
			if msg := takeMessage(body, msgKey); !strings.Contains(msg, a.msg) {
				t.Errorf("profile %q, %s: %s %q, want one saying %q", c.profile, a.what, msgKey, msg, a.msg)
			}
			if !reflect.DeepEqual(body, a.body) {
				t.Errorf("profile %q, %s: body %s, want %v and the %s", c.profile, a.what, a.got.body, a.body, msgKey)
			}
		}
		long := rt.post(t, "a", "Idempotency-Key", strings.Repeat("k", 256))
		if long.status != http.StatusBadRequest || problemType(long) != idemhttp.ProblemKeyInvalid || long.header.Get("Cache-Control") != "no-store" {
			t.Errorf("profile %q, a key too long: got %d %v %s, want 400 problem+json %s", c.profile, long.status, long.header, long.body, idemhttp.ProblemKeyInvalid)
		}
	}
}

// takeMessage removes the member name from body, or from the object of
// its "error" member, and returns it.
func takeMessage(body map[string]any, name string) string {
	obj := body
	if e, ok := body["error"].(map[string]any); ok {
		obj = e
	}
	msg, _ := obj[name].(string)
	delete(obj, name)
	return msg
}

// TestProfileGRPC: with a profile, gRPC calls still get their gRPC
// statuses for a mismatch (FailedPrecondition) and a key in flight
// (Aborted), as trailers-only HTTP 200 answers.
func TestProfileGRPC(t *testing.T) {
	for _, profile := range []string{"acp", "stripe"} {
		s := DefaultSettings()
		s.Profile, s.Wait = profile, 0
		held, release := make(chan struct{}), make(chan struct{})
		rt := newRoute(t, s, Env{}, func(*http.Request) string { return "t" }, holdUpstream(held, release))
		mismatch, inFlight := conflicts(t, rt, held, release, "Content-Type", "application/grpc")
		for _, a := range []struct {
			what, code string
			got        answer
		}{{"mismatch", "9", mismatch}, {"in flight", "10", inFlight}} {
			if a.got.status != http.StatusOK || a.got.header.Get("Content-Type") != "application/grpc" || a.got.header.Get("Grpc-Status") != a.code || a.got.body != "" {
				t.Errorf("profile %s, gRPC %s: got %d %v %q, want a trailers-only 200 with grpc-status %s", profile, a.what, a.got.status, a.got.header, a.got.body, a.code)
			}
		}
	}
}

// TestProfileErrorHandlerOthers: a profile passes every other problem, and
// gRPC calls, to the handler it wraps.
func TestProfileErrorHandlerOthers(t *testing.T) {
	var passed []string
	next := func(_ http.ResponseWriter, _ *http.Request, p *idemhttp.Problem) { passed = append(passed, p.Type) }
	for _, profile := range Profiles {
		passed = nil
		h := ProfileErrorHandler(profile, next)
		plain, _ := http.NewRequest("POST", "http://h/", nil)
		grpc, _ := http.NewRequest("POST", "http://h/", nil)
		grpc.Header.Set("Content-Type", "application/grpc")
		for _, typ := range []string{idemhttp.ProblemKeyMissing, idemhttp.ProblemStoreUnavailable, idemhttp.ProblemUnverified, idemhttp.ProblemResponseUnreadable} {
			h(httptest.NewRecorder(), plain, &idemhttp.Problem{Type: typ})
		}
		h(httptest.NewRecorder(), grpc, &idemhttp.Problem{Type: idemhttp.ProblemMismatch})
		want := []string{idemhttp.ProblemKeyMissing, idemhttp.ProblemStoreUnavailable, idemhttp.ProblemUnverified, idemhttp.ProblemResponseUnreadable, idemhttp.ProblemMismatch}
		if !reflect.DeepEqual(passed, want) {
			t.Errorf("profile %s: passed on %v, want %v", profile, passed, want)
		}
	}
}
