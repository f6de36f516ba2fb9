package main

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net/http"
	"os"
	"reflect"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"

	"go.yaml.in/yaml/v3"

	"github.com/idemkit/idem/internal/sidecar"
)

// routeSettings is what the idemhttp middleware does on one route: the
// flags give the defaults, and each route of the --config file overrides
// some of them. They are the sidecars' settings (internal/sidecar), which
// check themselves and map themselves to idemhttp.Config.
type routeSettings = sidecar.Settings

// proxyFile is the --config file.
type proxyFile struct {
	Routes []routeOverride `yaml:"routes"`
}

// routeOverride is one entry of routes: a ServeMux pattern and the
// settings that differ from the flags there. An absent field keeps the
// flag's value. Its fields are the one list of a route's settings:
// routeFields and settingsSet read their yaml tags, and apply has a case
// for each (TestRouteOverrideFields fails for one it misses).
type routeOverride struct {
	Match         string        `yaml:"match"`
	Methods       *[]string     `yaml:"methods"`
	RequireKey    *bool         `yaml:"require_key"`
	TenantHeader  *string       `yaml:"tenant_header"`
	TenantCookie  *string       `yaml:"tenant_cookie"` // either replaces the flags' tenant source
	Lease         *fileDuration `yaml:"lease"`
	Retention     *fileDuration `yaml:"retention"`
	Wait          *fileDuration `yaml:"wait"`
	FailOpen      *bool         `yaml:"fail_open"`
	MaxBody       *byteSize     `yaml:"max_body"`
	MaxResponse   *byteSize     `yaml:"max_response"`
	StoreStatuses *[]int        `yaml:"store_statuses"`
	MaxExecution  *fileDuration `yaml:"max_execution"`
	// ClientWriteTimeout: see --client-write-timeout.
	ClientWriteTimeout *fileDuration `yaml:"client_write_timeout"`
	// CancelOnDisconnect is unsafe: see idemhttp Config.CancelOnDisconnect.
	CancelOnDisconnect *bool `yaml:"cancel_on_disconnect"`
	// RefuseAnonymous: see --refuse-anonymous.
	RefuseAnonymous *bool `yaml:"refuse_anonymous"`
	// QuotaInFlight, QuotaRecords and QuotaBytes: see --quota-in-flight.
	// A route that sets one counts its tenants on its own.
	QuotaInFlight *int      `yaml:"quota_in_flight"`
	QuotaRecords  *int      `yaml:"quota_records"`
	QuotaBytes    *byteSize `yaml:"quota_bytes"`
	// Key is the route's key source, header:NAME or json:/pointer; it
	// replaces an inherited webhook (and its secrets and tolerance), as
	// a route's webhook replaces an inherited key.
	Key     *string `yaml:"key"`
	Webhook *string `yaml:"webhook"`
	// WebhookSecretFile and WebhookSecretEnv: either replaces the
	// inherited source of the secrets.
	WebhookSecretFile *string       `yaml:"webhook_secret_file"`
	WebhookSecretEnv  *string       `yaml:"webhook_secret_env"`
	WebhookTolerance  *fileDuration `yaml:"webhook_tolerance"`
	Fingerprint       *string       `yaml:"fingerprint"`
	// FingerprintExclude and FingerprintFields: either replaces both
	// inherited lists.
	FingerprintExclude *[]string `yaml:"fingerprint_exclude"`
	FingerprintFields  *[]string `yaml:"fingerprint_fields"`
	Profile            *string   `yaml:"profile"`
	EchoKey            *bool     `yaml:"echo_key"`
	LifetimeHeader     *bool     `yaml:"lifetime_header"`
	// ReplayHeadersAllow and ReplayHeadersDeny: each replaces the
	// inherited list ([]: none).
	ReplayHeadersAllow *[]string `yaml:"replay_headers_allow"`
	ReplayHeadersDeny  *[]string `yaml:"replay_headers_deny"`
}

// routeFields lists routeOverride's fields, as the file names them, for
// error messages.
var routeFields = strings.Join(routeFieldNames(), ", ")

// routeFieldNames is the yaml name of each field of routeOverride, in
// order.
func routeFieldNames() []string {
	var names []string
	for _, f := range reflect.VisibleFields(reflect.TypeFor[routeOverride]()) {
		names = append(names, yamlName(f))
	}
	return names
}

func yamlName(f reflect.StructField) string {
	name, _, _ := strings.Cut(f.Tag.Get("yaml"), ",")
	return name
}

// routeConfig is a validated route of the file.
type routeConfig struct {
	pattern  string
	settings routeSettings
}

// loadProxyConfig reads and validates the --config file. Every route is
// checked: unknown fields, a missing or invalid match pattern, two
// patterns ServeMux would refuse together, and bad settings are errors
// naming the file and the route.
func loadProxyConfig(path string, defaults routeSettings) ([]routeConfig, error) {
	data, err := os.ReadFile(path)
	if pe := (*fs.PathError)(nil); errors.As(err, &pe) {
		return nil, fmt.Errorf("%s: %v", path, pe.Err)
	} else if err != nil {
		return nil, err
	}
	var f proxyFile
	dec := yaml.NewDecoder(bytes.NewReader(data))
	dec.KnownFields(true)
	switch err := dec.Decode(&f); {
	case errors.Is(err, io.EOF):
		return nil, fmt.Errorf("%s: empty: the file lists routes (routes: - match: \"POST /payments/{id}\" …); without --config the flags apply to every path", path)
	case err != nil:
		msg := strings.TrimPrefix(syntaxErrorLine(data, err).Error(), "yaml: ")
		msg = strings.ReplaceAll(msg, "unmarshal errors:\n  ", "")
		msg = strings.ReplaceAll(msg, " in type main.proxyFile", " (want routes)")
		msg = strings.ReplaceAll(msg, " in type main.routeOverride", " (want "+routeFields+")")
		msg = notAList.ReplaceAllString(msg, "$1 is not a list (want e.g. [$1])")
		msg = nameFields(data, msg)
		return nil, fmt.Errorf("%s: %s", path, msg)
	}
	if err := dec.Decode(new(any)); !errors.Is(err, io.EOF) {
		return nil, fmt.Errorf("%s: want one YAML document, found more", path)
	}
	if len(f.Routes) == 0 {
		return nil, fmt.Errorf("%s: no routes: the file lists routes (routes: - match: \"POST /payments/{id}\" …); without --config the flags apply to every path", path)
	}
	routes := make([]routeConfig, 0, len(f.Routes))
	mux := http.NewServeMux() // to check the patterns as the proxy will use them
	for i, o := range f.Routes {
		where := fmt.Sprintf("%s: routes[%d]", path, i)
		if o.Match == "" {
			return nil, fmt.Errorf("%s: match is missing (a ServeMux pattern such as \"POST /payments/{id}\")", where)
		}
		where += fmt.Sprintf(" (match %q)", o.Match)
		if err := registerPattern(mux, o.Match); err != nil {
			return nil, fmt.Errorf("%s: %v", where, err)
		}
		s := o.apply(defaults)
		if set := o.settingsSet(); len(s.Methods) == 0 && len(set) > 0 {
			return nil, fmt.Errorf("%s: %s but no methods: a route without methods covers nothing; add methods: [POST] (or the methods to cover)",
				where, strings.Join(set, ", "))
		}
		if m, _, ok := strings.Cut(o.Match, " "); ok && len(s.Methods) > 0 && len(o.settingsSet()) > 0 && !slices.Contains(s.Methods, m) {
			return nil, fmt.Errorf("%s: the pattern's method %s is not among the covered methods %s, so the route covers nothing; add methods: [%s]",
				where, m, strings.Join(s.Methods, ","), m)
		}
		if err := s.Validate(sidecar.Underscored); err != nil {
			return nil, fmt.Errorf("%s: %v", where, err)
		}
		routes = append(routes, routeConfig{pattern: o.Match, settings: s})
	}
	return routes, nil
}

// settingsSet names the route's settings other than match and methods
// that the file sets.
func (o routeOverride) settingsSet() []string {
	var set []string
	v := reflect.ValueOf(o)
	for _, f := range reflect.VisibleFields(v.Type()) {
		if name := yamlName(f); name != "match" && name != "methods" && !v.FieldByIndex(f.Index).IsNil() {
			set = append(set, name)
		}
	}
	return set
}

// errorLine matches the line a YAML decoding error names, and the rest of
// its message.
var errorLine = regexp.MustCompile(`line ([0-9]+): ([^\n]*)`)

// nameFields puts the field of the file on each line that msg names
// before what is wrong with its value ("line 4: echo_key: cannot
// unmarshal …"), unless the message names it already: yaml's errors (and
// the value types') give only the line.
func nameFields(data []byte, msg string) string {
	var doc yaml.Node
	if yaml.Unmarshal(data, &doc) != nil {
		return msg
	}
	keys := map[int]string{} // line: the key of the scalar or list value that starts there
	var walk func(*yaml.Node)
	walk = func(n *yaml.Node) {
		if n.Kind == yaml.MappingNode {
			for i := 0; i+1 < len(n.Content); i += 2 {
				if k, v := n.Content[i], n.Content[i+1]; v.Kind != yaml.MappingNode && k.Line == v.Line {
					keys[v.Line] = k.Value
				}
			}
		}
		for _, c := range n.Content {
			walk(c)
		}
	}
	walk(&doc)
	return errorLine.ReplaceAllStringFunc(msg, func(m string) string {
		sub := errorLine.FindStringSubmatch(m)
		line, _ := strconv.Atoi(sub[1])
		if k, ok := keys[line]; ok && !strings.Contains(sub[2], k) {
			return "line " + sub[1] + ": " + k + ": " + sub[2]
		}
		return m
	})
}

// notAList matches yaml's error for a scalar where a list belongs
// (methods: POST).
var notAList = regexp.MustCompile("cannot unmarshal !!\\w+ `([^`]*)` into \\[\\]\\w+")

// yamlSyntax matches a YAML syntax error.
var yamlSyntax = regexp.MustCompile(`^yaml: line ([0-9]+): (.*)$`)

// syntaxErrorLine corrects the line of a YAML syntax error: the parser
// reports where the enclosing block began (a mis-indented key five lines
// down is "line 3: did not find expected key"). The line is the first
// whose prefix of the file fails with the same error, when the prefix
// before it parses.
func syntaxErrorLine(data []byte, err error) error {
	m := yamlSyntax.FindStringSubmatch(err.Error())
	if m == nil {
		return err
	}
	lines := bytes.SplitAfter(data, []byte("\n"))
	end := 0
	for k := range lines {
		prev := end
		end += len(lines[k])
		var n yaml.Node
		e := yaml.Unmarshal(data[:end], &n)
		if e == nil {
			continue
		}
		if pm := yamlSyntax.FindStringSubmatch(e.Error()); pm != nil && pm[2] == m[2] && yaml.Unmarshal(data[:prev], &n) == nil {
			if line := strconv.Itoa(k + 1); line != m[1] {
				return fmt.Errorf("yaml: line %s: %s", line, m[2])
			}
		}
		return err
	}
	return err
}

// registeredAt is the source position ServeMux gives in its panics.
var registeredAt = regexp.MustCompile(` \(registered at [^)]*\)`)

// registerPattern adds pattern to mux, turning ServeMux's panic on a bad
// or conflicting pattern into an error.
func registerPattern(mux *http.ServeMux, pattern string) (err error) {
	defer func() {
		if p := recover(); p != nil {
			msg := registeredAt.ReplaceAllString(fmt.Sprint(p), "")
			msg = strings.TrimSpace(strings.TrimPrefix(msg, "http: "))
			msg = strings.ReplaceAll(strings.ReplaceAll(msg, ":\n", ": "), "\n", "; ")
			err = fmt.Errorf("invalid pattern: %s", msg)
		}
	}()
	mux.Handle(pattern, http.NotFoundHandler())
	return nil
}

// apply returns s with the route's overrides.
func (o routeOverride) apply(s routeSettings) routeSettings {
	if o.Methods != nil {
		s.Methods = []string{} // methods: [] covers none
		for _, m := range *o.Methods {
			if m = strings.ToUpper(strings.TrimSpace(m)); !slices.Contains(s.Methods, m) {
				s.Methods = append(s.Methods, m) // validate reports bad ones
			}
		}
	}
	if o.RequireKey != nil {
		s.RequireKey = *o.RequireKey
	}
	if o.TenantHeader != nil || o.TenantCookie != nil {
		// One source per route: the route's replaces the flags'.
		s.TenantHeader, s.TenantCookie = "", ""
		if o.TenantHeader != nil {
			s.TenantHeader = *o.TenantHeader
		}
		if o.TenantCookie != nil {
			s.TenantCookie = *o.TenantCookie
		}
	}
	if o.Lease != nil {
		s.Lease = time.Duration(*o.Lease)
	}
	if o.Retention != nil {
		s.Retention = time.Duration(*o.Retention)
	}
	if o.Wait != nil {
		s.Wait = time.Duration(*o.Wait)
	}
	if o.FailOpen != nil {
		s.FailOpen = *o.FailOpen
	}
	if o.MaxBody != nil {
		s.MaxBody = int64(*o.MaxBody)
	}
	if o.MaxResponse != nil {
		s.MaxResponse = int64(*o.MaxResponse)
	}
	if o.MaxExecution != nil {
		s.MaxExecution = time.Duration(*o.MaxExecution)
	}
	if o.ClientWriteTimeout != nil {
		s.ClientWriteTimeout = time.Duration(*o.ClientWriteTimeout)
	}
	if o.CancelOnDisconnect != nil {
		s.CancelOnDisconnect = *o.CancelOnDisconnect
	}
	if o.RefuseAnonymous != nil {
		s.RefuseAnonymous = *o.RefuseAnonymous
	}
	if o.QuotaInFlight != nil || o.QuotaRecords != nil || o.QuotaBytes != nil {
		s.OwnQuota = true
	}
	if o.QuotaInFlight != nil {
		s.QuotaInFlight = *o.QuotaInFlight
	}
	if o.QuotaRecords != nil {
		s.QuotaRecords = *o.QuotaRecords
	}
	if o.QuotaBytes != nil {
		s.QuotaBytes = int64(*o.QuotaBytes)
	}
	s = o.applyKeys(s)
	if o.StoreStatuses != nil {
		s.StoreStatuses = slices.Clone(*o.StoreStatuses)
		if s.StoreStatuses == nil {
			s.StoreStatuses = []int{} // store_statuses: [] stores nothing
		}
	}
	return s
}

// applyKeys returns s with the route's key source, webhook, fingerprint
// and answer overrides. One key source per route: a route's key (or
// webhook: "") drops an inherited webhook with its secrets and tolerance,
// a route's webhook drops an inherited key (and another preset's
// secrets and tolerance); one source of secrets, and one fingerprint list, which
// fingerprint: raw drops (a route that sets both of either kind gets
// Validate's error).
func (o routeOverride) applyKeys(s routeSettings) routeSettings {
	if (o.Key != nil && o.Webhook == nil) || (o.Webhook != nil && *o.Webhook == "") {
		s.Webhook, s.WebhookSecretFile, s.WebhookSecretEnv, s.WebhookTolerance = "", "", "", 0
	}
	if o.Webhook != nil && o.Key == nil {
		s.Key = ""
	}
	if o.Key != nil {
		s.Key = *o.Key
	}
	if o.Webhook != nil {
		if *o.Webhook != s.Webhook {
			// The inherited preset's secrets and tolerance, not this one's.
			s.WebhookSecretFile, s.WebhookSecretEnv, s.WebhookTolerance = "", "", 0
		}
		s.Webhook = *o.Webhook
	}
	if o.WebhookSecretFile != nil || o.WebhookSecretEnv != nil {
		s.WebhookSecretFile, s.WebhookSecretEnv = "", ""
		if o.WebhookSecretFile != nil {
			s.WebhookSecretFile = *o.WebhookSecretFile
		}
		if o.WebhookSecretEnv != nil {
			s.WebhookSecretEnv = *o.WebhookSecretEnv
		}
	}
	if o.WebhookTolerance != nil {
		s.WebhookTolerance = time.Duration(*o.WebhookTolerance)
	}
	if o.Fingerprint != nil {
		s.Fingerprint = *o.Fingerprint
		if s.Fingerprint == "raw" {
			s.FingerprintExclude, s.FingerprintFields = nil, nil // the raw body: no inherited list
		}
	}
	if o.FingerprintExclude != nil || o.FingerprintFields != nil {
		s.FingerprintExclude, s.FingerprintFields = nil, nil
		if o.FingerprintExclude != nil {
			s.FingerprintExclude = slices.Clone(*o.FingerprintExclude)
		}
		if o.FingerprintFields != nil {
			s.FingerprintFields = slices.Clone(*o.FingerprintFields)
		}
	}
	if o.Profile != nil {
		s.Profile = *o.Profile
	}
	if o.EchoKey != nil {
		s.EchoKey = *o.EchoKey
	}
	if o.LifetimeHeader != nil {
		s.LifetimeHeader = *o.LifetimeHeader
	}
	if o.ReplayHeadersAllow != nil {
		s.ReplayHeadersAllow = slices.Clone(*o.ReplayHeadersAllow)
	}
	if o.ReplayHeadersDeny != nil {
		s.ReplayHeadersDeny = slices.Clone(*o.ReplayHeadersDeny)
	}
	return s
}

// fileDuration is a duration in the config file, written as Go writes
// them: "10s", "1m30s", "250ms".
type fileDuration time.Duration

func (d *fileDuration) UnmarshalYAML(n *yaml.Node) error {
	v, err := time.ParseDuration(n.Value)
	if n.Kind != yaml.ScalarNode || err != nil {
		return fmt.Errorf("line %d: %q is not a duration (want e.g. 10s or 250ms)", n.Line, n.Value)
	}
	*d = fileDuration(v)
	return nil
}

// byteSize is a size in bytes, read by sidecar.ParseSize: a plain number
// of bytes, or one with a unit (KiB, MiB, GiB; KB, MB, GB are decimal).
// It is a flag.Value and reads from YAML.
type byteSize int64

// sizeWant says what a size flag or field takes.
const sizeWant = sidecar.SizeWant

func (b *byteSize) Set(s string) error {
	n, err := sidecar.ParseSize(s)
	if err != nil {
		return err
	}
	*b = byteSize(n)
	return nil
}

func (b *byteSize) String() string {
	if b == nil {
		return "0"
	}
	return sidecar.FormatSize(int64(*b))
}

func (b *byteSize) UnmarshalYAML(n *yaml.Node) error {
	v, err := sidecar.ParseSize(n.Value)
	if n.Kind != yaml.ScalarNode || err != nil {
		return fmt.Errorf("line %d: %q is not a size (%s)", n.Line, n.Value, sizeWant)
	}
	*b = byteSize(v)
	return nil
}
