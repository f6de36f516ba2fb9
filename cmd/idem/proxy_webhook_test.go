package main

// Webhook ingress through the built proxy (issue 33), from outside: the
// deliveries are signed by each sender's own library
// (internal/webhooktest: stripe, @octokit/webhooks-methods,
// standardwebhooks, Shopify's recipe in Python), never by idem's code, and
// sent to the proxy in front of an upstream that counts what reaches it.

import (
	"encoding/json"
	"fmt"
	"net/http"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/internal/upstreamtest"
	"github.com/idemkit/idem/internal/webhooktest"
)

// TestProxyWebhooks: per preset, a delivery and its redeliveries run once,
// whatever Authorization says; forged deliveries under a real delivery id
// get 401 unverified, reach nothing, and leave the id to the genuine
// delivery; secrets rotate (two in a file or a variable; two signatures in
// a header; a SIGHUP that re-reads rewritten files, the flags' and a
// route's); the 401s are counted; no secret reaches the log. Then the key
// sources, JSON fingerprints and answer profiles of --config routes and
// flags.
func TestProxyWebhooks(t *testing.T) {
	t.Parallel()
	for _, preset := range webhooktest.Presets {
		t.Run(preset, func(t *testing.T) {
			t.Parallel()
			testProxyWebhook(t, preset)
		})
	}
	t.Run("key-sources", func(t *testing.T) { t.Parallel(); testProxyKeySources(t) })
	t.Run("fingerprint", func(t *testing.T) { t.Parallel(); testProxyFingerprint(t) })
	t.Run("profiles", func(t *testing.T) { t.Parallel(); testProxyProfiles(t) })
}

// webhookBody is a delivery's JSON body; its "id" is the delivery's id
// (stripe's key is there).
func webhookBody(preset, id string) string {
	return fmt.Sprintf(`{"id":%q,"object":"event","type":"%s.test","data":{"amount":2000,"note":"café"}}`, id, preset)
}

func testProxyWebhook(t *testing.T, preset string) {
	dir := t.TempDir()
	cur, next := webhooktest.NewSecret(preset), webhooktest.NewSecret(preset)
	retired, forger := webhooktest.NewSecret(preset), webhooktest.NewSecret(preset)
	// The flags' route holds two secrets, as while the operator rotates:
	// in a file, or (stripe, shopify) in an environment variable, one a
	// line. The --config route inherits the preset, its
	// webhook_secret_file replaces the flags' source, and it holds one
	// secret until a SIGHUP re-reads the file with the second.
	var env []string
	args := []string{"--webhook", preset}
	flagSecrets := ""
	if preset == "stripe" || preset == "shopify" {
		env = []string{"WEBHOOK_SECRETS=" + cur + "\n" + next}
		args = append(args, "--webhook-secret-env", "WEBHOOK_SECRETS")
	} else {
		flagSecrets = filepath.Join(dir, "flag-secrets")
		webhooktest.WriteSecrets(t, flagSecrets, cur, next)
		args = append(args, "--webhook-secret-file", flagSecrets)
	}
	routeSecrets := filepath.Join(dir, "route-secrets")
	webhooktest.WriteSecrets(t, routeSecrets, cur)
	cfg := filepath.Join(dir, "routes.yaml")
	routes := fmt.Sprintf("routes:\n  - match: \"POST /rotating/\"\n    methods: [POST]\n    webhook_secret_file: %q\n", routeSecrets)
	routes += "  - match: \"POST /strict/\"\n    methods: [POST]\n    require_key: true\n"
	signsTime := preset == "stripe" || preset == "standard-webhooks"
	if signsTime {
		routes += "  - match: \"POST /tolerant/\"\n    methods: [POST]\n    webhook_tolerance: 1h\n"
	}
	writeFile(t, cfg, routes)
	up := upstreamtest.StartCounter(t)
	p := startProxy(t, env, append(args, "--upstream", up.URL, "--log-level", "debug", "--config", cfg)...)

	seq := 0
	newID := func() string {
		seq++
		return fmt.Sprintf("%s-%d-%d", strings.ReplaceAll(preset, "-", ""), time.Now().UnixNano(), seq)
	}
	delivery := func(path, id string, secrets ...string) webhooktest.Delivery {
		return webhooktest.Delivery{Preset: preset, URL: p.url(path), Secrets: secrets, Body: webhookBody(preset, id), ID: id}
	}
	unverified := 0 // the 401s sent
	wantUnverified := func(what, path string, a webhooktest.Answer) {
		t.Helper()
		unverified++
		if err := webhooktest.CheckUnverified(a); err != nil {
			t.Errorf("%s: %v", what, err)
		}
		if leaked := webhooktest.Leaked(a.Body, cur, next, retired, forger); leaked != "" {
			t.Errorf("%s: the 401's body holds %s of [current, next, retired, forger]", what, leaked)
		}
		if n := up.Runs(path); n != 0 {
			t.Errorf("%s: the upstream ran %s %d times, want 0 (not forwarded)", what, path, n)
		}
	}
	wantExecuted := func(what, path string, a webhooktest.Answer, runs int) {
		t.Helper()
		if a.Status != http.StatusCreated || a.Replayed() {
			t.Errorf("%s: got %d (replayed %v) %s, want the upstream's 201", what, a.Status, a.Replayed(), a.Body)
		}
		if n := up.Runs(path); n != runs {
			t.Errorf("%s: the upstream ran %s %d times, want %d", what, path, n, runs)
		}
	}
	wantReplay := func(what, path string, a, first webhooktest.Answer) {
		t.Helper()
		if a.Status != first.Status || a.Body != first.Body || !a.Replayed() {
			t.Errorf("%s: got %d (replayed %v) %s, want the replay (%s: true) of %d %s",
				what, a.Status, a.Replayed(), a.Body, idemhttp.HeaderReplayed, first.Status, first.Body)
		}
		if n := up.Runs(path); n != 1 {
			t.Errorf("%s: the upstream ran %s %d times, want 1", what, path, n)
		}
	}

	// A delivery and two redeliveries (each signed again, as the senders
	// do): one execution, the stored answer twice. The tenant is the
	// sender's, not a credential's: the second redelivery, with an
	// Authorization header, is still the same delivery.
	id := newID()
	first := webhooktest.Send(t, delivery("/hooks/once", id, cur))
	wantExecuted("the delivery", "/hooks/once", first, 1)
	if got, want := up.Body("/hooks/once"), webhookBody(preset, id); got != want {
		t.Errorf("the upstream got body %q, want the signed bytes %q", got, want)
	}
	wantReplay("redelivery 1", "/hooks/once", webhooktest.Send(t, delivery("/hooks/once", id, cur)), first)
	again := delivery("/hooks/once", id, cur)
	again.Header = map[string]string{"Authorization": "Bearer another-caller"}
	wantReplay("redelivery 2, with an Authorization header", "/hooks/once", webhooktest.Send(t, again), first)

	// Forgeries under the id a genuine delivery is about to carry: each
	// refused, none forwarded, none claiming the id.
	id = newID()
	wantUnverified("signed by another secret", "/hooks/forged", webhooktest.Send(t, delivery("/hooks/forged", id, forger)))
	altered := delivery("/hooks/forged", id, cur)
	altered.SentBody = strings.Replace(altered.Body, `"amount":2000`, `"amount":1`, 1)
	wantUnverified("the body altered after signing", "/hooks/forged", webhooktest.Send(t, altered))
	if signsTime {
		stale := delivery("/hooks/forged", id, cur)
		stale.Timestamp = time.Now().Add(-10 * time.Minute) // the tolerance is 5 minutes
		wantUnverified("signed 10 minutes ago", "/hooks/forged", webhooktest.Send(t, stale))
		stale.Timestamp = time.Now().Add(10 * time.Minute)
		wantUnverified("signed 10 minutes ahead", "/hooks/forged", webhooktest.Send(t, stale))
		// A route of webhook_tolerance 1h takes it.
		tolerant := delivery("/tolerant/a", newID(), cur)
		tolerant.Timestamp = time.Now().Add(-10 * time.Minute)
		wantExecuted("signed 10 minutes ago, under webhook_tolerance 1h", "/tolerant/a", webhooktest.Send(t, tolerant), 1)
	}
	unsigned := mustSend(t, "POST", p.url("/hooks/forged"), "", webhookBody(preset, id),
		"X-GitHub-Delivery: "+id, "X-Shopify-Webhook-Id: "+id, "webhook-id: "+id)
	wantUnverified("unsigned", "/hooks/forged", webhooktest.Answer{Status: unsigned.status, Header: unsigned.header, Body: string(unsigned.body)})
	// The methods the route does not cover are refused too, not passed to
	// the upstream unverified.
	for _, method := range []string{"GET", "PUT", "DELETE", "post"} {
		r := mustSend(t, method, p.url("/hooks/forged"), "", "", "X-GitHub-Delivery: "+id)
		if r.status != http.StatusMethodNotAllowed || r.header.Get("Allow") == "" || !strings.Contains(string(r.body), "urn:idem:problem:method-not-allowed") {
			t.Errorf("unsigned %s on the webhook route: got %d Allow %q %s, want 405 with Allow and the method-not-allowed problem",
				method, r.status, r.header.Get("Allow"), r.body)
		}
	}
	wantRuns(t, "unsigned requests of other methods", up, "/hooks/forged", 0)
	const refusedMethods = 4 // counted as rejected, as the 400s are
	genuine := webhooktest.Send(t, delivery("/hooks/forged", id, cur))
	wantExecuted("the genuine delivery after the forgeries", "/hooks/forged", genuine, 1)
	wantReplay("its redelivery", "/hooks/forged", webhooktest.Send(t, delivery("/hooks/forged", id, cur)), genuine)

	// Rotation on the flags' route: the second secret verifies, a secret
	// no longer there does not.
	wantExecuted("signed by the second secret", "/hooks/next", webhooktest.Send(t, delivery("/hooks/next", newID(), next)), 1)
	wantUnverified("signed by a retired secret", "/hooks/retired", webhooktest.Send(t, delivery("/hooks/retired", newID(), retired)))
	if signsTime {
		// The sender rolls its secret: one signature by the old one (which
		// the receiver no longer has) and one by the new.
		two := webhooktest.Send(t, delivery("/hooks/two-signatures", newID(), retired, cur))
		wantExecuted("two signatures, the second by a secret of the route's", "/hooks/two-signatures", two, 1)
	}

	// Rotation without a restart: the --config route refuses the new
	// secret until its file holds it and a SIGHUP re-reads it; the 401
	// claimed nothing, so the same delivery then runs. The same SIGHUP
	// re-reads the flags' file, which the operator rewrote without the
	// current secret.
	id = newID()
	wantUnverified("the route's new secret before the reload", "/rotating/a", webhooktest.Send(t, delivery("/rotating/a", id, next)))
	webhooktest.WriteSecrets(t, routeSecrets, cur, next)
	if flagSecrets != "" {
		webhooktest.WriteSecrets(t, flagSecrets, next)
	}
	p.hangup(t, `"msg":"reloaded","what":"config"`, 1)
	wantExecuted("the route's new secret after the reload", "/rotating/a", webhooktest.Send(t, delivery("/rotating/a", id, next)), 1)
	wantExecuted("the route's old secret after the reload", "/rotating/b", webhooktest.Send(t, delivery("/rotating/b", newID(), cur)), 1)
	if flagSecrets != "" {
		wantUnverified("the flags' file rewritten without the current secret, after the reload", "/hooks/rotated-out",
			webhooktest.Send(t, delivery("/hooks/rotated-out", newID(), cur)))
		wantExecuted("the flags' remaining secret after the reload", "/hooks/remaining", webhooktest.Send(t, delivery("/hooks/remaining", newID(), next)), 1)
	}

	// A genuine delivery that names no key (stripe: a body without "id";
	// github, shopify: no delivery id header) is not unverified: it is a
	// request without a key, refused 400 where the key is required.
	missing := 0
	if preset != "standard-webhooks" { // its webhook-id is signed: without it, nothing verifies
		noKey := delivery("/strict/no-key", "", next) // the flags' secret left after the reload
		if preset == "stripe" {
			noKey.Body = `{"object":"event","type":"stripe.test"}`
		}
		a := webhooktest.Send(t, noKey)
		missing++
		wantStatus(t, "a genuine delivery without a key, require_key", result{a.Status, a.Header, []byte(a.Body)}, http.StatusBadRequest, idemhttp.ProblemKeyMissing)
		wantRuns(t, "a genuine delivery without a key, require_key", up, "/strict/no-key", 0)
	}

	if got := p.metric(fmt.Sprintf(`idem_webhook_unverified_total{preset=%q}`, preset)); got != float64(unverified) {
		t.Errorf("idem_webhook_unverified_total{preset=%q} = %v, want %d (the 401s)", preset, got, unverified)
	}
	if got := p.metric(`idem_requests_total{outcome="rejected"}`); got != float64(unverified+missing+refusedMethods) {
		t.Errorf(`idem_requests_total{outcome="rejected"} = %v, want %d (the 401s, 400s and 405s)`, got, unverified+missing+refusedMethods)
	}
	if leaked := webhooktest.Leaked(p.logText(), cur, next, retired, forger); leaked != "" {
		t.Errorf("the proxy's stderr (--log-level debug) holds %s of [current, next, retired, forger]", leaked)
	}
}

// routesProxy runs idem proxy in front of a new counting upstream with the
// --config file routes and more flags.
func routesProxy(t *testing.T, routes string, args ...string) (*proxyProc, *upstreamtest.Counter) {
	t.Helper()
	cfg := filepath.Join(t.TempDir(), "routes.yaml")
	writeFile(t, cfg, routes)
	up := upstreamtest.StartCounter(t)
	return startProxy(t, nil, append([]string{"--upstream", up.URL, "--config", cfg}, args...)...), up
}

// wantRuns checks how many times the upstream ran path.
func wantRuns(t *testing.T, what string, up *upstreamtest.Counter, path string, n int) {
	t.Helper()
	if got := up.Runs(path); got != n {
		t.Errorf("%s: the upstream ran %s %d times, want %d", what, path, got, n)
	}
}

// wantOnce checks that two answers are an execution (201) and its replay.
func wantOnce(t *testing.T, what string, up *upstreamtest.Counter, path string, first, again result) {
	t.Helper()
	if first.status != http.StatusCreated || first.replayed() {
		t.Errorf("%s: got %d (replayed %v) %s, want the upstream's 201", what, first.status, first.replayed(), first.body)
	}
	if again.status != first.status || string(again.body) != string(first.body) || !again.replayed() {
		t.Errorf("%s, repeated: got %d (replayed %v) %s, want the replay of %s", what, again.status, again.replayed(), again.body, first.body)
	}
	wantRuns(t, what, up, path, 1)
}

// testProxyKeySources: a key from a JSON body's field (a body without it,
// not JSON, or too large each get one clear answer), from a header a
// route names (key: header:NAME), and from the header --key-header names
// for every other route but one whose webhook names its own.
func testProxyKeySources(t *testing.T) {
	secret := webhooktest.NewSecret("github")
	secretFile := filepath.Join(t.TempDir(), "github-secret")
	webhooktest.WriteSecrets(t, secretFile, secret)
	p, up := routesProxy(t, fmt.Sprintf(`routes:
  - match: "POST /json/"
    methods: [POST]
    key: json:/id
    require_key: true
    max_body: 64
  - match: "POST /hdr/"
    methods: [POST]
    key: header:X-Request-Id
  - match: "POST /github/"
    methods: [POST]
    webhook: github
    webhook_secret_file: %q
`, secretFile), "--key-header", "X-Flag-Key")

	post := func(path, body string, hdr ...string) result {
		t.Helper()
		return mustSend(t, "POST", p.url(path), "", body, hdr...)
	}
	wantStatus(t, "key json:/id, a body without the field", post("/json/missing", `{"x":1}`), http.StatusBadRequest, idemhttp.ProblemKeyMissing)
	wantStatus(t, "key json:/id, a body that is not JSON", post("/json/not-json", `id=1`), http.StatusBadRequest, idemhttp.ProblemKeyInvalid)
	big := `{"id":"big-1","pad":"` + strings.Repeat("x", 100) + `"}`
	wantStatus(t, "key json:/id, a body over max_body 64", post("/json/big", big), http.StatusRequestEntityTooLarge, idemhttp.ProblemBodyTooLarge)
	for _, path := range []string{"/json/missing", "/json/not-json", "/json/big"} {
		wantRuns(t, "a refused body", up, path, 0)
	}
	// The key is the body's: another Idempotency-Key header changes
	// nothing.
	wantOnce(t, "key json:/id", up, "/json/ok", post("/json/ok", `{"id":"ord-1"}`, "Idempotency-Key: a"),
		post("/json/ok", `{"id":"ord-1"}`, "Idempotency-Key: b"))

	wantOnce(t, "key header:X-Request-Id", up, "/hdr/a", post("/hdr/a", `{}`, "X-Request-Id: r-1"), post("/hdr/a", `{}`, "X-Request-Id: r-1"))
	for _, h := range []string{"Idempotency-Key: k-1", "X-Flag-Key: f-1"} {
		path := "/hdr/" + strings.ToLower(strings.Split(h, ":")[0])
		post(path, `{}`, h)
		post(path, `{}`, h)
		wantRuns(t, "key header:X-Request-Id, a request with only "+h+" (no key: passed through)", up, path, 2)
	}
	wantOnce(t, "--key-header X-Flag-Key", up, "/flag/a", post("/flag/a", `{}`, "X-Flag-Key: f-1"), post("/flag/a", `{}`, "X-Flag-Key: f-1"))
	post("/flag/b", `{}`, "Idempotency-Key: k-1")
	post("/flag/b", `{}`, "Idempotency-Key: k-1")
	wantRuns(t, "--key-header X-Flag-Key, a request with only Idempotency-Key (no key: passed through)", up, "/flag/b", 2)

	// A route's webhook replaces the inherited --key-header: the key is
	// the delivery's, and the signature is checked.
	d := webhooktest.Delivery{Preset: "github", URL: p.url("/github/a"), Secrets: []string{secret}, Body: webhookBody("github", "gh-1"), ID: "gh-1",
		Header: map[string]string{"X-Flag-Key": "f-1"}}
	first := webhooktest.Send(t, d)
	d.Header["X-Flag-Key"] = "f-2"
	again := webhooktest.Send(t, d)
	if first.Status != http.StatusCreated || first.Replayed() || again.Body != first.Body || !again.Replayed() {
		t.Errorf("webhook github under --key-header: got %d (replayed %v) then %d (replayed %v) %s, want 201 and the replay of %s",
			first.Status, first.Replayed(), again.Status, again.Replayed(), again.Body, first.Body)
	}
	forged := mustSend(t, "POST", p.url("/github/b"), "", webhookBody("github", "gh-2"), "X-GitHub-Delivery: gh-2", "X-Flag-Key: f-3")
	if err := webhooktest.CheckUnverified(webhooktest.Answer{Status: forged.status, Header: forged.header, Body: string(forged.body)}); err != nil {
		t.Errorf("webhook github under --key-header, unsigned: %v", err)
	}
	wantRuns(t, "webhook github under --key-header", up, "/github/a", 1)
	wantRuns(t, "webhook github under --key-header, unsigned", up, "/github/b", 0)
}

// testProxyFingerprint: with fingerprint_exclude: [/attempt], a
// redelivery that bumped its attempt counter (and reordered its members)
// is a replay, and one that changed anything else a 422; without it, the
// changed counter is a 422. With fingerprint_fields: [/id, /amount], a
// redelivery whose other fields changed (or are new) is a replay, and one
// whose amount changed or is gone a 422. With fingerprint: json (sent by
// curl), members reordered and spaced otherwise are a replay and a value
// changed a 422; a body that is not JSON is fingerprinted raw: the same
// bytes replay, and bytes that differ only in spacing are a 422.
func testProxyFingerprint(t *testing.T) {
	p, up := routesProxy(t, `routes:
  - match: "POST /exclude/"
    methods: [POST]
    key: json:/id
    fingerprint_exclude: [/attempt]
  - match: "POST /raw/"
    methods: [POST]
    key: json:/id
  - match: "POST /fields/"
    methods: [POST]
    key: json:/id
    fingerprint_fields: [/id, /amount]
  - match: "POST /canonical/"
    methods: [POST]
    fingerprint: json
`)
	post := func(path, body string) result { t.Helper(); return mustSend(t, "POST", p.url(path), "", body) }
	wantOnce(t, "fingerprint_exclude [/attempt], the attempt bumped", up, "/exclude/a",
		post("/exclude/a", `{"id":"e-1","attempt":1,"amount":5}`), post("/exclude/a", `{"amount":5, "attempt":2, "id":"e-1"}`))
	wantStatus(t, "fingerprint_exclude [/attempt], the amount changed", post("/exclude/a", `{"id":"e-1","attempt":3,"amount":6}`),
		http.StatusUnprocessableEntity, idemhttp.ProblemMismatch)
	wantStatus(t, "the raw fingerprint, first", post("/raw/a", `{"id":"r-1","attempt":1}`), http.StatusCreated, "")
	wantStatus(t, "the raw fingerprint, the attempt bumped", post("/raw/a", `{"id":"r-1","attempt":2}`),
		http.StatusUnprocessableEntity, idemhttp.ProblemMismatch)
	wantRuns(t, "the raw fingerprint", up, "/raw/a", 1)

	first := post("/fields/a", `{"id":"f-1","amount":5,"attempt":1,"sent_at":"2026-12-02T07:00:00Z"}`)
	again := post("/fields/a", `{"sent_at":"2026-12-02T07:05:00Z","attempt":2,"amount":5,"id":"f-1","trace":"t-2"}`)
	wantOnce(t, "fingerprint_fields [/id, /amount], the other fields changed", up, "/fields/a", first, again)
	wantStatus(t, "fingerprint_fields [/id, /amount], the amount changed", post("/fields/a", `{"id":"f-1","amount":6,"attempt":1,"sent_at":"2026-12-02T07:00:00Z"}`),
		http.StatusUnprocessableEntity, idemhttp.ProblemMismatch)
	wantStatus(t, "fingerprint_fields [/id, /amount], the amount gone", post("/fields/a", `{"id":"f-1","attempt":3}`),
		http.StatusUnprocessableEntity, idemhttp.ProblemMismatch)
	wantRuns(t, "fingerprint_fields [/id, /amount]", up, "/fields/a", 1)

	// curl, another client than Go's, for the canonical JSON.
	first = curlPost(t, p.url("/canonical/a"), "c-1", `{"id":"c-1","amount":5,"items":[{"sku":"a","n":1}]}`)
	again = curlPost(t, p.url("/canonical/a"), "c-1", "{ \"items\" : [ { \"n\":1, \"sku\":\"a\" } ],\n  \"amount\": 5, \"id\": \"c-1\" }")
	wantOnce(t, "fingerprint json, members reordered and spaced otherwise", up, "/canonical/a", first, again)
	wantStatus(t, "fingerprint json, a value changed", curlPost(t, p.url("/canonical/a"), "c-1", `{"id":"c-1","amount":5,"items":[{"sku":"a","n":2}]}`),
		http.StatusUnprocessableEntity, idemhttp.ProblemMismatch)
	const notJSON = `{"id":"c-2","amount":5` // cut short: not JSON
	first = curlPost(t, p.url("/canonical/b"), "c-2", notJSON)
	again = curlPost(t, p.url("/canonical/b"), "c-2", notJSON)
	wantOnce(t, "fingerprint json, a body that is not JSON, the same bytes", up, "/canonical/b", first, again)
	wantStatus(t, "fingerprint json, a body that is not JSON, spaced otherwise (raw: other bytes)",
		curlPost(t, p.url("/canonical/b"), "c-2", `{"id": "c-2", "amount": 5`), http.StatusUnprocessableEntity, idemhttp.ProblemMismatch)
	wantRuns(t, "fingerprint json, a body that is not JSON", up, "/canonical/b", 1)
}

// testProxyProfiles: profile acp and stripe answer a mismatch and a key in
// flight in their APIs' JSON; echo_key puts the key, as its source read
// it, on every answer to a keyed request; lifetime_header the retention on
// every answer of a covered method. Neither header is stored: a replay
// carries each once.
func testProxyProfiles(t *testing.T) {
	p, up := routesProxy(t, `routes:
  - match: "POST /acp/"
    methods: [POST]
    profile: acp
    wait: 0s
  - match: "POST /stripe/"
    methods: [POST]
    profile: stripe
    wait: 0s
  - match: "POST /echo/"
    methods: [POST]
    echo_key: true
  - match: "POST /echo-header/"
    methods: [POST]
    key: header:X-Request-Id
    echo_key: true
  - match: "/lifetime/"
    methods: [POST]
    lifetime_header: true
  - match: "POST /lifetime-30m/"
    methods: [POST]
    lifetime_header: true
    retention: 30m
`)
	type jsonAnswer struct {
		Type, Code, Message string
		Error               *struct{ Type, Code, Message string }
	}
	wantJSON := func(what string, r result, status int, check func(a jsonAnswer) bool, want string) {
		t.Helper()
		var a jsonAnswer
		if r.status != status || r.header.Get("Content-Type") != "application/json" || json.Unmarshal(r.body, &a) != nil || !check(a) {
			t.Errorf("%s: got %d %s %s, want %d application/json %s", what, r.status, r.header.Get("Content-Type"), r.body, status, want)
		}
	}
	// inFlight sends a slow request under key, waits until the upstream
	// runs it, and returns the answer to a copy sent meanwhile.
	inFlight := func(path, key string) result {
		t.Helper()
		var wg sync.WaitGroup
		wg.Go(func() { send("POST", p.url(path), key, `{"n":1}`, "X-Test-Delay: 3s") })
		defer wg.Wait()
		for deadline := time.Now().Add(10 * time.Second); up.Runs(path) == 0; time.Sleep(5 * time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatalf("%s: the upstream did not start the slow request within 10s", path)
			}
		}
		return mustSend(t, "POST", p.url(path), key, `{"n":1}`)
	}

	wantStatus(t, "profile acp, first", mustSend(t, "POST", p.url("/acp/a"), "acp-1", `{"n":1}`), http.StatusCreated, "")
	wantJSON("profile acp, the key with another body", mustSend(t, "POST", p.url("/acp/a"), "acp-1", `{"n":2}`), http.StatusConflict,
		func(a jsonAnswer) bool {
			return a.Type == "invalid_request" && a.Code == "idempotency_conflict" && a.Message != ""
		},
		`{"type":"invalid_request","code":"idempotency_conflict","message":...}`)
	r := inFlight("/acp/slow", "acp-2")
	wantJSON("profile acp, the key in flight", r, http.StatusConflict,
		func(a jsonAnswer) bool {
			return a.Type == "invalid_request" && a.Code == "idempotency_in_flight" && a.Message != ""
		},
		`{"type":"invalid_request","code":"idempotency_in_flight","message":...}`)
	if r.header.Get("Retry-After") == "" {
		t.Errorf("profile acp, the key in flight: no Retry-After")
	}

	wantStatus(t, "profile stripe, first", mustSend(t, "POST", p.url("/stripe/a"), "stripe-1", `{"n":1}`), http.StatusCreated, "")
	wantJSON("profile stripe, the key with another body", mustSend(t, "POST", p.url("/stripe/a"), "stripe-1", `{"n":2}`), http.StatusBadRequest,
		func(a jsonAnswer) bool {
			return a.Error != nil && a.Error.Type == "idempotency_error" && a.Error.Message != ""
		},
		`{"error":{"type":"idempotency_error","message":...}}`)
	wantJSON("profile stripe, the key in flight", inFlight("/stripe/slow", "stripe-2"), http.StatusConflict,
		func(a jsonAnswer) bool {
			return a.Error != nil && a.Error.Type == "idempotency_error" && a.Error.Code == "idempotency_key_in_use" && a.Error.Message != ""
		},
		`{"error":{"type":"idempotency_error","code":"idempotency_key_in_use","message":...}}`)

	wantEcho := func(what string, r result, key string) {
		t.Helper()
		if got := r.header.Values(idemhttp.HeaderKey); len(got) != 1 || got[0] != key {
			t.Errorf("echo_key, %s: got %s %q, want one %q", what, idemhttp.HeaderKey, got, key)
		}
	}
	first, again := mustSend(t, "POST", p.url("/echo/a"), "echo-1", `{"n":1}`), mustSend(t, "POST", p.url("/echo/a"), "echo-1", `{"n":1}`)
	wantOnce(t, "echo_key", up, "/echo/a", first, again)
	wantEcho("executed", first, "echo-1")
	wantEcho("replayed", again, "echo-1")
	mismatch := mustSend(t, "POST", p.url("/echo/a"), "echo-1", `{"n":2}`)
	wantStatus(t, "echo_key, the key with another body", mismatch, http.StatusUnprocessableEntity, idemhttp.ProblemMismatch)
	wantEcho("a mismatch", mismatch, "echo-1")
	if got := mustSend(t, "POST", p.url("/echo/b"), "", `{}`).header.Values(idemhttp.HeaderKey); len(got) != 0 {
		t.Errorf("echo_key, a request without a key: got %s %q, want none", idemhttp.HeaderKey, got)
	}
	first = mustSend(t, "POST", p.url("/echo-header/a"), "", `{}`, "X-Request-Id: req-1")
	again = mustSend(t, "POST", p.url("/echo-header/a"), "", `{}`, "X-Request-Id: req-1")
	wantOnce(t, "echo_key with key header:X-Request-Id", up, "/echo-header/a", first, again)
	wantEcho("key header:X-Request-Id, executed", first, "req-1")
	wantEcho("key header:X-Request-Id, replayed", again, "req-1")

	const lifetime = "Idempotency-Key-Lifetime"
	wantLifetime := func(what string, r result, want string) {
		t.Helper()
		got := r.header.Values(lifetime)
		if want == "" && len(got) != 0 || want != "" && (len(got) != 1 || got[0] != want) {
			t.Errorf("lifetime_header, %s: got %s %q, want %q", what, lifetime, got, want)
		}
	}
	first, again = mustSend(t, "POST", p.url("/lifetime/a"), "life-1", `{}`), mustSend(t, "POST", p.url("/lifetime/a"), "life-1", `{}`)
	wantOnce(t, "lifetime_header", up, "/lifetime/a", first, again)
	wantLifetime("executed, the default retention", first, "PT24H")
	wantLifetime("replayed", again, "PT24H")
	wantLifetime("a POST without a key", mustSend(t, "POST", p.url("/lifetime/b"), "", `{}`), "PT24H")
	wantLifetime("a GET (a method not covered)", mustSend(t, "GET", p.url("/lifetime/c"), "life-2", ""), "")
	wantLifetime("retention 30m", mustSend(t, "POST", p.url("/lifetime-30m/a"), "life-3", `{}`), "PT30M")
}
