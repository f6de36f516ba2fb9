package main

import (
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/sidecar"
)

// docsBlocks returns the bodies of the ```lang blocks of the markdown
// file at path, in order.
func docsBlocks(t *testing.T, path, lang string) []string {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var blocks []string
	rest := string(b)
	for {
		_, after, ok := strings.Cut(rest, "\n```"+lang+"\n")
		if !ok {
			return blocks
		}
		block, tail, ok := strings.Cut(after, "\n```\n")
		if !ok {
			t.Fatalf("%s: a %s block does not end", path, lang)
		}
		blocks = append(blocks, block+"\n")
		rest = "\n" + tail
	}
}

// docSecret is one secret every preset takes: Standard Webhooks' form
// (whsec_ and base64), which the other presets use as its bytes.
func docSecret(t *testing.T) (line string, key []byte) {
	t.Helper()
	key = make([]byte, 32)
	rand.Read(key)
	line = "whsec_" + base64.StdEncoding.EncodeToString(key)
	return line, key
}

// signed is a delivery of body under id, signed as preset signs it with
// the secret line (whose base64 part is key) at now: its headers.
func signed(preset, line string, key []byte, id, body string, now time.Time) []string {
	mac := func(k []byte, parts ...string) []byte {
		m := hmac.New(sha256.New, k)
		for _, p := range parts {
			m.Write([]byte(p))
		}
		return m.Sum(nil)
	}
	ts := strconv.FormatInt(now.Unix(), 10)
	switch preset {
	case "github":
		return []string{"X-GitHub-Delivery: " + id, githubSignature(line, body)}
	case "shopify":
		return []string{"X-Shopify-Webhook-Id: " + id, "X-Shopify-Hmac-Sha256: " + base64.StdEncoding.EncodeToString(mac([]byte(line), body))}
	case "stripe": // the id is in the body
		return []string{"Stripe-Signature: t=" + ts + ",v1=" + hex.EncodeToString(mac([]byte(line), ts, ".", body))}
	}
	return []string{"webhook-id: " + id, "webhook-timestamp: " + ts,
		"webhook-signature: v1," + base64.StdEncoding.EncodeToString(mac(key, id, ".", ts, ".", body))}
}

// TestWebhookDocRoutes keeps docs/webhooks.md's --config routes true:
// every yaml block loads as idem proxy's --config (its secret files made
// here), and the proxy started with each sender's block runs a delivery
// signed as the sender signs it once, replays its redelivery (signed
// again, for the senders that sign a timestamp), and refuses a body
// altered after signing with 401, forwarding nothing.
func TestWebhookDocRoutes(t *testing.T) {
	t.Parallel()
	blocks := docsBlocks(t, "../../docs/webhooks.md", "yaml")
	secretPath := regexp.MustCompile(`/etc/idem/[a-z-]+\.secrets`)
	presetOf := regexp.MustCompile(`(?m)^\s+webhook: ([a-z-]+)$`)
	matchOf := regexp.MustCompile(`(?m)match: "POST (/[^"]*)"`)
	seen := map[string]bool{}
	for i, block := range blocks {
		dir := t.TempDir()
		line, key := docSecret(t)
		block = secretPath.ReplaceAllStringFunc(block, func(p string) string {
			f := filepath.Join(dir, filepath.Base(p))
			writeFile(t, f, "# made by TestWebhookDocRoutes\n"+line+"\n")
			return f
		})
		config := filepath.Join(dir, "routes.yaml")
		writeFile(t, config, block)
		if _, err := loadProxyConfig(config, sidecar.DefaultSettings()); err != nil {
			t.Errorf("docs/webhooks.md, yaml block %d: %v\n%s", i+1, err, block)
			continue
		}
		m := presetOf.FindStringSubmatch(block)
		if m == nil {
			continue
		}
		preset := m[1]
		seen[preset] = true
		path := matchOf.FindStringSubmatch(block)[1]
		t.Run(preset, func(t *testing.T) {
			t.Parallel()
			up := newTestUpstream(t)
			p := startProxy(t, nil, "--upstream", up.URL, "--config", config)
			id := "doc-" + preset + "-1"
			body := `{"id":"evt_doc_1","type":"doc.test","data":{"n":1}}`
			first := mustSend(t, "POST", p.url(path), "", body, signed(preset, line, key, id, body, time.Now())...)
			wantStatus(t, preset+" delivery", first, http.StatusCreated, "")
			again := mustSend(t, "POST", p.url(path), "", body, signed(preset, line, key, id, body, time.Now())...)
			if again.status != http.StatusCreated || !again.replayed() || string(again.body) != string(first.body) {
				t.Errorf("%s redelivery: got %d replayed %v; want the first answer replayed", preset, again.status, again.replayed())
			}
			altered := strings.Replace(body, `"n":1`, `"n":2`, 1)
			hdr := signed(preset, line, key, "doc-"+preset+"-2", body, time.Now()) // signed over body, sent with altered
			wantStatus(t, preset+" delivery with an altered body", mustSend(t, "POST", p.url(path), "", altered, hdr...),
				http.StatusUnauthorized, "urn:idem:problem:unverified")
			if n := up.runsOf(""); n != 1 {
				t.Errorf("%s: the upstream ran %d times; want once", preset, n)
			}
			if got := p.metric(fmt.Sprintf(`idem_webhook_unverified_total{preset=%q}`, preset)); got != 1 {
				t.Errorf("%s: idem_webhook_unverified_total %v; want 1", preset, got)
			}
		})
	}
	for _, preset := range []string{"github", "stripe", "shopify", "standard-webhooks"} {
		if !seen[preset] {
			t.Errorf("docs/webhooks.md has no yaml route with webhook: %s", preset)
		}
	}
}
