package main

// The operator's suite: the built idem binary driven as an operator drives
// it, through its command line, environment, exit status and output. The
// binary is proctest.BuildIdem's (built once per test binary, without
// -race, removed in TestMain).
//
// opRunLine and opStartLine run a command line written as in the README
// (backslash-newlines, quotes), with the README's ports replaced by live
// ones, for tests that check the README's commands literally.

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/tls"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem/internal/childproc"
	"github.com/idemkit/idem/internal/mysqltest"
	"github.com/idemkit/idem/internal/nettest"
	"github.com/idemkit/idem/internal/pgtest"
	"github.com/idemkit/idem/internal/proctest"
	"github.com/idemkit/idem/internal/tlstest"
)

// opResult is how a finished idem command ended.
type opResult struct {
	code           int
	stdout, stderr string
}

func (r opResult) String() string {
	return fmt.Sprintf("exit %d, stdout %q, stderr %q", r.code, r.stdout, r.stderr)
}

// opBin returns the built idem binary.
func opBin(t *testing.T) string {
	t.Helper()
	bin, err := proctest.BuildIdem()
	if err != nil {
		t.Fatal(err)
	}
	return bin
}

// opRun runs the idem binary with args to its end (at most 20s), with
// the environment stripped of IDEM_* variables plus env.
func opRun(t *testing.T, env []string, args ...string) opResult {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, opBin(t), args...)
	cmd.Env = proxyEnv(env)
	cmd.SysProcAttr = childproc.SysProcAttr()
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	err := cmd.Run()
	if ctx.Err() != nil {
		t.Fatalf("idem %q: still running after 20s\nstderr: %s", args, errb.String())
	}
	if _, exited := err.(*exec.ExitError); err != nil && !exited {
		t.Fatalf("idem %q: %v", args, err)
	}
	return opResult{cmd.ProcessState.ExitCode(), out.String(), errb.String()}
}

// opOneLine fails t unless r is a usage error (exit 2) whose stderr is one
// line containing every string of want.
func opOneLine(t *testing.T, what string, r opResult, want ...string) {
	t.Helper()
	msg := strings.TrimSuffix(r.stderr, "\n")
	if r.code != 2 || msg == "" || strings.Contains(msg, "\n") {
		t.Errorf("%s: %v; want exit 2 and one line on stderr", what, r)
		return
	}
	for _, w := range want {
		if !strings.Contains(msg, w) {
			t.Errorf("%s: stderr %q does not say %q", what, msg, w)
		}
	}
}

// opCommands lists the commands `idem -h` names.
func opCommands(t *testing.T) []string {
	r := opRun(t, nil, "-h")
	var names []string
	in := false
	for line := range strings.Lines(r.stdout) {
		switch {
		case strings.HasPrefix(line, "commands:"):
			in = true
		case in && strings.HasPrefix(line, "  "):
			names = append(names, strings.Fields(line)[0])
		case in:
			in = false
		}
	}
	if r.code != 0 || len(names) < 5 {
		t.Fatalf("idem -h: %v; want the commands", r)
	}
	return names
}

// opFlag is a flag as `idem COMMAND -h` lists it: its name and the word
// after it (flag's type name or the usage's `name`; "" for a bool).
type opFlag struct{ name, typ string }

var opFlagLine = regexp.MustCompile(`^  -([a-z0-9-]+)(?: (\S+))?$`)

func opFlags(t *testing.T, cmd string) []opFlag {
	r := opRun(t, nil, cmd, "-h")
	var flags []opFlag
	for line := range strings.Lines(r.stderr) {
		if m := opFlagLine.FindStringSubmatch(strings.TrimSuffix(line, "\n")); m != nil {
			flags = append(flags, opFlag{m[1], m[2]})
		}
	}
	if r.code != 0 || len(flags) == 0 || !strings.Contains(r.stderr, "usage: idem "+cmd) {
		t.Fatalf("idem %s -h: %v; want exit 0 and the usage with the flags", cmd, r)
	}
	return flags
}

// opBad is a bad value of one flag and what the error must say.
type opBad struct{ value, want string }

// opBadByType are the bad values of the flag types, by the word -h shows.
var opBadByType = map[string]opBad{
	"":         {"yes", "want true or false"},
	"duration": {"30", "want a duration with a unit, such as 30s or 1m"},
	"int":      {"x", "want a whole number"},
	"float":    {"x", "want a number"},
}

// opBadByName are the bad values of the flags whose type does not say
// ("command flag"): strings are checked by the command.
var opBadByName = map[string]opBad{
	"proxy listen":              {"nohost", "want host:port"},
	"proxy admin-listen":        {"nohost", "want host:port"},
	"proxy upstream":            {"127.0.0.1:19000", "want a URL: http://127.0.0.1:19000"},
	"proxy store":               {"ftp://x", `unknown scheme "ftp"`},
	"proxy prefix":              {"a{b", "must not contain '{'"},
	"proxy methods":             {"GET,P OST", "not an HTTP method"},
	"proxy tenant-header":       {"X Tenant", "not a header name"},
	"proxy blob":                {"ftp://x", `unknown scheme "ftp"`},
	"proxy log-format":          {"xml", "want json or text"},
	"proxy log-level":           {"loud", "want debug, info, warn or error"},
	"proxy config":              {"/nonexistent/idem.yaml", "no such file"},
	"proxy max-body":            {"lots", "want a size: a number of bytes"},
	"proxy max-response":        {"lots", "want a size: a number of bytes"},
	"proxy memory-limit":        {"lots", "want a size: a number of bytes"},
	"proxy tenant-cookie":       {"a b", "not a cookie name"},
	"proxy quota-in-flight":     {"-1", "want a whole number, 0 or more (0: no limit)"},
	"proxy quota-records":       {"x", "want a whole number, 0 or more (0: no limit)"},
	"proxy quota-bytes":         {"lots", "want a size: a number of bytes"},
	"proxy v1-scopes":           {"0", "want a positive duration, such as 24h, or off"},
	"proxy tls-cert":            {"/nonexistent/tls.crt", "want both (a PEM certificate and its key) or neither"},
	"proxy tls-key":             {"/nonexistent/tls.key", "want both (a PEM certificate and its key) or neither"},
	"proxy tls-client-ca":       {"/nonexistent/ca.pem", "needs --tls-cert and --tls-key"},
	"proxy upstream-ca":         {"/nonexistent/ca.pem", "need an https:// upstream"},
	"proxy upstream-cert":       {"/nonexistent/c.crt", "want both (a PEM certificate and its key) or neither"},
	"proxy upstream-key":        {"/nonexistent/c.key", "want both (a PEM certificate and its key) or neither"},
	"proxy key-header":          {"X Id", "not a header name"},
	"proxy webhook":             {"gitlab", "want one of github, shopify, standard-webhooks, stripe"},
	"proxy webhook-secret-file": {"/nonexistent/secrets", "needs --webhook (one of github,"},
	"proxy webhook-secret-env":  {"GH_SECRETS", "needs --webhook (one of github,"},
	"proxy fingerprint":         {"bytes", "want raw (the body's bytes) or json"},
	"proxy fingerprint-exclude": {"ts", `"ts" is not a JSON Pointer`},
	"proxy fingerprint-fields":  {"/amount,id", `"id" is not a JSON Pointer`},
	"proxy profile":             {"paypal", "want one of ietf, acp, stripe"},
	"demo store":                {"ftp://x", `unknown scheme "ftp"`},
	"demo blob":                 {"ftp://x", `unknown scheme "ftp"`},
	"inspect store":             {"ftp://x", `unknown scheme "ftp"`},
	"inspect prefix":            {"a{b", "must not contain '{'"},
	"inspect blob":              {"ftp://x", `unknown scheme "ftp"`},
	"inspect key":               {"k\x01", "invalid idempotency key"},
	"inspect stored-key":        {"short", "stored key"},
	"purge store":               {"ftp://x", `unknown scheme "ftp"`},
	"purge prefix":              {"a{b", "must not contain '{'"},
	"purge blob":                {"ftp://x", `unknown scheme "ftp"`},
	"purge key":                 {"k\x01", "invalid idempotency key"},
	"purge stored-key":          {"short", "stored key"},
	"gc store":                  {"ftp://x", `unknown scheme "ftp"`},
	"gc prefix":                 {"a{b", "must not contain '{'"},
	"gc blob":                   {"ftp://x", `unknown scheme "ftp"`},
	"bench redis":               {"ftp://x", "want redis://"},
	"bench impls":               {"bogus", "unknown implementation"},
	"bench scenarios":           {"z", "unknown scenario"},
	"bench rate":                {"x", "want a number"},
	"bench physical-limit":      {"x", "want a number"},
	"bench instances":           {"x", "want a whole number"},
	"bench rounds":              {"x", "want a whole number"},

	// The replay header lists.
	"proxy replay-headers-allow": {"Location,set-cookie", "Set-Cookie is never stored"},
	"proxy replay-headers-deny":  {"X-Debug,X Trace", `"X Trace" is not a header name`},

	// Sealing (the ring's other mistakes: TestOperatorSealKeyMistakes).
	"proxy seal-keys":   {"/nonexistent/ring", "/nonexistent/ring: no such file"},
	"proxy seal-kms":    {"my-key", "want the ARN of a KMS key"},
	"inspect seal-keys": {"/nonexistent/ring", "/nonexistent/ring: no such file"},
}

// opNoBadValue are the flags without a bad value, and why.
var opNoBadValue = map[string]string{
	"inspect tenant":   "any string is a tenant",
	"inspect method":   "any string is a method (idem keys are not only HTTP's)",
	"inspect route":    "any string is a route",
	"purge tenant":     "any string is a tenant",
	"purge method":     "any string is a method (idem keys are not only HTTP's)",
	"purge route":      "any string is a route",
	"bench json":       "a file path, written after the benchmark ran",
	"bench svg":        "a file path, written after the benchmark ran",
	"bench cpuprofile": "a file path, created when the benchmark starts",
}

// opBaseArgs are the arguments that make cmd run up to checking flag
// (and no further: the store at 127.0.0.1:1 refuses connections).
func opBaseArgs(t *testing.T, cmd, flag string) []string {
	stored := []string{"--stored-key", "AAAAAAAAAAAAAAAAAAAAAA"}
	if flag == "key" || flag == "stored-key" {
		stored = []string{"--key", "k", "--route", "/x"}
		if flag == "stored-key" {
			stored = nil
		}
	}
	var args []string
	switch cmd {
	case "proxy":
		args = []string{"--upstream", "http://127.0.0.1:1", "--listen", "127.0.0.1:0"}
	case "inspect":
		args = append([]string{"--store", "redis://127.0.0.1:1"}, stored...)
	case "purge":
		args = append([]string{"--store", "redis://127.0.0.1:1", "--yes"}, stored...)
	case "gc":
		args = []string{"--store", "redis://127.0.0.1:1", "--blob", "file://" + t.TempDir()}
	case "demo":
		args = []string{"--payments", "1", "--copies", "1"}
	case "bench":
		args = []string{"--quick", "--redis", "redis://127.0.0.1:1"}
	}
	// The flag under test is given once: by the test, not the base.
	for i := 0; i < len(args); i++ {
		if args[i] == "--"+flag {
			n := 1 // a bool: no value follows
			if i+1 < len(args) && !strings.HasPrefix(args[i+1], "--") {
				n = 2
			}
			args = slices.Delete(args, i, i+n)
			i--
		}
	}
	return args
}

// Every flag of every command, on the command line and as IDEM_<FLAG>,
// with a bad value: exit 2 and one line naming the flag (or variable) and
// what it wants. The flags come from each command's -h, so a new flag
// without an entry here fails the test.
func TestOperatorBadFlagValues(t *testing.T) {
	t.Parallel()
	for _, cmd := range opCommands(t) {
		for _, f := range opFlags(t, cmd) {
			id := cmd + " " + f.name
			bad, ok := opBadByName[id]
			if !ok {
				bad, ok = opBadByType[f.typ]
			}
			if why, exempt := opNoBadValue[id]; exempt {
				if ok && opBadByName[id] != (opBad{}) {
					t.Errorf("%s: both a bad value and no bad value (%s)", id, why)
				}
				continue
			}
			if !ok {
				t.Errorf("idem %s --%s (%s): no bad value to try; add one to opBadByName (or a reason to opNoBadValue)", cmd, f.name, f.typ)
				continue
			}
			arg := []string{"--" + f.name, bad.value}
			if f.typ == "" { // a bool takes its value after =
				arg = []string{"--" + f.name + "=" + bad.value}
			}
			t.Run(cmd+"/"+f.name, func(t *testing.T) {
				t.Parallel()
				r := opRun(t, nil, append(append([]string{cmd}, opBaseArgs(t, cmd, f.name)...), arg...)...)
				opOneLine(t, fmt.Sprintf("idem %s %q", cmd, arg), r, "--"+f.name, bad.want)
				if f.name == "yes" { // IDEM_YES is not read: a confirmation is typed
					return
				}
				env := envName(f.name)
				r = opRun(t, []string{env + "=" + bad.value}, append([]string{cmd}, opBaseArgs(t, cmd, f.name)...)...)
				opOneLine(t, fmt.Sprintf("%s=%q idem %s", env, bad.value, cmd), r, env, bad.want)
			})
		}
	}
}

// Mistakes in the command line itself: one line each, no usage text; -h
// still shows the usage.
func TestOperatorCommandLineMistakes(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		args []string
		want []string
	}{
		{[]string{"proxy", "--bogus"}, []string{"unknown flag --bogus", `"idem proxy -h"`}},
		{[]string{"bench", "--bogus"}, []string{"unknown flag --bogus", `"idem bench -h"`}},
		{[]string{"proxy", "--upstream", "http://x", "--lease"}, []string{"--lease needs a value", "30s"}},
		{[]string{"proxy", "--upstream", "http://x", "--require-key", "false"}, []string{`unexpected argument "false"`, "--require-key=true or --require-key=false"}},
		{[]string{"proxy", "--upstream", "http://x", "--lease", "1m", "extra"}, []string{`unexpected argument "extra"`}},
		// The tiered store's two URLs, unquoted: quote them; the password is not shown.
		{[]string{"proxy", "--upstream", "http://127.0.0.1:1", "--store", "redis://127.0.0.1:1", "postgres://u:s3cretpw@127.0.0.1:1/db"},
			[]string{"quote them", "postgres://u:xxxxx@127.0.0.1:1/db"}},
		{[]string{"inspect", "--stored-key", "AAAAAAAAAAAAAAAAAAAAAA", "--store", "postgres://u:s3cretpw@127.0.0.1:1/db", "redis://127.0.0.1:1"},
			[]string{"quote them", "redis://127.0.0.1:1"}},
	} {
		r := opRun(t, nil, c.args...)
		opOneLine(t, fmt.Sprintf("idem %q", c.args), r, c.want...)
		if strings.Contains(r.stderr, "s3cretpw") {
			t.Errorf("idem %q: stderr %q shows the password", c.args, r.stderr)
		}
	}
}

// The --config file: a syntax error names the line where it is, a route
// that sets require_key (or another setting) but covers no method is
// refused, and so is a file without routes.
func TestOperatorConfigMistakes(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	for _, c := range []struct {
		name, text string
		args       []string
		want       []string
	}{
		{"indent.yaml", "routes:\n  - match: \"/a\"\n    lease: 30\n  - match: \"/b\"\n     wait: 1s\n", nil, []string{"line 5:", "did not find expected key"}},
		{"no-methods.yaml", "routes:\n  - match: /pay/{id}\n    methods: []\n    require_key: true\n", nil,
			[]string{`routes[0] (match "/pay/{id}")`, "require_key but no methods", "add methods"}},
		{"flag-methods.yaml", "routes:\n  - match: /pay/{id}\n    require_key: true\n", []string{"--methods", ""},
			[]string{`routes[0] (match "/pay/{id}")`, "require_key but no methods"}},
		{"cookie-no-methods.yaml", "routes:\n  - match: /pay/{id}\n    methods: []\n    tenant_cookie: session\n", nil,
			[]string{`routes[0] (match "/pay/{id}")`, "tenant_cookie but no methods"}},
		{"pattern-method.yaml", "routes:\n  - match: \"PUT /x\"\n    require_key: true\n", nil,
			[]string{`routes[0] (match "PUT /x")`, "the pattern's method PUT is not among the covered methods POST,PATCH", "add methods: [PUT]"}},
		{"empty.yaml", "", nil, []string{"empty.yaml: empty"}},
		{"comments.yaml", "# routes come later\n", nil, []string{"comments.yaml: empty"}},
		{"no-routes.yaml", "routes: []\n", nil, []string{"no-routes.yaml: no routes"}},
		{"methods-scalar.yaml", "routes:\n  - match: /a\n    methods: POST\n", nil, []string{"line 3:", "POST is not a list"}},
		{"key.yaml", "routes:\n  - match: /a\n    key: X-Id\n", nil, []string{`routes[0] (match "/a")`, `key "X-Id": want header:NAME or json:/pointer`}},
		{"webhook.yaml", "routes:\n  - match: /a\n    webhook: gitlab\n", nil, []string{`routes[0] (match "/a")`, `webhook: webhook preset "gitlab": want one of`}},
		{"webhook-key.yaml", "routes:\n  - match: /a\n    key: header:X-Id\n    webhook: github\n    webhook_secret_env: GH\n", nil,
			[]string{`key "header:X-Id" and webhook github: the preset names its key; drop key`}},
		{"webhook-secrets.yaml", "routes:\n  - match: /a\n    webhook: github\n", nil,
			[]string{"webhook github: set one of webhook_secret_file and webhook_secret_env"}},
		{"tolerance.yaml", "routes:\n  - match: /a\n    webhook: stripe\n    webhook_secret_env: S\n    webhook_tolerance: 1ms\n", nil,
			[]string{`routes[0] (match "/a")`, "webhook_tolerance 1ms: want at least 1s"}},
		{"fingerprint.yaml", "routes:\n  - match: /a\n    fingerprint: bytes\n", nil, []string{`fingerprint "bytes": want raw`}},
		{"fingerprint-lists.yaml", "routes:\n  - match: /a\n    fingerprint_fields: [/id]\n    fingerprint_exclude: [/ts]\n", nil,
			[]string{"fingerprint_exclude and fingerprint_fields: set one, not both"}},
		{"fingerprint-pointer.yaml", "routes:\n  - match: /a\n    fingerprint_exclude: [ts]\n", nil, []string{`fingerprint_exclude: "ts" is not a JSON Pointer`}},
		{"profile.yaml", "routes:\n  - match: /a\n    profile: paypal\n", nil, []string{`profile "paypal": want one of ietf, acp, stripe`}},
		{"echo-key.yaml", "routes:\n  - match: /a\n    echo_key: maybe\n", nil, []string{"line 3: echo_key: cannot unmarshal", "into bool"}},
		{"replay-allow.yaml", "routes:\n  - match: /a\n    replay_headers_allow: [Location, Set-Cookie]\n", nil,
			[]string{`routes[0] (match "/a")`, "replay_headers_allow: Set-Cookie is never stored"}},
		{"replay-deny.yaml", "routes:\n  - match: /a\n    replay_headers_deny: X-Token\n", nil, []string{"line 3:", "X-Token is not a list"}},
		{"replay-deny-name.yaml", "routes:\n  - match: /a\n    replay_headers_deny: [\"X Token\"]\n", nil, []string{`replay_headers_deny: "X Token" is not a header name`}},
		{"replay-flag.yaml", "routes:\n  - match: /a\n    require_key: true\n", []string{"--replay-headers-deny", "Content-Encoding"},
			[]string{"--replay-headers-deny: Content-Encoding says how to read the stored body"}},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			path := filepath.Join(dir, c.name)
			writeFile(t, path, c.text)
			r := opRun(t, nil, append([]string{"proxy", "--upstream", "http://127.0.0.1:1", "--listen", "127.0.0.1:0", "--config", path}, c.args...)...)
			opOneLine(t, c.name, r, c.want...)
		})
	}
}

// A webhook's secrets that are not there: a --webhook-secret-file (or a
// route's webhook_secret_file) that does not exist, a --webhook-secret-env
// that is not set. The proxy does not start: exit 2 and one line naming
// the file or the variable.
func TestOperatorWebhookSecretMissing(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	missing := filepath.Join(dir, "gh-secrets") // never written
	routes := filepath.Join(dir, "routes.yaml")
	writeFile(t, routes, "routes:\n  - match: \"POST /hooks/\"\n    webhook: stripe\n    webhook_secret_file: "+missing+"\n")
	base := []string{"proxy", "--upstream", "http://127.0.0.1:1", "--listen", "127.0.0.1:0"}
	for _, c := range []struct {
		env  []string
		args []string
		want []string
	}{
		{nil, []string{"--webhook", "github", "--webhook-secret-file", missing}, []string{missing}},
		{[]string{"IDEM_WEBHOOK=github", "IDEM_WEBHOOK_SECRET_FILE=" + missing}, nil, []string{missing}},
		{nil, []string{"--config", routes}, []string{`"POST /hooks/"`, missing}},
		{nil, []string{"--webhook", "shopify", "--webhook-secret-env", "IDEM_TEST_NO_SUCH_SECRETS"}, []string{"IDEM_TEST_NO_SUCH_SECRETS"}},
	} {
		r := opRun(t, c.env, append(slices.Clone(base), c.args...)...)
		opOneLine(t, fmt.Sprintf("%q idem proxy %q", c.env, c.args), r, c.want...)
	}
}

// A key ring (--seal-keys, IDEM_SEAL_KEYS) that does not load: missing,
// a key of the wrong size, a duplicate id, no key (so no primary), a line
// that is not ID BASE64; and --seal-open-only without keys. The proxy does
// not start: exit 2 and one line naming the flag (or variable) and the
// file, never a key.
func TestOperatorSealKeyMistakes(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	key := func(n int, c byte) string { return base64.StdEncoding.EncodeToString(bytes.Repeat([]byte{c}, n)) }
	ring := func(name, text string) string {
		path := filepath.Join(dir, name)
		if text != "\x00missing" {
			writeFile(t, path, text)
		}
		return path
	}
	base := []string{"proxy", "--upstream", "http://127.0.0.1:1", "--listen", "127.0.0.1:0"}
	missing := ring("missing", "\x00missing")
	short := ring("short", "k1 "+key(16, 'a')+"\n")
	dup := ring("dup", "k1 "+key(32, 'a')+"\nk2 "+key(32, 'b')+"\nk1 "+key(32, 'c')+"\n")
	empty := ring("empty", "# no keys yet\n\n")
	fields := ring("fields", key(32, 'd')+"\n")
	notB64 := ring("not-base64", "k1 "+strings.Repeat("!", 44)+"\n")
	for _, c := range []struct {
		env  []string
		args []string
		want []string
	}{
		{nil, []string{"--seal-keys", missing}, []string{"--seal-keys: open " + missing, "no such file or directory"}},
		{[]string{"IDEM_SEAL_KEYS=" + missing}, nil, []string{"IDEM_SEAL_KEYS: --seal-keys: open " + missing}},
		{nil, []string{"--seal-keys", short}, []string{"--seal-keys: file " + short + " line 1: key k1 has 16 bytes; want 32 (AES-256)"}},
		{nil, []string{"--seal-keys", dup}, []string{"--seal-keys: file " + dup + " line 3: key id k1 is already on line 1"}},
		{nil, []string{"--seal-keys", empty}, []string{"--seal-keys: file " + empty + " holds no key, so no primary"}},
		{[]string{"IDEM_SEAL_KEYS=" + empty}, nil, []string{"IDEM_SEAL_KEYS: --seal-keys: file " + empty + " holds no key"}},
		{nil, []string{"--seal-keys", fields}, []string{"--seal-keys: file " + fields + " line 1: 1 field(s); want ID BASE64"}},
		{nil, []string{"--seal-keys", notB64}, []string{"--seal-keys: file " + notB64 + " line 1: key k1 is not base64"}},
		{nil, []string{"--seal-open-only"}, []string{"--seal-open-only needs --seal-keys or --seal-kms"}},
		{[]string{"IDEM_SEAL_OPEN_ONLY=true"}, nil, []string{"IDEM_SEAL_OPEN_ONLY: --seal-open-only needs --seal-keys"}},
	} {
		r := opRun(t, c.env, append(slices.Clone(base), c.args...)...)
		opOneLine(t, fmt.Sprintf("%q idem proxy %q", c.env, c.args), r, c.want...)
		for _, k := range []string{key(16, 'a'), key(32, 'a'), key(32, 'b'), key(32, 'c'), key(32, 'd')} {
			if strings.Contains(r.stderr, k) {
				t.Errorf("%q idem proxy %q: stderr %q shows a key", c.env, c.args, r.stderr)
			}
		}
	}
}

// A server that is not what the URL's scheme says: Redis and PostgreSQL
// URLs on a port that closes each connection, and PostgreSQL on a port
// that never answers. Each says what it expected, without the password.
func TestOperatorStoreNotThere(t *testing.T) {
	t.Parallel()
	closing := opListen(t, func(c net.Conn) { c.Close() })
	silent := opListen(t, func(c net.Conn) { io.Copy(io.Discard, c) })
	for _, c := range []struct {
		store string
		want  []string
	}{
		{"redis://u:s3cretpw@" + closing, []string{"the server at " + closing + " did not answer as Redis", "rediss://"}},
		{"postgres://u:s3cretpw@" + closing + "/db", []string{"the server at " + closing + " did not answer as PostgreSQL", "it closed the connection"}},
		{"postgres://u:s3cretpw@" + silent + "/db?connect_timeout=1", []string{"the server at " + silent + " did not answer as PostgreSQL", "no answer within the connect timeout"}},
		{"postgres://u:s3cretpw@127.0.0.1:1/db", []string{"nothing listens at 127.0.0.1:1"}},
	} {
		for _, args := range [][]string{
			{"proxy", "--upstream", "http://127.0.0.1:1", "--listen", "127.0.0.1:0", "--store", c.store},
			{"inspect", "--stored-key", "AAAAAAAAAAAAAAAAAAAAAA", "--store", c.store},
		} {
			r := opRun(t, nil, args...)
			msg := strings.TrimSuffix(r.stderr, "\n")
			if r.code != 1 || strings.Contains(msg, "\n") || strings.Contains(msg, "s3cretpw") {
				t.Errorf("idem %s --store %s: %v; want exit 1, one line, no password", args[0], c.store, r)
			}
			for _, w := range c.want {
				if !strings.Contains(msg, w) {
					t.Errorf("idem %s --store %s: stderr %q does not say %q", args[0], c.store, msg, w)
				}
			}
		}
	}
}

// opListen serves each connection to 127.0.0.1:0 with serve until the
// test ends, and returns the address.
func opListen(t *testing.T, serve func(net.Conn)) string {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	var mu sync.Mutex
	var conns []net.Conn
	t.Cleanup(func() {
		ln.Close()
		mu.Lock()
		for _, c := range conns {
			c.Close()
		}
		mu.Unlock()
		wg.Wait()
	})
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			conns = append(conns, c)
			mu.Unlock()
			wg.Add(1)
			go func() { defer wg.Done(); serve(c) }()
		}
	}()
	return ln.Addr().String()
}

// inspect and purge read the proxies' store: --store is required, memory
// refused; a PostgreSQL database without idem's table is said to be so,
// and stays without it (they create nothing).
func TestOperatorReadCommandsCreateNothing(t *testing.T) {
	t.Parallel()
	key := []string{"--key", "k", "--route", "/charges"}
	for _, cmd := range [][]string{{"inspect"}, {"purge", "--yes"}} {
		opOneLine(t, cmd[0]+" without --store", opRun(t, nil, append(cmd, key...)...), "--store is required", "never holds a record")
		opOneLine(t, cmd[0]+" --store memory", opRun(t, nil, append(cmd, append(key, "--store", "memory")...)...), "--store memory: a memory store lives inside one process", "never holds a record", "mysql://")
	}
	opOneLine(t, "gc --store memory", opRun(t, nil, "gc", "--store", "memory", "--blob", "file://"+t.TempDir()), "--store memory: a memory store lives inside one process", "orphan", "mysql://")

	ctx := t.Context()
	dbURL, drop, err := pgtest.CreateDatabase(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { drop() })
	redis := proxyRedis(t)
	for _, store := range []string{dbURL, "redis://" + redis.Addr() + " " + dbURL} {
		for _, args := range [][]string{
			append([]string{"inspect", "--store", store}, key...),
			append([]string{"purge", "--yes", "--store", store}, key...),
			{"gc", "--store", store, "--blob", "file://" + t.TempDir()},
		} {
			r := opRun(t, nil, args...)
			msg := strings.TrimSuffix(r.stderr, "\n")
			if r.code != 1 || strings.Contains(msg, "\n") || !strings.Contains(msg, "no idem table") || !strings.Contains(msg, "has a proxy run against this database?") {
				t.Errorf("idem %s on a database without idem's table: %v; want exit 1 and one line saying so", args[0], r)
			}
		}
	}
	conn, err := pgx.Connect(ctx, dbURL)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	var tables int
	if err := conn.QueryRow(ctx, "SELECT count(*) FROM pg_tables WHERE schemaname = 'public'").Scan(&tables); err != nil {
		t.Fatal(err)
	}
	if tables != 0 {
		t.Errorf("after inspect, purge and gc: %d tables in the database, want 0 (commands that read create nothing)", tables)
	}
}

// opUpstream starts the service behind the proxy, Python's standard
// library (testdata/upstream.py), and returns its base URL.
func opUpstream(t *testing.T) string {
	t.Helper()
	return startScriptUpstream(t, "python3", "testdata/upstream.py").url
}

// opPost sends a keyed POST and returns the status, the
// Idempotent-Replayed header and the body.
func opPost(t *testing.T, url, key string, pad int) (int, string, []byte) {
	t.Helper()
	return opPostWith(t, http.DefaultClient, url, key, pad)
}

// opPostWith is opPost through client (one that trusts a test CA).
func opPostWith(t *testing.T, client *http.Client, url, key string, pad int) (int, string, []byte) {
	t.Helper()
	req, err := http.NewRequest("POST", url, strings.NewReader(`{"amount":100}`))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Idempotency-Key", key)
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("X-Pad", fmt.Sprint(pad))
	resp, err := client.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return resp.StatusCode, resp.Header.Get("Idempotent-Replayed"), body
}

// Every store form, with and without a file blob store: a keyed POST sent
// twice runs once upstream and its replay is byte-identical; then idem
// inspect shows the record, idem purge --yes deletes it, idem gc (with
// --blob) finds its body an orphan, and inspect says it is gone.
func TestOperatorStores(t *testing.T) {
	t.Parallel()
	upstream := opUpstream(t)
	redis := proxyRedis(t)
	dbURL, drop, err := pgtest.CreateDatabase(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { drop() })
	ms, err := mysqltest.Start()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(ms.Stop)
	myDB, err := ms.CreateDatabase()
	if err != nil {
		t.Fatal(err)
	}
	redisURL := "redis://" + redis.Addr()
	// The log names the database (Redis's /0 when the URL gives none),
	// never the user or password.
	pgName := "postgres://" + strings.SplitN(strings.SplitN(dbURL, "@", 2)[1], "?", 2)[0]
	for _, st := range []struct{ name, store, logged string }{
		{"memory", "memory", "memory"},
		{"redis", redisURL, redisURL + "/0"},
		{"redis9", redisURL + "/9", redisURL + "/9"},
		{"postgres", dbURL, pgName},
		{"mysql", ms.URL(myDB), "mysql://" + ms.Addr() + "/" + myDB},
		{"tiered", redisURL + " " + dbURL, redisURL + "/0 " + pgName},
	} {
		for _, withBlob := range []bool{false, true} {
			name := st.name
			if withBlob {
				name += "+blob"
			}
			t.Run(name, func(t *testing.T) {
				t.Parallel()
				opStoreForm(t, upstream, st.store, st.logged, withBlob)
			})
		}
	}
}

func opStoreForm(t *testing.T, upstream, store, logged string, withBlob bool) {
	prefix := "op-" + strings.ToLower(rand.Text()[:8]) + ":"
	args := []string{"--upstream", upstream, "--store", store, "--prefix", prefix}
	pad, blobDir := 0, ""
	if withBlob {
		blobDir = t.TempDir()
		args = append(args, "--blob", "file://"+blobDir, "--max-response", "1KiB")
		pad = 4096 // the body goes to the blob store
	}
	p := proctest.StartProxy(t, args...)
	var started struct{ Store string }
	for line := range strings.Lines(p.LogText()) {
		if strings.Contains(line, `"idem proxy listening"`) {
			json.Unmarshal([]byte(line), &started)
		}
	}
	if started.Store != logged {
		t.Errorf("start-up log: store %q, want %q", started.Store, logged)
	}

	key := "op-" + rand.Text()
	url := "http://" + p.Addr + "/charges"
	s1, r1, first := opPost(t, url, key, pad)
	s2, r2, replay := opPost(t, url, key, pad)
	if s1 != 201 || r1 != "" || s2 != 201 || r2 != "true" || !bytes.Equal(first, replay) {
		t.Fatalf("keyed POST twice: %d %q then %d %q, bodies equal %v; want 201, then 201 replayed with the same bytes\n%s\n%s",
			s1, r1, s2, r2, bytes.Equal(first, replay), first, replay)
	}
	var count struct{ Executions int }
	resp, err := http.Get(upstream + "/count?key=" + key)
	if err != nil {
		t.Fatal(err)
	}
	json.NewDecoder(resp.Body).Decode(&count)
	resp.Body.Close()
	if count.Executions != 1 {
		t.Errorf("upstream executions of the key: %d, want 1", count.Executions)
	}

	sel := []string{"--store", store, "--prefix", prefix, "--key", key, "--route", "/charges"}
	if store == "memory" { // each process has its own: the commands refuse it
		for _, cmd := range [][]string{{"inspect"}, {"purge", "--yes"}} {
			opOneLine(t, cmd[0]+" --store memory", opRun(t, nil, append(cmd, sel...)...), "--store memory: a memory store lives inside one process")
		}
		if withBlob {
			opOneLine(t, "gc --store memory", opRun(t, nil, "gc", "--store", store, "--blob", "file://"+blobDir), "--store memory: a memory store lives inside one process")
		}
		return
	}
	blobArgs := []string{}
	if withBlob {
		blobArgs = []string{"--blob", "file://" + blobDir}
	}
	r := opRun(t, nil, append(append([]string{"inspect"}, sel...), blobArgs...)...)
	if r.code != 0 || !strings.Contains(r.stdout, "state:") || !strings.Contains(r.stdout, "completed") || !strings.Contains(r.stdout, "201 Created") {
		t.Errorf("inspect: %v; want exit 0 and the completed record", r)
	}
	if withBlob && (!strings.Contains(r.stdout, "in the blob store") || !strings.Contains(r.stdout, "present, ")) {
		t.Errorf("inspect --blob: stdout %q; want the body in the blob store, present", r.stdout)
	}
	if !withBlob && !strings.Contains(r.stdout, `"executions": 1`) {
		t.Errorf("inspect: stdout %q; want the stored body", r.stdout)
	}

	// purge without --blob: the blob stays for gc.
	r = opRun(t, nil, append([]string{"purge", "--yes"}, sel...)...)
	if r.code != 0 || !strings.HasPrefix(r.stdout, "purged ") || !strings.Contains(r.stdout, "was completed") {
		t.Errorf("purge --yes: %v; want exit 0 and purged … (was completed…)", r)
	}
	if withBlob {
		if !strings.Contains(r.stdout, "until idem gc") {
			t.Errorf("purge without --blob: stdout %q; want the blob left for idem gc", r.stdout)
		}
		gc := []string{"gc", "--store", store, "--prefix", prefix, "--blob", "file://" + blobDir, "--min-age", "0"}
		r = opRun(t, nil, append(gc, "--dry-run")...)
		if r.code != 0 || !strings.Contains(r.stdout, "would delete 1 orphans") {
			t.Errorf("gc --dry-run: %v; want exit 0 and would delete 1 orphans", r)
		}
		r = opRun(t, nil, gc...)
		if r.code != 0 || !strings.Contains(r.stdout, "deleted 1 orphans") {
			t.Errorf("gc: %v; want exit 0 and deleted 1 orphans", r)
		}
		r = opRun(t, nil, append(gc, "--dry-run")...)
		if r.code != 0 || !strings.Contains(r.stdout, "would delete 0 orphans") {
			t.Errorf("gc --dry-run after gc: %v; want exit 0 and nothing left to delete", r)
		}
	}
	r = opRun(t, nil, append([]string{"inspect"}, sel...)...)
	if r.code != 1 || r.stdout != "no record\n" || !strings.Contains(r.stderr, "no record for stored key") ||
		!strings.Contains(r.stderr, fmt.Sprintf("under %q in %s", prefix, logged)) || strings.Count(r.stderr, "\n") > 2 {
		t.Errorf("inspect after purge: %v; want exit 1, no record, and at most two lines naming the prefix and the store", r)
	}
	if _, db, _ := strings.Cut(strings.SplitN(strings.Fields(logged)[0], "://", 2)[1], "/"); !strings.Contains(r.stderr, "is database /"+db+" of ") {
		t.Errorf("inspect after purge: stderr %q; want the hint to ask about database /%s", r.stderr, db)
	}
}

// opSplit splits a command line as sh would for the README's commands:
// words separated by blanks, '…' and "…" quoting, backslash-newline
// joining lines, # comments at the start of a word.
func opSplit(line string) ([]string, error) {
	var words []string
	var w strings.Builder
	inWord := false
	for i := 0; i < len(line); i++ {
		c := line[i]
		switch {
		case c == '\\' && i+1 < len(line) && line[i+1] == '\n':
			i++
		case c == '\\' && i+1 < len(line):
			w.WriteByte(line[i+1])
			i++
			inWord = true
		case c == '\'' || c == '"':
			end := strings.IndexByte(line[i+1:], c)
			if end < 0 {
				return nil, fmt.Errorf("unterminated %c quote in %q", c, line)
			}
			w.WriteString(line[i+1 : i+1+end])
			i += end + 1
			inWord = true
		case c == ' ' || c == '\t' || c == '\n':
			if inWord {
				words = append(words, w.String())
				w.Reset()
				inWord = false
			}
		case c == '#' && !inWord:
			for i < len(line) && line[i] != '\n' {
				i++
			}
		default:
			w.WriteByte(c)
			inWord = true
		}
	}
	if inWord {
		words = append(words, w.String())
	}
	return words, nil
}

// opLine turns a README command line into the binary's arguments: the
// leading "idem" goes, and every ":PORT" of ports (a README port to a live
// one, such as "6379" to a private redis-server's) is replaced.
func opLine(t *testing.T, line string, ports map[string]string) []string {
	t.Helper()
	words, err := opSplit(line)
	if err != nil {
		t.Fatal(err)
	}
	if len(words) == 0 || words[0] != "idem" {
		t.Fatalf("README line %q: not an idem command", line)
	}
	words = words[1:]
	for i, w := range words {
		for from, to := range ports {
			w = regexp.MustCompile(`:`+regexp.QuoteMeta(from)+`\b`).ReplaceAllString(w, ":"+to)
		}
		words[i] = w
	}
	return words
}

// opRunLine runs one README command line (ports substituted) to its end.
func opRunLine(t *testing.T, line string, ports map[string]string) opResult {
	t.Helper()
	return opRun(t, nil, opLine(t, line, ports)...)
}

// opStartLine starts one README `idem proxy` line (ports substituted,
// --log-format json added so that the start is seen) and returns it once
// it listens; it is killed at the end of the test.
func opStartLine(t *testing.T, line string, ports map[string]string) *proctest.Proxy {
	t.Helper()
	words := opLine(t, line, ports)
	if len(words) == 0 || words[0] != "proxy" {
		t.Fatalf("README line %q: not idem proxy", line)
	}
	return proctest.StartProxy(t, words[1:]...) // its --listen 127.0.0.1:0 comes first: the line's own wins
}

func TestOperatorSplit(t *testing.T) {
	words, err := opSplit("idem proxy --listen :8080 \\\n  --store 'redis://h:6379 postgres://h/db' --x \"a b\" # comment\n")
	want := []string{"idem", "proxy", "--listen", ":8080", "--store", "redis://h:6379 postgres://h/db", "--x", "a b"}
	if err != nil || !slices.Equal(words, want) {
		t.Errorf("opSplit: got %q, %v; want %q", words, err, want)
	}
}

// The README harness on a README-like line: the ports are replaced and
// the proxy serves.
func TestOperatorReadmeLine(t *testing.T) {
	t.Parallel()
	upstream := opUpstream(t)
	redis := proxyRedis(t)
	upPort := upstream[strings.LastIndexByte(upstream, ':')+1:]
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	listenPort := fmt.Sprint(ln.Addr().(*net.TCPAddr).Port)
	ln.Close()
	p := opStartLine(t, `idem proxy --listen 127.0.0.1:8080 --upstream http://127.0.0.1:9000 \
  --store redis://127.0.0.1:6379/0`, map[string]string{"8080": listenPort, "9000": upPort, "6379": fmt.Sprint(redis.Port())})
	if p.Addr != "127.0.0.1:"+listenPort {
		t.Errorf("proxy listens on %s, want 127.0.0.1:%s (the line's --listen)", p.Addr, listenPort)
	}
	key := "readme-" + rand.Text()
	_, _, a := opPost(t, "http://"+p.Addr+"/x", key, 0)
	_, replayed, b := opPost(t, "http://"+p.Addr+"/x", key, 0)
	if replayed != "true" || !bytes.Equal(a, b) {
		t.Errorf("README line: second POST replayed %q, same bytes %v; want a replay", replayed, bytes.Equal(a, b))
	}
	r := opRunLine(t, `idem inspect --store redis://127.0.0.1:6379/0 --key `+key+` --route /x`, map[string]string{"6379": fmt.Sprint(redis.Port())})
	if r.code != 0 || !strings.Contains(r.stdout, "completed") {
		t.Errorf("README inspect line: %v; want the completed record", r)
	}
}

// docCommands returns the idem command lines of the ```sh blocks of the
// markdown files, backslash-continued lines joined, in order.
func docCommands(t *testing.T, files ...string) []string {
	t.Helper()
	var lines []string
	for _, f := range files {
		md, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		inSh, cur := false, ""
		for line := range strings.Lines(string(md)) {
			line = strings.TrimRight(line, "\n")
			switch {
			case strings.HasPrefix(line, "```"):
				inSh = line == "```sh"
				continue
			case !inSh:
				continue
			}
			if cur != "" {
				cur += "\n" + line
			} else if strings.HasPrefix(line, "idem ") {
				cur = line
			}
			if cur != "" && !strings.HasSuffix(line, `\`) {
				lines = append(lines, cur)
				cur = ""
			}
		}
	}
	return lines
}

// freePort returns a loopback port nothing listens on.
func freePort(t *testing.T) string {
	t.Helper()
	port, err := nettest.FreePort()
	if err != nil {
		t.Fatal(err)
	}
	return fmt.Sprint(port)
}

// The idem commands of the shell blocks of the README and every guide
// under docs/, run as written but for their ports (a private redis-server for
// 6379, a Python upstream for 9000, free ports for the proxy's own) and
// the blob directory and TLS files (made here, under /etc/idem/tls/ in the
// guides): each proxy serves a keyed POST of the guide's
// example (order-1042 on /payments) and replays it; inspect, purge and gc
// find what it stored and exit 0.
func TestOperatorDocCommands(t *testing.T) {
	t.Parallel()
	upstream := opUpstream(t)
	redis := proxyRedis(t)
	blobDir := t.TempDir()
	guides, err := filepath.Glob("../../docs/*.md")
	if err != nil || len(guides) == 0 {
		t.Fatalf("docs/*.md: %v, %d files", err, len(guides))
	}
	lines := docCommands(t, append([]string{"../../README.md"}, guides...)...)
	tlsDir := t.TempDir()
	ca := tlstest.NewCA(t, tlsDir, "clients-ca")
	serverCert, serverKey := ca.Issue("tls", "127.0.0.1", 2, false)
	clientCert, clientKey := ca.Issue("client", "client", 3, true)
	tlsClient := &http.Client{Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: ca.Pool,
		Certificates: []tls.Certificate{tlstest.Pair(t, clientCert, clientKey)}}}}
	sealKeys := sealRingFile(t, sealRingLine("k1", 1))
	files := strings.NewReplacer("file:///var/lib/idem/blobs", "file://"+blobDir, "/etc/idem/seal.keys", sealKeys,
		"/etc/idem/tls/tls.crt", serverCert, "/etc/idem/tls/tls.key", serverKey, "/etc/idem/tls/clients-ca.crt", ca.File)
	seen := map[string]int{}
	for _, line := range lines {
		line = files.Replace(line)
		ports := map[string]string{"9000": upstream[strings.LastIndexByte(upstream, ':')+1:],
			"6379": fmt.Sprint(redis.Port()), "8080": freePort(t), "8443": freePort(t), "9090": freePort(t)}
		if strings.Contains(line, "s3://") {
			// It would reach AWS (or, without credentials, the EC2
			// metadata address): tests send traffic to loopback only.
			t.Errorf("%s\n: an s3:// command cannot run here: show it in a text block, not an sh block", line)
			continue
		}
		words := opLine(t, line, ports)
		seen[words[0]]++
		switch words[0] {
		case "proxy":
			p := opStartLine(t, line, ports)
			url, client := "http://"+p.Addr+"/payments", http.DefaultClient
			if strings.Contains(line, "--tls-cert") {
				_, port, _ := net.SplitHostPort(p.Addr) // [::]:port for --listen :8443: dial loopback
				url, client = "https://127.0.0.1:"+port+"/payments", tlsClient
			}
			status, _, first := opPostWith(t, client, url, "order-1042", 0)
			_, replayed, again := opPostWith(t, client, url, "order-1042", 0)
			if status != http.StatusCreated || replayed != "true" || !bytes.Equal(first, again) {
				t.Errorf("%s\n: got %d, then replayed=%q (same bytes %v); want 201 and its replay", line, status, replayed, bytes.Equal(first, again))
			}
		case "inspect", "purge", "gc":
			if r := opRunLine(t, line, ports); r.code != 0 {
				t.Errorf("%s\n: %v; want exit 0", line, r)
			}
		default:
			t.Errorf("%s\n: a command this test does not know how to run: teach it", line)
		}
	}
	for _, cmd := range []string{"proxy", "inspect", "purge", "gc"} {
		if seen[cmd] == 0 {
			t.Errorf("no idem %s command in the docs' shell blocks (found %q)", cmd, lines)
		}
	}
}
