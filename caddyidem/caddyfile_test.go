package caddyidem

import (
	"encoding/json"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig"

	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/internal/sidecar"
)

// adapt turns a Caddyfile into JSON config, failing the test on an error.
func adapt(t *testing.T, cf string) string {
	t.Helper()
	out, _, err := caddyconfig.GetAdapter("caddyfile").Adapt([]byte(cf), nil)
	if err != nil {
		t.Fatalf("adapting:\n%s\ngot %v, want no error", cf, err)
	}
	return string(out)
}

// handlersOf returns the handler names of the first route's handle list
// (the site's), in order, and the idempotency handler's JSON.
func handlersOf(t *testing.T, cfg string) ([]string, json.RawMessage) {
	t.Helper()
	var c struct {
		Apps struct {
			HTTP struct {
				Servers map[string]struct {
					Routes []struct {
						Handle []json.RawMessage `json:"handle"`
					} `json:"routes"`
				} `json:"servers"`
			} `json:"http"`
		} `json:"apps"`
	}
	if err := json.Unmarshal([]byte(cfg), &c); err != nil {
		t.Fatal(err)
	}
	var names []string
	var idem json.RawMessage
	var walk func([]json.RawMessage)
	walk = func(hs []json.RawMessage) {
		for _, h := range hs {
			var v struct {
				Handler string `json:"handler"`
				Routes  []struct {
					Handle []json.RawMessage `json:"handle"`
				} `json:"routes"`
			}
			json.Unmarshal(h, &v)
			names = append(names, v.Handler)
			if v.Handler == "idempotency" {
				idem = h
			}
			for _, r := range v.Routes {
				walk(r.Handle)
			}
		}
	}
	for _, s := range c.Apps.HTTP.Servers {
		for _, r := range s.Routes {
			walk(r.Handle)
		}
	}
	return names, idem
}

// TestCaddyfileIssueExample: the Caddyfile of issue 24 adapts to the
// idempotency handler before reverse_proxy, on the Redis store.
func TestCaddyfileIssueExample(t *testing.T) {
	names, raw := handlersOf(t, adapt(t, `:8080
route /payments/* {
	idempotency {
		store redis://127.0.0.1:6379
	}
	reverse_proxy app:8080
}
`))
	if !reflect.DeepEqual(names, []string{"subroute", "idempotency", "reverse_proxy"}) {
		t.Errorf("got handlers %v, want [subroute idempotency reverse_proxy]", names)
	}
	var h Handler
	if err := json.Unmarshal(raw, &h); err != nil {
		t.Fatal(err)
	}
	if h.Store != "redis://127.0.0.1:6379" {
		t.Errorf("got store %q, want redis://127.0.0.1:6379", h.Store)
	}
}

// TestCaddyfileOrder: outside a route block, idempotency written after
// reverse_proxy still runs before it, without an order line.
func TestCaddyfileOrder(t *testing.T) {
	names, _ := handlersOf(t, adapt(t, `:8080
reverse_proxy app:8080
idempotency
`))
	if !reflect.DeepEqual(names, []string{"idempotency", "reverse_proxy"}) {
		t.Errorf("got handlers %v, want [idempotency reverse_proxy] (the directive ordered before reverse_proxy)", names)
	}
}

// TestCaddyfileOptions: every subdirective reaches its JSON field.
func TestCaddyfileOptions(t *testing.T) {
	_, raw := handlersOf(t, adapt(t, `:8080
idempotency /pay* {
	store redis://127.0.0.1:6379 postgres://u@127.0.0.1/db
	prefix shop:
	memory_limit 64MiB
	reap_interval 0
	methods POST PUT,patch
	require_key
	tenant_header X-Account
	lease 10s
	retention 1h
	wait 2s
	fail_open
	max_body 64KiB
	max_response 2MiB
	store_statuses 200 201
	max_execution 1m
	client_write_timeout 0
	cancel_on_disconnect
	blob mem://
	blob_timeout 5s
	quota_in_flight 8
	quota_records 0
	quota_bytes 4MiB
}
reverse_proxy app:8080
`))
	var got Handler
	if err := json.Unmarshal(raw, &got); err != nil {
		t.Fatal(err)
	}
	mem, reap, cwt, wait := int64(64<<20), caddy.Duration(0), caddy.Duration(0), caddy.Duration(2*time.Second)
	qInFlight, qRecords, qBytes := 8, 0, int64(4<<20)
	want := Handler{Store: "redis://127.0.0.1:6379 postgres://u@127.0.0.1/db", Prefix: "shop:", MemoryLimit: &mem, ReapInterval: &reap,
		Methods: []string{"POST", "PUT", "PATCH"}, RequireKey: true, TenantHeader: "X-Account",
		Lease: caddy.Duration(10 * time.Second), Retention: caddy.Duration(time.Hour), Wait: &wait,
		FailOpen: true, MaxBody: 64 << 10, MaxResponse: 2 << 20, StoreStatuses: []int{200, 201},
		MaxExecution: caddy.Duration(time.Minute), ClientWriteTimeout: &cwt, CancelOnDisconnect: true,
		Blob: "mem://", BlobTimeout: caddy.Duration(5 * time.Second), QuotaInFlight: &qInFlight, QuotaRecords: &qRecords, QuotaBytes: &qBytes}
	if !reflect.DeepEqual(got, want) {
		gj, _ := json.Marshal(got)
		wj, _ := json.Marshal(want)
		t.Errorf("got\n%s\nwant\n%s", gj, wj)
	}
}

// TestCaddyfileKeyOptions: the key source, webhook, fingerprint and
// answer subdirectives reach their JSON fields (under the same names) and
// the route's settings.
func TestCaddyfileKeyOptions(t *testing.T) {
	for _, tc := range []struct {
		body     string
		json     []string // in the handler's JSON
		want     Handler
		key      string // Settings.Key
		exclude  []string
		fields   []string
		tolerate time.Duration
	}{
		{
			body: "webhook stripe\n\twebhook_secret_file /run/secrets/stripe\n\twebhook_tolerance 10m\n\tfingerprint json\n" +
				"\tfingerprint_exclude /attempt /sent_at\n\tprofile acp\n\techo_key\n\tlifetime_header",
			json: []string{`"webhook":"stripe"`, `"webhook_secret_file":"/run/secrets/stripe"`, `"webhook_tolerance":600000000000`,
				`"fingerprint":"json"`, `"fingerprint_exclude":["/attempt","/sent_at"]`, `"profile":"acp"`, `"echo_key":true`, `"lifetime_header":true`},
			want: Handler{Webhook: "stripe", WebhookSecretFile: "/run/secrets/stripe", WebhookTolerance: caddy.Duration(10 * time.Minute),
				Fingerprint: "json", FingerprintExclude: []string{"/attempt", "/sent_at"}, Profile: "acp", EchoKey: true, LifetimeHeader: true},
			exclude: []string{"/attempt", "/sent_at"}, tolerate: 10 * time.Minute,
		},
		{
			body: "webhook github\n\twebhook_secret_env GITHUB_WEBHOOK_SECRETS",
			json: []string{`"webhook":"github"`, `"webhook_secret_env":"GITHUB_WEBHOOK_SECRETS"`},
			want: Handler{Webhook: "github", WebhookSecretEnv: "GITHUB_WEBHOOK_SECRETS"},
		},
		{
			body: "key_header X-Request-Id\n\tfingerprint_fields /amount /currency\n\tprofile stripe",
			json: []string{`"key_header":"X-Request-Id"`, `"fingerprint_fields":["/amount","/currency"]`, `"profile":"stripe"`},
			want: Handler{KeyHeader: "X-Request-Id", FingerprintFields: []string{"/amount", "/currency"}, Profile: "stripe"},
			key:  "header:X-Request-Id", fields: []string{"/amount", "/currency"},
		},
		{
			body: "replay_headers_allow X-Request-Id Location\n\treplay_headers_deny X-Session-Token\n\tseal_keys /run/secrets/idem-ring\n\tseal_open_only",
			json: []string{`"replay_headers_allow":["X-Request-Id","Location"]`, `"replay_headers_deny":["X-Session-Token"]`,
				`"seal_keys":"/run/secrets/idem-ring"`, `"seal_open_only":true`},
			want: Handler{ReplayHeadersAllow: []string{"X-Request-Id", "Location"}, ReplayHeadersDeny: []string{"X-Session-Token"},
				SealKeys: "/run/secrets/idem-ring", SealOpenOnly: true},
		},
		{
			body: "seal_kms arn:aws:kms:eu-west-2:111122223333:key/bc436485-5092-42b8-92a3-0aa8b93536dc",
			json: []string{`"seal_kms":"arn:aws:kms:eu-west-2:111122223333:key/bc436485-5092-42b8-92a3-0aa8b93536dc"`},
			want: Handler{SealKMS: "arn:aws:kms:eu-west-2:111122223333:key/bc436485-5092-42b8-92a3-0aa8b93536dc"},
		},
		{
			body: "key json:/order/id\n\tfingerprint raw",
			json: []string{`"key":"json:/order/id"`, `"fingerprint":"raw"`},
			want: Handler{Key: "json:/order/id", Fingerprint: "raw"},
			key:  "json:/order/id",
		},
	} {
		_, raw := handlersOf(t, adapt(t, ":8080\nidempotency {\n\t"+tc.body+"\n}\nreverse_proxy app:8080\n"))
		for _, j := range tc.json {
			if !strings.Contains(string(raw), j) {
				t.Errorf("%s: JSON %s does not hold %s", strings.ReplaceAll(tc.body, "\n\t", "; "), raw, j)
			}
		}
		var got Handler
		if err := json.Unmarshal(raw, &got); err != nil {
			t.Fatal(err)
		}
		if !reflect.DeepEqual(got, tc.want) {
			gj, _ := json.Marshal(got)
			wj, _ := json.Marshal(tc.want)
			t.Errorf("%s: got\n%s\nwant\n%s", strings.ReplaceAll(tc.body, "\n\t", "; "), gj, wj)
		}
		s := got.settings()
		if s.Key != tc.key || s.Webhook != got.Webhook || s.WebhookSecretFile != got.WebhookSecretFile || s.WebhookSecretEnv != got.WebhookSecretEnv ||
			s.WebhookTolerance != tc.tolerate || s.Fingerprint != got.Fingerprint || !reflect.DeepEqual(s.FingerprintExclude, tc.exclude) ||
			!reflect.DeepEqual(s.FingerprintFields, tc.fields) || s.Profile != got.Profile || s.EchoKey != got.EchoKey || s.LifetimeHeader != got.LifetimeHeader ||
			!reflect.DeepEqual(s.ReplayHeadersAllow, got.ReplayHeadersAllow) || !reflect.DeepEqual(s.ReplayHeadersDeny, got.ReplayHeadersDeny) ||
			s.Seal != (sidecar.SealSettings{Keys: got.SealKeys, KMS: got.SealKMS, OpenOnly: got.SealOpenOnly}) {
			t.Errorf("%s: settings key %q webhook %q file %q env %q tolerance %v fingerprint %q exclude %q fields %q profile %q echo %v lifetime %v; want them from %s (key %q)",
				strings.ReplaceAll(tc.body, "\n\t", "; "), s.Key, s.Webhook, s.WebhookSecretFile, s.WebhookSecretEnv, s.WebhookTolerance,
				s.Fingerprint, s.FingerprintExclude, s.FingerprintFields, s.Profile, s.EchoKey, s.LifetimeHeader, raw, tc.key)
		}
	}
}

// TestCaddyfileErrors: a bad value is refused when the Caddyfile is
// adapted, naming the subdirective and what it wants.
func TestCaddyfileErrors(t *testing.T) {
	for _, tc := range []struct{ body, want string }{
		{"lease 30", `lease "30": want a duration`},
		{"lease 1ms", "lease 1ms: want at least 10ms"},
		{"retention 10ms", "retention 10ms: want at least 1s"},
		{"max_body lots", `max_body "lots": want a size`},
		{"tenant_header X-A\n\ttenant_cookie s", "set one tenant source, not both"},
		{"methods get", `methods: "GET"`}, // upper-cased, so accepted
		{"methods PO/ST", `methods: "PO/ST" is not an upper-case HTTP method`},
		{"store_statuses 99", "store_statuses: 99 is not a final HTTP status"},
		{"store a b c", "store: want a URL"},
		{"prefix a{b}", "must not contain '{' or '}'"},
		{"require_key yes", "require_key takes no argument"},
		{"wait -1s", "wait -1s: must not be negative (0: no wait, 409 at once)"},
		{"wait soon", `wait "soon": want a duration`},
		{"colour blue", `unknown subdirective "colour"`},
		{"quota_in_flight -1", `quota_in_flight "-1": want a whole number, 0 or more (0: no limit)`},
		{"quota_records many", `quota_records "many": want a whole number`},
		{"quota_bytes lots", `quota_bytes "lots": want a size`},
		{"key_header X/Id", `key_header "X/Id": not a header name`},
		{"key_header X-A X-B", "key_header: want one argument, got 2"},
		{"key_header X-Id\n\tkey json:/id", `key_header "X-Id" and key "json:/id": set one key source, not both`},
		{"key X-Id", `key "X-Id": want header:NAME or json:/pointer`},
		{"key json:id", `key "json:id": "id" is not a JSON Pointer`},
		{"webhook gitlab", `webhook: webhook preset "gitlab": want one of github, shopify, standard-webhooks, stripe`},
		{"webhook github", "webhook github: set one of webhook_secret_file and webhook_secret_env"},
		{"webhook github\n\twebhook_secret_file /a\n\twebhook_secret_env B", "set one of webhook_secret_file and webhook_secret_env"},
		{"webhook_secret_env GH", "webhook_secret_file, webhook_secret_env and webhook_tolerance need webhook"},
		{"key_header X-Id\n\twebhook github\n\twebhook_secret_env GH", `key_header "header:X-Id" and webhook github: the preset names its key; drop key_header`},
		{"webhook stripe\n\twebhook_secret_env S\n\twebhook_tolerance 30", `webhook_tolerance "30": want a duration`},
		{"webhook shopify\n\twebhook_secret_env S\n\twebhook_tolerance 1m", "webhook_tolerance 1m0s: shopify signs no timestamp"},
		{"fingerprint bytes", `fingerprint "bytes": want raw (the body's bytes) or json`},
		{"fingerprint raw\n\tfingerprint_exclude /ts", "fingerprint raw: fingerprint_exclude and fingerprint_fields need json"},
		{"fingerprint_exclude", "fingerprint_exclude: want one or more JSON Pointers"},
		{"fingerprint_fields /amount id", `fingerprint_fields: "id" is not a JSON Pointer`},
		{"fingerprint_exclude /ts\n\tfingerprint_fields /id", "fingerprint_exclude and fingerprint_fields: set one, not both"},
		{"profile paypal", `profile "paypal": want one of ietf, acp, stripe`},
		{"profile", "profile: want one argument, got 0"},
		{"echo_key true", "echo_key takes no argument, got 1"},
		{"lifetime_header yes", "lifetime_header takes no argument, got 1"},
		{"replay_headers_allow", "replay_headers_allow: want one or more header names"},
		{"replay_headers_allow Location Set-Cookie", "replay_headers_allow: Set-Cookie is never stored"},
		{"replay_headers_deny X-A,X-B", `replay_headers_deny: "X-A,X-B" is not a header name`},
		{"replay_headers_deny content-encoding", "replay_headers_deny: Content-Encoding says how to read the stored body"},
		{"seal_keys", "seal_keys: want one argument, got 0"},
		{"seal_keys /a /b", "seal_keys: want one argument, got 2"},
		{"seal_kms my-key", `seal_kms "my-key": want the ARN of a KMS key`},
		{"seal_open_only", "seal_open_only needs seal_keys or seal_kms"},
		{"seal_keys /r\n\tseal_open_only yes", "seal_open_only takes no argument, got 1"},
	} {
		cf := ":8080\nidempotency {\n\t" + tc.body + "\n}\nreverse_proxy app:8080\n"
		_, _, err := caddyconfig.GetAdapter("caddyfile").Adapt([]byte(cf), nil)
		if tc.want == `methods: "GET"` {
			if err != nil {
				t.Errorf("%s: got %v, want it accepted (methods are upper-cased)", tc.body, err)
			}
			continue
		}
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: got error %v, want one containing %q", strings.ReplaceAll(tc.body, "\n\t", "; "), err, tc.want)
		}
	}
}

// TestCaddyfileSizes: sizes are idem proxy's (sidecar.ParseSize): a bare
// number is bytes, so max_body 1 is one byte, as --max-body 1 is; a unit
// is written as the docs spell it; max_body 0 and max_response 0 are
// refused (the JSON field's 0 is the default, 1MiB), and what was wanted
// is named.
func TestCaddyfileSizes(t *testing.T) {
	for _, tc := range []struct {
		body string
		want func(Handler) int64
		n    int64
	}{
		{"max_body 1", func(h Handler) int64 { return h.MaxBody }, 1},
		{"max_body 10B", func(h Handler) int64 { return h.MaxBody }, 10},
		{"max_body 512KB", func(h Handler) int64 { return h.MaxBody }, 512e3},
		{`max_body "1 MiB"`, func(h Handler) int64 { return h.MaxBody }, 1 << 20},
		{"max_response 32MiB", func(h Handler) int64 { return h.MaxResponse }, 32 << 20},
		{"memory_limit 0", func(h Handler) int64 { return *h.MemoryLimit }, 0},
		{"memory_limit 1048576", func(h Handler) int64 { return *h.MemoryLimit }, 1 << 20},
		{"quota_bytes 16MiB", func(h Handler) int64 { return *h.QuotaBytes }, 16 << 20},
	} {
		_, raw := handlersOf(t, adapt(t, ":8080\nidempotency {\n\t"+tc.body+"\n}\nreverse_proxy app:8080\n"))
		var h Handler
		if err := json.Unmarshal(raw, &h); err != nil {
			t.Fatal(err)
		}
		if got := tc.want(h); got != tc.n {
			t.Errorf("%s: got %d bytes, want %d", tc.body, got, tc.n)
		}
	}
	for _, tc := range []struct{ body, want string }{
		{"max_body 1mb", `max_body "1mb": ` + sidecar.SizeWant},
		{"max_body 64K", `max_body "64K": ` + sidecar.SizeWant},
		{"max_body 1.5MiB", `max_body "1.5MiB": ` + sidecar.SizeWant},
		{"max_body 1TiB", `max_body "1TiB": ` + sidecar.SizeWant},
		{"max_body -1", `max_body "-1": ` + sidecar.SizeWant},
		{"max_body 1 MiB", "max_body: want one argument, got 2"},
		{"max_body 0", "max_body 0: want at least 1 byte (leave max_body out for the default, 1MiB)"},
		{"max_response 0B", "max_response 0: want at least 1 byte (leave max_response out for the default, 1MiB)"},
		{"memory_limit 1GB5", `memory_limit "1GB5": ` + sidecar.SizeWant},
		{"quota_bytes lots", `quota_bytes "lots": ` + sidecar.SizeWant},
	} {
		cf := ":8080\nidempotency {\n\t" + tc.body + "\n}\nreverse_proxy app:8080\n"
		_, _, err := caddyconfig.GetAdapter("caddyfile").Adapt([]byte(cf), nil)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: got error %v, want one containing %q", tc.body, err, tc.want)
		}
	}
}

// TestJSONValidate: the JSON config is checked as the Caddyfile is (the
// handler's Provision validates before it opens anything).
func TestJSONValidate(t *testing.T) {
	for _, tc := range []struct{ json, want string }{
		{`{"lease": 5000000}`, "lease 5ms: want at least 10ms"},
		{`{"max_response": -1}`, "max_response -1: want 1 to"},
		{`{"tenant_header": "a b"}`, `tenant_header "a b": not a header name`},
		{`{"wait": "-1s"}`, "wait -1s: must not be negative"},
		{`{"key_header": "a b"}`, `key_header "a b": not a header name`},
		{`{"key": "header:"}`, `key "header:": "" is not a header name`},
		{`{"webhook": "github", "webhook_secret_env": "GH", "key": "header:X-Id"}`, "drop key"},
		{`{"fingerprint_exclude": ["ts"]}`, `fingerprint_exclude: "ts" is not a JSON Pointer`},
		{`{"profile": "IETF"}`, `profile "IETF": want one of ietf, acp, stripe`},
		{`{"webhook_tolerance": "-1s", "webhook": "stripe", "webhook_secret_file": "/s"}`, "webhook_tolerance -1s: must not be negative"},
		{`{"replay_headers_allow": ["Connection"]}`, "replay_headers_allow: Connection is never stored"},
		{`{"replay_headers_deny": ["Grpc-Status"]}`, "replay_headers_deny: Grpc-Status says how to read the stored body"},
		{`{"seal_open_only": true}`, "seal_open_only needs seal_keys or seal_kms"},
		{`{"seal_kms": "alias/idem"}`, `seal_kms "alias/idem": want the ARN of a KMS key`},
	} {
		var h Handler
		if err := json.Unmarshal([]byte(tc.json), &h); err != nil {
			t.Fatal(err)
		}
		if err := h.Validate(); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: got %v, want an error containing %q", tc.json, err, tc.want)
		}
	}
}

// TestWait: wait means what idem proxy's --wait means. Unset (in the
// Caddyfile or in JSON) is idemhttp's default wait (idemhttp.DefaultWait);
// wait 0, wait off and JSON's "wait": 0 are no wait, 409 at once (its
// Config.Wait negative); a duration is that wait.
func TestWait(t *testing.T) {
	const noWait, dflt = time.Duration(-1), idemhttp.DefaultWait // idemhttp's Config.Wait
	for _, tc := range []struct {
		line string // in the Caddyfile block; "" for none
		want time.Duration
	}{
		{"", dflt},
		{"wait 0", noWait},
		{"wait 0s", noWait},
		{"wait off", noWait},
		{"wait 2s", 2 * time.Second},
	} {
		_, raw := handlersOf(t, adapt(t, ":8080\nidempotency {\n\t"+tc.line+"\n}\nreverse_proxy app:8080\n"))
		var h Handler
		if err := json.Unmarshal(raw, &h); err != nil {
			t.Fatal(err)
		}
		if got := h.idemWait(); got != tc.want {
			t.Errorf("Caddyfile %q (JSON %s): got idemhttp Wait %v, want %v", tc.line, raw, got, tc.want)
		}
	}
	for _, tc := range []struct {
		json string
		want time.Duration
	}{
		{`{}`, dflt},
		{`{"wait": 0}`, noWait},
		{`{"wait": "0s"}`, noWait},
		{`{"wait": "750ms"}`, 750 * time.Millisecond},
		{`{"wait": 2000000000}`, 2 * time.Second},
	} {
		var h Handler
		if err := json.Unmarshal([]byte(tc.json), &h); err != nil {
			t.Fatal(err)
		}
		if err := h.Validate(); err != nil {
			t.Errorf("%s: got %v, want it valid", tc.json, err)
		}
		if got := h.idemWait(); got != tc.want {
			t.Errorf("JSON %s: got idemhttp Wait %v, want %v", tc.json, got, tc.want)
		}
	}
}
