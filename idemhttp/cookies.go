package idemhttp

import (
	"maps"
	"net/http"
	"slices"
	"strings"
	"time"

	"github.com/idemkit/idem/internal/ident"
)

// Cookies of a caller no tenant source names.
//
// A browser, or an HTTP client with a cookie jar, that sends no
// credential idemhttp reads is still told apart from another by its
// session cookie, whatever its name. So when Config.Tenant returns "", the
// record of the request keeps a digest of each cookie the request carried
// (name and value), except the cookies that only track (load balancers'
// stickiness, analytics: DefaultTrackingCookies), and of the cookies its
// response set (Set-Cookie, never replayed). A later request with the key
// gets the replay only if it carries each remembered cookie with the value
// it had, or with the value the response set (or without it, when the
// response deleted it); other cookies it carries do not matter. Anything
// else is 422, never the replay:
//
//   - a cookie-jar client (Python requests.Session, a browser) whose first
//     response set `session=…` retries with that cookie: replayed;
//   - a load balancer that rotates its stickiness cookie (AWSALB) on every
//     response: the cookie is not remembered, the retry replays;
//   - another browser, with another session cookie, or none, under a key
//     the first used: 422.
//
// A request that carried no cookies (other than tracking ones) identifies
// no one: its record replays to any request with the key, as without
// cookies. The cookies are digests in the stored record (the header
// headerCallerCookies), removed from every replay.

// DefaultTrackingCookies are the cookies a record never remembers for
// want of a tenant (Config.TrackingCookies): they track, balance or record
// consent, and change between two retries of one caller. A name that ends
// in "*" is a prefix.
var DefaultTrackingCookies = []string{
	// Load balancers' stickiness: AWS ALB and ELB, Google Cloud, Azure,
	// F5 BIG-IP, HAProxy and nginx ingress defaults, Cloudflare's.
	"AWSALB", "AWSALBCORS", "AWSALBTG", "AWSALBTGCORS", "AWSELB", "AWSELBCORS",
	"GCLB", "ARRAffinity", "ARRAffinitySameSite", "BIGipServer*", "SERVERID", "INGRESSCOOKIE",
	"__cf_bm", "__cflb", "_cfuvid",
	// Analytics and advertising: Google, Meta, Microsoft, HubSpot,
	// Hotjar, Matomo, Mixpanel, Segment's anonymous id.
	"_ga", "_ga_*", "_gid", "_gat*", "_gcl_*", "__utm*", "_fbp", "_fbc", "_uetsid", "_uetvid",
	"_clck", "_clsk", "__hstc", "__hssc", "__hssrc", "hubspotutk", "_hj*", "_pk_*", "mp_*", "ajs_anonymous_id",
	// Consent banners.
	"OptanonConsent", "OptanonAlertBoxClosed", "CookieConsent", "cookieconsent_status",
}

// headerCallerCookies holds, in a stored response, the digests of the
// cookies that identify its caller. Never replayed, never taken from a
// handler's response (alwaysDenied).
const headerCallerCookies = "Idempotent-Caller-Cookies"

// cookieMatcher tells tracking cookies from the others.
type cookieMatcher struct {
	names    map[string]bool
	prefixes []string
}

func newCookieMatcher(names []string) cookieMatcher {
	m := cookieMatcher{names: map[string]bool{}}
	for _, n := range names {
		if p, ok := strings.CutSuffix(n, "*"); ok {
			m.prefixes = append(m.prefixes, p)
		} else {
			m.names[n] = true
		}
	}
	return m
}

func (m cookieMatcher) tracking(name string) bool {
	if m.names[name] {
		return true
	}
	for _, p := range m.prefixes {
		if strings.HasPrefix(name, p) {
			return true
		}
	}
	return false
}

// callerCookies returns the identifying cookies of r: name → values.
// nil when it has none.
func (m cookieMatcher) callerCookies(r *http.Request) map[string][]string {
	if len(r.Header["Cookie"]) == 0 {
		return nil
	}
	var out map[string][]string
	for _, c := range r.Cookies() {
		if m.tracking(c.Name) {
			continue
		}
		if out == nil {
			out = map[string][]string{}
		}
		out[c.Name] = append(out[c.Name], c.Value)
	}
	return out
}

// maxCallerCookies bounds the cookies a record remembers (the first by
// name): a client's thousands of cookies must not make each of its
// records that large.
const maxCallerCookies = 32

// cookieRecord returns the value of headerCallerCookies for a request
// whose identifying cookies are have and whose response header is resp:
// for each cookie, "N=V" with N the digest of its name and V that of its
// name and value, followed by "|W" for the value the response set (W
// "-" when it deleted the cookie); entries separated by ", ". "" when
// have is empty.
func cookieRecord(have map[string][]string, resp http.Header) string {
	if len(have) == 0 {
		return ""
	}
	set := map[string]string{} // name → the value digest the response set
	for name, vs := range resp {
		if !strings.EqualFold(name, "Set-Cookie") {
			continue
		}
		for _, v := range vs {
			c, err := http.ParseSetCookie(v)
			if err != nil {
				continue
			}
			if c.MaxAge < 0 || (!c.Expires.IsZero() && c.Expires.Before(time.Now())) {
				set[c.Name] = "-"
			} else {
				set[c.Name] = ident.Digest(c.Name, c.Value)
			}
		}
	}
	var b strings.Builder
	names := slices.Sorted(maps.Keys(have))
	for _, name := range names[:min(len(names), maxCallerCookies)] {
		for _, v := range have[name] {
			if b.Len() > 0 {
				b.WriteString(", ")
			}
			b.WriteString(ident.Digest(name))
			b.WriteByte('=')
			b.WriteString(ident.Digest(name, v))
			if w, ok := set[name]; ok {
				b.WriteByte('|')
				b.WriteString(w)
			}
		}
	}
	return b.String()
}

// sameCaller reports whether a request whose identifying cookies are
// have may get the replay of a response whose record is the
// headerCallerCookies value rec (see the comment at the top of the file).
func sameCaller(rec string, have map[string][]string) bool {
	if rec == "" {
		return true
	}
	// The request's cookies by name digest: value digests.
	byName := make(map[string][]string, len(have))
	for name, vs := range have {
		dn := ident.Digest(name)
		for _, v := range vs {
			byName[dn] = append(byName[dn], ident.Digest(name, v))
		}
	}
	for entry := range strings.SplitSeq(rec, ", ") {
		dn, vals, ok := strings.Cut(entry, "=")
		if !ok {
			return false // not written by cookieRecord: refuse
		}
		orig, set, _ := strings.Cut(vals, "|")
		got := byName[dn]
		if set == "-" && len(got) == 0 {
			continue // the response deleted it
		}
		found := false
		for _, g := range got {
			if g == orig || (set != "" && g == set) {
				found = true
				break
			}
		}
		if !found {
			return false
		}
	}
	return true
}
