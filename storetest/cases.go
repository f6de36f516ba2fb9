package storetest

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/idemkit/idem"
)

var jsonHeader = http.Header{"Content-Type": {"application/json"}}

// testOutcomes walks one key through Acquired, InFlight, Mismatch, Replay.
func (s *suite) testOutcomes(t *testing.T) {
	e := s.env(t)
	key, id := newKey(), idem.NewLeaseID()
	acq := e.acquire(key, fpA, id, longTTL)
	e.wantOutcome("first Acquire", acq, idem.Acquired)
	l := acq.Lease
	// The TTL is the time left when the store answered: the full lease, or
	// a little less when the store measures it at the end of its step.
	if want := (idem.Lease{Key: key, ID: id, Token: l.Token, TTL: l.TTL}); l != want || l.TTL > longTTL || l.TTL < longTTL-time.Second {
		t.Errorf("first Acquire: got lease %+v, want %+v with TTL in (%v, %v]", l, want, longTTL-time.Second, longTTL)
	}
	if l.Token == 0 {
		t.Error("first Acquire: got token 0, want > 0")
	}
	e.wantRecord("in flight", key, inFlight(l, fpA), longTTL/2)

	acq = e.acquire(key, fpA, idem.NewLeaseID(), longTTL)
	e.wantOutcome("Acquire while in flight", acq, idem.InFlight)
	if acq.RetryAfter <= 0 || acq.RetryAfter > longTTL {
		t.Errorf("Acquire while in flight: got RetryAfter %v, want in (0, %v]", acq.RetryAfter, longTTL)
	}
	e.wantOutcome("Acquire with another fingerprint while in flight", e.acquire(key, fpB, idem.NewLeaseID(), longTTL), idem.Mismatch)

	resp := &idem.Response{
		Status: 201,
		Header: http.Header{"Content-Type": {"application/json"}, "Location": {"/orders/1"}},
		Body:   []byte(`{"id":1}`),
	}
	want := cloneResponse(resp)
	e.complete(l, resp, retention)
	// The store must have taken a copy.
	resp.Status, resp.Body[1] = 500, 'X'
	resp.Header.Set("Location", "/elsewhere")
	e.wantRecord("completed", key, completed(l, fpA, want, retention), retention/2)

	acq = e.acquire(key, fpA, idem.NewLeaseID(), longTTL)
	e.wantOutcome("Acquire after Complete", acq, idem.Replay)
	if diff := diffResponse(acq.Response, want); diff != "" {
		t.Errorf("replayed response: %s", diff)
	}
	e.wantOutcome("Acquire with another fingerprint after Complete", e.acquire(key, fpB, idem.NewLeaseID(), longTTL), idem.Mismatch)
}

// testTakeover lets a lease expire and checks that its holder can no
// longer touch the next holder's record.
func (s *suite) testTakeover(t *testing.T) {
	e := s.env(t)
	key := newKey()
	old := e.lease(key, fpA, shortTTL)
	e.Sleep(pastShort)
	e.wantMiss("after the lease ended", key)

	cur := e.lease(key, fpA, longTTL)
	if cur.Token <= old.Token {
		t.Errorf("takeover: got token %d, want > %d", cur.Token, old.Token)
	}
	before := e.wantRecord("after takeover", key, inFlight(cur, fpA), longTTL/2)
	e.wantLost("Renew by the old lease", e.Store.Renew(e.ctx, old, longTTL))
	e.wantLost("Complete by the old lease", e.Store.Complete(e.ctx, old, &idem.Response{Status: 200}, retention))
	e.wantLost("Release by the old lease", e.Store.Release(e.ctx, old))
	e.wantUnchanged("after the old lease's calls", key, before)

	// The new holder completes. The old lease's Complete with the very
	// bytes the record now holds is not a repeat: that lease never
	// completed, so it is lost (a store that told a repeat by the response
	// alone would answer success for a write that went nowhere).
	resp := &idem.Response{Status: 201, Header: jsonHeader, Body: []byte(`{"id":7}`)}
	e.complete(cur, cloneResponse(resp), retention)
	before = e.wantRecord("completed by the new holder", key, completed(cur, fpA, resp, retention), retention/2)
	e.wantLost("Complete by the old lease with the stored response", e.Store.Complete(e.ctx, old, cloneResponse(resp), retention))
	e.wantLost("Renew by the old lease after the new holder completed", e.Store.Renew(e.ctx, old, longTTL))
	e.wantLost("Release by the old lease after the new holder completed", e.Store.Release(e.ctx, old))
	e.wantUnchanged("after the old lease's calls on the completed record", key, before)
}

// testStaleLease checks that only the current lease may renew, complete
// or release.
// testExpiredLease: a holder that outlived its lease, with nobody taking
// over, can neither renew, complete nor release, and writes nothing: the
// key stays absent.
func (s *suite) testExpiredLease(t *testing.T) {
	e := s.env(t)
	key := newKey()
	l := e.lease(key, fpA, shortTTL)
	e.Sleep(pastShort)
	e.wantLost("Renew after the lease ended", e.Store.Renew(e.ctx, l, longTTL))
	e.wantLost("Complete after the lease ended", e.Store.Complete(e.ctx, l, &idem.Response{Status: 200}, retention))
	e.wantLost("Release after the lease ended", e.Store.Release(e.ctx, l))
	e.wantMiss("after the late calls", key)
	if next := e.lease(key, fpA, longTTL); next.Token <= l.Token {
		e.t.Errorf("next token: got %d, want more than %d", next.Token, l.Token)
	}
}

// testTokensAheadOfClock drives tokens ahead of the store clock (many
// acquisitions within a few milliseconds each add one), then lets a short
// lease expire. The record must not vanish before the clock has passed
// its token, or the next token, taken from the clock, would be smaller.
func (s *suite) testTokensAheadOfClock(t *testing.T) {
	e := s.env(t)
	key := newKey()
	var last uint64
	for range 300 {
		l := e.lease(key, fpA, longTTL)
		e.release(l)
		last = l.Token
	}
	l := e.lease(key, fpA, time.Millisecond)
	if l.Token <= last {
		t.Fatalf("token after the releases: got %d, want more than %d", l.Token, last)
	}
	// Wait for the key to free up, however long the clock needs to catch
	// up with the tokens: the next token must still be larger.
	deadline := time.Now().Add(5 * time.Second)
	for {
		e.Sleep(5 * time.Millisecond)
		acq := e.acquire(key, fpA, idem.NewLeaseID(), longTTL)
		if acq.Outcome == idem.Acquired {
			if acq.Lease.Token <= l.Token {
				t.Fatalf("token after the expiry: got %d, want more than %d", acq.Lease.Token, l.Token)
			}
			return
		}
		e.wantOutcome("Acquire while the short lease lives", acq, idem.InFlight)
		if time.Now().After(deadline) {
			t.Fatal("the key stayed in flight for 5s after a 1ms lease")
		}
	}
}

func (s *suite) testStaleLease(t *testing.T) {
	resp := &idem.Response{Status: 200}
	t.Run("WrongID", func(t *testing.T) {
		t.Parallel()
		e := s.env(t)
		key := newKey()
		l := e.lease(key, fpA, longTTL)
		before := e.wantRecord("in flight", key, inFlight(l, fpA), longTTL/2)
		wrong := l
		wrong.ID = idem.NewLeaseID()
		e.wantLost("Renew with a wrong lease id", e.Store.Renew(e.ctx, wrong, longTTL))
		e.wantLost("Complete with a wrong lease id", e.Store.Complete(e.ctx, wrong, resp, retention))
		e.wantLost("Release with a wrong lease id", e.Store.Release(e.ctx, wrong))
		e.wantUnchanged("after calls with a wrong lease id", key, before)
	})
	t.Run("AfterRelease", func(t *testing.T) {
		t.Parallel()
		e := s.env(t)
		key := newKey()
		l := e.lease(key, fpA, longTTL)
		e.release(l)
		before := e.wantRecord("released", key, idem.Record{State: idem.StateReleased, Token: l.Token, TTL: l.TTL}, longTTL/2)
		e.wantLost("Renew after Release", e.Store.Renew(e.ctx, l, longTTL))
		e.wantLost("Complete after Release", e.Store.Complete(e.ctx, l, resp, retention))
		e.wantUnchanged("after calls by the released lease", key, before)

		next := e.lease(key, fpA, longTTL)
		if next.Token <= l.Token {
			t.Errorf("Acquire after Release: got token %d, want > %d", next.Token, l.Token)
		}
		before = e.wantRecord("in flight again", key, inFlight(next, fpA), longTTL/2)
		e.wantLost("Renew by the released lease", e.Store.Renew(e.ctx, l, longTTL))
		e.wantLost("Complete by the released lease", e.Store.Complete(e.ctx, l, resp, retention))
		e.wantLost("Release by the released lease", e.Store.Release(e.ctx, l))
		e.wantUnchanged("after calls by the released lease", key, before)

		// Only the lease that left a tombstone may repeat its Release.
		e.release(next)
		before = e.wantRecord("released again", key, idem.Record{State: idem.StateReleased, Token: next.Token, TTL: next.TTL}, longTTL/2)
		e.wantLost("Release by the earlier lease", e.Store.Release(e.ctx, l))
		e.wantUnchanged("after a Release by the earlier lease", key, before)
	})
	t.Run("AfterComplete", func(t *testing.T) {
		t.Parallel()
		e := s.env(t)
		key := newKey()
		l := e.lease(key, fpA, longTTL)
		e.complete(l, resp, retention)
		before := e.wantRecord("completed", key, completed(l, fpA, resp, retention), retention/2)
		e.wantLost("Renew after Complete", e.Store.Renew(e.ctx, l, longTTL))
		e.wantLost("Release after Complete", e.Store.Release(e.ctx, l))
		other := idem.Lease{Key: key, ID: idem.NewLeaseID(), Token: l.Token + 1, TTL: longTTL}
		e.wantLost("Renew by another lease", e.Store.Renew(e.ctx, other, longTTL))
		e.wantLost("Complete by another lease", e.Store.Complete(e.ctx, other, &idem.Response{Status: 500}, retention))
		e.wantLost("Release by another lease", e.Store.Release(e.ctx, other))
		e.wantUnchanged("after calls on the completed record", key, before)
	})
}

// testRenewExtends checks that Renew restarts the lease from now.
func (s *suite) testRenewExtends(t *testing.T) {
	e := s.env(t)
	key := newKey()
	l := e.lease(key, fpA, shortTTL)
	// Long enough that the Acquire below finds the lease held however
	// slow the calls before it (with 3*shortTTL, a loaded machine took
	// the Get and the Acquire past its end); a Renew that extended the
	// old end instead of restarting from now is still caught by the TTL
	// checks' upper bounds.
	const renewed = longTTL
	if err := e.Store.Renew(e.ctx, l, renewed); err != nil {
		t.Fatalf("Renew: got error %v, want none", err)
	}
	want := inFlight(l, fpA)
	want.TTL = renewed
	e.wantRecord("after Renew", key, want, renewed-pastShort)

	e.Sleep(pastShort) // past the first lease, not the renewed one
	want.TTL = renewed - pastShort
	e.wantRecord("after the first lease would have ended", key, want, 0)
	e.wantOutcome("Acquire by another lease", e.acquire(key, fpA, idem.NewLeaseID(), longTTL), idem.InFlight)
	if err := e.Store.Renew(e.ctx, l, renewed); err != nil {
		t.Errorf("second Renew: got error %v, want none", err)
	}
}

// testFencingTokens checks that tokens strictly increase across releases,
// takeovers and expiry, even when they run ahead of the clock.
func (s *suite) testFencingTokens(t *testing.T) {
	e := s.env(t)
	key := newKey()
	var last uint64
	next := func(what string, l idem.Lease) {
		t.Helper()
		if l.Token <= last {
			t.Fatalf("%s: got token %d, want > %d", what, l.Token, last)
		}
		last = l.Token
	}

	// Many acquisitions within a millisecond: tokens run ahead of the clock.
	for i := range 50 {
		l := e.lease(key, fpA, longTTL)
		next(fmt.Sprintf("Acquire %d after Release", i), l)
		e.release(l)
	}
	// 1ms leases whose records outlive their TTL, because the clock has to
	// pass their token before they may go.
	for i := range 50 {
		// The lease before may have ended before its Release (a slow
		// machine): its record then stays in flight until the clock has
		// passed its token, and the key is taken over after that.
		var acq idem.Acquisition
		for deadline := time.Now().Add(5 * time.Second); ; {
			acq = e.acquire(key, fpA, idem.NewLeaseID(), time.Millisecond)
			if acq.Outcome != idem.InFlight || time.Now().After(deadline) {
				break
			}
			e.Sleep(max(acq.RetryAfter, time.Millisecond))
		}
		e.wantOutcome(fmt.Sprintf("Acquire %d of a 1ms lease", i), acq, idem.Acquired)
		l := acq.Lease
		next(fmt.Sprintf("Acquire %d of a 1ms lease", i), l)
		// The lease may have ended already: then the key is free once its
		// record goes (above).
		if err := e.Store.Release(e.ctx, l); err != nil && !errors.Is(err, idem.ErrLeaseLost) {
			t.Fatalf("Release of a 1ms lease: got error %v, want none or ErrLeaseLost", err)
		}
		if i%10 == 9 {
			e.Sleep(2 * time.Millisecond)
		}
	}

	l := e.lease(key, fpA, shortTTL)
	next("Acquire", l)
	e.Sleep(pastShort)
	l = e.lease(key, fpA, shortTTL)
	next("takeover after the lease ended", l)

	e.release(l)
	e.Sleep(pastShort)
	l = e.lease(key, fpA, longTTL)
	next("Acquire after the release's record expired", l)

	e.complete(l, &idem.Response{Status: 200}, shortTTL)
	e.Sleep(pastShort)
	l = e.lease(key, fpA, longTTL)
	next("Acquire after the retention ended", l)

	// Delete drops the history, so no token order is required after it.
	if ok, err := e.Store.Delete(e.ctx, key); err != nil || !ok {
		t.Fatalf("Delete: got %t, %v; want true, nil", ok, err)
	}
	e.lease(key, fpA, longTTL)
}

// testRetentionExpiry checks that a completed key is new again after its
// retention.
func (s *suite) testRetentionExpiry(t *testing.T) {
	e := s.env(t)
	key := newKey()
	l := e.lease(key, fpA, longTTL)
	resp := &idem.Response{Status: 200, Body: []byte("done")}
	e.complete(l, resp, shortTTL)
	e.wantRecord("completed", key, completed(l, fpA, resp, shortTTL), 0)
	e.Sleep(pastShort)
	e.wantMiss("after the retention ended", key)
	if next := e.lease(key, fpA, longTTL); next.Token <= l.Token {
		t.Errorf("Acquire after the retention ended: got token %d, want > %d", next.Token, l.Token)
	}
}

// testRepeatedCalls repeats every call as a client does after a lost reply.
func (s *suite) testRepeatedCalls(t *testing.T) {
	e := s.env(t)
	key, id := newKey(), idem.NewLeaseID()
	first := e.acquire(key, fpA, id, longTTL)
	e.wantOutcome("Acquire", first, idem.Acquired)
	again := e.acquire(key, fpA, id, longTTL)
	e.wantOutcome("repeated Acquire", again, idem.Acquired)
	if again.Lease.Key != key || again.Lease.ID != id || again.Lease.Token != first.Lease.Token {
		t.Errorf("repeated Acquire: got lease %+v, want %+v", again.Lease, first.Lease)
	}
	if ttl := again.Lease.TTL; ttl <= 0 || ttl > longTTL {
		t.Errorf("repeated Acquire: got lease TTL %v, want in (0, %v]", ttl, longTTL)
	}

	l := first.Lease
	for i := range 2 {
		if err := e.Store.Renew(e.ctx, l, longTTL); err != nil {
			t.Errorf("Renew %d: got error %v, want none", i+1, err)
		}
	}
	resp := &idem.Response{Status: 200, Body: []byte("first")}
	e.complete(l, resp, retention)
	before := e.wantRecord("completed", key, completed(l, fpA, resp, retention), retention/2)
	if err := e.Store.Complete(e.ctx, l, resp, retention); err != nil {
		t.Errorf("repeated Complete: got error %v, want none", err)
	}
	e.wantUnchanged("after the repeated Complete", key, before)
	// The same lease with another response is not a repeat of the call
	// that succeeded: nil or ErrLeaseLost (see idem.Store's Complete), and
	// nothing changes.
	if err := e.Store.Complete(e.ctx, l, &idem.Response{Status: 500, Body: []byte("second")}, retention); err != nil && !errors.Is(err, idem.ErrLeaseLost) {
		t.Errorf("Complete again with another response: got error %v, want nil or ErrLeaseLost", err)
	}
	e.wantUnchanged("after Complete again with another response", key, before)

	key = newKey()
	l = e.lease(key, fpA, longTTL)
	e.release(l)
	before = e.wantRecord("released", key, idem.Record{State: idem.StateReleased, Token: l.Token, TTL: l.TTL}, longTTL/2)
	if err := e.Store.Release(e.ctx, l); err != nil {
		t.Errorf("repeated Release: got error %v, want none", err)
	}
	e.wantUnchanged("after the repeated Release", key, before)
}

// testConcurrency races many callers for one key, and for many keys.
func (s *suite) testConcurrency(t *testing.T) {
	t.Run("OneKey", func(t *testing.T) {
		t.Parallel()
		e := s.env(t)
		acqs := race(e, []idem.Key{newKey()}, 1000)[0]
		if n := count(acqs, idem.Acquired); n != 1 {
			t.Errorf("%d callers on one key: got %d Acquired, want 1", len(acqs), n)
		}
		if n := count(acqs, idem.InFlight); n != len(acqs)-1 {
			t.Errorf("%d callers on one key: got %d InFlight, want %d", len(acqs), n, len(acqs)-1)
		}
	})
	t.Run("ManyKeys", func(t *testing.T) {
		t.Parallel()
		e := s.env(t)
		keys := make([]idem.Key, 64)
		for i := range keys {
			keys[i] = newKey()
		}
		const callers = 16
		resp := &idem.Response{Status: 200, Body: []byte("once")}
		// Every count is checked before any Complete starts: a t.Fatalf
		// with goroutines still running would let them report to a test
		// that has ended, which panics the test binary.
		var leases []idem.Lease
		for i, acqs := range race(e, keys, callers) {
			if n := count(acqs, idem.Acquired); n != 1 {
				t.Fatalf("%d callers on key %d: got %d Acquired, want 1", callers, i, n)
			}
			for _, acq := range acqs {
				if acq.Outcome == idem.Acquired {
					leases = append(leases, acq.Lease)
				}
			}
		}
		var wg sync.WaitGroup
		for i, l := range leases {
			wg.Go(func() {
				if err := e.Store.Complete(e.ctx, l, resp, retention); err != nil {
					t.Errorf("Complete key %d: got error %v, want none", i, err)
				}
			})
		}
		wg.Wait()
		for i, acqs := range race(e, keys, callers) {
			if n := count(acqs, idem.Replay); n != callers {
				t.Errorf("%d callers on completed key %d: got %d Replay, want %d", callers, i, n, callers)
			}
		}
	})
}

// race has callers goroutines per key call Acquire at once, each with its
// own lease id, and returns the acquisitions per key.
func race(e *env, keys []idem.Key, callers int) [][]idem.Acquisition {
	e.t.Helper()
	acqs := make([][]idem.Acquisition, len(keys))
	errs := make([]error, len(keys)*callers)
	start := make(chan struct{})
	var wg sync.WaitGroup
	for k, key := range keys {
		acqs[k] = make([]idem.Acquisition, callers)
		for c := range callers {
			wg.Go(func() {
				<-start
				req := idem.AcquireRequest{Key: key, Fingerprint: fpA, LeaseID: idem.NewLeaseID(), TTL: longTTL}
				acqs[k][c], errs[k*callers+c] = e.Store.Acquire(e.ctx, req)
			})
		}
	}
	close(start)
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		e.t.Fatalf("concurrent Acquire: got error %v, want none", err)
	}
	return acqs
}

func count(acqs []idem.Acquisition, o idem.Outcome) int {
	n := 0
	for _, a := range acqs {
		if a.Outcome == o {
			n++
		}
	}
	return n
}

// testCancelledContext calls every method with a cancelled context.
func (s *suite) testCancelledContext(t *testing.T) {
	e := s.env(t)
	cancelled, cancel := context.WithCancel(e.ctx)
	cancel()
	key := newKey()
	_, err := e.Store.Acquire(cancelled, idem.AcquireRequest{Key: key, Fingerprint: fpA, LeaseID: idem.NewLeaseID(), TTL: longTTL})
	wantCancelled(t, "acquire", key, err)
	e.wantMiss("after Acquire with a cancelled context", key)

	l := e.lease(key, fpA, longTTL)
	before := e.wantRecord("in flight", key, inFlight(l, fpA), longTTL/2)
	wantCancelled(t, "renew", key, e.Store.Renew(cancelled, l, longTTL))
	wantCancelled(t, "complete", key, e.Store.Complete(cancelled, l, &idem.Response{Status: 200}, retention))
	wantCancelled(t, "release", key, e.Store.Release(cancelled, l))
	_, _, err = e.Store.Get(cancelled, key)
	wantCancelled(t, "get", key, err)
	_, err = e.Store.Delete(cancelled, key)
	wantCancelled(t, "delete", key, err)
	e.wantUnchanged("after calls with a cancelled context", key, before)
}

func wantCancelled(t *testing.T, op string, key idem.Key, err error) {
	t.Helper()
	if !errors.Is(err, context.Canceled) {
		t.Errorf("%s with a cancelled context: got error %v, want context.Canceled", op, err)
	}
	var se *idem.StoreError
	if !errors.As(err, &se) {
		t.Errorf("%s with a cancelled context: got error %T, want a *idem.StoreError", op, err)
		return
	}
	if se.Op != op || se.Key != key {
		t.Errorf("%s with a cancelled context: got StoreError{Op: %q, Key: %v}, want {%q, %v}", op, se.Op, se.Key, op, key)
	}
}

// testPrefixIsolation checks that two prefixes on one backend do not share
// records.
func (s *suite) testPrefixIsolation(t *testing.T) {
	e1, e2 := s.env(t), s.env(t)
	key := newKey()
	l1 := e1.lease(key, fpA, longTTL)
	l2 := e2.lease(key, fpA, longTTL)
	e1.complete(l1, &idem.Response{Status: 200}, retention)
	e2.wantRecord("other prefix after Complete", key, inFlight(l2, fpA), longTTL/2)
	e2.wantOutcome("Acquire by another lease under the other prefix", e2.acquire(key, fpA, idem.NewLeaseID(), longTTL), idem.InFlight)
	e1.wantOutcome("Acquire under the completed prefix", e1.acquire(key, fpA, idem.NewLeaseID(), longTTL), idem.Replay)
	if ok, err := e2.Store.Delete(e2.ctx, key); err != nil || !ok {
		t.Fatalf("Delete under the other prefix: got %t, %v; want true, nil", ok, err)
	}
	e1.wantOutcome("Acquire after Delete under the other prefix", e1.acquire(key, fpA, idem.NewLeaseID(), longTTL), idem.Replay)
}

// testCorruptRecord checks that undecodable records give ErrCorrupt, and
// that Delete clears them.
func (s *suite) testCorruptRecord(t *testing.T) {
	e := s.env(t)
	if e.Corrupt == nil {
		t.Skip("Fixture.Corrupt is nil")
	}
	key := newKey()
	e.complete(e.lease(key, fpA, longTTL), &idem.Response{Status: 200, Body: []byte("fine")}, retention)
	if err := e.Corrupt(key); err != nil {
		t.Fatalf("Corrupt: %v", err)
	}
	_, _, err := e.Store.Get(e.ctx, key)
	wantCorrupt(t, "Get", err)
	_, err = e.Store.Acquire(e.ctx, idem.AcquireRequest{Key: key, Fingerprint: fpA, LeaseID: idem.NewLeaseID(), TTL: longTTL})
	wantCorrupt(t, "Acquire", err)
	if ok, err := e.Store.Delete(e.ctx, key); err != nil || !ok {
		t.Fatalf("Delete of a corrupt record: got %t, %v; want true, nil", ok, err)
	}
	e.wantMiss("after Delete", key)
	e.lease(key, fpA, longTTL)
}

func wantCorrupt(t *testing.T, what string, err error) {
	t.Helper()
	var se *idem.StoreError
	if !errors.Is(err, idem.ErrCorrupt) || !errors.As(err, &se) {
		t.Errorf("%s of a corrupt record: got error %v, want a *idem.StoreError wrapping ErrCorrupt", what, err)
	}
}

// testResponses round-trips responses of every shape through Complete,
// Get and a replay.
func (s *suite) testResponses(t *testing.T) {
	random := make([]byte, 64<<10)
	rand.Read(random)
	var js strings.Builder
	js.WriteString(`{"items":[`)
	for i := 0; js.Len() < 4<<10-64; i++ {
		fmt.Fprintf(&js, `{"id":%d,"name":"item %d","price":{"amount":%d,"currency":"EUR"}},`, i, i, 100+i)
	}
	json := []byte(strings.TrimSuffix(js.String(), ",") + "]}")

	for _, tt := range []struct {
		name       string
		resp       idem.Response
		compressed bool // Record.Size must be smaller than the body
	}{
		{name: "Empty", resp: idem.Response{Status: 200}},
		{name: "NoHeaders", resp: idem.Response{Status: 200, Body: []byte("ok")}},
		{name: "EmptyBody", resp: idem.Response{Status: 204, Header: http.Header{"Etag": {`"v1"`}}}},
		{name: "JSONHeaderOnly", resp: idem.Response{Status: 201, Header: jsonHeader, Body: []byte(`{"ok":true}`)}},
		{name: "MultiValuedHeaders", resp: idem.Response{Status: 202, Header: http.Header{
			"Content-Type":  {"text/plain; charset=utf-8"},
			"Vary":          {"Accept", "Origin"},
			"X-Trace":       {"a", "b", ""},
			"x-lower-case":  {"kept as written"},
			"Cache-Control": {"no-store"},
		}, Body: []byte("accepted")}},
		{name: "Status0", resp: idem.Response{Status: 0}},
		{name: "Status100", resp: idem.Response{Status: 100}},
		{name: "Status599", resp: idem.Response{Status: 599, Body: []byte("x")}},
		{name: "Status999", resp: idem.Response{Status: 999}},
		{name: "JSON4KiB", resp: idem.Response{Status: 200, Header: jsonHeader, Body: json}, compressed: true},
		{name: "Random64KiB", resp: idem.Response{Status: 200, Header: http.Header{"Content-Type": {"application/octet-stream"}}, Body: random}},
		{name: "BodyOmitted", resp: idem.Response{Status: 200, Header: jsonHeader, BodyOmitted: true}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			e := s.env(t)
			key := newKey()
			l := e.lease(key, fpA, longTTL)
			e.complete(l, cloneResponse(&tt.resp), retention)
			rec := e.wantRecord("completed", key, completed(l, fpA, &tt.resp, retention), retention/2)
			if tt.compressed && rec.Size >= len(tt.resp.Body) {
				t.Errorf("Get: got Size %d, want < %d (the body compressed)", rec.Size, len(tt.resp.Body))
			}
			acq := e.acquire(key, fpA, idem.NewLeaseID(), longTTL)
			e.wantOutcome("Acquire after Complete", acq, idem.Replay)
			if diff := diffResponse(acq.Response, &tt.resp); diff != "" {
				t.Errorf("replayed response: %s", diff)
			}
		})
	}
}

// testBadInput checks that a lease shorter than a millisecond is refused.
func (s *suite) testBadInput(t *testing.T) {
	e := s.env(t)
	key := newKey()
	for _, ttl := range []time.Duration{0, -time.Second, time.Millisecond - 1} {
		acq, err := e.Store.Acquire(e.ctx, idem.AcquireRequest{Key: key, Fingerprint: fpA, LeaseID: idem.NewLeaseID(), TTL: ttl})
		if err == nil {
			t.Errorf("Acquire with TTL %v: got outcome %v and no error, want an error", ttl, acq.Outcome)
		}
		e.wantMiss(fmt.Sprintf("after Acquire with TTL %v", ttl), key)
	}
}
