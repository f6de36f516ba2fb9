package main

import (
	"io"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/sidecar"
)

// TestRouteOverrideFields checks that routeOverride, the one list of a
// route's settings, is read whole: each of its fields (match aside), set
// alone, changes what apply returns, is named by settingsSet (methods
// aside) and routeFields, and every field of routeSettings is set by one
// of them.
func TestRouteOverrideFields(t *testing.T) {
	reached := map[string]bool{} // routeSettings fields some override changes
	settings := reflect.TypeFor[routeSettings]()
	for _, f := range reflect.VisibleFields(reflect.TypeFor[routeOverride]()) {
		name := yamlName(f)
		if name == "" {
			t.Errorf("routeOverride.%s: no yaml tag", f.Name)
			continue
		}
		if !strings.Contains(", "+routeFields+", ", ", "+name+", ") {
			t.Errorf("routeFields = %q, want it to name %s", routeFields, name)
		}
		if name == "match" {
			continue
		}
		if f.Type.Kind() != reflect.Pointer {
			t.Errorf("routeOverride.%s is a %v, want a pointer (nil: keep the flag's value)", f.Name, f.Type)
			continue
		}
		var o routeOverride
		reflect.ValueOf(&o).Elem().FieldByIndex(f.Index).Set(nonZero(f.Type.Elem()))
		if set := o.settingsSet(); name != "methods" && !slices.Equal(set, []string{name}) {
			t.Errorf("with only %s set, settingsSet() = %q, want [%s]", name, set, name)
		}
		got := reflect.ValueOf(o.apply(routeSettings{}))
		changed := false
		for _, sf := range reflect.VisibleFields(settings) {
			if !got.FieldByIndex(sf.Index).IsZero() {
				reached[sf.Name], changed = true, true
			}
		}
		if !changed {
			t.Errorf("with only %s set, apply changes nothing: give routeOverride.apply a case for %s", name, f.Name)
		}
	}
	for _, sf := range reflect.VisibleFields(settings) {
		if sf.Name == "Seal" {
			continue // the process's (--seal-keys, --seal-kms, --seal-open-only), not a route's: the file does not set it
		}
		if !reached[sf.Name] {
			t.Errorf("routeSettings.%s: no field of routeOverride sets it (a route setting the file cannot set)", sf.Name)
		}
	}
}

// nonZero returns a value of type t that is not its zero value: true, a
// non-empty string, 7777, a slice of one such element.
func nonZero(t reflect.Type) reflect.Value {
	v := reflect.New(t)
	switch t.Kind() {
	case reflect.Bool:
		v.Elem().SetBool(true)
	case reflect.String:
		v.Elem().SetString("X-Tenant")
	case reflect.Int, reflect.Int64:
		v.Elem().SetInt(7777)
	case reflect.Slice:
		v.Elem().Set(reflect.Append(reflect.MakeSlice(t, 0, 1), nonZero(t.Elem()).Elem()))
	default:
		panic("nonZero: add a case for " + t.String())
	}
	return v
}

// TestProxyConfigKeys: a route's key source, webhook, fingerprint and
// answer settings over the flags': a route's key replaces an inherited
// webhook (its secrets and tolerance too) and its webhook an inherited
// key; either source of secrets replaces the inherited one; either
// fingerprint list replaces both of the flags'; the rest is kept.
func TestProxyConfigKeys(t *testing.T) {
	t.Parallel()
	webhookFlags := sidecar.DefaultSettings()
	webhookFlags.Webhook, webhookFlags.WebhookSecretEnv, webhookFlags.WebhookTolerance = "stripe", "STRIPE_SECRETS", time.Minute
	webhookFlags.FingerprintExclude, webhookFlags.Profile, webhookFlags.EchoKey = []string{"/attempt"}, "stripe", true
	keyFlags := sidecar.DefaultSettings()
	keyFlags.Key, keyFlags.FingerprintFields, keyFlags.LifetimeHeader = "header:X-Request-Id", []string{"/amount"}, true
	type keys struct {
		Key, Webhook, SecretFile, SecretEnv string
		Tolerance                           time.Duration
		Fingerprint                         string
		Exclude, Fields                     []string
		Profile                             string
		EchoKey, Lifetime                   bool
	}
	of := func(s routeSettings) keys {
		return keys{s.Key, s.Webhook, s.WebhookSecretFile, s.WebhookSecretEnv, s.WebhookTolerance, s.Fingerprint,
			s.FingerprintExclude, s.FingerprintFields, s.Profile, s.EchoKey, s.LifetimeHeader}
	}
	for _, c := range []struct {
		name  string
		flags routeSettings
		route string // the route's fields, one a line
		want  keys
	}{
		{"nothing set keeps the flags' webhook", webhookFlags, "",
			keys{Webhook: "stripe", SecretEnv: "STRIPE_SECRETS", Tolerance: time.Minute, Exclude: []string{"/attempt"}, Profile: "stripe", EchoKey: true}},
		{"key replaces the webhook", webhookFlags, "key: json:/id",
			keys{Key: "json:/id", Exclude: []string{"/attempt"}, Profile: "stripe", EchoKey: true}},
		{"webhook: \"\" drops it", webhookFlags, `webhook: ""`,
			keys{Exclude: []string{"/attempt"}, Profile: "stripe", EchoKey: true}},
		{"secret file replaces the variable", webhookFlags, "webhook_secret_file: /run/secrets/stripe",
			keys{Webhook: "stripe", SecretFile: "/run/secrets/stripe", Tolerance: time.Minute, Exclude: []string{"/attempt"}, Profile: "stripe", EchoKey: true}},
		{"another preset drops the secrets' source", webhookFlags, "webhook: standard-webhooks\nwebhook_secret_env: SVIX_SECRETS\nwebhook_tolerance: 2m",
			keys{Webhook: "standard-webhooks", SecretEnv: "SVIX_SECRETS", Tolerance: 2 * time.Minute, Exclude: []string{"/attempt"}, Profile: "stripe", EchoKey: true}},
		{"fields replace exclude", webhookFlags, "fingerprint_fields: [/amount, /currency]",
			keys{Webhook: "stripe", SecretEnv: "STRIPE_SECRETS", Tolerance: time.Minute, Fields: []string{"/amount", "/currency"}, Profile: "stripe", EchoKey: true}},
		{"an empty list drops the flags'", webhookFlags, "fingerprint_exclude: []\nprofile: ietf\necho_key: false",
			keys{Webhook: "stripe", SecretEnv: "STRIPE_SECRETS", Tolerance: time.Minute, Exclude: []string{}, Profile: "ietf"}},
		{"fingerprint: raw drops the flags' list", webhookFlags, "fingerprint: raw",
			keys{Webhook: "stripe", SecretEnv: "STRIPE_SECRETS", Tolerance: time.Minute, Fingerprint: "raw", Profile: "stripe", EchoKey: true}},
		{"another preset drops the secrets and the tolerance", webhookFlags, "webhook: github\nwebhook_secret_file: /run/secrets/github",
			keys{Webhook: "github", SecretFile: "/run/secrets/github", Exclude: []string{"/attempt"}, Profile: "stripe", EchoKey: true}},
		{"the same preset keeps them", webhookFlags, "webhook: stripe",
			keys{Webhook: "stripe", SecretEnv: "STRIPE_SECRETS", Tolerance: time.Minute, Exclude: []string{"/attempt"}, Profile: "stripe", EchoKey: true}},
		{"webhook replaces the key", keyFlags, "webhook: github\nwebhook_secret_env: GH_SECRETS",
			keys{Webhook: "github", SecretEnv: "GH_SECRETS", Fields: []string{"/amount"}, Lifetime: true}},
		{"key replaces the key", keyFlags, "key: header:X-Shopify-Webhook-Id\nlifetime_header: false\nfingerprint: json",
			keys{Key: "header:X-Shopify-Webhook-Id", Fingerprint: "json", Fields: []string{"/amount"}}},
		{"exclude replaces fields", keyFlags, "fingerprint_exclude: [/ts]",
			keys{Key: "header:X-Request-Id", Exclude: []string{"/ts"}, Lifetime: true}},
	} {
		t.Run(c.name, func(t *testing.T) {
			path := filepath.Join(t.TempDir(), "routes.yaml")
			text := "routes:\n  - match: /hooks/\n    methods: [POST]\n"
			for line := range strings.Lines(c.route) {
				text += "    " + strings.TrimSuffix(line, "\n") + "\n"
			}
			writeFile(t, path, text)
			routes, err := loadProxyConfig(path, c.flags)
			if err != nil {
				t.Fatalf("route %q: %v; want it loaded", c.route, err)
			}
			if got := of(routes[0].settings); !reflect.DeepEqual(got, c.want) {
				t.Errorf("flags %+v, route %q:\ngot  %+v\nwant %+v", of(c.flags), c.route, got, c.want)
			}
		})
	}
}

// TestProxyConfigKeyErrors: a bad key source, webhook, fingerprint or
// profile of a route is refused in one line naming the file, the route and
// the field (as the file spells it), as Settings.Validate words it.
func TestProxyConfigKeyErrors(t *testing.T) {
	t.Parallel()
	webhookFlags := sidecar.DefaultSettings()
	webhookFlags.Webhook, webhookFlags.WebhookSecretEnv = "github", "GH_SECRETS"
	for _, c := range []struct {
		flags routeSettings
		route string
		want  []string
	}{
		{sidecar.DefaultSettings(), "key: X-Id", []string{`key "X-Id"`, "want header:NAME or json:/pointer"}},
		{sidecar.DefaultSettings(), `key: "header:X Id"`, []string{`key "header:X Id"`, "not a header name"}},
		{sidecar.DefaultSettings(), "key: json:id", []string{`key "json:id"`, "not a JSON Pointer"}},
		{sidecar.DefaultSettings(), "webhook: gitlab", []string{"webhook:", `"gitlab"`, "github, shopify, standard-webhooks, stripe"}},
		{sidecar.DefaultSettings(), "webhook: github", []string{"webhook github", "webhook_secret_file", "webhook_secret_env"}},
		{sidecar.DefaultSettings(), "webhook: github\nwebhook_secret_file: /a\nwebhook_secret_env: B", []string{"webhook github", "set one of webhook_secret_file and webhook_secret_env"}},
		{sidecar.DefaultSettings(), "webhook_secret_env: B", []string{"webhook_secret_env", "need webhook"}},
		{webhookFlags, "key: header:X-Id\nwebhook: github", []string{`key "header:X-Id" and webhook github`, "drop key"}},
		{webhookFlags, "webhook_tolerance: 10m", []string{"webhook_tolerance 10m0s", "github signs no timestamp"}},
		{webhookFlags, "webhook: stripe\nwebhook_secret_env: STRIPE_SECRETS\nwebhook_tolerance: -1s", []string{"webhook_tolerance -1s", "must not be negative"}},
		{webhookFlags, "webhook: stripe", []string{"webhook stripe", "set one of webhook_secret_file and webhook_secret_env"}},
		{webhookFlags, "webhook_tolerance: 10", []string{`line 4: webhook_tolerance: "10" is not a duration`}},
		{sidecar.DefaultSettings(), "fingerprint: bytes", []string{`fingerprint "bytes"`, "want raw"}},
		{sidecar.DefaultSettings(), "fingerprint: raw\nfingerprint_exclude: [/ts]", []string{"fingerprint raw", "need json"}},
		{sidecar.DefaultSettings(), "fingerprint_exclude: [/ts]\nfingerprint_fields: [/id]", []string{"fingerprint_exclude and fingerprint_fields", "not both"}},
		{sidecar.DefaultSettings(), "fingerprint_fields: [id]", []string{"fingerprint_fields", `"id" is not a JSON Pointer`}},
		{sidecar.DefaultSettings(), "fingerprint_exclude: /ts", []string{"line 4: fingerprint_exclude: /ts is not a list"}},
		{sidecar.DefaultSettings(), "profile: paypal", []string{`profile "paypal"`, "want one of ietf, acp, stripe"}},
		{sidecar.DefaultSettings(), "echo_key: yes please", []string{"line 4: echo_key: cannot unmarshal", "into bool"}},
	} {
		path := filepath.Join(t.TempDir(), "bad.yaml")
		text := "routes:\n  - match: /hooks/\n    methods: [POST]\n"
		for line := range strings.Lines(c.route) {
			text += "    " + strings.TrimSuffix(line, "\n") + "\n"
		}
		writeFile(t, path, text)
		_, err := loadProxyConfig(path, c.flags)
		if err == nil {
			t.Errorf("route %q: loaded; want an error", c.route)
			continue
		}
		msg := err.Error()
		if strings.Contains(msg, "\n") || !strings.Contains(msg, "bad.yaml") {
			t.Errorf("route %q: error %q; want one line naming bad.yaml", c.route, msg)
		}
		for _, w := range c.want {
			if !strings.Contains(msg, w) {
				t.Errorf("route %q: error %q does not say %q", c.route, msg, w)
			}
		}
	}
}

// TestProxyKeyFlags: the flags of key sources, webhooks, fingerprints and
// answers reach the flags' settings: --key-header as a header key, the
// pointer lists split at commas and trimmed.
func TestProxyKeyFlags(t *testing.T) {
	for _, c := range []struct {
		args []string
		want func(routeSettings) bool
		what string
	}{
		{[]string{"--key-header", "X-Request-Id"}, func(s routeSettings) bool { return s.Key == "header:X-Request-Id" }, "Key header:X-Request-Id"},
		{nil, func(s routeSettings) bool {
			return s.Key == "" && s.Webhook == "" && s.Profile == "" && !s.EchoKey && !s.LifetimeHeader
		}, "none set"},
		{[]string{"--fingerprint-exclude", "/attempt, /sent_at"}, func(s routeSettings) bool {
			return slices.Equal(s.FingerprintExclude, []string{"/attempt", "/sent_at"}) && s.FingerprintFields == nil
		}, "FingerprintExclude [/attempt /sent_at]"},
		{[]string{"--fingerprint-fields", "/amount", "--fingerprint", "json"}, func(s routeSettings) bool {
			return slices.Equal(s.FingerprintFields, []string{"/amount"}) && s.Fingerprint == "json"
		}, "FingerprintFields [/amount], Fingerprint json"},
		{[]string{"--webhook", "stripe", "--webhook-secret-env", "STRIPE_SECRETS", "--webhook-tolerance", "10m", "--profile", "stripe", "--echo-key", "--lifetime-header"},
			func(s routeSettings) bool {
				return s.Webhook == "stripe" && s.WebhookSecretEnv == "STRIPE_SECRETS" && s.WebhookSecretFile == "" && s.WebhookTolerance == 10*time.Minute &&
					s.Profile == "stripe" && s.EchoKey && s.LifetimeHeader && s.Key == ""
			}, "the webhook stripe, its variable and tolerance, profile stripe, echo and lifetime"},
	} {
		o, err := parseProxyFlags(append([]string{"--upstream", "http://127.0.0.1:1"}, c.args...), io.Discard)
		if err == nil {
			_, err = o.validate()
		}
		if err != nil {
			t.Errorf("%q: %v; want it valid", c.args, err)
			continue
		}
		if !c.want(o.settings) {
			t.Errorf("%q: settings %+v; want %s", c.args, o.settings, c.what)
		}
	}
}

// TestProxyConfigReplayHeaders: a route's replay_headers_allow and
// replay_headers_deny each replace the flags' list ([]: none), and a
// route that sets neither keeps both.
func TestProxyConfigReplayHeaders(t *testing.T) {
	t.Parallel()
	flags := sidecar.DefaultSettings()
	flags.ReplayHeadersAllow, flags.ReplayHeadersDeny = []string{"Location"}, []string{"X-Session-Token"}
	for _, c := range []struct {
		route       string
		allow, deny []string
	}{
		{"require_key: true", []string{"Location"}, []string{"X-Session-Token"}},
		{"replay_headers_allow: [X-Request-Id, Location]", []string{"X-Request-Id", "Location"}, []string{"X-Session-Token"}},
		{"replay_headers_allow: []", []string{}, []string{"X-Session-Token"}},
		{"replay_headers_deny: [X-Debug]", []string{"Location"}, []string{"X-Debug"}},
		{"replay_headers_deny: []\nreplay_headers_allow: [ETag]", []string{"ETag"}, []string{}},
	} {
		path := filepath.Join(t.TempDir(), "routes.yaml")
		text := "routes:\n  - match: /pay/\n    methods: [POST]\n"
		for line := range strings.Lines(c.route) {
			text += "    " + strings.TrimSuffix(line, "\n") + "\n"
		}
		writeFile(t, path, text)
		routes, err := loadProxyConfig(path, flags)
		if err != nil {
			t.Fatalf("route %q: %v", c.route, err)
		}
		if s := routes[0].settings; !reflect.DeepEqual(s.ReplayHeadersAllow, c.allow) || !reflect.DeepEqual(s.ReplayHeadersDeny, c.deny) {
			t.Errorf("route %q: allow %q, deny %q; want %q, %q", c.route, s.ReplayHeadersAllow, s.ReplayHeadersDeny, c.allow, c.deny)
		}
	}
	if !slices.Equal(flags.ReplayHeadersAllow, []string{"Location"}) {
		t.Errorf("the flags' list was changed: %q", flags.ReplayHeadersAllow)
	}
}
