package webhooktest

import (
	"io"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/webhook"
)

// TestSend: what Send signs with the senders' libraries verifies under
// internal/webhook with the secret it was signed by, and only with it;
// its body arrives as signed, or altered when SentBody says so; several
// secrets put several signatures in one header.
func TestSend(t *testing.T) {
	t.Parallel()
	for _, preset := range Presets {
		t.Run(preset, func(t *testing.T) {
			t.Parallel()
			secret, other := NewSecret(preset), NewSecret(preset)
			file := filepath.Join(t.TempDir(), "secret")
			WriteSecrets(t, file, secret)
			s, err := webhook.SecretsFromFile(file)
			if err != nil {
				t.Fatal(err)
			}
			p, err := webhook.Lookup(preset)
			if err != nil {
				t.Fatal(err)
			}
			v, err := webhook.NewVerifier(p, s)
			if err != nil {
				t.Fatal(err)
			}
			var mu sync.Mutex
			got := "" // the last body received
			received := func() string { mu.Lock(); defer mu.Unlock(); return got }
			srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				b, _ := io.ReadAll(r.Body)
				mu.Lock()
				got = string(b)
				mu.Unlock()
				key, err := v.Verify(r.Header, b, time.Now())
				if err != nil {
					http.Error(w, err.Error(), http.StatusUnauthorized)
					return
				}
				w.Header().Set("X-Key", key)
				w.WriteHeader(http.StatusAccepted)
				io.WriteString(w, "ok é")
			}))
			defer srv.Close()

			body := `{"id":"evt_webhooktest_1","note":"café"}`
			d := Delivery{Preset: preset, URL: srv.URL, Secrets: []string{secret}, Body: body, ID: "delivery-1"}
			a := Send(t, d)
			wantKey := "delivery-1"
			if preset == "stripe" {
				wantKey = "evt_webhooktest_1"
			}
			if a.Status != http.StatusAccepted || a.Header.Get("X-Key") != wantKey || a.Body != "ok é" || received() != body {
				t.Fatalf("genuine: got %d key %q body %q (received %q), want 202 key %q body \"ok é\" (received as signed)", a.Status, a.Header.Get("X-Key"), a.Body, received(), wantKey)
			}
			d.Secrets = []string{other}
			if a := Send(t, d); a.Status != http.StatusUnauthorized {
				t.Errorf("signed by another secret: got %d %s, want 401", a.Status, a.Body)
			}
			d.Secrets, d.SentBody = []string{secret}, body+" "
			if a := Send(t, d); a.Status != http.StatusUnauthorized || received() != body+" " {
				t.Errorf("altered after signing: got %d %s (received %q), want 401 for the altered body", a.Status, a.Body, received())
			}
			d.SentBody = ""
			switch preset {
			case "stripe", "standard-webhooks":
				d.Timestamp = time.Now().Add(-time.Hour)
				if a := Send(t, d); a.Status != http.StatusUnauthorized {
					t.Errorf("signed an hour ago: got %d %s, want 401", a.Status, a.Body)
				}
				d.Timestamp = time.Time{}
				d.Secrets = []string{other, secret}
				if a := Send(t, d); a.Status != http.StatusAccepted {
					t.Errorf("signed by two secrets, the second the receiver's: got %d %s, want 202", a.Status, a.Body)
				}
			default:
				d.Secrets = []string{other, secret}
				if a, err := send(t, d); err == nil {
					t.Errorf("two secrets for %s: got %d %s, want the sender to refuse them", preset, a.Status, a.Body)
				}
			}
		})
	}
}
