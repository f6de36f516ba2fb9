package caddyidem

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/internal/upstreamtest"
	"github.com/idemkit/idem/internal/webhooktest"
)

// TestWebhooks: through a real Caddy with a route per webhook preset
// (webhook, webhook_secret_file) in front of an upstream that counts what
// reaches it, with deliveries signed by each sender's own library
// (internal/webhooktest), never by idem's code: a delivery and its
// redeliveries run once; forgeries under a real delivery id get 401
// unverified, reach nothing, and leave the id to the genuine delivery;
// the secret file's second secret verifies, and so do two signatures in
// one header while a sender rolls its secret; the 401s are counted. A
// route with key json:/id and fingerprint_exclude replays a redelivery
// whose attempt counter changed; one with key_header, profile stripe,
// echo_key and lifetime_header answers in Stripe's JSON with the key and
// the retention. A reload re-reads a rewritten secret file.
func TestWebhooks(t *testing.T) {
	up := upstreamtest.StartCounter(t)
	upstream := strings.TrimPrefix(up.URL, "http://")
	dir := t.TempDir()
	type keys struct{ cur, next, forger, file string }
	secrets := map[string]keys{}
	var site strings.Builder
	site.WriteString("\tmetrics /metrics\n")
	for _, preset := range webhooktest.Presets {
		k := keys{webhooktest.NewSecret(preset), webhooktest.NewSecret(preset), webhooktest.NewSecret(preset), filepath.Join(dir, preset+".secrets")}
		webhooktest.WriteSecrets(t, k.file, k.cur, k.next)
		secrets[preset] = k
		fmt.Fprintf(&site, "\troute /%s/* {\n\t\tidempotency {\n\t\t\tprefix webhooks-%s-%s:\n\t\t\twebhook %s\n\t\t\twebhook_secret_file %s\n\t\t}\n\t\treverse_proxy %s\n\t}\n",
			preset, preset, runID, preset, k.file, upstream)
	}
	fmt.Fprintf(&site, "\troute /orders/* {\n\t\tidempotency {\n\t\t\tprefix webhooks-orders-%s:\n\t\t\tkey json:/id\n\t\t\tfingerprint_exclude /attempt\n\t\t}\n\t\treverse_proxy %s\n\t}\n", runID, upstream)
	fmt.Fprintf(&site, "\troute /answers/* {\n\t\tidempotency {\n\t\t\tprefix webhooks-answers-%s:\n\t\t\tkey_header X-Request-Id\n\t\t\tprofile stripe\n\t\t\techo_key\n\t\t\tlifetime_header\n\t\t\tretention 30m\n\t\t}\n\t\treverse_proxy %s\n\t}", runID, upstream)
	base := startCaddy(t, site.String())

	seq := 0
	newID := func(preset string) string {
		seq++
		return fmt.Sprintf("%s-%s-%d", strings.ReplaceAll(preset, "-", ""), runID, seq)
	}
	delivery := func(base, preset, path, id string, secrets ...string) webhooktest.Delivery {
		return webhooktest.Delivery{Preset: preset, URL: base + path, Secrets: secrets,
			Body: fmt.Sprintf(`{"id":%q,"object":"event","type":"%s.test","data":{"amount":2000,"note":"café"}}`, id, preset), ID: id}
	}
	wantExecuted := func(t *testing.T, what, path string, a webhooktest.Answer) {
		t.Helper()
		if a.Status != http.StatusCreated || a.Replayed() {
			t.Errorf("%s: got %d (replayed %v) %s, want the upstream's 201", what, a.Status, a.Replayed(), a.Body)
		}
		if n := up.Runs(path); n != 1 {
			t.Errorf("%s: the upstream ran %s %d times, want 1", what, path, n)
		}
	}
	wantUnverified := func(t *testing.T, what, path string, a webhooktest.Answer) {
		t.Helper()
		if err := webhooktest.CheckUnverified(a); err != nil {
			t.Errorf("%s: %v", what, err)
		}
		if n := up.Runs(path); n != 0 {
			t.Errorf("%s: the upstream ran %s %d times, want 0 (not forwarded)", what, path, n)
		}
	}

	// The presets one after another: newID is not safe for concurrent
	// use, and the machine's two cores run the senders' Node anyway.
	for _, preset := range webhooktest.Presets {
		t.Run(preset, func(t *testing.T) {
			k := secrets[preset]
			series := fmt.Sprintf(`idem_webhook_unverified_total{preset=%q}`, preset)
			before := metricValue(t, base+"/metrics", series)
			once := "/" + preset + "/once"
			id := newID(preset)
			first := webhooktest.Send(t, delivery(base, preset, once, id, k.cur))
			wantExecuted(t, "the delivery", once, first)
			for i := range 2 {
				a := webhooktest.Send(t, delivery(base, preset, once, id, k.cur))
				if a.Status != first.Status || a.Body != first.Body || !a.Replayed() || up.Runs(once) != 1 {
					t.Errorf("redelivery %d: got %d (replayed %v) %s after %d executions, want the replay of %d %s after 1",
						i+1, a.Status, a.Replayed(), a.Body, up.Runs(once), first.Status, first.Body)
				}
			}

			forged := "/" + preset + "/forged"
			id = newID(preset)
			wantUnverified(t, "signed by another secret", forged, webhooktest.Send(t, delivery(base, preset, forged, id, k.forger)))
			altered := delivery(base, preset, forged, id, k.cur)
			altered.SentBody = strings.Replace(altered.Body, `"amount":2000`, `"amount":1`, 1)
			wantUnverified(t, "the body altered after signing", forged, webhooktest.Send(t, altered))
			unverified := 2.0
			if preset == "stripe" || preset == "standard-webhooks" {
				stale := delivery(base, preset, forged, id, k.cur)
				stale.Timestamp = time.Now().Add(-10 * time.Minute) // the tolerance is 5 minutes
				wantUnverified(t, "signed 10 minutes ago", forged, webhooktest.Send(t, stale))
				unverified++
			}
			// Other methods are refused, not passed on unverified.
			for _, method := range []string{"GET", "PUT"} {
				req, _ := http.NewRequest(method, base+forged, nil)
				resp, err := http.DefaultClient.Do(req)
				if err != nil {
					t.Fatal(err)
				}
				body, _ := io.ReadAll(resp.Body)
				resp.Body.Close()
				if resp.StatusCode != http.StatusMethodNotAllowed || !strings.Contains(resp.Header.Get("Allow"), "POST") || up.Runs(forged) != 0 {
					t.Errorf("unsigned %s: got %d Allow %q %s after %d executions, want 405, Allow with POST, after none",
						method, resp.StatusCode, resp.Header.Get("Allow"), body, up.Runs(forged))
				}
			}
			wantExecuted(t, "the genuine delivery after the forgeries", forged, webhooktest.Send(t, delivery(base, preset, forged, id, k.cur)))

			next := "/" + preset + "/next"
			wantExecuted(t, "signed by the file's second secret", next, webhooktest.Send(t, delivery(base, preset, next, newID(preset), k.next)))
			if preset == "stripe" || preset == "standard-webhooks" {
				two := "/" + preset + "/two-signatures"
				wantExecuted(t, "two signatures, the second by a secret of the file", two,
					webhooktest.Send(t, delivery(base, preset, two, newID(preset), k.forger, k.cur)))
			}
			if got := metricValue(t, base+"/metrics", series) - before; got != unverified {
				t.Errorf("%s: got %v more, want %v (the 401s)", series, got, unverified)
			}
		})
	}

	t.Run("json-key", func(t *testing.T) {
		send := func(path, body string) answer { t.Helper(); return post(t, base+path, "", body) }
		first := send("/orders/a", `{"id":"o-1-`+runID+`","attempt":1,"amount":5}`)
		again := send("/orders/a", `{"amount":5, "attempt":2, "id":"o-1-`+runID+`"}`)
		if first.status != 201 || first.replayed != "" || again.status != 201 || again.replayed != "true" || again.body != first.body || up.Runs("/orders/a") != 1 {
			t.Errorf("key json:/id, fingerprint_exclude /attempt: got %d then %d (replayed %q) %q after %d executions, want 201 and its replay %q after 1",
				first.status, again.status, again.replayed, again.body, up.Runs("/orders/a"), first.body)
		}
		if a := send("/orders/a", `{"id":"o-1-`+runID+`","attempt":3,"amount":6}`); a.status != 422 || !strings.Contains(a.body, idemhttp.ProblemMismatch) {
			t.Errorf("the amount changed: got %d %q, want 422 mismatch", a.status, a.body)
		}
		if a := send("/orders/b", `id=o-2`); a.status != 400 || !strings.Contains(a.body, idemhttp.ProblemKeyInvalid) || up.Runs("/orders/b") != 0 {
			t.Errorf("a body that is not JSON: got %d %q after %d executions, want 400 key-invalid after none", a.status, a.body, up.Runs("/orders/b"))
		}
	})

	// key_header, profile stripe, echo_key and lifetime_header.
	t.Run("answers", func(t *testing.T) {
		key := "a-1-" + runID
		send := func(body string) (*http.Response, string) {
			t.Helper()
			req, err := http.NewRequest(http.MethodPost, base+"/answers/a", strings.NewReader(body))
			if err != nil {
				t.Fatal(err)
			}
			req.Header.Set("X-Request-Id", key)
			req.Header.Set("Content-Type", "application/json")
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			defer resp.Body.Close()
			b, _ := io.ReadAll(resp.Body)
			return resp, string(b)
		}
		wantHeaders := func(what string, resp *http.Response) {
			t.Helper()
			if got := resp.Header.Values(idemhttp.HeaderKey); len(got) != 1 || got[0] != key {
				t.Errorf("%s: got %s %q, want one %q (echo_key: the key X-Request-Id carried)", what, idemhttp.HeaderKey, got, key)
			}
			if got := resp.Header.Values("Idempotency-Key-Lifetime"); len(got) != 1 || got[0] != "PT30M" {
				t.Errorf("%s: got Idempotency-Key-Lifetime %q, want one PT30M (lifetime_header, retention 30m)", what, got)
			}
		}
		first, firstBody := send(`{"n":1}`)
		again, againBody := send(`{"n":1}`)
		if first.StatusCode != 201 || again.StatusCode != 201 || again.Header.Get(idemhttp.HeaderReplayed) != "true" || againBody != firstBody || up.Runs("/answers/a") != 1 {
			t.Errorf("key_header X-Request-Id: got %d then %d (replayed %q) %q after %d executions, want 201 and its replay %q after 1",
				first.StatusCode, again.StatusCode, again.Header.Get(idemhttp.HeaderReplayed), againBody, up.Runs("/answers/a"), firstBody)
		}
		wantHeaders("executed", first)
		wantHeaders("replayed", again)
		other, otherBody := send(`{"n":2}`)
		var stripe struct {
			Error struct{ Type, Message string }
		}
		if other.StatusCode != 400 || other.Header.Get("Content-Type") != "application/json" || json.Unmarshal([]byte(otherBody), &stripe) != nil ||
			stripe.Error.Type != "idempotency_error" || stripe.Error.Message == "" {
			t.Errorf("profile stripe, the key with another body: got %d %s %s, want 400 application/json {\"error\":{\"type\":\"idempotency_error\",\"message\":...}}",
				other.StatusCode, other.Header.Get("Content-Type"), otherBody)
		}
		wantHeaders("a mismatch", other)
	})

	// A reload provisions the handlers again, and they read the secret
	// file again: the operator rotated github's secret out.
	t.Run("reload", func(t *testing.T) {
		k := secrets["github"]
		third := webhooktest.NewSecret("github")
		webhooktest.WriteSecrets(t, k.file, third)
		base := startCaddy(t, site.String()+"\n\theader X-Reloaded yes") // another config: a reload
		wantExecuted(t, "signed by the new secret after the reload", "/github/reloaded-new",
			webhooktest.Send(t, delivery(base, "github", "/github/reloaded-new", newID("github"), third)))
		wantUnverified(t, "signed by the secret rotated out", "/github/reloaded-old",
			webhooktest.Send(t, delivery(base, "github", "/github/reloaded-old", newID("github"), k.cur)))
	})
}
