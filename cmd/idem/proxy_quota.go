package main

import (
	"errors"
	"flag"
	"strconv"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/internal/sidecar"
)

// Per-tenant quotas (idemhttp.Quota): the flags, their defaults, which
// depend on the store, and their metrics.

// quotaFlags are the --quota-* flags. A count or size flag that was not
// given takes a default that depends on the store: see resolve.
type quotaFlags struct {
	inFlight, records optCount
	bytes             optSize
	tenants           int
}

func (q *quotaFlags) register(fs *flag.FlagSet) {
	fs.Var(&q.inFlight, "quota-in-flight", "per tenant (a client's Authorization, API key, --tenant-header or --tenant-cookie; every anonymous caller together is one): the most requests with new keys in flight at once; past it a new key gets 429 (urn:idem:problem:quota-exceeded, Retry-After) and nothing is forwarded; default 32 with --store memory and a --memory-limit, else 0: no limit")
	fs.Var(&q.records, "quota-records", "per tenant: the most records it holds (in flight, and stored until their --retention ends); past it a new key gets 429; keys already stored still replay; 0 (the default): no limit")
	fs.Var(&q.bytes, "quota-bytes", "per tenant: the most bytes its stored records hold (each response's body and header, plus 160 bytes), in bytes or with a unit (16MiB); past it a new key gets 429; keys already stored still replay; default an eighth of --memory-limit with --store memory, else 0: no limit")
	fs.IntVar(&q.tenants, "quota-tenants", idemhttp.DefaultQuotaTenants, "with a quota: the most tenants counted one by one; past them, the new ones are counted together as one tenant (about 1 KiB of memory each)")
}

// resolve puts the flags' limits into s: the given ones, else the
// defaults, which are on only where the proxy knows the store's size
// (--store memory with a --memory-limit).
func (q *quotaFlags) resolve(s *routeSettings, memoryBytes int64) error {
	def := sidecar.DefaultQuota(memoryBytes)
	s.SetQuota(sidecar.QuotaLimits{InFlight: int(q.inFlight.or(int64(def.InFlight))),
		Records: int(q.records.or(int64(def.Records))), Bytes: q.bytes.or(def.Bytes)})
	if q.tenants < 1 {
		return usageError{"--quota-tenants " + strconv.Itoa(q.tenants) + ": want at least 1"}
	}
	return nil
}

// optCount is a count flag that knows whether it was given.
type optCount struct {
	n   int64
	set bool
}

func (c *optCount) Set(s string) error {
	n, err := strconv.ParseInt(s, 10, 64)
	if err != nil || n < 0 || n > 1<<31-1 {
		return errors.New("want a whole number, 0 or more (0: no limit)")
	}
	c.n, c.set = n, true
	return nil
}

func (c *optCount) String() string {
	if c == nil || !c.set {
		return ""
	}
	return strconv.FormatInt(c.n, 10)
}

func (c *optCount) or(def int64) int64 {
	if c.set {
		return c.n
	}
	return def
}

// optSize is a size flag that knows whether it was given.
type optSize struct {
	b   byteSize
	set bool
}

func (o *optSize) Set(s string) error {
	if err := o.b.Set(s); err != nil {
		return errors.New(sizeWant + " (0: no limit)")
	}
	o.set = true
	return nil
}

func (o *optSize) String() string {
	if o == nil || !o.set {
		return ""
	}
	return o.b.String()
}

func (o *optSize) or(def int64) int64 {
	if o.set {
		return int64(o.b)
	}
	return def
}

// registerQuotaTenants adds idem_quota_tenants, over the proxy's quotas.
func (m *proxyMetrics) registerQuotaTenants(quotas func() []*idemhttp.Quota) {
	m.reg.MustRegister(prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "idem_quota_tenants",
		Help: "Tenants whose quota is counted one by one (at most about --quota-tenants per quota: the routes of the flags share one, a --config route with quota_* settings has its own).",
	}, func() float64 {
		n := 0
		for _, q := range quotas() {
			n += q.Stats().Tenants
		}
		return float64(n)
	}))
}
