package sidecar

import (
	"errors"
	"fmt"
	"net/http"
	"slices"
	"strings"
	"time"

	"golang.org/x/net/http/httpguts"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/internal/jsonptr"
	"github.com/idemkit/idem/internal/webhook"
)

// Settings is what the idemhttp middleware does on one route, in the
// sidecars' terms: idem proxy's flags (and each route of its --config
// file, which overrides some of them) and the Caddy handler's fields
// both come down to it, so that each setting is checked and mapped to
// idemhttp.Config once. A zero duration or size means what the sidecars
// document for 0 (no wait, no limit), not idemhttp's default: the front
// ends fill their defaults in first (DefaultSettings).
type Settings struct {
	Methods      []string // covered methods; empty: none (the route is not covered)
	RequireKey   bool
	TenantHeader string // "": idemhttp.DefaultTenant
	TenantCookie string // idemhttp.TenantFromCookie; at most one of it and TenantHeader is set
	Lease        time.Duration
	Retention    time.Duration
	Wait         time.Duration // 0: 409 at once
	FailOpen     bool
	MaxBody      int64
	MaxResponse  int64
	// StoreStatuses: nil, idemhttp.DefaultShouldStore; empty, none.
	StoreStatuses []int
	MaxExecution  time.Duration // 0: none
	// ClientWriteTimeout: a keyed request's client that does not take a
	// write (32 KiB at most) within this long is gone (idemhttp
	// Config.ClientWriteTimeout); 0: none.
	ClientWriteTimeout time.Duration
	// CancelOnDisconnect: the client's disconnect cancels the upstream
	// request (unsafe; idemhttp Config.CancelOnDisconnect).
	CancelOnDisconnect bool
	// RefuseAnonymous: keyed requests that no tenant source identifies get
	// 401 (idemhttp Config.RefuseAnonymous).
	RefuseAnonymous bool
	// QuotaInFlight, QuotaRecords, QuotaBytes: each tenant's limits
	// (idemhttp.Quota); 0: none. OwnQuota: a route of idem proxy's
	// --config file sets one of them, and counts its tenants on its own
	// rather than with the flags' routes.
	QuotaInFlight int
	QuotaRecords  int
	QuotaBytes    int64
	OwnQuota      bool

	// Key is where a request's idempotency key is (KeySpec's forms): ""
	// the Idempotency-Key header, "header:NAME" a header of the
	// sender's, "json:/pointer" a field of a JSON body (RFC 6901). Not
	// with Webhook, whose preset names its key.
	Key string
	// Webhook names a webhook preset (internal/webhook: github, stripe,
	// shopify, standard-webhooks): each request's signature is verified
	// over the raw body before its key (the preset's) is claimed, and one
	// that does not verify gets 401, is not forwarded and claims nothing.
	// Its secrets are read from WebhookSecretFile or WebhookSecretEnv
	// (exactly one of them), one a line, when the middleware is made
	// (KeySource). A delivery's tenant is its sender, "webhook:" + the
	// preset's name, whatever the route's tenant source (Config).
	Webhook           string
	WebhookSecretFile string
	WebhookSecretEnv  string
	// WebhookTolerance bounds a signed timestamp's distance from now
	// (stripe, standard-webhooks); 0: the preset's (5 minutes).
	WebhookTolerance time.Duration
	// Fingerprint is what of the body a retry must repeat: "" or "raw"
	// (the bytes, idemhttp.DefaultFingerprint), "json" (its canonical
	// JSON, RFC 8785, idemhttp.FingerprintJSON). FingerprintExclude
	// (pointers left out: a sender's retry counter or timestamp) and
	// FingerprintFields (the only pointers in it) each imply "json", and
	// at most one of them is set.
	Fingerprint        string
	FingerprintExclude []string
	FingerprintFields  []string
	// Profile is how a mismatch and a key in flight are answered: ""
	// or "ietf" (422 and 409 problem+json, the IETF draft's), "acp" (409
	// idempotency_conflict and 409 idempotency_in_flight, the Agentic
	// Commerce Protocol's), "stripe" (400 and 409 idempotency_error, as
	// Stripe answers).
	Profile string
	// EchoKey: every response to a keyed request carries its key in an
	// Idempotency-Key header (idemhttp Config.EchoKey).
	EchoKey bool
	// LifetimeHeader: every response to a request of a covered method
	// advertises the retention in an Idempotency-Key-Lifetime header
	// (idemhttp Config.LifetimeHeader).
	LifetimeHeader bool
	// ReplayHeadersAllow, when not empty, names the only response headers
	// stored and replayed, besides those that say what the body is
	// (idemhttp Config.ReplayHeaderAllowlist); ReplayHeadersDeny names
	// headers never stored, and wins (Config.ReplayHeaderDenylist).
	ReplayHeadersAllow []string
	ReplayHeadersDeny  []string
	// Seal is how stored responses are sealed at rest: the process's,
	// not a route's (its Sealer, made once, is Env.Seal; idem proxy's
	// --config file does not set it).
	Seal SealSettings
}

// Profiles are the names Settings.Profile takes.
var Profiles = []string{"ietf", "acp", "stripe"}

// DefaultSettings are the settings of a sidecar configured with nothing:
// POST and PATCH covered, idem's lease and retention, idemhttp's wait,
// sizes and client write timeout, no quota (the front end resolves it:
// DefaultQuota).
func DefaultSettings() Settings {
	return Settings{
		Methods:            []string{http.MethodPost, http.MethodPatch},
		Lease:              idem.DefaultLease,
		Retention:          idem.DefaultRetention,
		Wait:               idemhttp.DefaultWait,
		MaxBody:            idemhttp.DefaultMaxBodySize,
		MaxResponse:        idemhttp.DefaultMaxResponseSize,
		ClientWriteTimeout: idemhttp.DefaultClientWriteTimeout,
	}
}

// Validate reports the first bad setting in one line; name turns a
// setting's name, written with dashes (max-body), into how the front end
// spells it ("--max-body" for a flag, "max_body" in a file or a
// Caddyfile).
func (s Settings) Validate(name func(string) string) error {
	switch {
	case s.Lease < 10*time.Millisecond:
		return fmt.Errorf("%s %v: want at least 10ms", name("lease"), s.Lease)
	case s.Retention < time.Second:
		return fmt.Errorf("%s %v: want at least 1s", name("retention"), s.Retention)
	case s.Wait < 0:
		return fmt.Errorf("%s %v: must not be negative (0: no wait, 409 at once)", name("wait"), s.Wait)
	case s.MaxExecution < 0:
		return fmt.Errorf("%s %v: must not be negative (0: no limit)", name("max-execution"), s.MaxExecution)
	case s.ClientWriteTimeout < 0:
		return fmt.Errorf("%s %v: must not be negative (0: no limit)", name("client-write-timeout"), s.ClientWriteTimeout)
	case s.QuotaInFlight < 0:
		return fmt.Errorf("%s %d: must not be negative (0: no limit)", name("quota-in-flight"), s.QuotaInFlight)
	case s.QuotaRecords < 0:
		return fmt.Errorf("%s %d: must not be negative (0: no limit)", name("quota-records"), s.QuotaRecords)
	case s.QuotaBytes < 0:
		return fmt.Errorf("%s %d: must not be negative (0: no limit)", name("quota-bytes"), s.QuotaBytes)
	case s.MaxBody < 1:
		return fmt.Errorf("%s %d: want at least 1 byte", name("max-body"), s.MaxBody)
	case s.MaxResponse < 1 || s.MaxResponse > idem.MaxEncodedBody:
		return fmt.Errorf("%s %d: want 1 to %d bytes", name("max-response"), s.MaxResponse, idem.MaxEncodedBody)
	}
	for _, m := range s.Methods {
		if err := CheckMethod(m); err != nil {
			return fmt.Errorf("%s: %v", name("methods"), err)
		}
	}
	if s.TenantHeader != "" && !httpguts.ValidHeaderFieldName(s.TenantHeader) {
		return fmt.Errorf("%s %q: not a header name", name("tenant-header"), s.TenantHeader)
	}
	if s.TenantCookie != "" && !httpguts.ValidHeaderFieldName(s.TenantCookie) {
		return fmt.Errorf("%s %q: not a cookie name", name("tenant-cookie"), s.TenantCookie)
	}
	if s.TenantHeader != "" && s.TenantCookie != "" {
		return fmt.Errorf("%s %q and %s %q: set one tenant source, not both", name("tenant-header"), s.TenantHeader,
			name("tenant-cookie"), s.TenantCookie)
	}
	if err := s.validateKeys(name); err != nil {
		return err
	}
	for _, st := range s.StoreStatuses {
		if st < 200 || st > 599 {
			return fmt.Errorf("%s: %d is not a final HTTP status (200-599)", name("store-statuses"), st)
		}
	}
	if err := s.validateReplayHeaders(name); err != nil {
		return err
	}
	return s.Seal.Validate(name)
}

// Headers the replay header lists may not name: an allowlist those never
// stored, a denylist those without which the stored body is unreadable.
// They are idemhttp's rules (NewMiddleware refuses the same names;
// TestReplayHeadersAsIdemhttp checks), checked here to name the setting.
var (
	neverStored = []string{"Set-Cookie", "Connection", "Keep-Alive", "Proxy-Connection", "Transfer-Encoding", "Upgrade", "Te",
		"Trailer", "Proxy-Authenticate", "Proxy-Authorization", idemhttp.HeaderReplayed, "Idempotent-Caller-Cookies"}
	bodyReaders = []string{"Content-Encoding", "Grpc-Encoding", "Grpc-Status"}
)

// validateReplayHeaders checks the replay header lists.
func (s Settings) validateReplayHeaders(name func(string) string) error {
	for _, list := range []struct {
		setting string
		names   []string
		refused []string
		why     string
	}{
		{"replay-headers-allow", s.ReplayHeadersAllow, neverStored, "is never stored (Set-Cookie, hop-by-hop headers and idem's own are dropped whatever the lists say)"},
		{"replay-headers-deny", s.ReplayHeadersDeny, bodyReaders, "says how to read the stored body (a replay without it is not the answer the client got)"},
	} {
		for _, h := range list.names {
			if !httpguts.ValidHeaderFieldName(h) {
				return fmt.Errorf("%s: %q is not a header name", name(list.setting), h)
			}
			if c := http.CanonicalHeaderKey(h); slices.Contains(list.refused, c) {
				return fmt.Errorf("%s: %s %s; drop it", name(list.setting), c, list.why)
			}
		}
	}
	return nil
}

// validateKeys checks the key source, webhook, fingerprint and profile
// settings (not the secrets' contents: the middleware reads them).
func (s Settings) validateKeys(name func(string) string) error {
	if s.Key != "" {
		if _, err := KeySpec(s.Key); err != nil {
			return fmt.Errorf("%s %q: %v", name("key"), s.Key, err)
		}
	}
	if s.Webhook != "" {
		p, err := webhook.Lookup(s.Webhook)
		if err != nil {
			return fmt.Errorf("%s: %v", name("webhook"), err)
		}
		switch {
		case len(s.Methods) == 0:
			return fmt.Errorf("%s %s: the route covers no methods; want %s with POST", name("webhook"), s.Webhook, name("methods"))
		case s.Key != "":
			return fmt.Errorf("%s %q and %s %s: the preset names its key; drop %s", name("key"), s.Key, name("webhook"), s.Webhook, name("key"))
		case (s.WebhookSecretFile == "") == (s.WebhookSecretEnv == ""):
			return fmt.Errorf("%s %s: set one of %s and %s (its signing secrets, one a line)", name("webhook"), s.Webhook,
				name("webhook-secret-file"), name("webhook-secret-env"))
		case s.WebhookTolerance < 0:
			return fmt.Errorf("%s %v: must not be negative (0: the preset's)", name("webhook-tolerance"), s.WebhookTolerance)
		case s.WebhookTolerance != 0 && p.Tolerance == 0:
			return fmt.Errorf("%s %v: %s signs no timestamp; drop it", name("webhook-tolerance"), s.WebhookTolerance, s.Webhook)
		case s.WebhookTolerance != 0 && s.WebhookTolerance < time.Second:
			return fmt.Errorf("%s %v: want at least 1s", name("webhook-tolerance"), s.WebhookTolerance)
		}
	} else if s.WebhookSecretFile != "" || s.WebhookSecretEnv != "" || s.WebhookTolerance != 0 {
		return fmt.Errorf("%s, %s and %s need %s (one of %s)", name("webhook-secret-file"), name("webhook-secret-env"),
			name("webhook-tolerance"), name("webhook"), strings.Join(webhook.Names(), ", "))
	}
	switch s.Fingerprint {
	case "", "raw", "json":
	default:
		return fmt.Errorf("%s %q: want raw (the body's bytes) or json (its canonical JSON)", name("fingerprint"), s.Fingerprint)
	}
	if len(s.FingerprintExclude) > 0 && len(s.FingerprintFields) > 0 {
		return fmt.Errorf("%s and %s: set one, not both", name("fingerprint-exclude"), name("fingerprint-fields"))
	}
	if s.Fingerprint == "raw" && len(s.FingerprintExclude)+len(s.FingerprintFields) > 0 {
		return fmt.Errorf("%s raw: %s and %s need json", name("fingerprint"), name("fingerprint-exclude"), name("fingerprint-fields"))
	}
	for _, list := range []struct {
		setting string
		ptrs    []string
	}{{"fingerprint-exclude", s.FingerprintExclude}, {"fingerprint-fields", s.FingerprintFields}} {
		for _, ptr := range list.ptrs {
			if _, err := jsonptr.Parse(ptr); err != nil || ptr == "" {
				return fmt.Errorf("%s: %q is not a JSON Pointer to a field; want /field or /a/b (RFC 6901)", name(list.setting), ptr)
			}
		}
	}
	if s.Profile != "" && !slices.Contains(Profiles, s.Profile) {
		return fmt.Errorf("%s %q: want one of %s", name("profile"), s.Profile, strings.Join(Profiles, ", "))
	}
	return nil
}

// KeyName names the key source of s for a log line: "webhook:" and the
// preset, the Key setting, or "header:Idempotency-Key".
func (s Settings) KeyName() string {
	switch {
	case s.Webhook != "":
		return "webhook:" + s.Webhook
	case s.Key != "":
		return s.Key
	}
	return "header:" + idemhttp.HeaderKey
}

// KeySpec parses a key source as the sidecars spell it: header:NAME (a
// header's value, as Idempotency-Key's is read) or json:/pointer (a field
// of a JSON body, RFC 6901).
func KeySpec(spec string) (idemhttp.KeySource, error) {
	kind, arg, ok := strings.Cut(spec, ":")
	var src idemhttp.KeySource
	switch {
	case ok && kind == "header":
		if !httpguts.ValidHeaderFieldName(arg) {
			return src, fmt.Errorf("%q is not a header name; want header:NAME, say header:X-GitHub-Delivery", arg)
		}
		return idemhttp.KeyFromHeader(arg), nil
	case ok && kind == "json":
		if _, err := jsonptr.Parse(arg); err != nil || arg == "" {
			return src, fmt.Errorf("%q is not a JSON Pointer to a field; want json:/field or json:/a/b (RFC 6901)", arg)
		}
		return idemhttp.KeyFromJSON(arg), nil
	}
	return src, errors.New("want header:NAME or json:/pointer")
}

// Underscored is the name function of Validate for a file or a
// Caddyfile: max-body is max_body.
func Underscored(n string) string { return strings.ReplaceAll(n, "-", "_") }

// ParseMethods parses a comma-separated method list, upper-cased, each
// once.
func ParseMethods(list string) []string {
	var methods []string
	for m := range strings.SplitSeq(list, ",") {
		if m = strings.ToUpper(strings.TrimSpace(m)); m != "" && !slices.Contains(methods, m) {
			methods = append(methods, m)
		}
	}
	return methods
}

// CheckMethod accepts an upper-case RFC 9110 token (a method is one, as a
// header or cookie name is: httpguts checks tokens).
func CheckMethod(m string) error {
	if !httpguts.ValidHeaderFieldName(m) || strings.ToUpper(m) != m {
		return fmt.Errorf("%q is not an HTTP method", m)
	}
	return nil
}
