package main

import (
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/idemkit/idem/internal/sidecar"
	"github.com/idemkit/idem/internal/webhooktest"
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

// TestWebhookDocRoutes keeps docs/webhooks.md's --config routes true:
// every yaml block loads as idem proxy's --config (its secret files made
// here), and the proxy started with each sender's block runs a delivery
// signed by the sender's own library (internal/webhooktest) once, replays
// its redelivery (signed again, for the senders that sign a timestamp),
// and refuses a body altered after signing with 401, forwarding nothing.
func TestWebhookDocRoutes(t *testing.T) {
	t.Parallel()
	blocks := docsBlocks(t, "../../docs/webhooks.md", "yaml")
	secretPath := regexp.MustCompile(`/etc/idem/[a-z-]+\.secrets`)
	presetOf := regexp.MustCompile(`(?m)^\s+webhook: ([a-z-]+)$`)
	matchOf := regexp.MustCompile(`(?m)match: "?(?:POST )?(/[^"\s]*)`)
	seen := map[string]bool{}
	for i, block := range blocks {
		preset := ""
		if m := presetOf.FindStringSubmatch(block); m != nil {
			preset = m[1]
		}
		dir := t.TempDir()
		secret := webhooktest.NewSecret(preset)
		block = secretPath.ReplaceAllStringFunc(block, func(p string) string {
			f := filepath.Join(dir, filepath.Base(p))
			webhooktest.WriteSecrets(t, f, secret)
			return f
		})
		config := filepath.Join(dir, "routes.yaml")
		writeFile(t, config, block)
		if _, err := loadProxyConfig(config, sidecar.DefaultSettings()); err != nil {
			t.Errorf("docs/webhooks.md, yaml block %d: %v\n%s", i+1, err, block)
			continue
		}
		if preset == "" {
			continue
		}
		seen[preset] = true
		path := matchOf.FindStringSubmatch(block)[1]
		t.Run(preset, func(t *testing.T) {
			t.Parallel()
			up := newTestUpstream(t)
			p := startProxy(t, nil, "--upstream", up.URL, "--config", config)
			d := webhooktest.Delivery{Preset: preset, URL: p.url(path), Secrets: []string{secret},
				Body: `{"id":"evt_doc_1","type":"doc.test","data":{"n":1}}`, ID: "doc-" + preset + "-1"}
			first := webhooktest.Send(t, d)
			if first.Status != http.StatusCreated || first.Replayed() {
				t.Fatalf("%s delivery: got %d (replayed %v) %s; want 201, executed", preset, first.Status, first.Replayed(), first.Body)
			}
			if again := webhooktest.Send(t, d); again.Status != http.StatusCreated || !again.Replayed() || again.Body != first.Body {
				t.Errorf("%s redelivery: got %d replayed %v; want the first answer replayed", preset, again.Status, again.Replayed())
			}
			altered := d
			altered.ID, altered.SentBody = "doc-"+preset+"-2", strings.Replace(d.Body, `"n":1`, `"n":2`, 1)
			if err := webhooktest.CheckUnverified(webhooktest.Send(t, altered)); err != nil {
				t.Errorf("%s delivery with a body altered after signing: %v", preset, err)
			}
			if put := mustSend(t, "PUT", p.url(path), "", d.Body); put.status != http.StatusMethodNotAllowed {
				t.Errorf("%s: an unsigned PUT on the route got %d; want 405, not forwarded", preset, put.status)
			}
			if n := up.runsOf(""); n != 1 {
				t.Errorf("%s: the upstream ran %d times; want once", preset, n)
			}
			if got := p.metric(fmt.Sprintf(`idem_webhook_unverified_total{preset=%q}`, preset)); got != 1 {
				t.Errorf("%s: idem_webhook_unverified_total %v; want 1", preset, got)
			}
		})
	}
	for _, preset := range webhooktest.Presets {
		if !seen[preset] {
			t.Errorf("docs/webhooks.md has no yaml route with webhook: %s", preset)
		}
	}
}
