package idemhttp

import (
	"fmt"
	"net/http"
	"strconv"
	"sync"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/quota"
	"github.com/idemkit/idem/memstore"
)

// Quota limits what the keyed requests of one tenant (Config.Tenant's
// answer; the callers it names "" are one tenant) may hold in the store,
// so that no one client fills it for the others: its keys in flight, its
// stored records, and their bytes. A request with a new key that would
// take its tenant past a limit gets 429 application/problem+json of type
// ProblemQuotaExceeded with Retry-After (outcome OutcomeQuotaExceeded):
// the handler does not run and nothing is claimed. A key that already
// has a record (a retry of a stored or in-flight key) is never refused:
// it replays, waits or gets 409 as usual, so a tenant over its quota
// still gets its stored results. Finding that out costs the store one
// read (Store.Get), for refused requests only.
//
// The counts are this process's (package internal/quota): several
// processes in front of one store each count their own, a restart starts
// from zero, and a client that rotates credentials is as many tenants. A
// key counts in flight from before it is claimed until its work ends; a
// stored record counts (one record, and its bytes) until its retention
// ends, rounded up to a sixteenth of that retention, also when the store
// dropped it sooner (a purge). Released keys give their place back at
// once. A tenant over Bytes still completes what it has in flight, so it
// may exceed Bytes by up to InFlight responses.
//
// At most Tenants tenants are tracked (about that many: the table is
// sharded); while the table is full of tenants that still hold records,
// a new tenant is counted together with every other such tenant, as one
// tenant with the same limits. Each tracked tenant takes up to about 1
// KiB.
//
// A Quota is shared by the middlewares it is given to (their tenants'
// counts are one), and must not be changed once in use. A limit of zero
// or less is no limit: &Quota{} limits nothing.
type Quota struct {
	// InFlight bounds the requests of a tenant that hold a new key, or
	// are about to claim one, at once.
	InFlight int
	// Records bounds the records a tenant holds: in flight and stored
	// (until their retention ends).
	Records int
	// Bytes bounds the bytes of a tenant's stored records:
	// memstore.RecordOverhead each plus the response's body (as the
	// handler wrote it, before compression; a body in the blob store not
	// included) and header.
	Bytes int64
	// Tenants bounds the tenants tracked. Default DefaultQuotaTenants.
	Tenants int

	once sync.Once
	set  *quota.Set // nil when nothing is limited
}

// Quota defaults: see DefaultQuota.
const (
	// DefaultQuotaInFlight is DefaultQuota's InFlight.
	DefaultQuotaInFlight = 32
	// DefaultQuotaShare is the share of the store DefaultQuota gives one
	// tenant: Bytes is the store's size divided by it.
	DefaultQuotaShare = 8
	// DefaultQuotaTenants is Quota.Tenants's default.
	DefaultQuotaTenants = quota.DefaultTenants
)

// Limits of a Quota, as Config.OnQuotaExceeded and the problem's detail
// name them.
const (
	QuotaInFlight = string(quota.LimitInFlight) // "in_flight"
	QuotaRecords  = string(quota.LimitRecords)  // "records"
	QuotaBytes    = string(quota.LimitBytes)    // "bytes"
)

// DefaultQuota is the quota for a store that holds at most storeBytes
// bytes: each tenant may have DefaultQuotaInFlight keys in flight and an
// eighth of storeBytes (DefaultQuotaShare) in stored records, so that one
// client's flood of new keys, large responses included, leaves the store
// room for the others' (it holds at most its Bytes plus the responses of
// its keys in flight: with idem proxy's defaults, 16 MiB plus 32 responses
// of at most 1 MiB, of a 128 MiB store). Config.Quota's default when the
// store is a *memstore.Store with a MaxBytes; without a known size, nil.
func DefaultQuota(storeBytes int64) *Quota {
	if storeBytes <= 0 {
		return nil
	}
	return &Quota{InFlight: DefaultQuotaInFlight, Bytes: max(storeBytes/DefaultQuotaShare, 1)}
}

// NoQuota limits nothing: Config.Quota's value to turn the default off.
var NoQuota = &Quota{}

// String describes q's limits, for logs.
func (q *Quota) String() string {
	if q == nil || !q.limits().On() {
		return "none"
	}
	l := q.limits()
	s := ""
	add := func(name string, v int64) {
		if v > 0 {
			if s != "" {
				s += " "
			}
			s += name + "=" + strconv.FormatInt(v, 10)
		}
	}
	add("in_flight", int64(l.InFlight))
	add("records", l.Records)
	add("bytes", l.Bytes)
	return s
}

func (q *Quota) limits() quota.Limits {
	return quota.Limits{InFlight: q.InFlight, Records: int64(q.Records), Bytes: q.Bytes, Tenants: q.Tenants}
}

// counts returns q's counter, made on first use; nil when q limits
// nothing.
func (q *Quota) counts() *quota.Set {
	if q == nil {
		return nil
	}
	q.once.Do(func() {
		if l := q.limits(); l.On() {
			q.set = quota.New(l, nil)
		}
	})
	return q.set
}

// QuotaStats is what a Quota tracks.
type QuotaStats struct {
	// Tenants is the number of tenants with counts of their own.
	Tenants int
	// Overflow reports that tenants past Quota.Tenants are counted
	// together now.
	Overflow bool
}

// Stats returns what q tracks (zero before its first use). It takes a
// lock per shard of the table: for metrics, not for every request.
func (q *Quota) Stats() QuotaStats {
	if s := q.counts(); s != nil {
		st := s.Stats()
		return QuotaStats{Tenants: st.Tenants, Overflow: st.Overflow}
	}
	return QuotaStats{}
}

// defaultQuota is Config.Quota's default for store.
func defaultQuota(store idem.Store) *Quota {
	if ms, ok := store.(*memstore.Store); ok {
		return DefaultQuota(ms.Stats().MaxBytes)
	}
	return nil
}

// admit counts a request of tenant against the quota before its key is
// claimed. A request over it is let through only when its key has a
// record already (it claims nothing new: it replays, waits or gets 409,
// or re-claims a released or expired key, counted then); otherwise it is
// answered 429 and admit reports false.
func (m *middleware) admit(w http.ResponseWriter, r *http.Request, tenant string, key idem.Key, start time.Time) (quota.Ticket, bool) {
	if m.quota == nil {
		return quota.Ticket{}, true
	}
	t, over, retryAfter := m.quota.Admit(tenant, start)
	if over == "" {
		return t, true
	}
	if rec, ok, err := m.store.Get(r.Context(), key); err == nil && ok && rec.State != idem.StateReleased {
		return quota.Ticket{}, true
	}
	if m.cfg.OnQuotaExceeded != nil {
		m.cfg.OnQuotaExceeded(r, string(over))
	}
	m.outcome(r, OutcomeQuotaExceeded)
	p := problemQuotaExceeded
	p.RetryAfter = int((retryAfter + time.Second - 1) / time.Second)
	p.Detail = fmt.Sprintf(quotaDetail[over], m.quotaLimit(over))
	m.problem(w, r, p)
	return quota.Ticket{}, false
}

// quotaLimit is the value of limit.
func (m *middleware) quotaLimit(limit quota.Limit) int64 {
	l := m.quota.Limits()
	switch limit {
	case quota.LimitInFlight:
		return int64(l.InFlight)
	case quota.LimitRecords:
		return l.Records
	}
	return l.Bytes
}

var quotaDetail = map[quota.Limit]string{
	quota.LimitInFlight: "This client has %d requests with new Idempotency-Keys in progress, its limit. The request was not processed; retry it with the same key once one has finished.",
	quota.LimitRecords:  "This client holds %d stored idempotency records, its limit, until older ones expire. The request was not processed; retry it with the same key after Retry-After. Keys already stored still replay.",
	quota.LimitBytes:    "This client's stored idempotency records hold %d bytes, its limit, until older ones expire. The request was not processed; retry it with the same key after Retry-After. Keys already stored still replay.",
}

// takeOver counts a key that was let through over the quota (it had a
// record) and then was claimed: a retry re-claiming its released or
// expired key, which is not a new one.
func (m *middleware) takeOver(t quota.Ticket, tenant string) quota.Ticket {
	if m.quota == nil || t != (quota.Ticket{}) {
		return t
	}
	return m.quota.Force(tenant)
}

// recordSize is what resp counts for in Quota.Bytes.
func recordSize(resp *idem.Response) int64 {
	n := int64(memstore.RecordOverhead + len(resp.Body))
	for name, vs := range resp.Header {
		for _, v := range vs {
			n += int64(len(name) + len(v) + 4)
		}
	}
	return n
}
