package main

import (
	"context"
	"log/slog"
	"math"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/memstore"
	"github.com/idemkit/idem/mysqlstore"
	"github.com/idemkit/idem/pgstore"
	"github.com/idemkit/idem/redisstore"
	"github.com/idemkit/idem/tieredstore"
)

// defaultMemoryLimit is --memory-limit's default: the most the records of
// --store memory may take before new keys get 503. With Go's collector
// letting the heap grow to about twice the live data, 128 MiB of records
// is a process of roughly 300 MiB, which a sidecar's usual memory limit
// holds, so a busy proxy refuses new keys (safe: nothing runs, the client
// retries) instead of being killed for memory (which forgets every key).
// It holds about 400,000 records of a 100-byte JSON response with two
// headers (about 340 bytes each, RecordOverhead included).
const defaultMemoryLimit = 128 << 20

// defaultReapInterval is --reap-interval's default, the tiered store's own
// (tieredstore.DefaultReapInterval). A pass is a few indexed DELETEs of at
// most 1000 rows (pgstore.DefaultReapBatch); records are reaped only once expired for the
// store's grace (a minute for pgstore, an hour for the tiered store), so
// reaping more often frees little sooner.
const defaultReapInterval = tieredstore.DefaultReapInterval

// memoryStoreWarning is logged at start-up when the proxy runs on memory.
const memoryStoreWarning = "--store memory keeps the records in this process: each instance has its own records, " +
	"and a restart forgets every key (its repeats run again); in production use a shared store: " + sharedStores

// storeMetrics are the proxy's metrics of its store, and the reaper's log
// lines. Each is registered only for the stores it applies to.
type storeMetrics struct {
	logger *slog.Logger
	reaped prometheus.Counter     // idem_reaped_total
	reaps  *prometheus.CounterVec // idem_reaps_total{result}
}

func newStoreMetrics(logger *slog.Logger) *storeMetrics {
	return &storeMetrics{
		logger: logger,
		reaped: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "idem_reaped_total",
			Help: "Expired records the PostgreSQL reaper deleted (--reap-interval): rows of pgstore's table, or of the tiered store's completions table.",
		}),
		reaps: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "idem_reaps_total",
			Help: "Passes of the PostgreSQL reaper by result: ok, error (logged; retried at the next pass).",
		}, []string{"result"}),
	}
}

// onReap is pgstore.Options.OnReap and tieredstore.Options.OnReap: it
// counts the pass and logs it, at INFO when it deleted something and at
// DEBUG otherwise. A failure is logged by the store.
func (m *storeMetrics) onReap(deleted int, took time.Duration, err error) {
	m.reaped.Add(float64(deleted))
	if err != nil {
		m.reaps.WithLabelValues("error").Inc()
		return
	}
	m.reaps.WithLabelValues("ok").Inc()
	level := slog.LevelDebug
	if deleted > 0 {
		level = slog.LevelInfo
	}
	m.logger.LogAttrs(context.Background(), level, "reaped expired records",
		slog.Int("deleted", deleted), slog.String("took", took.String()))
}

// register adds to reg the metrics that apply to store: the size and
// refusals of the memory store; the replay cache of the Redis store; the
// reaper's passes for PostgreSQL; and the outbox backlog of the tiered
// store.
func (m *storeMetrics) register(reg *prometheus.Registry, store idem.Store) {
	switch s := store.(type) {
	case *memstore.Store:
		reg.MustRegister(
			prometheus.NewGaugeFunc(prometheus.GaugeOpts{
				Name: "idem_memory_records",
				Help: "Records held by --store memory, the expired ones not yet dropped included.",
			}, func() float64 { return float64(s.Stats().Records) }),
			prometheus.NewGaugeFunc(prometheus.GaugeOpts{
				Name: "idem_memory_bytes",
				Help: "Approximate bytes the records of --store memory take (keys, fingerprints, responses and a fixed overhead each); the process uses about twice this (Go's collector). It may exceed the limit by the responses of the requests in flight.",
			}, func() float64 { return float64(s.Stats().Bytes) }),
			prometheus.NewGaugeFunc(prometheus.GaugeOpts{
				Name: "idem_memory_limit_bytes",
				Help: "--memory-limit: new keys are refused (503) when idem_memory_bytes reaches it; 0: no limit.",
			}, func() float64 { return float64(s.Stats().MaxBytes) }),
			prometheus.NewCounterFunc(prometheus.CounterOpts{
				Name: "idem_memory_refused_total",
				Help: "Requests with a new key refused with 503 (urn:idem:problem:store-full) because --store memory was at --memory-limit and no record had expired. Also counted as store_error in idem_requests_total.",
			}, func() float64 { return float64(s.Stats().Refused) }),
		)
	case *redisstore.Store:
		registerPolicy(reg, s)
		if !s.CacheStats().Enabled {
			return
		}
		reg.MustRegister(
			prometheus.NewCounterFunc(prometheus.CounterOpts{
				Name: "idem_redis_cache_hits_total",
				Help: "Acquires the Redis store answered from its replay cache, without a round trip: replays of completed records kept in this process and kept coherent by Redis (client-side caching).",
			}, func() float64 { return float64(s.CacheStats().Hits) }),
			prometheus.NewCounterFunc(prometheus.CounterOpts{
				Name: "idem_redis_cache_misses_total",
				Help: "Acquires Redis answered while the replay cache is on: first requests, replays of records not (or no longer) in the cache, in-flight and mismatched keys.",
			}, func() float64 { return float64(s.CacheStats().Misses) }),
		)
	case *pgstore.Store, *mysqlstore.Store:
		m.registerReaper(reg)
	case *tieredstore.Store:
		m.registerReaper(reg)
		reg.MustRegister(prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "idem_outbox_pending",
			Help: "Completions committed in PostgreSQL and not yet relayed to Redis, older than the relay's delay (2s): the tiered store's outbox backlog. Growing: the relay cannot reach Redis. NaN when PostgreSQL did not answer.",
		}, func() float64 {
			ctx, cancel := context.WithTimeout(context.Background(), readyProbeTimeout)
			defer cancel()
			n, err := s.Pending(ctx)
			if err != nil {
				return math.NaN()
			}
			return float64(n)
		}))
	}
}

func (m *storeMetrics) registerReaper(reg *prometheus.Registry) {
	reg.MustRegister(m.reaped, m.reaps)
	m.reaps.WithLabelValues("ok")
	m.reaps.WithLabelValues("error")
}

// registerPolicy adds the metrics of the Redis store's maxmemory-policy
// checks (redisstore.PolicyStats): at start-up, then at most once a minute
// (a failover or a CONFIG SET can change it).
func registerPolicy(reg *prometheus.Registry, s *redisstore.Store) {
	reg.MustRegister(
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "idem_redis_evicting_policy",
			Help: "1 when the last check of Redis's maxmemory-policy found a node that evicts keys (allkeys-*, volatile-*): an evicted completed record runs its work again on a retry. Set it to noeviction. 0 otherwise; NaN when no node's policy could be read (CONFIG GET and INFO refused).",
		}, func() float64 {
			switch st := s.PolicyStats(); {
			case st.Unknown:
				return math.NaN()
			case st.Evicting:
				return 1
			}
			return 0
		}),
		prometheus.NewCounterFunc(prometheus.CounterOpts{
			Name: "idem_redis_policy_checks_total",
			Help: "Checks of Redis's maxmemory-policy (at start-up, then at most once a minute).",
		}, func() float64 { return float64(s.PolicyStats().Checks) }),
		prometheus.NewCounterFunc(prometheus.CounterOpts{
			Name: "idem_redis_evicting_checks_total",
			Help: "Checks of Redis's maxmemory-policy that found a node that evicts keys (each also logged at WARN).",
		}, func() float64 { return float64(s.PolicyStats().EvictingChecks) }),
	)
}
