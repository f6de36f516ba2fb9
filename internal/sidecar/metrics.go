package sidecar

import (
	"errors"
	"net/http"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemhttp"
)

// OutcomeNotCovered counts requests whose method the route does not
// cover: the sidecar passes them on without looking at them.
const OutcomeNotCovered = "not_covered"

// Metrics are the middleware's metrics that both sidecars have, under the
// same names and labels: idem proxy registers them on its own registry
// (its --admin-listen /metrics), Caddy on the registry of each config it
// loads. Each series exists from the start, at zero, so that rate() and
// alerts see the first increment.
type Metrics struct {
	Requests      *prometheus.CounterVec // idem_requests_total{outcome}
	Renewals      *prometheus.CounterVec // idem_lease_renewals_total{result}
	NotKept       prometheus.Counter     // idem_responses_not_kept_total
	Anonymous     prometheus.Counter     // idem_anonymous_requests_total
	BlobErrors    *prometheus.CounterVec // idem_blob_errors_total{op,reason}
	QuotaExceeded *prometheus.CounterVec // idem_quota_exceeded_total{limit}
	// WebhookUnverified: idem_webhook_unverified_total{preset}; a route's
	// series is made at zero with its middleware (Settings.KeySource).
	WebhookUnverified *prometheus.CounterVec
}

// NewMetrics makes the metrics; name spells a setting in their help as
// the front end does (as for Settings.Validate).
func NewMetrics(name func(string) string) *Metrics {
	m := &Metrics{
		Requests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "idem_requests_total",
			Help: "Requests by what idem did with them: executed (forwarded under the key, response stored), released (forwarded under the key, then the key released for a retry: a status the storage policy does not store, by default 5xx, 408, 409, 425 and 429, an upstream that failed mid-body or could not be reached, or an upgraded connection), replayed, in_flight (409: the key was still running past " + name("wait") + "), mismatch (422), rejected (400, 401, 405 or 413: a key missing or invalid, a webhook signature not verified, a method a webhook route does not take, a body too large), store_error (503), passed_through (no key), gone (the client left before its key was acquired: nothing was forwarded), replay_failed (stored body unreadable from the blob store: 503 or aborted), quota_exceeded (429: the tenant was at its " + name("quota-*") + " limit; nothing forwarded), unsealable (500 urn:idem:problem:response-unreadable: the key completed but its sealed record cannot be opened, altered or under a key id not in " + name("seal-keys") + "; nothing forwarded, logged at ERROR with the key_id), not_covered (method not covered). The log line of each request has the same outcome.",
		}, []string{"outcome"}),
		Renewals: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "idem_lease_renewals_total",
			Help: "Background lease renewals by result: ok, lease_lost (another holder may run the key), error (store failed; retried).",
		}, []string{"result"}),
		NotKept: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "idem_responses_not_kept_total",
			Help: "Responses stored without their body: larger than " + name("max-response") + ", and no " + name("blob") + " (or the blob store failed). Their requests ran once; their replays answer 500 (urn:idem:problem:response-not-kept) and count as replayed. Set " + name("blob") + " or raise " + name("max-response") + ".",
		}),
		Anonymous: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "idem_anonymous_requests_total",
			Help: "Keyed requests that carried nothing identifying their caller (no Authorization, API-key header, client certificate, " + name("tenant-header") + " or " + name("tenant-cookie") + "), refused (" + name("refuse-anonymous") + ") or served: callers that send the same key share its record.",
		}),
		BlobErrors: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "idem_blob_errors_total",
			Help: "Failed blob store operations by op (write: storing a large body, read: replaying one, check: the probe before a new request) and reason (missing, corrupt, unavailable).",
		}, []string{"op", "reason"}),
		QuotaExceeded: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "idem_quota_exceeded_total",
			Help: "Requests with a new key refused 429 (urn:idem:problem:quota-exceeded) because their tenant was at a limit: in_flight (" + name("quota-in-flight") + "), records (" + name("quota-records") + "), bytes (" + name("quota-bytes") + "). Nothing was forwarded or claimed. Also counted as quota_exceeded in idem_requests_total.",
		}, []string{"limit"}),
		WebhookUnverified: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "idem_webhook_unverified_total",
			Help: "Webhook deliveries refused 401 (urn:idem:problem:unverified) by preset (" + name("webhook") + ") because their signature did not verify under the secrets of " + name("webhook-secret-file") + " or " + name("webhook-secret-env") + ": missing or malformed, made with another secret, a body altered, or a signed timestamp outside " + name("webhook-tolerance") + ". Nothing was forwarded or claimed. Also counted as rejected in idem_requests_total.",
		}, []string{"preset"}),
	}
	for _, o := range []idemhttp.Outcome{idemhttp.OutcomeExecuted, idemhttp.OutcomeReleased, idemhttp.OutcomeReplayed, idemhttp.OutcomeInFlight,
		idemhttp.OutcomeMismatch, idemhttp.OutcomeRejected, idemhttp.OutcomeStoreError, idemhttp.OutcomePassedThrough,
		idemhttp.OutcomeGone, idemhttp.OutcomeReplayFailed, idemhttp.OutcomeQuotaExceeded, idemhttp.OutcomeUnsealable} {
		m.Requests.WithLabelValues(string(o))
	}
	m.Requests.WithLabelValues(OutcomeNotCovered)
	for _, r := range []string{"ok", "lease_lost", "error"} {
		m.Renewals.WithLabelValues(r)
	}
	for _, l := range []string{idemhttp.QuotaInFlight, idemhttp.QuotaRecords, idemhttp.QuotaBytes} {
		m.QuotaExceeded.WithLabelValues(l)
	}
	return m
}

// Register adds the metrics to reg; a registry that has them already
// (a second Caddy handler of one config) is fine. Any other clash is a
// programming error, and panics, as prometheus.MustRegister does.
func (m *Metrics) Register(reg prometheus.Registerer) {
	for _, c := range []prometheus.Collector{m.Requests, m.Renewals, m.NotKept, m.Anonymous, m.BlobErrors, m.QuotaExceeded, m.WebhookUnverified} {
		if err := reg.Register(c); err != nil && !errors.As(err, new(prometheus.AlreadyRegisteredError)) {
			panic(err)
		}
	}
}

// BlobReasons label idem_blob_errors_total.
var BlobReasons = []string{"missing", "corrupt", "unavailable"}

// BlobReason names what went wrong with a blob operation.
func BlobReason(err error) string {
	switch {
	case errors.Is(err, idem.ErrBlobNotFound):
		return "missing"
	case errors.Is(err, idem.ErrBlobCorrupt):
		return "corrupt"
	}
	return "unavailable"
}

// InitBlobSeries creates the blob series at zero, for a sidecar with a
// blob store.
func (m *Metrics) InitBlobSeries() {
	for _, op := range []string{idemhttp.BlobOpWrite, idemhttp.BlobOpRead, idemhttp.BlobOpCheck} {
		for _, r := range BlobReasons {
			m.BlobErrors.WithLabelValues(op, r)
		}
	}
}

// OnBlobError is idemhttp.Config.OnBlobError.
func (m *Metrics) OnBlobError(_ *http.Request, op string, err error) {
	m.BlobErrors.WithLabelValues(op, BlobReason(err)).Inc()
}

// OnRenew is idemhttp.Config.OnRenew.
func (m *Metrics) OnRenew(_ idem.Key, err error) {
	switch {
	case err == nil:
		m.Renewals.WithLabelValues("ok").Inc()
	case errors.Is(err, idem.ErrLeaseLost):
		m.Renewals.WithLabelValues("lease_lost").Inc()
	default:
		m.Renewals.WithLabelValues("error").Inc()
	}
}

// OnQuotaExceeded is idemhttp.Config.OnQuotaExceeded.
func (m *Metrics) OnQuotaExceeded(_ *http.Request, limit string) {
	m.QuotaExceeded.WithLabelValues(limit).Inc()
}
