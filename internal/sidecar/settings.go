package sidecar

import (
	"fmt"
	"net/http"
	"slices"
	"strings"
	"time"

	"golang.org/x/net/http/httpguts"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemhttp"
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
}

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
	for _, st := range s.StoreStatuses {
		if st < 200 || st > 599 {
			return fmt.Errorf("%s: %d is not a final HTTP status (200-599)", name("store-statuses"), st)
		}
	}
	return nil
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
