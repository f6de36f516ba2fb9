// Package webhooktest sends webhook deliveries signed by each sender's own
// library, for the end-to-end tests of idem proxy (cmd/idem) and of Caddy
// with idem's handler (caddyidem): GitHub's with @octokit/webhooks-methods,
// Stripe's with stripe, Standard Webhooks' with standardwebhooks (Node,
// testdata/send.mjs), and Shopify's with its documented recipe in Python's
// standard library (testdata/shopify_send.py), never with idem's own code.
// The scripts are embedded, so that both modules run the same ones.
//
// The Node libraries are those scripts/test.sh installs into
// $(go env GOPATH)/idem-webhooks; a missing library, node or python3
// fails the test (never skips it). It is test support: only _test.go files
// import it (it imports testing).
package webhooktest

import (
	"bytes"
	"context"
	"crypto/rand"
	_ "embed"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"go/build"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/internal/childproc"
	"github.com/idemkit/idem/internal/proctest"
)

var (
	//go:embed testdata/send.mjs
	sendMJS []byte
	//go:embed testdata/shopify_send.py
	shopifySend []byte
)

// Presets are the presets Send signs for, in the order the tests run them.
var Presets = []string{"github", "stripe", "shopify", "standard-webhooks"}

// libraries are the npm packages send.mjs imports (scripts/test.sh
// installs them; the versions are internal/webhook/testdata/regen.sh's).
var libraries = []string{"stripe", "@octokit/webhooks-methods", "standardwebhooks"}

// Delivery is one webhook delivery, signed by Send.
type Delivery struct {
	Preset string // github, stripe, shopify or standard-webhooks
	URL    string
	// Secrets sign the delivery, one signature each: several are what a
	// Stripe or Standard Webhooks sender puts in one header while it rolls
	// its secret; github and shopify take exactly one.
	Secrets []string
	Body    string // the signed body (stripe's key is its "id")
	// ID is the delivery id header's value: X-GitHub-Delivery,
	// X-Shopify-Webhook-Id or webhook-id (signed by standard-webhooks).
	// Unused by stripe, whose id is in the body.
	ID string
	// Timestamp is the time signed (stripe, standard-webhooks); zero: now.
	Timestamp time.Time
	// SentBody, when not "", is sent instead of Body: a body altered after
	// signing.
	SentBody string
	// Header holds more request headers ("Name": "value").
	Header map[string]string
}

// Answer is the receiver's response as the sender got it.
type Answer struct {
	Status int
	Header http.Header
	Body   string
}

// Replayed reports whether the answer carries Idempotent-Replayed: true.
func (a Answer) Replayed() bool { return a.Header.Get(idemhttp.HeaderReplayed) == "true" }

// Send signs d with its preset's library and sends it (POST). A failure to
// sign or send fails the test; its message never holds a secret.
func Send(t testing.TB, d Delivery) Answer {
	t.Helper()
	a, err := send(t, d)
	if err != nil {
		t.Fatal(err)
	}
	return a
}

// send is Send, returning its failure.
func send(t testing.TB, d Delivery) (Answer, error) {
	t.Helper()
	spec := map[string]any{"preset": d.Preset, "url": d.URL, "body": d.Body, "secrets": d.Secrets, "id": d.ID, "headers": d.Header}
	if !d.Timestamp.IsZero() {
		spec["timestamp"] = d.Timestamp.Unix()
	}
	if d.SentBody != "" {
		spec["sent_body"] = d.SentBody
	}
	in, err := json.Marshal(spec)
	if err != nil {
		return Answer{}, err
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var cmd *exec.Cmd
	if d.Preset == "shopify" {
		cmd = exec.CommandContext(ctx, proctest.RequireTool(t, "python3"), script(t, "shopify_send.py", shopifySend, false))
	} else {
		cmd = exec.CommandContext(ctx, proctest.RequireTool(t, "node"), script(t, "send.mjs", sendMJS, true))
	}
	cmd.SysProcAttr = childproc.SysProcAttr()
	cmd.Stdin = bytes.NewReader(in)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return Answer{}, fmt.Errorf("sending a %s delivery to %s: %v: %s", d.Preset, d.URL, err, strings.TrimSpace(stderr.String()))
	}
	var got struct {
		Status  int
		Headers map[string]string
		Body    string
	}
	if err := json.Unmarshal(out, &got); err != nil {
		return Answer{}, fmt.Errorf("sending a %s delivery: the sender printed %q, want its JSON answer: %v", d.Preset, out, err)
	}
	a := Answer{Status: got.Status, Header: http.Header{}, Body: got.Body}
	for k, v := range got.Headers {
		a.Header.Set(k, v)
	}
	return a, nil
}

// script writes the script body as name into a directory of the test's
// and returns its path; with modules, the directory's node_modules is the
// installed libraries' (an ES module resolves its imports from its own
// directory up, not from NODE_PATH).
func script(t testing.TB, name string, body []byte, modules bool) string {
	t.Helper()
	dir := t.TempDir()
	if modules {
		if err := os.Symlink(nodeModules(t), filepath.Join(dir, "node_modules")); err != nil {
			t.Fatal(err)
		}
	}
	path := filepath.Join(dir, name)
	if err := os.WriteFile(path, body, 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}

// nodeModules is the node_modules directory in $(go env GOPATH)/idem-webhooks
// that holds every library, or it fails the test.
func nodeModules(t testing.TB) string {
	t.Helper()
	for _, p := range filepath.SplitList(build.Default.GOPATH) {
		dir := filepath.Join(p, "idem-webhooks", "node_modules")
		ok := true
		for _, lib := range libraries {
			if _, err := os.Stat(filepath.Join(dir, lib, "package.json")); err != nil {
				ok = false
			}
		}
		if ok {
			return dir
		}
	}
	t.Fatalf("the webhook signing libraries (%s) are not installed in $(go env GOPATH)/idem-webhooks (scripts/test.sh installs them)", strings.Join(libraries, ", "))
	return ""
}

// NewSecret returns a fresh random signing secret in the form preset's
// senders issue: whsec_ and base64 for standard-webhooks (the Standard
// Webhooks libraries decode it), whsec_ and text for stripe, text for
// github and shopify.
func NewSecret(preset string) string {
	switch preset {
	case "standard-webhooks":
		b := make([]byte, 24)
		rand.Read(b)
		return "whsec_" + base64.StdEncoding.EncodeToString(b)
	case "stripe":
		return "whsec_" + rand.Text()
	}
	return rand.Text()
}

// WriteSecrets writes secrets into the file at path, one a line, as an
// operator writes a webhook secret file (mode 0600).
func WriteSecrets(t testing.TB, path string, secrets ...string) {
	t.Helper()
	if err := os.WriteFile(path, []byte(strings.Join(secrets, "\n")+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
}

// CheckUnverified returns nil when a is the answer to a delivery refused
// for its signature: 401 application/problem+json of type
// idemhttp.ProblemUnverified; else an error in one line that says what a was.
func CheckUnverified(a Answer) error {
	var p struct{ Type string }
	switch {
	case a.Status != http.StatusUnauthorized:
		return fmt.Errorf("got status %d, want 401; body %s", a.Status, a.Body)
	case a.Header.Get("Content-Type") != "application/problem+json":
		return fmt.Errorf("got Content-Type %q, want application/problem+json; body %s", a.Header.Get("Content-Type"), a.Body)
	case json.Unmarshal([]byte(a.Body), &p) != nil || p.Type != idemhttp.ProblemUnverified:
		return fmt.Errorf("got problem %s, want type %s", a.Body, idemhttp.ProblemUnverified)
	}
	return nil
}

// Leaked names the secrets (by their position in secrets, never their
// value) that text holds, whole or, for a whsec_ secret, the part after
// the prefix; "" when none.
func Leaked(text string, secrets ...string) string {
	var found []string
	for i, s := range secrets {
		if strings.Contains(text, s) || strings.Contains(text, strings.TrimPrefix(s, "whsec_")) {
			found = append(found, fmt.Sprintf("secret %d", i+1))
		}
	}
	return strings.Join(found, ", ")
}
