// Package storetest is the conformance suite for idem.Store
// implementations, in the manner of testing/slogtest: a store's test hands
// Run a Harness that makes a fresh store, and Run checks the contract of
// idem.Store, and of idem.Guard over it, in named parallel subtests.
//
//	func TestConformance(t *testing.T) {
//		storetest.Run(t, func(t *testing.T, prefix string) storetest.Fixture {
//			s := mystore.New(client, mystore.Options{Prefix: prefix})
//			return storetest.Fixture{Store: s, Sleep: time.Sleep, Corrupt: s.corrupt}
//		})
//	}
//
// The suite lets leases and retentions of 100ms expire and sleeps 50ms
// longer than that, so a store on a real clock (a server, with millisecond
// expiry) passes it in about a second. A store on a fake clock passes it
// faster: only the Guard subtests wait in real time, because Guard renews
// leases on a real-time timer.
//
// Delete is an operator's purge that drops a key's history: the suite does
// not require a lease acquired after Delete to get a larger token than the
// leases before it.
package storetest

import (
	"bytes"
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"net/http"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem"
)

// Fixture is one fresh store made for one subtest.
type Fixture struct {
	// Store is the store under test. It holds none of the suite's keys.
	Store idem.Store

	// Sleep lets d pass on the store's clock: a fake clock advances by d, a
	// store on a real clock waits (time.Sleep).
	Sleep func(d time.Duration)

	// Corrupt overwrites key's record with bytes the store cannot decode.
	// When it is nil, the CorruptRecord subtest is skipped.
	Corrupt func(key idem.Key) error
}

// Harness makes a fresh store whose records are isolated from those of
// every other prefix on the same backend. The suite passes a unique prefix
// per call (unique across runs too), so backends need no flushing between
// subtests. Errors setting up the store should stop t.
type Harness func(t *testing.T, prefix string) Fixture

// Durations the suite uses. Timing checks leave slack for a store on a
// real clock with millisecond expiry, reached over a network.
const (
	shortTTL  = 100 * time.Millisecond // leases and retentions left to expire
	pastShort = 150 * time.Millisecond // a sleep that outlasts shortTTL
	longTTL   = 2 * time.Minute        // leases that never expire in a test, even on a loaded machine (1,000 callers on dynalite took 90s once)
	retention = time.Hour              // retention that never ends in a test
)

// Run runs the suite in subtests of t, in parallel, each with a fresh
// Fixture from h. It returns when they have all finished.
func Run(t *testing.T, h Harness) {
	s := &suite{h: h, run: rand.Text()[:8]}
	tests := []struct {
		name string
		fn   func(*suite, *testing.T)
	}{
		{"Outcomes", (*suite).testOutcomes},
		{"Takeover", (*suite).testTakeover},
		{"ExpiredLease", (*suite).testExpiredLease},
		{"TokensAheadOfClock", (*suite).testTokensAheadOfClock},
		{"StaleLease", (*suite).testStaleLease},
		{"RenewExtends", (*suite).testRenewExtends},
		{"FencingTokens", (*suite).testFencingTokens},
		{"RetentionExpiry", (*suite).testRetentionExpiry},
		{"RepeatedCalls", (*suite).testRepeatedCalls},
		{"Concurrency", (*suite).testConcurrency},
		{"CancelledContext", (*suite).testCancelledContext},
		{"PrefixIsolation", (*suite).testPrefixIsolation},
		{"CorruptRecord", (*suite).testCorruptRecord},
		{"Responses", (*suite).testResponses},
		{"BadInput", (*suite).testBadInput},
		{"Guard", (*suite).testGuard},
		{"Batch", (*suite).testBatch},
	}
	// The group keeps Run from returning (and the caller from tearing down
	// its backend) before the parallel subtests have run.
	// Concurrency runs before the others, not beside them: its storm of
	// 1,000 callers can starve a client's connection pool, and the timing
	// subtests (lease renewal) would fail for that reason only.
	// Batch too: its subtests run side by side and race batches of their
	// own.
	alone := map[string]bool{"Concurrency": true, "Batch": true}
	t.Run("storetest", func(t *testing.T) {
		for _, tt := range tests {
			if alone[tt.name] {
				t.Run(tt.name, func(t *testing.T) { tt.fn(s, t) })
			}
		}
		for _, tt := range tests {
			if !alone[tt.name] {
				t.Run(tt.name, func(t *testing.T) {
					t.Parallel()
					tt.fn(s, t)
				})
			}
		}
	})
}

type suite struct {
	h   Harness
	run string // random, so prefixes differ between runs on one backend
	n   atomic.Uint64
}

// env is one subtest's fixture with helpers that check as they go.
type env struct {
	Fixture
	t   *testing.T
	ctx context.Context
}

// env calls the harness for a fresh fixture with a new prefix.
func (s *suite) env(t *testing.T) *env {
	t.Helper()
	f := s.h(t, fmt.Sprintf("storetest:%s:%d:", s.run, s.n.Add(1)))
	if f.Store == nil || f.Sleep == nil {
		t.Fatal("storetest: the Harness returned a Fixture without Store or Sleep")
	}
	return &env{Fixture: f, t: t, ctx: t.Context()}
}

var (
	fpA = idem.Fingerprint{0: 'a'}
	fpB = idem.Fingerprint{0: 'b'}
)

func newKey() idem.Key {
	var k idem.Key
	rand.Read(k[:])
	return k
}

// acquire calls Acquire and stops the test on an error.
func (e *env) acquire(key idem.Key, fp idem.Fingerprint, id idem.LeaseID, ttl time.Duration) idem.Acquisition {
	e.t.Helper()
	acq, err := e.Store.Acquire(e.ctx, idem.AcquireRequest{Key: key, Fingerprint: fp, LeaseID: id, TTL: ttl})
	if err != nil {
		e.t.Fatalf("Acquire: got error %v, want none", err)
	}
	return acq
}

// lease acquires key with a new lease id and stops the test unless the
// outcome is Acquired.
func (e *env) lease(key idem.Key, fp idem.Fingerprint, ttl time.Duration) idem.Lease {
	e.t.Helper()
	acq := e.acquire(key, fp, idem.NewLeaseID(), ttl)
	e.wantOutcome("Acquire", acq, idem.Acquired)
	return acq.Lease
}

func (e *env) wantOutcome(what string, acq idem.Acquisition, want idem.Outcome) {
	e.t.Helper()
	if acq.Outcome != want {
		e.t.Fatalf("%s: got outcome %v, want %v", what, acq.Outcome, want)
	}
}

func (e *env) complete(l idem.Lease, resp *idem.Response, retention time.Duration) {
	e.t.Helper()
	if err := e.Store.Complete(e.ctx, l, resp, retention); err != nil {
		e.t.Fatalf("Complete: got error %v, want none", err)
	}
}

func (e *env) release(l idem.Lease) {
	e.t.Helper()
	if err := e.Store.Release(e.ctx, l); err != nil {
		e.t.Fatalf("Release: got error %v, want none", err)
	}
}

// get calls Get and stops the test on an error.
func (e *env) get(key idem.Key) (idem.Record, bool) {
	e.t.Helper()
	rec, ok, err := e.Store.Get(e.ctx, key)
	if err != nil {
		e.t.Fatalf("Get: got error %v, want none", err)
	}
	return rec, ok
}

func (e *env) wantMiss(what string, key idem.Key) {
	e.t.Helper()
	if rec, ok := e.get(key); ok {
		e.t.Errorf("%s: Get: got a %v record, want none", what, rec.State)
	}
}

func (e *env) wantLost(what string, err error) {
	e.t.Helper()
	if !errors.Is(err, idem.ErrLeaseLost) {
		e.t.Errorf("%s: got error %v, want ErrLeaseLost", what, err)
	}
}

// wantRecord checks key's record against want and returns it. The TTL must
// be in (minTTL, want.TTL]; Size must equal want.Size unless that is zero.
func (e *env) wantRecord(what string, key idem.Key, want idem.Record, minTTL time.Duration) idem.Record {
	e.t.Helper()
	got, ok := e.get(key)
	if !ok {
		e.t.Fatalf("%s: Get: got no record, want a %v one", what, want.State)
	}
	var d []string
	if got.State != want.State {
		d = append(d, fmt.Sprintf("state: got %v, want %v", got.State, want.State))
	}
	if got.Token != want.Token {
		d = append(d, fmt.Sprintf("token: got %d, want %d", got.Token, want.Token))
	}
	if got.Fingerprint != want.Fingerprint {
		d = append(d, fmt.Sprintf("fingerprint: got %x, want %x", got.Fingerprint, want.Fingerprint))
	}
	if got.LeaseID != want.LeaseID {
		d = append(d, fmt.Sprintf("lease id: got %v, want %v", got.LeaseID, want.LeaseID))
	}
	if got.TTL <= minTTL || got.TTL > want.TTL {
		d = append(d, fmt.Sprintf("TTL: got %v, want in (%v, %v]", got.TTL, minTTL, want.TTL))
	}
	if want.Size != 0 && got.Size != want.Size {
		d = append(d, fmt.Sprintf("size: got %d, want %d", got.Size, want.Size))
	}
	switch {
	case want.Response != nil:
		if diff := diffResponse(got.Response, want.Response); diff != "" {
			d = append(d, "response: "+diff)
		}
	case got.Response != nil:
		d = append(d, "response: got one, want none")
	}
	if len(d) > 0 {
		e.t.Errorf("%s: Get: %s", what, strings.Join(d, "; "))
	}
	return got
}

// wantUnchanged checks that key's record is still before, its TTL not
// extended.
func (e *env) wantUnchanged(what string, key idem.Key, before idem.Record) {
	e.t.Helper()
	e.wantRecord(what, key, before, 0)
}

func inFlight(l idem.Lease, fp idem.Fingerprint) idem.Record {
	return idem.Record{State: idem.StateInFlight, Token: l.Token, Fingerprint: fp, LeaseID: l.ID, TTL: l.TTL}
}

func completed(l idem.Lease, fp idem.Fingerprint, resp *idem.Response, retention time.Duration) idem.Record {
	return idem.Record{State: idem.StateCompleted, Token: l.Token, Fingerprint: fp, TTL: retention, Response: resp}
}

// diffResponse describes how got differs from want, or returns "". A nil
// and an empty header or body are equal.
func diffResponse(got, want *idem.Response) string {
	if got == nil || want == nil {
		if got == want {
			return ""
		}
		return fmt.Sprintf("got %v, want %v", got, want)
	}
	var d []string
	if got.Status != want.Status {
		d = append(d, fmt.Sprintf("status: got %d, want %d", got.Status, want.Status))
	}
	if !headerEqual(got.Header, want.Header) {
		d = append(d, fmt.Sprintf("header: got %v, want %v", got.Header, want.Header))
	}
	if !bytes.Equal(got.Body, want.Body) {
		i := 0
		for i < min(len(got.Body), len(want.Body)) && got.Body[i] == want.Body[i] {
			i++
		}
		d = append(d, fmt.Sprintf("body: got %d bytes, want %d, first difference at offset %d", len(got.Body), len(want.Body), i))
	}
	if got.BodyOmitted != want.BodyOmitted {
		d = append(d, fmt.Sprintf("body omitted: got %t, want %t", got.BodyOmitted, want.BodyOmitted))
	}
	return strings.Join(d, "; ")
}

func headerEqual(a, b http.Header) bool {
	if len(a) != len(b) {
		return false
	}
	for name, va := range a {
		if vb, ok := b[name]; !ok || !slices.Equal(va, vb) {
			return false
		}
	}
	return true
}

func cloneResponse(r *idem.Response) *idem.Response {
	return &idem.Response{Status: r.Status, Header: r.Header.Clone(), Body: bytes.Clone(r.Body), BodyOmitted: r.BodyOmitted}
}
