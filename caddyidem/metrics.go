package caddyidem

import (
	"sync"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/idemkit/idem/internal/sidecar"
)

// outcomeNotCovered counts requests whose method the handler does not
// cover: passed on without a look, as idem proxy's not_covered.
const outcomeNotCovered = sidecar.OutcomeNotCovered

// metrics are the handler's Prometheus metrics: idem proxy's
// (sidecar.Metrics), on Caddy's registry (its /metrics, with the metrics
// directive or the admin endpoint). One set per process, shared by every
// idempotency handler and kept across config reloads, as Caddy's own
// handlers do.
var (
	metrics     *sidecar.Metrics
	metricsOnce sync.Once
)

// registerMetrics creates the metrics once per process and registers them
// with reg, the registry of the config being provisioned (a new one on
// each load); a second handler of the same config finds them there.
func registerMetrics(reg prometheus.Registerer) *sidecar.Metrics {
	metricsOnce.Do(func() { metrics = sidecar.NewMetrics(sidecar.Underscored) })
	metrics.Register(reg)
	return metrics
}
