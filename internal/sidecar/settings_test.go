package sidecar

import (
	"context"
	"errors"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/memstore"
)

// TestSettingsValidate: each bad setting is one error that names it as
// the front end spells it, with what it wants; the defaults are good.
func TestSettingsValidate(t *testing.T) {
	if err := DefaultSettings().Validate(Underscored); err != nil {
		t.Fatalf("DefaultSettings: %v, want valid", err)
	}
	flag := func(n string) string { return "--" + n }
	for _, tc := range []struct {
		set  func(*Settings)
		flag string // the error with flag names
		file string // with Underscored
	}{
		{func(s *Settings) { s.Lease = time.Millisecond }, "--lease 1ms: want at least 10ms", "lease 1ms"},
		{func(s *Settings) { s.Wait = -time.Second }, "--wait -1s: must not be negative (0: no wait, 409 at once)", "wait -1s"},
		{func(s *Settings) { s.ClientWriteTimeout = -1 }, "--client-write-timeout -1ns: must not be negative", "client_write_timeout -1ns"},
		{func(s *Settings) { s.QuotaBytes = -1 }, "--quota-bytes -1: must not be negative", "quota_bytes -1"},
		{func(s *Settings) { s.MaxBody = 0 }, "--max-body 0: want at least 1 byte", "max_body 0"},
		{func(s *Settings) { s.Methods = []string{"PO ST"} }, `--methods: "PO ST" is not an HTTP method`, `methods: "PO ST"`},
		{func(s *Settings) { s.TenantHeader, s.TenantCookie = "X-T", "sid" }, `--tenant-header "X-T" and --tenant-cookie "sid": set one`, `tenant_header "X-T" and tenant_cookie "sid"`},
		{func(s *Settings) { s.StoreStatuses = []int{99} }, "--store-statuses: 99 is not a final HTTP status", "store_statuses: 99"},
		{func(s *Settings) { s.Key = "bogus" }, `--key "bogus": want header:NAME or json:/pointer`, `key "bogus"`},
		{func(s *Settings) { s.Key = "header:a b" }, `--key "header:a b": "a b" is not a header name`, `key "header:a b"`},
		{func(s *Settings) { s.Key = "json:id" }, `--key "json:id": "id" is not a JSON Pointer`, `key "json:id"`},
		{func(s *Settings) { s.Webhook = "gitlab" }, `--webhook: webhook preset "gitlab": want one of github, shopify, standard-webhooks, stripe`, "webhook: "},
		{func(s *Settings) { s.Key, s.Webhook, s.WebhookSecretEnv = "header:X", "github", "S" },
			`--key "header:X" and --webhook github: the preset names its key; drop --key`, `key "header:X" and webhook github`},
		{func(s *Settings) { s.Webhook = "github" }, "--webhook github: set one of --webhook-secret-file and --webhook-secret-env",
			"webhook github: set one of webhook_secret_file and webhook_secret_env"},
		{func(s *Settings) { s.Webhook, s.WebhookSecretFile, s.WebhookSecretEnv = "github", "f", "S" },
			"--webhook github: set one of --webhook-secret-file and --webhook-secret-env", "webhook github: set one of"},
		{func(s *Settings) { s.Webhook, s.WebhookSecretEnv, s.WebhookTolerance = "stripe", "S", -time.Second },
			"--webhook-tolerance -1s: must not be negative (0: the preset's)", "webhook_tolerance -1s"},
		{func(s *Settings) { s.Webhook, s.WebhookSecretEnv, s.WebhookTolerance = "github", "S", time.Minute },
			"--webhook-tolerance 1m0s: github signs no timestamp; drop it", "webhook_tolerance 1m0s"},
		{func(s *Settings) { s.Webhook, s.WebhookSecretEnv, s.WebhookTolerance = "stripe", "S", time.Second/2 },
			"--webhook-tolerance 500ms: want at least 1s", "webhook_tolerance 500ms"},
		{func(s *Settings) { s.WebhookSecretFile = "f" },
			"--webhook-secret-file, --webhook-secret-env and --webhook-tolerance need --webhook (one of github, shopify, standard-webhooks, stripe)",
			"webhook_secret_file, webhook_secret_env and webhook_tolerance need webhook"},
		{func(s *Settings) { s.WebhookTolerance = time.Minute }, "need --webhook", "webhook_secret_file, webhook_secret_env"},
		{func(s *Settings) { s.Fingerprint = "jcs" }, `--fingerprint "jcs": want raw (the body's bytes) or json (its canonical JSON)`, `fingerprint "jcs"`},
		{func(s *Settings) { s.FingerprintExclude, s.FingerprintFields = []string{"/a"}, []string{"/b"} },
			"--fingerprint-exclude and --fingerprint-fields: set one, not both", "fingerprint_exclude and fingerprint_fields"},
		{func(s *Settings) { s.Fingerprint, s.FingerprintFields = "raw", []string{"/b"} },
			"--fingerprint raw: --fingerprint-exclude and --fingerprint-fields need json", "fingerprint raw: fingerprint_exclude"},
		{func(s *Settings) { s.FingerprintExclude = []string{"/a", "attempt"} },
			`--fingerprint-exclude: "attempt" is not a JSON Pointer to a field`, `fingerprint_exclude: "attempt"`},
		{func(s *Settings) { s.FingerprintFields = []string{""} }, `--fingerprint-fields: "" is not a JSON Pointer to a field`, `fingerprint_fields: ""`},
		{func(s *Settings) { s.Profile = "aws" }, `--profile "aws": want one of ietf, acp, stripe`, `profile "aws"`},
		{func(s *Settings) { s.ReplayHeadersAllow = []string{"X-Ok", ""} }, `--replay-headers-allow: "" is not a header name`, `replay_headers_allow: ""`},
		{func(s *Settings) { s.ReplayHeadersAllow = []string{"X Debug"} }, `--replay-headers-allow: "X Debug" is not a header name`, `replay_headers_allow: "X Debug"`},
		{func(s *Settings) { s.ReplayHeadersAllow = []string{"set-cookie"} }, `--replay-headers-allow: Set-Cookie is never stored`, `replay_headers_allow: Set-Cookie`},
		{func(s *Settings) { s.ReplayHeadersAllow = []string{"connection"} }, `--replay-headers-allow: Connection is never stored`, `replay_headers_allow: Connection`},
		{func(s *Settings) { s.ReplayHeadersDeny = []string{"X-A,X-B"} }, `--replay-headers-deny: "X-A,X-B" is not a header name`, `replay_headers_deny: "X-A,X-B"`},
		{func(s *Settings) { s.ReplayHeadersDeny = []string{"content-encoding"} }, `--replay-headers-deny: Content-Encoding says how to read the stored body`,
			`replay_headers_deny: Content-Encoding`},
	} {
		s := DefaultSettings()
		tc.set(&s)
		if err := s.Validate(flag); err == nil || !strings.Contains(err.Error(), tc.flag) {
			t.Errorf("got %v, want %q", err, tc.flag)
		}
		if err := s.Validate(Underscored); err == nil || !strings.HasPrefix(err.Error(), tc.file) {
			t.Errorf("got %v, want it to start %q", err, tc.file)
		}
	}
	for i, set := range []func(*Settings){
		func(s *Settings) { s.Key = "header:X-GitHub-Delivery" },
		func(s *Settings) { s.Key = "json:/data/object/id" },
		func(s *Settings) { s.Webhook, s.WebhookSecretFile = "github", "secrets" },
		func(s *Settings) { s.Webhook, s.WebhookSecretEnv, s.WebhookTolerance = "stripe", "S", 10*time.Minute },
		func(s *Settings) { s.Fingerprint, s.FingerprintExclude = "json", []string{"/attempt", "/a~1b"} },
		func(s *Settings) { s.FingerprintFields = []string{"/amount"} },
		func(s *Settings) { s.Profile = "stripe" },
		func(s *Settings) {
			s.ReplayHeadersAllow, s.ReplayHeadersDeny = []string{"x-request-id", "Content-Type"}, []string{"Set-Cookie", "X-Session-Token"}
		},
	} {
		s := DefaultSettings()
		set(&s)
		if err := s.Validate(flag); err != nil {
			t.Errorf("valid settings %d: %v", i, err)
		}
	}
}

// TestSettingsConfig: the sidecars' 0 (no wait, no limit) is idemhttp's
// negative; an unset quota is NoQuota, not idemhttp's default; the
// store statuses are the only ones stored.
func TestSettingsConfig(t *testing.T) {
	s := DefaultSettings()
	s.Wait, s.ClientWriteTimeout, s.StoreStatuses = 0, 0, []int{201}
	cfg := s.Config(nil, nil, Env{Metrics: NewMetrics(Underscored)})
	if cfg.Wait != -1 || cfg.ClientWriteTimeout != -1 {
		t.Errorf("Wait %v, ClientWriteTimeout %v: want -1 each (none)", cfg.Wait, cfg.ClientWriteTimeout)
	}
	if cfg.Quota != idemhttp.NoQuota {
		t.Errorf("Quota %v, want NoQuota", cfg.Quota)
	}
	if !cfg.ShouldStore(nil, 201) || cfg.ShouldStore(nil, 200) {
		t.Errorf("ShouldStore: want 201 alone stored")
	}
	if got := DefaultSettings().Config(nil, nil, Env{}).Wait; got != idemhttp.DefaultWait {
		t.Errorf("default Wait %v, want idemhttp.DefaultWait", got)
	}
	s.ReplayHeadersAllow, s.ReplayHeadersDeny = []string{"X-Request-Id"}, []string{"X-Session-Token"}
	if cfg := s.Config(nil, nil, Env{Metrics: NewMetrics(Underscored)}); !slices.Equal(cfg.ReplayHeaderAllowlist, s.ReplayHeadersAllow) ||
		!slices.Equal(cfg.ReplayHeaderDenylist, s.ReplayHeadersDeny) {
		t.Errorf("ReplayHeaderAllowlist %q, ReplayHeaderDenylist %q: want the settings' lists", cfg.ReplayHeaderAllowlist, cfg.ReplayHeaderDenylist)
	}
}

// TestReplayHeadersAsIdemhttp: Validate refuses a name in a replay header
// list exactly when idemhttp.NewMiddleware does (it checks them first, to
// name the setting).
func TestReplayHeadersAsIdemhttp(t *testing.T) {
	names := []string{"", "X Y", "X-Ok", "content-type", "Content-Length", "Date", "Location", "Grpc-Message", "Grpc-Status-Details-Bin",
		"Idempotency-Key", "Idempotency-Key-Lifetime", "Authorization", "Cookie", "Vary", "ETag"}
	names = append(names, neverStored...)
	names = append(names, bodyReaders...)
	for _, n := range slices.Clone(names) {
		names = append(names, strings.ToLower(n), strings.ToUpper(n))
	}
	for _, n := range names {
		for _, s := range []Settings{{ReplayHeadersAllow: []string{n}}, {ReplayHeadersDeny: []string{n}}} {
			_, mwErr := idemhttp.NewMiddleware(memstore.New(memstore.Options{}), idemhttp.Config{ReplayHeaderAllowlist: s.ReplayHeadersAllow,
				ReplayHeaderDenylist: s.ReplayHeadersDeny})
			if err := s.validateReplayHeaders(Underscored); (err == nil) != (mwErr == nil) {
				t.Errorf("allow %q, deny %q: Validate says %v, idemhttp %v", s.ReplayHeadersAllow, s.ReplayHeadersDeny, err, mwErr)
			}
		}
	}
}

// TestQuota: the memory store's default quota, and none for a store of
// unknown size.
func TestQuota(t *testing.T) {
	if q := DefaultQuota(0); !q.None() || q.New(0) != idemhttp.NoQuota {
		t.Errorf("DefaultQuota(0) = %+v, want none", q)
	}
	q := DefaultQuota(128 << 20)
	if q.InFlight != idemhttp.DefaultQuotaInFlight || q.Bytes != 16<<20 || q.Records != 0 {
		t.Errorf("DefaultQuota(128 MiB) = %+v, want in flight %d, bytes 16 MiB", q, idemhttp.DefaultQuotaInFlight)
	}
	if n := q.New(7); n.InFlight != q.InFlight || n.Bytes != q.Bytes || n.Tenants != 7 {
		t.Errorf("New(7) = %+v", n)
	}
}

// TestOpenStoreErrors: an error in the URL is a BadStore that names the
// setting as the front end does, without the URL.
func TestOpenStoreErrors(t *testing.T) {
	for _, name := range []string{"--store", "store"} {
		_, _, err := OpenStore(context.Background(), "mongodb://u:s3cret@h/db", "", StoreOptions{Name: name})
		var bad BadStore
		if !errors.As(err, &bad) || !strings.HasPrefix(bad.Msg, name+`: unknown scheme "mongodb"`) || strings.Contains(bad.Msg, "s3cret") {
			t.Errorf("%s: got %v, want a BadStore %q… without the password", name, err, name+": unknown scheme")
		}
	}
	s, closeStore, err := OpenStore(context.Background(), "memory", "", StoreOptions{})
	if err != nil || s == nil {
		t.Fatalf("memory: %v", err)
	}
	closeStore()
}
