package caddyidem

import (
	"strconv"
	"strings"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/caddyconfig/httpcaddyfile"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"

	"github.com/idemkit/idem/internal/sidecar"
)

func init() {
	httpcaddyfile.RegisterHandlerDirective("idempotency", parseCaddyfile)
	// Before reverse_proxy, so that a site needs no order line: the
	// handler runs the proxying under the key.
	httpcaddyfile.RegisterDirectiveOrder("idempotency", httpcaddyfile.Before, "reverse_proxy")
}

// parseCaddyfile sets up the handler from Caddyfile tokens:
//
//	idempotency [<matcher>] {
//		store                <url> [<url>]   # memory (default), redis://…, postgres://…, mysql://…, or Redis and PostgreSQL (tiered)
//		prefix               <prefix>
//		memory_limit         <size>          # 128MiB; 0: none
//		reap_interval        <duration>      # 1m; 0: never
//		methods              <method...>     # POST PATCH
//		require_key
//		tenant_header        <header>
//		tenant_cookie        <cookie>
//		lease                <duration>      # 30s
//		retention            <duration>      # 24h
//		wait                 <duration>|off  # 500ms; 0 or off: 409 at once
//		fail_open
//		max_body             <size>          # 1MiB
//		max_response         <size>          # 1MiB
//		store_statuses       <status...>
//		max_execution        <duration>
//		client_write_timeout <duration>      # 30s; 0: none
//		cancel_on_disconnect
//		refuse_anonymous
//		blob                 <url>
//		blob_timeout         <duration>      # 30s
//		quota_in_flight      <count>         # per tenant; 32 with store memory, else 0: none
//		quota_records        <count>         # per tenant; 0: none
//		quota_bytes          <size>          # per tenant; an eighth of memory_limit with store memory, else 0: none
//		key_header           <header>        # Idempotency-Key
//		key                  header:<header>|json:<pointer>
//		webhook              <preset>        # github, shopify, standard-webhooks, stripe
//		webhook_secret_file  <path>          # its secrets, one a line; or:
//		webhook_secret_env   <variable>
//		webhook_tolerance    <duration>      # the preset's, 5m
//		fingerprint          raw|json        # raw
//		fingerprint_exclude  <pointer...>    # implies json
//		fingerprint_fields   <pointer...>    # implies json
//		profile              ietf|acp|stripe # ietf
//		echo_key
//		lifetime_header
//		replay_headers_allow <header...>     # only these stored (and those of the body); default all
//		replay_headers_deny  <header...>     # never stored
//		seal_keys            <path>          # key ring file: ID BASE64 lines, the first the primary
//		seal_kms             <key ARN>       # AWS KMS key
//		seal_open_only                       # new records in clear; sealed ones still open
//	}
func parseCaddyfile(h httpcaddyfile.Helper) (caddyhttp.MiddlewareHandler, error) {
	m := new(Handler)
	err := m.UnmarshalCaddyfile(h.Dispenser)
	return m, err
}

// UnmarshalCaddyfile implements caddyfile.Unmarshaler. Every error names
// the subdirective and what it wants.
func (h *Handler) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	d.Next() // the directive's name
	if d.NextArg() {
		return d.ArgErr() // the matcher is the helper's; nothing else goes on this line
	}
	for d.NextBlock(0) {
		name := d.Val()
		args := d.RemainingArgs()
		one := func() (string, error) {
			if len(args) != 1 {
				return "", d.Errf("%s: want one argument, got %d", name, len(args))
			}
			return args[0], nil
		}
		none := func() error {
			if len(args) != 0 {
				return d.Errf("%s takes no argument, got %d", name, len(args))
			}
			return nil
		}
		duration := func() (caddy.Duration, error) {
			a, err := one()
			if err != nil {
				return 0, err
			}
			v, err := caddy.ParseDuration(a)
			if err != nil {
				return 0, d.Errf("%s %q: want a duration such as 30s, 250ms or 1m", name, a)
			}
			return caddy.Duration(v), nil
		}
		size := func() (int64, error) {
			a, err := one()
			if err != nil {
				return 0, err
			}
			v, err := sidecar.ParseSize(a)
			if err != nil {
				return 0, d.Errf("%s %q: %v", name, a, err)
			}
			return v, nil
		}
		var err error
		switch name {
		case "store":
			if len(args) < 1 || len(args) > 2 {
				return d.Errf("store: want a URL (memory, redis://…, postgres://…, mysql://…), or a Redis URL and a PostgreSQL URL (the tiered store), got %d arguments", len(args))
			}
			h.Store = strings.Join(args, " ")
		case "prefix":
			h.Prefix, err = one()
		case "memory_limit":
			var v int64
			v, err = size()
			h.MemoryLimit = &v
		case "reap_interval":
			var v caddy.Duration
			v, err = duration()
			h.ReapInterval = &v
		case "methods":
			if len(args) == 0 {
				return d.Errf("methods: want one or more methods, such as POST PATCH")
			}
			h.Methods = nil
			for _, a := range args {
				for m := range strings.SplitSeq(a, ",") {
					if m = strings.ToUpper(strings.TrimSpace(m)); m != "" {
						h.Methods = append(h.Methods, m)
					}
				}
			}
		case "require_key":
			err = none()
			h.RequireKey = true
		case "tenant_header":
			h.TenantHeader, err = one()
		case "tenant_cookie":
			h.TenantCookie, err = one()
		case "lease":
			h.Lease, err = duration()
		case "retention":
			h.Retention, err = duration()
		case "wait":
			var v caddy.Duration
			if len(args) == 1 && args[0] == "off" {
				h.Wait = &v // no wait, as wait 0
				break
			}
			v, err = duration()
			h.Wait = &v
		case "fail_open":
			err = none()
			h.FailOpen = true
		case "max_body", "max_response":
			// 0 is the JSON field's "not set" (the default): written
			// here, it would silently be 1MiB, where --max-body 0 is
			// refused.
			var v int64
			if v, err = size(); err == nil && v == 0 {
				return d.Errf("%s 0: want at least 1 byte (leave %s out for the default, 1MiB)", name, name)
			}
			if name == "max_body" {
				h.MaxBody = v
			} else {
				h.MaxResponse = v
			}
		case "store_statuses":
			if len(args) == 0 {
				return d.Errf("store_statuses: want one or more statuses, such as 200 201 (JSON's [] stores nothing)")
			}
			h.StoreStatuses = []int{}
			for _, a := range args {
				st, cerr := strconv.Atoi(a)
				if cerr != nil {
					return d.Errf("store_statuses: %q is not a status code", a)
				}
				h.StoreStatuses = append(h.StoreStatuses, st)
			}
		case "max_execution":
			h.MaxExecution, err = duration()
		case "client_write_timeout":
			var v caddy.Duration
			v, err = duration()
			h.ClientWriteTimeout = &v
		case "refuse_anonymous":
			err = none()
			h.RefuseAnonymous = true
		case "cancel_on_disconnect":
			err = none()
			h.CancelOnDisconnect = true
		case "blob":
			h.Blob, err = one()
		case "blob_timeout":
			h.BlobTimeout, err = duration()
		case "quota_in_flight", "quota_records":
			var a string
			if a, err = one(); err != nil {
				break
			}
			n, cerr := strconv.Atoi(a)
			if cerr != nil || n < 0 {
				return d.Errf("%s %q: want a whole number, 0 or more (0: no limit)", name, a)
			}
			if name == "quota_in_flight" {
				h.QuotaInFlight = &n
			} else {
				h.QuotaRecords = &n
			}
		case "quota_bytes":
			var v int64
			v, err = size()
			h.QuotaBytes = &v
		case "key_header":
			h.KeyHeader, err = one()
		case "key":
			h.Key, err = one()
		case "webhook":
			h.Webhook, err = one()
		case "webhook_secret_file":
			h.WebhookSecretFile, err = one()
		case "webhook_secret_env":
			h.WebhookSecretEnv, err = one()
		case "webhook_tolerance":
			h.WebhookTolerance, err = duration()
		case "fingerprint":
			h.Fingerprint, err = one()
		case "fingerprint_exclude", "fingerprint_fields":
			if len(args) == 0 {
				return d.Errf("%s: want one or more JSON Pointers, such as /attempt /sent_at", name)
			}
			if name == "fingerprint_exclude" {
				h.FingerprintExclude = args
			} else {
				h.FingerprintFields = args
			}
		case "profile":
			h.Profile, err = one()
		case "echo_key":
			err = none()
			h.EchoKey = true
		case "lifetime_header":
			err = none()
			h.LifetimeHeader = true
		case "replay_headers_allow", "replay_headers_deny":
			if len(args) == 0 {
				return d.Errf("%s: want one or more header names, such as X-Request-Id Location", name)
			}
			if name == "replay_headers_allow" {
				h.ReplayHeadersAllow = args
			} else {
				h.ReplayHeadersDeny = args
			}
		case "seal_keys":
			h.SealKeys, err = one()
		case "seal_kms":
			h.SealKMS, err = one()
		case "seal_open_only":
			err = none()
			h.SealOpenOnly = true
		default:
			return d.Errf("unknown subdirective %q (want store, prefix, memory_limit, reap_interval, methods, require_key, "+
				"tenant_header, tenant_cookie, lease, retention, wait, fail_open, max_body, max_response, store_statuses, "+
				"max_execution, client_write_timeout, cancel_on_disconnect, refuse_anonymous, blob, blob_timeout, quota_in_flight, quota_records, quota_bytes, "+
				"key_header, key, webhook, webhook_secret_file, webhook_secret_env, webhook_tolerance, fingerprint, fingerprint_exclude, "+
				"fingerprint_fields, profile, echo_key, lifetime_header, replay_headers_allow, replay_headers_deny, seal_keys, seal_kms, seal_open_only)", name)
		}
		if err != nil {
			return err
		}
	}
	return h.Validate()
}

// Interface guard.
var _ caddyfile.Unmarshaler = (*Handler)(nil)
