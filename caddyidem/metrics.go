package caddyidem

import (
	"errors"
	"net/http"
	"sync"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemhttp"
)

// outcomeNotCovered counts requests whose method the handler does not
// cover: passed on without a look, as idem proxy's not_covered.
const outcomeNotCovered = "not_covered"

// handlerMetrics are the handler's Prometheus metrics: idem proxy's names,
// on Caddy's registry (its /metrics, with the metrics directive or the
// admin endpoint). One set per process, shared by every idempotency
// handler and kept across config reloads, as Caddy's own handlers do.
type handlerMetrics struct {
	requests   *prometheus.CounterVec // idem_requests_total{outcome}
	renewals   *prometheus.CounterVec // idem_lease_renewals_total{result}
	notKept    prometheus.Counter     // idem_responses_not_kept_total
	anonymous  prometheus.Counter     // idem_anonymous_requests_total
	blobErrors *prometheus.CounterVec // idem_blob_errors_total{op,reason}
	// quotaExceeded: idem_quota_exceeded_total{limit}
	quotaExceeded *prometheus.CounterVec
}

var (
	metrics     handlerMetrics
	metricsOnce sync.Once
)

// registerMetrics creates the metrics once per process and registers them
// with reg, the registry of the config being provisioned (a new one on
// each load); a second handler of the same config finds them there.
func registerMetrics(reg *prometheus.Registry) *handlerMetrics {
	metricsOnce.Do(func() {
		metrics = handlerMetrics{
			requests: prometheus.NewCounterVec(prometheus.CounterOpts{
				Name: "idem_requests_total",
				Help: "Requests by what the idempotency handler did with them: executed (the route ran under the key, response stored), released (ran under the key, then the key released for a retry: a status the storage policy does not store, by default 5xx, 408, 409, 425 and 429, or an error of the route such as reverse_proxy's 502), replayed, in_flight (409), mismatch (422), rejected (400, 413), store_error (503), passed_through (no key), gone (the client left before its key was acquired), replay_failed (stored body unreadable from the blob store), quota_exceeded (429: the tenant was at its quota_* limit; nothing ran), not_covered (method not covered). The access log line of each request has the same word in idempotency_outcome.",
			}, []string{"outcome"}),
			renewals: prometheus.NewCounterVec(prometheus.CounterOpts{
				Name: "idem_lease_renewals_total",
				Help: "Background lease renewals by result: ok, lease_lost (another holder may run the key), error (store failed; retried).",
			}, []string{"result"}),
			notKept: prometheus.NewCounter(prometheus.CounterOpts{
				Name: "idem_responses_not_kept_total",
				Help: "Responses stored without their body: larger than max_response, and no blob store (or it failed). Their requests ran once; their replays answer 500 (urn:idem:problem:response-not-kept). Set blob or raise max_response.",
			}),
			anonymous: prometheus.NewCounter(prometheus.CounterOpts{
				Name: "idem_anonymous_requests_total",
				Help: "Keyed requests that carried nothing identifying their caller (no Authorization, API-key header, client certificate, tenant_header or tenant_cookie), refused (refuse_anonymous) or served: callers that send the same key share its record.",
			}),
			blobErrors: prometheus.NewCounterVec(prometheus.CounterOpts{
				Name: "idem_blob_errors_total",
				Help: "Failed blob store operations by op (write, read, check) and reason (missing, corrupt, unavailable).",
			}, []string{"op", "reason"}),
			quotaExceeded: prometheus.NewCounterVec(prometheus.CounterOpts{
				Name: "idem_quota_exceeded_total",
				Help: "Requests with a new key refused 429 (urn:idem:problem:quota-exceeded) because their tenant was at a limit: in_flight (quota_in_flight), records (quota_records), bytes (quota_bytes). Nothing ran or was claimed. Also counted as quota_exceeded in idem_requests_total.",
			}, []string{"limit"}),
		}
		for _, l := range []string{idemhttp.QuotaInFlight, idemhttp.QuotaRecords, idemhttp.QuotaBytes} {
			metrics.quotaExceeded.WithLabelValues(l)
		}
		// Every series exists from the start, at zero, so that rate()
		// and alerts see the first increment.
		for _, o := range []idemhttp.Outcome{idemhttp.OutcomeExecuted, idemhttp.OutcomeReleased, idemhttp.OutcomeReplayed,
			idemhttp.OutcomeInFlight, idemhttp.OutcomeMismatch, idemhttp.OutcomeRejected, idemhttp.OutcomeStoreError,
			idemhttp.OutcomePassedThrough, idemhttp.OutcomeGone, idemhttp.OutcomeReplayFailed, idemhttp.OutcomeQuotaExceeded} {
			metrics.requests.WithLabelValues(string(o))
		}
		metrics.requests.WithLabelValues(outcomeNotCovered)
		for _, r := range []string{"ok", "lease_lost", "error"} {
			metrics.renewals.WithLabelValues(r)
		}
	})
	for _, c := range []prometheus.Collector{metrics.requests, metrics.renewals, metrics.notKept, metrics.anonymous, metrics.blobErrors, metrics.quotaExceeded} {
		if err := reg.Register(c); err != nil && !errors.As(err, new(prometheus.AlreadyRegisteredError)) {
			panic(err) // another collector of the same name: a programming error, as for Caddy's own
		}
	}
	return &metrics
}

// initBlobSeries creates the blob series at zero, for a handler with a
// blob store.
func (m *handlerMetrics) initBlobSeries() {
	for _, op := range []string{idemhttp.BlobOpWrite, idemhttp.BlobOpRead, idemhttp.BlobOpCheck} {
		for _, r := range []string{"missing", "corrupt", "unavailable"} {
			m.blobErrors.WithLabelValues(op, r)
		}
	}
}

// onBlobError is idemhttp.Config.OnBlobError.
func (m *handlerMetrics) onBlobError(_ *http.Request, op string, err error) {
	reason := "unavailable"
	switch {
	case errors.Is(err, idem.ErrBlobNotFound):
		reason = "missing"
	case errors.Is(err, idem.ErrBlobCorrupt):
		reason = "corrupt"
	}
	m.blobErrors.WithLabelValues(op, reason).Inc()
}

// onRenew is idemhttp.Config.OnRenew.
func (m *handlerMetrics) onRenew(_ idem.Key, err error) {
	switch {
	case err == nil:
		m.renewals.WithLabelValues("ok").Inc()
	case errors.Is(err, idem.ErrLeaseLost):
		m.renewals.WithLabelValues("lease_lost").Inc()
	default:
		m.renewals.WithLabelValues("error").Inc()
	}
}

// onQuotaExceeded is idemhttp.Config.OnQuotaExceeded.
func (m *handlerMetrics) onQuotaExceeded(_ *http.Request, limit string) {
	m.quotaExceeded.WithLabelValues(limit).Inc()
}
