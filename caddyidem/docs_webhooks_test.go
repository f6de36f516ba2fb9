package caddyidem

import (
	"encoding/json"
	"os"
	"slices"
	"strings"
	"testing"
)

// TestWebhookDocCaddyfiles keeps docs/webhooks.md's Caddyfile blocks true:
// each adapts, puts the idempotency handler before reverse_proxy, sets a
// webhook preset with a secret file, and passes the handler's Validate;
// between them they cover every preset. (TestWebhooks runs deliveries
// through a Caddy; this test checks what the guide shows.)
func TestWebhookDocCaddyfiles(t *testing.T) {
	md, err := os.ReadFile("../docs/webhooks.md")
	if err != nil {
		t.Fatal(err)
	}
	seen := map[string]bool{}
	rest := string(md)
	for n := 1; ; n++ {
		_, after, ok := strings.Cut(rest, "\n```caddyfile\n")
		if !ok {
			break
		}
		block, tail, ok := strings.Cut(after, "\n```\n")
		if !ok {
			t.Fatalf("docs/webhooks.md: caddyfile block %d does not end", n)
		}
		rest = "\n" + tail
		names, raw := handlersOf(t, adapt(t, block+"\n"))
		if i := slices.Index(names, "idempotency"); i < 0 || !slices.Contains(names[i+1:], "reverse_proxy") {
			t.Errorf("caddyfile block %d: handlers %v; want idempotency before reverse_proxy", n, names)
			continue
		}
		var h Handler
		if err := json.Unmarshal(raw, &h); err != nil {
			t.Fatalf("caddyfile block %d: %v", n, err)
		}
		if err := h.Validate(); err != nil {
			t.Errorf("caddyfile block %d: Validate: %v\n%s", n, err, block)
		}
		if h.Webhook == "" || h.WebhookSecretFile == "" || !h.RequireKey {
			t.Errorf("caddyfile block %d: webhook %q, webhook_secret_file %q, require_key %v; want a preset, its file and require_key, as the guide's routes",
				n, h.Webhook, h.WebhookSecretFile, h.RequireKey)
		}
		seen[h.Webhook] = true
	}
	for _, preset := range []string{"github", "stripe", "shopify", "standard-webhooks"} {
		if !seen[preset] {
			t.Errorf("docs/webhooks.md has no caddyfile block with webhook %s", preset)
		}
	}
}
