package sidecar

import (
	"encoding/json"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/internal/webhook"
)

// webhookFixture is one of internal/webhook/testdata's fixtures: deliveries
// signed by the sender's own library (see its README).
type webhookFixture struct {
	Secret       string `json:"secret"`
	OldSecret    string `json:"old_secret"`
	ForgerSecret string `json:"forger_secret"`
	SignedAt     int64  `json:"signed_at"`
	Key          string `json:"key"`
	Deliveries   map[string]struct {
		Headers map[string]string `json:"headers"`
		Body    string            `json:"body"`
	} `json:"deliveries"`
}

func loadWebhookFixture(t *testing.T, preset string) webhookFixture {
	t.Helper()
	path := filepath.Join("..", "webhook", "testdata", preset+".json")
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var f webhookFixture
	if err := json.Unmarshal(data, &f); err != nil {
		t.Fatalf("%s: %v", path, err)
	}
	for _, d := range []string{"genuine", "old_secret", "forged"} {
		if f.Deliveries[d].Body == "" {
			t.Fatalf("%s: no %s delivery", path, d)
		}
	}
	if f.Secret == "" || f.OldSecret == "" || f.SignedAt == 0 || f.Key == "" {
		t.Fatalf("%s: incomplete fixture", path)
	}
	return f
}

// at is a clock stopped at the fixture's signing time plus d.
func (f webhookFixture) at(d time.Duration) func() time.Time {
	return func() time.Time { return time.Unix(f.SignedAt, 0).Add(d) }
}

// deliver posts the fixture's delivery name, with the extra headers.
func (rt *testRoute) deliver(t *testing.T, f webhookFixture, name string, extra ...string) answer {
	t.Helper()
	d, ok := f.Deliveries[name]
	if !ok {
		t.Fatalf("no delivery %q in the fixture", name)
	}
	var headers []string
	for k, v := range d.Headers {
		headers = append(headers, k, v)
	}
	return rt.post(t, d.Body, append(headers, extra...)...)
}

// webhookSettings are the default settings with the preset, its secrets
// in a file of the test's, one a line.
func webhookSettings(t *testing.T, preset string, secrets ...string) Settings {
	s := DefaultSettings()
	s.Webhook = preset
	s.WebhookSecretFile = writeFile(t, "secrets", secrets...)
	return s
}

// hasSecret reports whether text holds any of the fixture's secrets.
func (f webhookFixture) hasSecret(text string) bool {
	return strings.Contains(text, f.Secret) || strings.Contains(text, f.OldSecret) || strings.Contains(text, f.ForgerSecret)
}

// TestWebhookRoute: for each preset, a delivery signed with another secret
// (sent first, under the genuine delivery's key) is refused 401
// unverified, not forwarded and counted; the genuine delivery then runs
// once and its redelivery replays; the route's tenant function is never
// asked (the tenant is the sender), so a redelivery with another tenant
// header still replays.
func TestWebhookRoute(t *testing.T) {
	for _, preset := range webhook.Names() {
		t.Run(preset, func(t *testing.T) {
			f := loadWebhookFixture(t, preset)
			var asked atomic.Int64
			tenant := func(r *http.Request) string { asked.Add(1); return "hdr:" + r.Header.Get("X-Tenant") }
			rt := newRoute(t, webhookSettings(t, preset, f.Secret), Env{now: f.at(0)}, tenant, nil)
			const series = "idem_webhook_unverified_total"
			if n := rt.metric(t, series, "preset", preset); n != 0 {
				t.Errorf("%s{preset=%q} before any delivery: %v, want 0 (the series made with the middleware)", series, preset, n)
			}

			forged := rt.deliver(t, f, "forged", "X-Tenant", "a")
			if forged.status != http.StatusUnauthorized || problemType(forged) != idemhttp.ProblemUnverified {
				t.Errorf("forged: got %d %q %s, want 401 %s", forged.status, forged.header.Get("Content-Type"), forged.body, idemhttp.ProblemUnverified)
			}
			if want := "webhook signature not verified (" + preset + "): no secret gives"; !strings.Contains(forged.body, want) || f.hasSecret(forged.body) {
				t.Errorf("forged: detail %s, want it to say %q and hold no secret", forged.body, want)
			}
			if n := rt.runs.Load(); n != 0 {
				t.Errorf("forged: the upstream ran %d times, want 0", n)
			}
			if n := rt.metric(t, series, "preset", preset); n != 1 {
				t.Errorf("%s{preset=%q}: %v, want 1", series, preset, n)
			}
			if n := rt.metric(t, "idem_requests_total", "outcome", "rejected"); n != 1 {
				t.Errorf(`idem_requests_total{outcome="rejected"}: %v, want 1`, n)
			}

			first := rt.deliver(t, f, "genuine", "X-Tenant", "a")
			if first.status != http.StatusCreated || first.body != "ran 1" || first.header.Get(idemhttp.HeaderReplayed) != "" {
				t.Errorf("genuine after the forgery: got %d %q %v, want 201 \"ran 1\", run", first.status, first.body, first.header)
			}
			again := rt.deliver(t, f, "genuine", "X-Tenant", "b")
			if again.status != http.StatusCreated || again.body != "ran 1" || again.header.Get(idemhttp.HeaderReplayed) != "true" {
				t.Errorf("redelivery (another X-Tenant): got %d %q %v, want the replay of 201 \"ran 1\"", again.status, again.body, again.header)
			}
			if n := rt.runs.Load(); n != 1 {
				t.Errorf("the upstream ran %d times, want 1", n)
			}
			if n := asked.Load(); n != 0 {
				t.Errorf("the tenant function was asked %d times on a webhook route, want never", n)
			}
		})
	}
}

// TestWebhookTenant: a webhook route's tenant is "webhook:" + preset,
// whatever the tenant function passed; another route's is the function's.
func TestWebhookTenant(t *testing.T) {
	tenant := func(*http.Request) string { return "hdr:x" }
	r, _ := http.NewRequest("POST", "http://h/hook", nil)
	s := DefaultSettings()
	s.Webhook, s.WebhookSecretEnv = "shopify", "UNUSED"
	if got := s.Config(tenant, nil, Env{}).Tenant(r); got != "webhook:shopify" {
		t.Errorf("webhook route: tenant %q, want webhook:shopify", got)
	}
	if got := DefaultSettings().Config(tenant, nil, Env{}).Tenant(r); got != "hdr:x" {
		t.Errorf("other route: tenant %q, want the function's hdr:x", got)
	}
}

// TestWebhookRotation: with two secrets in the file (old and new, while
// the sender rotates), a delivery signed with either runs; with the new
// one alone, the old one's is refused.
func TestWebhookRotation(t *testing.T) {
	for _, preset := range webhook.Names() {
		t.Run(preset, func(t *testing.T) {
			f := loadWebhookFixture(t, preset)
			for _, d := range []string{"genuine", "old_secret"} {
				rt := newRoute(t, webhookSettings(t, preset, f.OldSecret, f.Secret), Env{now: f.at(0)}, nil, nil)
				if a := rt.deliver(t, f, d); a.status != http.StatusCreated || rt.runs.Load() != 1 {
					t.Errorf("%s, both secrets: got %d %s (%d runs), want 201, run once", d, a.status, a.body, rt.runs.Load())
				}
			}
			rt := newRoute(t, webhookSettings(t, preset, f.Secret), Env{now: f.at(0)}, nil, nil)
			if a := rt.deliver(t, f, "old_secret"); a.status != http.StatusUnauthorized || rt.runs.Load() != 0 {
				t.Errorf("old_secret, the new secret alone: got %d %s (%d runs), want 401, not run", a.status, a.body, rt.runs.Load())
			}
		})
	}
}

// TestWebhookSecretsReadEachTime: each middleware made reads the secrets
// file again (a reload rotates them); the one made before keeps its own.
func TestWebhookSecretsReadEachTime(t *testing.T) {
	f := loadWebhookFixture(t, "github")
	s := webhookSettings(t, "github", f.OldSecret)
	before := newRoute(t, s, Env{}, nil, nil)
	if err := os.WriteFile(s.WebhookSecretFile, []byte(f.Secret+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	after := newRoute(t, s, Env{}, nil, nil)
	if a := before.deliver(t, f, "genuine"); a.status != http.StatusUnauthorized {
		t.Errorf("middleware made with the old secret: got %d, want 401", a.status)
	}
	if a := after.deliver(t, f, "genuine"); a.status != http.StatusCreated {
		t.Errorf("middleware made after the file changed: got %d %s, want 201", a.status, a.body)
	}
}

// TestWebhookTolerance: a signed timestamp further from now than the
// preset's 5 minutes is refused, one within WebhookTolerance is not; the
// real clock (the fixtures were signed at a fixed time) refuses them.
func TestWebhookTolerance(t *testing.T) {
	for _, preset := range []string{"stripe", "standard-webhooks"} {
		t.Run(preset, func(t *testing.T) {
			f := loadWebhookFixture(t, preset)
			s := webhookSettings(t, preset, f.Secret)
			for _, c := range []struct {
				name      string
				now       func() time.Time
				tolerance time.Duration
				status    int
				detail    string
			}{
				{"4m59s before", f.at(-299 * time.Second), 0, http.StatusCreated, ""},
				{"6m after", f.at(6 * time.Minute), 0, http.StatusUnauthorized, "is 360 s before now; want within 5m0s"},
				{"6m before", f.at(-6 * time.Minute), 0, http.StatusUnauthorized, "is 360 s after now; want within 5m0s"},
				{"6m after, tolerance 10m", f.at(6 * time.Minute), 10 * time.Minute, http.StatusCreated, ""},
				{"real clock", nil, 0, http.StatusUnauthorized, "s before now; want within 5m0s"},
			} {
				s.WebhookTolerance = c.tolerance
				rt := newRoute(t, s, Env{now: c.now}, nil, nil)
				a := rt.deliver(t, f, "genuine")
				if a.status != c.status || !strings.Contains(a.body, c.detail) {
					t.Errorf("%s: got %d %s, want %d %q", c.name, a.status, a.body, c.status, c.detail)
				}
			}
		})
	}
}

// TestWebhookNoKey: a genuine delivery that names no key (a Stripe event
// without "id") is a request without a key: passed through, or 400
// key-missing when the key is required.
func TestWebhookNoKey(t *testing.T) {
	f := loadWebhookFixture(t, "stripe")
	s := webhookSettings(t, "stripe", f.Secret)
	rt := newRoute(t, s, Env{now: f.at(0)}, nil, nil)
	rt.deliver(t, f, "no_id")
	if a := rt.deliver(t, f, "no_id"); a.status != http.StatusCreated || rt.runs.Load() != 2 {
		t.Errorf("no_id twice: got %d %s, %d runs; want 201, passed through each time", a.status, a.body, rt.runs.Load())
	}
	if n := rt.metric(t, "idem_webhook_unverified_total", "preset", "stripe"); n != 0 {
		t.Errorf("idem_webhook_unverified_total: %v, want 0 (the deliveries were genuine)", n)
	}
	s.RequireKey = true
	rt = newRoute(t, s, Env{now: f.at(0)}, nil, nil)
	a := rt.deliver(t, f, "no_id")
	if want := `webhook delivery has no key (stripe): body has no \"id\"`; a.status != http.StatusBadRequest ||
		problemType(a) != idemhttp.ProblemKeyMissing || !strings.Contains(a.body, want) || rt.runs.Load() != 0 {
		t.Errorf("no_id, key required: got %d %s (%d runs), want 400 %s saying %s, not run", a.status, a.body, rt.runs.Load(), idemhttp.ProblemKeyMissing, want)
	}
}

// TestWebhookSecretsErrors: a secrets file or variable that cannot be
// read, or holds a bad secret, is Middleware's one-line error that names
// it, never a secret; the variable's secrets verify as the file's do.
func TestWebhookSecretsErrors(t *testing.T) {
	f := loadWebhookFixture(t, "standard-webhooks")
	missing := filepath.Join(t.TempDir(), "no-such-secrets")
	bad := writeFile(t, "bad", f.Secret, "whsec_not base64!")
	t.Setenv("IDEM_TEST_SECRETS_EMPTY", "\n# none\n")
	for _, c := range []struct {
		file, env string
		want      string
	}{
		{file: missing, want: "webhook secret file: open " + missing + ": no such file or directory"},
		{env: "IDEM_TEST_SECRETS_UNSET", want: "webhook secret: environment variable IDEM_TEST_SECRETS_UNSET is not set"},
		{env: "IDEM_TEST_SECRETS_EMPTY", want: "environment variable IDEM_TEST_SECRETS_EMPTY holds no secret"},
		{file: bad, want: "the secret on line 2 of file " + bad + ": want whsec_ followed by base64"},
	} {
		s := DefaultSettings()
		s.Webhook, s.WebhookSecretFile, s.WebhookSecretEnv = "standard-webhooks", c.file, c.env
		if err := s.Validate(Underscored); err != nil {
			t.Fatal(err)
		}
		_, err := s.Middleware(nil, nil, nil, Env{Metrics: NewMetrics(Underscored)})
		if err == nil || !strings.Contains(err.Error(), c.want) || strings.Contains(err.Error(), "\n") || f.hasSecret(err.Error()) ||
			strings.Contains(err.Error(), "not base64!") {
			t.Errorf("%s%s: got %v, want one line saying %q without a secret", c.file, c.env, err, c.want)
		}
	}
	t.Setenv("IDEM_TEST_SECRETS", f.OldSecret+"\n"+f.Secret)
	s := DefaultSettings()
	s.Webhook, s.WebhookSecretEnv = "standard-webhooks", "IDEM_TEST_SECRETS"
	rt := newRoute(t, s, Env{now: f.at(0)}, nil, nil)
	if a := rt.deliver(t, f, "genuine"); a.status != http.StatusCreated {
		t.Errorf("secrets from IDEM_TEST_SECRETS: got %d %s, want 201", a.status, a.body)
	}
}
