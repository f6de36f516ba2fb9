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

// TestJSONValidate: the JSON config is checked as the Caddyfile is (the
// handler's Provision validates before it opens anything).
func TestJSONValidate(t *testing.T) {
	for _, tc := range []struct{ json, want string }{
		{`{"lease": 5000000}`, "lease 5ms: want at least 10ms"},
		{`{"max_response": -1}`, "max_response -1: want 1 to"},
		{`{"tenant_header": "a b"}`, `tenant_header "a b": not a header name`},
		{`{"wait": "-1s"}`, "wait -1s: must not be negative"},
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
