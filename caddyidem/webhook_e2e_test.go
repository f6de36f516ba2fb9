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
// the retention. A route with fingerprint_fields /id /amount replays a
// redelivery whose other fields changed, and one with fingerprint json
// (sent by curl) one whose members were reordered and spaced otherwise
// (a body that is not JSON: the same bytes); a changed amount or value is
// a 422. One with profile acp answers another body and a key in flight
// 409 in the Agentic Commerce Protocol's JSON; one with key
// header:X-Request-Id takes its key from that header alone. A reload
// re-reads a rewritten secret file.
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
	for _, r := range []struct{ path, directives string }{
		{"fields", "key json:/id\n\t\t\tfingerprint_fields /id /amount"},
		{"canonical", "fingerprint json"},
		{"acp", "profile acp\n\t\t\twait off"},
		{"reqid", "key header:X-Request-Id"},
	} {
		fmt.Fprintf(&site, "\n\troute /%s/* {\n\t\tidempotency {\n\t\t\tprefix webhooks-%s-%s:\n\t\t\t%s\n\t\t}\n\t\treverse_proxy %s\n\t}",
			r.path, r.path, runID, r.directives, upstream)
	}
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

	// request POSTs body to path with the "Name: value" headers.
	request := func(path, body string, hdr ...string) (*http.Response, string, error) {
		req, err := http.NewRequest(http.MethodPost, base+path, strings.NewReader(body))
		if err != nil {
			return nil, "", err
		}
		req.Header.Set("Content-Type", "application/json")
		for _, h := range hdr {
			name, value, _ := strings.Cut(h, ":")
			req.Header.Set(name, strings.TrimSpace(value))
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			return nil, "", err
		}
		defer resp.Body.Close()
		b, err := io.ReadAll(resp.Body)
		return resp, string(b), err
	}
	mustRequest := func(t *testing.T, path, body string, hdr ...string) (*http.Response, string) {
		t.Helper()
		resp, b, err := request(path, body, hdr...)
		if err != nil {
			t.Fatal(err)
		}
		return resp, b
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
			return mustRequest(t, "/answers/a", body, "X-Request-Id: "+key)
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

	// fingerprint_fields /id /amount: only those fields are the request's;
	// fingerprint json: its canonical JSON, or its bytes when it is not
	// JSON.
	t.Run("fingerprints", func(t *testing.T) {
		wantOnce := func(what, path string, first, again answer) {
			t.Helper()
			if first.status != 201 || first.replayed != "" || again.status != 201 || again.replayed != "true" || again.body != first.body || up.Runs(path) != 1 {
				t.Errorf("%s: got %d then %d (replayed %q) %q after %d executions, want 201 and its replay %q after 1",
					what, first.status, again.status, again.replayed, again.body, up.Runs(path), first.body)
			}
		}
		wantMismatch := func(what, path string, status int, body string) {
			t.Helper()
			if status != 422 || !strings.Contains(body, idemhttp.ProblemMismatch) || up.Runs(path) != 1 {
				t.Errorf("%s: got %d %q after %d executions, want 422 mismatch after 1", what, status, body, up.Runs(path))
			}
		}
		id := "f-1-" + runID
		wantOnce("fingerprint_fields /id /amount, the other fields changed", "/fields/a",
			post(t, base+"/fields/a", "", `{"id":"`+id+`","amount":5,"attempt":1,"sent_at":"2026-12-02T07:00:00Z"}`),
			post(t, base+"/fields/a", "", `{"sent_at":"2026-12-02T07:05:00Z","attempt":2,"amount":5,"id":"`+id+`","trace":"t-2"}`))
		a := post(t, base+"/fields/a", "", `{"id":"`+id+`","amount":6,"attempt":1,"sent_at":"2026-12-02T07:00:00Z"}`)
		wantMismatch("fingerprint_fields /id /amount, the amount changed", "/fields/a", a.status, a.body)

		// curl, another client than Go's.
		key := "c-1-" + runID
		first := curlPost(t, base+"/canonical/a", key, `{"id":"c-1","amount":5,"items":[{"sku":"a","n":1}]}`)
		again := curlPost(t, base+"/canonical/a", key, "{ \"items\" : [ { \"n\":1, \"sku\":\"a\" } ],\n  \"amount\": 5, \"id\": \"c-1\" }")
		if first.err != nil || again.err != nil {
			t.Fatalf("curl: %v, %v", first.err, again.err)
		}
		wantOnce("fingerprint json, members reordered and spaced otherwise", "/canonical/a",
			answer{status: first.status, body: first.body, replayed: first.replayed}, answer{status: again.status, body: again.body, replayed: again.replayed})
		r := curlPost(t, base+"/canonical/a", key, `{"id":"c-1","amount":5,"items":[{"sku":"a","n":2}]}`)
		wantMismatch("fingerprint json, a value changed", "/canonical/a", r.status, r.body)
		key = "c-2-" + runID
		const notJSON = `{"id":"c-2","amount":5` // cut short: not JSON
		wantOnce("fingerprint json, a body that is not JSON, the same bytes", "/canonical/b",
			post(t, base+"/canonical/b", key, notJSON), post(t, base+"/canonical/b", key, notJSON))
		a = post(t, base+"/canonical/b", key, `{"id": "c-2", "amount": 5`)
		wantMismatch("fingerprint json, a body that is not JSON, spaced otherwise (raw: other bytes)", "/canonical/b", a.status, a.body)
	})

	// profile acp: another body under the key, and the key in flight,
	// answered 409 in the Agentic Commerce Protocol's JSON.
	t.Run("acp", func(t *testing.T) {
		wantACP := func(what string, resp *http.Response, body, code string) {
			t.Helper()
			var a struct{ Type, Code, Message string }
			if resp.StatusCode != 409 || resp.Header.Get("Content-Type") != "application/json" || json.Unmarshal([]byte(body), &a) != nil ||
				a.Type != "invalid_request" || a.Code != code || a.Message == "" {
				t.Errorf("profile acp, %s: got %d %s %s, want 409 application/json {\"type\":\"invalid_request\",\"code\":%q,\"message\":...}",
					what, resp.StatusCode, resp.Header.Get("Content-Type"), body, code)
			}
		}
		key := idemhttp.HeaderKey + ": acp-1-" + runID
		if resp, body := mustRequest(t, "/acp/a", `{"n":1}`, key); resp.StatusCode != 201 {
			t.Fatalf("profile acp, first: got %d %s, want 201", resp.StatusCode, body)
		}
		resp, body := mustRequest(t, "/acp/a", `{"n":2}`, key)
		wantACP("the key with another body", resp, body, "idempotency_conflict")

		key = idemhttp.HeaderKey + ": acp-2-" + runID
		slow := make(chan error, 1)
		go func() { _, _, err := request("/acp/slow", `{"n":1}`, key, "X-Test-Delay: 3s"); slow <- err }()
		for deadline := time.Now().Add(10 * time.Second); up.Runs("/acp/slow") == 0; time.Sleep(5 * time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatalf("the upstream did not start the slow request within 10s")
			}
		}
		resp, body = mustRequest(t, "/acp/slow", `{"n":1}`, key)
		wantACP("the key in flight", resp, body, "idempotency_in_flight")
		if resp.Header.Get("Retry-After") == "" {
			t.Errorf("profile acp, the key in flight: no Retry-After")
		}
		if err := <-slow; err != nil {
			t.Errorf("the slow request: %v", err)
		}
	})

	// key header:X-Request-Id: the key is that header's, and a request
	// with only an Idempotency-Key has none.
	t.Run("key-header", func(t *testing.T) {
		key := "X-Request-Id: r-1-" + runID
		first, firstBody := mustRequest(t, "/reqid/a", `{"n":1}`, key)
		again, againBody := mustRequest(t, "/reqid/a", `{"n":1}`, key, idemhttp.HeaderKey+": other-"+runID)
		if first.StatusCode != 201 || again.StatusCode != 201 || again.Header.Get(idemhttp.HeaderReplayed) != "true" || againBody != firstBody || up.Runs("/reqid/a") != 1 {
			t.Errorf("key header:X-Request-Id: got %d then %d (replayed %q) %q after %d executions, want 201 and its replay %q after 1",
				first.StatusCode, again.StatusCode, again.Header.Get(idemhttp.HeaderReplayed), againBody, up.Runs("/reqid/a"), firstBody)
		}
		if resp, body := mustRequest(t, "/reqid/a", `{"n":2}`, key); resp.StatusCode != 422 || !strings.Contains(body, idemhttp.ProblemMismatch) {
			t.Errorf("key header:X-Request-Id, another body: got %d %s, want 422 mismatch", resp.StatusCode, body)
		}
		only := idemhttp.HeaderKey + ": k-1-" + runID
		mustRequest(t, "/reqid/b", `{}`, only)
		mustRequest(t, "/reqid/b", `{}`, only)
		if n := up.Runs("/reqid/b"); n != 2 {
			t.Errorf("key header:X-Request-Id, a request with only %s (no key: passed through): the upstream ran it %d times, want 2", idemhttp.HeaderKey, n)
		}
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
