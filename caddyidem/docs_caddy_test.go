package caddyidem

import (
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"reflect"
	"regexp"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig"

	"github.com/idemkit/idem/internal/nettest"
)

// mdBlock is a fenced code block of a markdown file: its language (the
// word after ```), the section (## heading) it is in, and its text.
type mdBlock struct {
	lang, section, text string
}

// mdBlocks returns the fenced code blocks of the markdown file at path,
// in order.
func mdBlocks(t *testing.T, path string) []mdBlock {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var blocks []mdBlock
	var cur *mdBlock
	section := ""
	for line := range strings.SplitSeq(string(b), "\n") {
		switch {
		case cur == nil && strings.HasPrefix(line, "## "):
			section = strings.TrimPrefix(line, "## ")
		case cur == nil && strings.HasPrefix(line, "```"):
			cur = &mdBlock{lang: strings.TrimPrefix(line, "```"), section: section}
		case cur != nil && line == "```":
			blocks = append(blocks, *cur)
			cur = nil
		case cur != nil:
			cur.text += line + "\n"
		}
	}
	if cur != nil {
		t.Fatalf("%s: the %s block of section %q does not end", path, cur.lang, cur.section)
	}
	return blocks
}

// The addresses the docs' whole Caddyfiles name, which a test replaces by
// its own: the site (":8080", "http://:8080"), the app, the gRPC app and
// the Redis.
var docSite = regexp.MustCompile(`(?m)^(http://)?:8080 \{$`)

const (
	docApp      = "127.0.0.1:9000"
	docGRPCApp  = "127.0.0.1:50051"
	docRedisURL = "redis://127.0.0.1:6379"
)

// loadDocCaddyfile runs a whole Caddyfile of the docs, as written but for
// its addresses: the site's port becomes a free one, listened on loopback
// only, and each old of replace (every one must be in the file) its new.
// The config is loaded into this process's Caddy with the test's admin,
// storage and log settings (admin off, the run's directory, WARN), the
// only other changes to it. It returns the site's base URL.
func loadDocCaddyfile(t *testing.T, cf string, replace ...string) string {
	t.Helper()
	port, err := nettest.FreePort()
	if err != nil {
		t.Fatal(err)
	}
	if n := len(docSite.FindAllString(cf, -1)); n != 1 {
		t.Fatalf("the Caddyfile has %d site blocks on :8080, want 1 (the address the test replaces):\n%s", n, cf)
	}
	cf = docSite.ReplaceAllString(cf, fmt.Sprintf("${1}:%d {", port))
	for i := 0; i+1 < len(replace); i += 2 {
		if !strings.Contains(cf, replace[i]) {
			t.Fatalf("the Caddyfile does not name %s, which the test replaces with its own:\n%s", replace[i], cf)
		}
		cf = strings.ReplaceAll(cf, replace[i], replace[i+1])
	}
	out, warnings, err := caddyconfig.GetAdapter("caddyfile").Adapt([]byte(cf), nil)
	if err != nil {
		t.Fatalf("adapting the Caddyfile: %v\n%s", err, cf)
	}
	for _, w := range warnings {
		t.Errorf("Caddyfile warning: %s (the docs' files adapt without one)", w.String())
	}
	var cfg map[string]any
	if err := json.Unmarshal(out, &cfg); err != nil {
		t.Fatal(err)
	}
	if _, ok := cfg["admin"]; ok {
		t.Fatalf("the Caddyfile sets admin, which the test would replace:\n%s", cf)
	}
	cfg["admin"] = map[string]any{"disabled": true, "config": map[string]any{"persist": false}}
	cfg["storage"] = map[string]any{"module": "file_system", "root": storageDir}
	cfg["logging"] = map[string]any{"logs": map[string]any{"default": map[string]any{"level": "WARN"}}}
	// The site listens on every interface, as the file says (:8080); the
	// test's on loopback only.
	servers, _ := cfg["apps"].(map[string]any)["http"].(map[string]any)["servers"].(map[string]any)
	for name, srv := range servers {
		srv := srv.(map[string]any)
		if l := fmt.Sprint(srv["listen"]); l != fmt.Sprintf("[:%d]", port) {
			t.Fatalf("server %s listens on %s, want the site's port alone, [:%d]", name, l, port)
		}
		srv["listen"] = []string{fmt.Sprintf("127.0.0.1:%d", port)}
	}
	if len(servers) != 1 {
		t.Fatalf("the Caddyfile makes %d servers, want 1", len(servers))
	}
	final, err := json.Marshal(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := caddy.Load(final, true); err != nil {
		t.Fatalf("loading the config: %v\n%s", err, final)
	}
	t.Cleanup(func() { caddy.Stop() })
	return fmt.Sprintf("http://127.0.0.1:%d", port)
}

// docCaddyfiles returns the caddyfile blocks of docs/caddy.md by the test
// that runs them: those of "Quick start" (TestDocsQuickStarts) and of
// "gRPC" (TestGRPC). A block elsewhere, or a Caddyfile in a block without
// the caddyfile tag, fails the test: no untested file hides in the guide.
func docCaddyfiles(t *testing.T) (quick []string, grpc string) {
	t.Helper()
	for i, b := range mdBlocks(t, "../docs/caddy.md") {
		switch {
		case b.lang == "caddyfile" && b.section == "Quick start":
			quick = append(quick, b.text)
		case b.lang == "caddyfile" && b.section == "gRPC" && grpc == "":
			grpc = b.text
		case b.lang == "caddyfile":
			t.Errorf("docs/caddy.md, block %d (section %q): a Caddyfile that no test runs", i+1, b.section)
		case b.lang != "json" && strings.Contains(b.text, "idempotency"):
			t.Errorf("docs/caddy.md, block %d (section %q, ```%s): holds the idempotency directive but is not a ```caddyfile block that a test runs:\n%s",
				i+1, b.section, b.lang, b.text)
		}
	}
	if len(quick) < 2 || grpc == "" {
		t.Fatalf("docs/caddy.md: %d Quick start Caddyfiles and gRPC's %t; want the site-block and route forms, and gRPC's", len(quick), grpc != "")
	}
	return quick, grpc
}

// TestDocsQuickStarts runs docs/caddy.md's Quick start Caddyfiles as
// written (the addresses the test's) through a real Caddy to a counting
// upstream, on a private Redis: a keyed POST to /payments and one to
// /payments/x each run once and are replayed byte for byte (the matcher
// covers /payments itself); a POST elsewhere reaches the upstream (the
// site has a handler for the rest, not Caddy's empty 200); a POST to
// /payments without a key passes through, or is refused 400 where the
// file says require_key. The first is the quick start of caddyidem's
// README.md and package doc too, word for word.
func TestDocsQuickStarts(t *testing.T) {
	quick, _ := docCaddyfiles(t)
	readme, err := os.ReadFile("README.md")
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(readme), "\n```caddyfile\n"+quick[0]+"```\n") {
		t.Errorf("caddyidem/README.md does not show docs/caddy.md's quick start as a caddyfile block:\n%s", quick[0])
	}
	doc, err := os.ReadFile("doc.go")
	if err != nil {
		t.Fatal(err)
	}
	if asComment := "//\t" + strings.ReplaceAll(strings.TrimSuffix(quick[0], "\n"), "\n", "\n//\t") + "\n"; !strings.Contains(string(doc), asComment) {
		t.Errorf("caddyidem/doc.go does not show docs/caddy.md's quick start:\n%s", asComment)
	}
	for n, cf := range quick {
		t.Run(fmt.Sprint(n+1), func(t *testing.T) {
			up := startCounter(t, 0)
			base := loadDocCaddyfile(t, cf, docApp, strings.TrimPrefix(up.srv.URL, "http://"), docRedisURL, "redis://"+rdb.Addr())
			for _, path := range []string{"/payments", "/payments/x"} {
				key := fmt.Sprintf("quick-start-%d%s-%s", n+1, path, runID)
				first := post(t, base+path, key, `{"amount":4200}`)
				again := post(t, base+path, key, `{"amount":4200}`)
				if first.status != http.StatusCreated || first.replayed != "" {
					t.Errorf("POST %s: got %d (replayed %q) %q, want the upstream's 201", path, first.status, first.replayed, first.body)
				}
				if again.status != first.status || again.replayed != "true" || again.body != first.body {
					t.Errorf("POST %s again: got %d (replayed %q) %q, want the replay of %q", path, again.status, again.replayed, again.body, first.body)
				}
				if runs := up.count(key); runs != 1 {
					t.Errorf("POST %s twice with key %s: the upstream ran it %d times, want 1", path, key, runs)
				}
			}
			other := "quick-start-orders-" + fmt.Sprint(n+1) + "-" + runID
			a, b := post(t, base+"/orders", other, `{}`), post(t, base+"/orders", other, `{}`)
			if a.status != http.StatusCreated || b.status != http.StatusCreated || b.replayed != "" || up.count(other) != 2 {
				t.Errorf("POST /orders twice: got %d and %d (replayed %q), %d executions; want the upstream's 201 twice, not keyed",
					a.status, b.status, b.replayed, up.count(other))
			}
			unkeyed := post(t, base+"/payments", "", `{"amount":1}`)
			if strings.Contains(cf, "require_key") {
				if unkeyed.status != http.StatusBadRequest || up.count("") != 0 {
					t.Errorf("POST /payments without a key (require_key): got %d, %d executions; want 400 and none", unkeyed.status, up.count(""))
				}
			} else if unkeyed.status != http.StatusCreated || up.count("") != 1 {
				t.Errorf("POST /payments without a key: got %d, %d executions; want the upstream's 201 (passed through)", unkeyed.status, up.count(""))
			}
		})
	}
}

// TestDocsJSONForm: docs/caddy.md's JSON form of the handler is a
// handler of this module with only known fields, valid, and the options
// of the route-form quick start.
func TestDocsJSONForm(t *testing.T) {
	var blocks []string
	for _, b := range mdBlocks(t, "../docs/caddy.md") {
		if b.lang == "json" {
			blocks = append(blocks, b.text)
		}
	}
	if len(blocks) != 1 {
		t.Fatalf("docs/caddy.md has %d json blocks, want 1 (the handler's JSON form)", len(blocks))
	}
	var fields map[string]json.RawMessage
	if err := json.Unmarshal([]byte(blocks[0]), &fields); err != nil {
		t.Fatalf("the JSON form %s: %v", blocks[0], err)
	}
	if string(fields["handler"]) != `"idempotency"` {
		t.Errorf("the JSON form's handler is %s, want \"idempotency\"", fields["handler"])
	}
	delete(fields, "handler")
	rest, _ := json.Marshal(fields)
	dec := json.NewDecoder(strings.NewReader(string(rest)))
	dec.DisallowUnknownFields()
	var h Handler
	if err := dec.Decode(&h); err != nil {
		t.Fatalf("the JSON form %s: %v", blocks[0], err)
	}
	if err := h.Validate(); err != nil {
		t.Errorf("the JSON form %s: Validate: %v", blocks[0], err)
	}
	quick, _ := docCaddyfiles(t)
	_, raw := handlersOf(t, adapt(t, quick[1]))
	var fromCaddyfile Handler
	if err := json.Unmarshal(raw, &fromCaddyfile); err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(h, fromCaddyfile) {
		t.Errorf("the JSON form is %s, the route-form quick start's handler %s; want the same options", blocks[0], raw)
	}
}
