package sidecar

import (
	"fmt"

	"github.com/idemkit/idem/idemhttp"
)

// QuotaLimits are the per-tenant limits of an idemhttp.Quota; 0: none.
type QuotaLimits struct {
	InFlight, Records int
	Bytes             int64
}

// DefaultQuota is the quota of a sidecar whose quota settings were not
// given: idemhttp.DefaultQuota of the memory store's limit (memoryBytes;
// 0 for another store, whose size the sidecar does not know), else none.
// The front ends put each given setting over it.
func DefaultQuota(memoryBytes int64) QuotaLimits {
	q := idemhttp.DefaultQuota(memoryBytes)
	if q == nil {
		return QuotaLimits{}
	}
	return QuotaLimits{InFlight: q.InFlight, Records: q.Records, Bytes: q.Bytes}
}

// Quota returns s's limits.
func (s Settings) Quota() QuotaLimits {
	return QuotaLimits{InFlight: s.QuotaInFlight, Records: s.QuotaRecords, Bytes: s.QuotaBytes}
}

// SetQuota sets s's limits to l.
func (s *Settings) SetQuota(l QuotaLimits) {
	s.QuotaInFlight, s.QuotaRecords, s.QuotaBytes = l.InFlight, l.Records, l.Bytes
}

// None reports whether l limits nothing.
func (l QuotaLimits) None() bool { return l.InFlight <= 0 && l.Records <= 0 && l.Bytes <= 0 }

// New is a new idemhttp.Quota of l, counting at most tenants tenants one
// by one (0: idemhttp's default); idemhttp.NoQuota when l limits nothing.
func (l QuotaLimits) New(tenants int) *idemhttp.Quota {
	if l.None() {
		return idemhttp.NoQuota
	}
	return &idemhttp.Quota{InFlight: l.InFlight, Records: l.Records, Bytes: l.Bytes, Tenants: tenants}
}

// String names l, for the keys under which the sidecars keep a quota's
// counts (across a reload, between handlers).
func (l QuotaLimits) String() string {
	return fmt.Sprintf("in_flight=%d records=%d bytes=%d", l.InFlight, l.Records, l.Bytes)
}
