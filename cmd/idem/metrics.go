package main

import (
	"context"
	"net/http"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/blobstore"
	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/internal/sidecar"
)

// outcomeNotCovered counts requests whose method the route does not cover:
// the proxy passes them on without looking at them.
const outcomeNotCovered = sidecar.OutcomeNotCovered

// proxyMetrics are the proxy's Prometheus metrics, on a registry of their
// own (never the global one): the middleware's, which Caddy has too
// (sidecar.Metrics), and the proxy's own.
type proxyMetrics struct {
	*sidecar.Metrics
	reg      *prometheus.Registry
	store    *prometheus.HistogramVec // idem_store_duration_seconds{op}
	upstream prometheus.Histogram     // idem_upstream_duration_seconds
	// clientGone: idem_client_gone_total{outcome}
	clientGone *prometheus.CounterVec
	// upstreamAborted: idem_upstream_aborted_total
	upstreamAborted prometheus.Counter
	// sweeps and sweepDeleted: idem_blob_sweeps_total{result},
	// idem_blob_sweep_deleted_total
	sweeps       *prometheus.CounterVec
	sweepDeleted prometheus.Counter
	// sweepLeft: idem_blob_sweep_left{reason}
	sweepLeft *prometheus.GaugeVec
}

// flagName spells a setting as the proxy's flags do, for the metrics'
// help.
func flagName(n string) string { return "--" + n }

func newProxyMetrics() *proxyMetrics {
	m := &proxyMetrics{
		Metrics: sidecar.NewMetrics(flagName),
		reg:     prometheus.NewRegistry(),
		store: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "idem_store_duration_seconds",
			Help:    "Latency of idempotency store calls by operation.",
			Buckets: []float64{.0001, .00025, .0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5},
		}, []string{"op"}),
		clientGone: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "idem_client_gone_total",
			Help: "Requests whose client left (disconnected, or did not take a write within --client-write-timeout) before it had the whole response, by outcome (also counted under that outcome in idem_requests_total); with outcome executed, the upstream's response was read to its end and stored for the client's retry. Logged as client_gone=true.",
		}, []string{"outcome"}),
		upstreamAborted: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "idem_upstream_aborted_total",
			Help: "Requests whose upstream failed in the middle of its response body: the client's connection is cut (a keyed request's key is released, outcome released). Logged as upstream_aborted=true.",
		}),
		sweeps: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "idem_blob_sweeps_total",
			Help: "Blob sweeps (--blob-sweep) by result: ok, error (the sweep stopped; also when some blobs could not be checked or deleted).",
		}, []string{"result"}),
		sweepDeleted: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "idem_blob_sweep_deleted_total",
			Help: "Blobs the sweeps deleted: orphans (no record refers to them) and temporary files of interrupted writes.",
		}),
		upstream: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "idem_upstream_duration_seconds",
			Help:    "Time the upstream took to answer a forwarded request, body included.",
			Buckets: []float64{.001, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60},
		}),
		sweepLeft: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "idem_blob_sweep_left",
			Help: "Blobs the last sweep (--blob-sweep) left alone because they are not this proxy's store's, by reason: other_namespace (written through a store with another --prefix or of another kind: run idem gc with that store), unqualified (names from before blob names had a namespace: never judged; see idem gc -h), legacy (names of the store's v1.0 namespace, which did not tell databases apart: never judged).",
		}, []string{"reason"}),
	}
	m.Register(m.reg)
	m.reg.MustRegister(m.store, m.upstream, m.clientGone, m.upstreamAborted, m.sweeps, m.sweepDeleted, m.sweepLeft,
		collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	// Every series exists from the start, at zero, so that rate() and
	// alerts see the first increment.
	m.clientGone.WithLabelValues(string(idemhttp.OutcomeExecuted))
	return m
}

// initBlobSeries creates the blob series at zero, for a proxy with --blob.
func (m *proxyMetrics) initBlobSeries() {
	m.InitBlobSeries()
	m.sweeps.WithLabelValues("ok")
	m.sweeps.WithLabelValues("error")
	m.sweepLeft.WithLabelValues("other_namespace")
	m.sweepLeft.WithLabelValues("unqualified")
	m.sweepLeft.WithLabelValues("legacy")
}

// sweep counts a blob sweep.
func (m *proxyMetrics) sweep(res blobstore.SweepResult, err error) {
	m.sweepDeleted.Add(float64(res.Orphans + res.Partial))
	if err == nil { // a sweep that stopped saw only part of the bucket
		m.sweepLeft.WithLabelValues("other_namespace").Set(float64(res.Other))
		m.sweepLeft.WithLabelValues("unqualified").Set(float64(res.Unqualified))
		m.sweepLeft.WithLabelValues("legacy").Set(float64(res.Legacy))
	}
	if err != nil || res.Errors > 0 {
		m.sweeps.WithLabelValues("error").Inc()
		return
	}
	m.sweeps.WithLabelValues("ok").Inc()
}

// timedStore is an idem.Store that records the latency of every call.
type timedStore struct {
	s                                                 idem.Store
	acquire, renew, complete, release, get, deleteObs prometheus.Observer
}

var _ idem.Store = (*timedStore)(nil)

// Unwrap is the store timed: the engine looks through it (a memory store
// is never looked up for v1.0's keys).
func (t *timedStore) Unwrap() idem.Store { return t.s }

func newTimedStore(s idem.Store, h *prometheus.HistogramVec) *timedStore {
	return &timedStore{s: s,
		acquire: h.WithLabelValues("acquire"), renew: h.WithLabelValues("renew"),
		complete: h.WithLabelValues("complete"), release: h.WithLabelValues("release"),
		get: h.WithLabelValues("get"), deleteObs: h.WithLabelValues("delete")}
}

func since(o prometheus.Observer, start time.Time) { o.Observe(time.Since(start).Seconds()) }

func (t *timedStore) Acquire(ctx context.Context, req idem.AcquireRequest) (idem.Acquisition, error) {
	defer since(t.acquire, time.Now())
	return t.s.Acquire(ctx, req)
}

func (t *timedStore) Renew(ctx context.Context, l idem.Lease, ttl time.Duration) error {
	defer since(t.renew, time.Now())
	return t.s.Renew(ctx, l, ttl)
}

func (t *timedStore) Complete(ctx context.Context, l idem.Lease, resp *idem.Response, retention time.Duration) error {
	defer since(t.complete, time.Now())
	return t.s.Complete(ctx, l, resp, retention)
}

func (t *timedStore) Release(ctx context.Context, l idem.Lease) error {
	defer since(t.release, time.Now())
	return t.s.Release(ctx, l)
}

func (t *timedStore) Get(ctx context.Context, key idem.Key) (idem.Record, bool, error) {
	defer since(t.get, time.Now())
	return t.s.Get(ctx, key)
}

func (t *timedStore) Delete(ctx context.Context, key idem.Key) (bool, error) {
	defer since(t.deleteObs, time.Now())
	return t.s.Delete(ctx, key)
}

// Namespace forwards idem.Namespacer, so that the middleware names its
// blobs with the store's namespace; "" when the store has none.
func (t *timedStore) Namespace() string {
	if n, ok := t.s.(idem.Namespacer); ok {
		return n.Namespace()
	}
	return ""
}

// LegacyNamespace forwards blobstore.LegacyNamespacer, so that a sweep
// knows the blobs the store named in v1.0; "" when the store has none.
func (t *timedStore) LegacyNamespace() string {
	if n, ok := t.s.(interface{ LegacyNamespace() string }); ok {
		return n.LegacyNamespace()
	}
	return ""
}

// readyProbeTimeout bounds the store check behind /readyz.
const readyProbeTimeout = 2 * time.Second

// readyProbeKey is the record /readyz reads: no request can produce it
// (no route is named like this), and a miss is the expected answer.
var readyProbeKey, _ = idem.Scope{Tenant: "idem-proxy", Method: "READYZ", Route: "idem proxy readiness probe"}.Key("probe")

// adminHandler serves /metrics, /healthz and /readyz. /readyz answers 503
// while draining is set (the proxy is shutting down), when a read of a
// fixed probe key fails within readyProbeTimeout, or, with a blob store,
// when that store does not answer (new keyed requests then get 503).
func adminHandler(m *proxyMetrics, store idem.Store, blobs idem.BlobStore, draining *atomic.Bool) http.Handler {
	mux := http.NewServeMux()
	mux.Handle("GET /metrics", promhttp.HandlerFor(m.reg, promhttp.HandlerOpts{Registry: m.reg}))
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) {
		plain(w, http.StatusOK, "ok")
	})
	mux.HandleFunc("GET /readyz", func(w http.ResponseWriter, r *http.Request) {
		if draining.Load() {
			plain(w, http.StatusServiceUnavailable, "shutting down")
			return
		}
		ctx, cancel := context.WithTimeout(r.Context(), readyProbeTimeout)
		defer cancel()
		if _, _, err := store.Get(ctx, readyProbeKey); err != nil {
			plain(w, http.StatusServiceUnavailable, "store unavailable") // the error names hosts and users: not for this port
			return
		}
		if blobs != nil {
			if err := blobs.Check(ctx); err != nil {
				plain(w, http.StatusServiceUnavailable, "blob store unavailable")
				return
			}
		}
		plain(w, http.StatusOK, "ok")
	})
	return mux
}

func plain(w http.ResponseWriter, status int, msg string) {
	w.Header().Set("Content-Type", "text/plain; charset=utf-8")
	w.Header().Set("Cache-Control", "no-store")
	w.WriteHeader(status)
	w.Write([]byte(msg + "\n"))
}
