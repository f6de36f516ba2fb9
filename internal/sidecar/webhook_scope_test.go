package sidecar

import (
	"net/http"
	"strings"
	"testing"
)

// TestWebhookHostNotInScope: a captured stripe delivery, sent again within
// the tolerance under another Host header (which the caller chooses and
// nothing signs), is replayed, not run again.
func TestWebhookHostNotInScope(t *testing.T) {
	f := loadWebhookFixture(t, "stripe")
	s := webhookSettings(t, "stripe", f.Secret)
	s.RequireKey = true
	rt := newRoute(t, s, Env{now: f.at(0)}, nil, nil)
	d := f.Deliveries["genuine"]
	for i, host := range []string{"", "other.example", "third.example:8443"} {
		req, err := http.NewRequest("POST", rt.srv.URL+"/hook", strings.NewReader(d.Body))
		if err != nil {
			t.Fatal(err)
		}
		for k, v := range d.Headers {
			req.Header.Set(k, v)
		}
		if host != "" {
			req.Host = host
		}
		resp, err := rt.srv.Client().Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if replayed := resp.Header.Get("Idempotent-Replayed") == "true"; resp.StatusCode != http.StatusCreated || replayed != (i > 0) {
			t.Errorf("Host %q: %d, replayed %v; want 201, replayed %v", host, resp.StatusCode, replayed, i > 0)
		}
	}
	if n := rt.runs.Load(); n != 1 {
		t.Errorf("the upstream ran %d times; want 1", n)
	}
}

// TestWebhookPathVariantsInScope: the same captured delivery sent to
// variants of the path that a matcher may route alike (case, empty and
// dot segments) is the same key, and is not run again.
func TestWebhookPathVariantsInScope(t *testing.T) {
	f := loadWebhookFixture(t, "stripe")
	s := webhookSettings(t, "stripe", f.Secret)
	rt := newRoute(t, s, Env{now: f.at(0)}, nil, nil)
	d := f.Deliveries["genuine"]
	for i, p := range []string{"/hooks/stripe", "/Hooks/Stripe", "//hooks//stripe", "/hooks/./stripe", "/hooks/x/../stripe"} {
		req, err := http.NewRequest("POST", rt.srv.URL+"/", strings.NewReader(d.Body))
		if err != nil {
			t.Fatal(err)
		}
		req.URL.Path, req.URL.RawPath = p, ""
		for k, v := range d.Headers {
			req.Header.Set(k, v)
		}
		resp, err := rt.srv.Client().Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		// The path is in the fingerprint: another spelling is the same key
		// with another request, 422, never a run.
		if replayed := resp.Header.Get("Idempotent-Replayed") == "true"; i == 0 && (resp.StatusCode != http.StatusCreated || replayed) ||
			i > 0 && resp.StatusCode != http.StatusUnprocessableEntity {
			t.Errorf("path %q: %d, replayed %v; want 201 executed the first time, 422 after", p, resp.StatusCode, replayed)
		}
		if n := rt.runs.Load(); n != 1 {
			t.Errorf("path %q: the upstream ran %d times; want once", p, n)
		}
	}
}
