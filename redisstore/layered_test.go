package redisstore_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/redistest"
	"github.com/idemkit/idem/redisstore"
)

// Hold, Fill and RaiseToken, the steps tieredstore builds on, with each
// client on a single node and on a cluster.
func TestLayered(t *testing.T) {
	for _, c := range clients(t) {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			s := c.store(t, redisstore.Options{Prefix: redistest.Prefix("layered")})
			t.Run("Hold", func(t *testing.T) { testHold(t, s) })
			t.Run("Fill", func(t *testing.T) { testFill(t, s) })
			t.Run("RaiseToken", func(t *testing.T) { testRaiseToken(t, s) })
		})
	}
}

var (
	fpA = idem.Fingerprint{0: 'a'}
	fpB = idem.Fingerprint{0: 'b'}
)

func lease(t *testing.T, s *redisstore.Store, key idem.Key, fp idem.Fingerprint, ttl time.Duration) idem.Lease {
	t.Helper()
	acq, err := s.Acquire(context.Background(), idem.AcquireRequest{Key: key, Fingerprint: fp, LeaseID: idem.NewLeaseID(), TTL: ttl})
	if err != nil || acq.Outcome != idem.Acquired {
		t.Fatalf("Acquire: %v %v", acq.Outcome, err)
	}
	return acq.Lease
}

func get(t *testing.T, s *redisstore.Store, key idem.Key) idem.Record {
	t.Helper()
	rec, ok, err := s.Get(context.Background(), key)
	if err != nil || !ok {
		t.Fatalf("Get: %v %v", ok, err)
	}
	return rec
}

func testHold(t *testing.T, s *redisstore.Store) {
	ctx := context.Background()
	key := scope(1)
	l := lease(t, s, key, fpB, 200*time.Millisecond)
	fp, err := s.Hold(ctx, l, 10*time.Second)
	if err != nil || fp != fpB {
		t.Fatalf("Hold: got %x, %v; want the lease's fingerprint", fp, err)
	}
	if rec := get(t, s, key); rec.State != idem.StateInFlight || rec.TTL < 9*time.Second {
		t.Fatalf("after Hold: got %+v, want in flight for about 10s", rec)
	}
	other := l
	other.ID = idem.NewLeaseID()
	if _, err := s.Hold(ctx, other, time.Second); !errors.Is(err, idem.ErrLeaseLost) {
		t.Fatalf("Hold by another lease: got %v, want ErrLeaseLost", err)
	}
	if err := s.Complete(ctx, l, &idem.Response{Status: 200}, time.Hour); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Hold(ctx, l, time.Second); !errors.Is(err, idem.ErrLeaseLost) {
		t.Fatalf("Hold after Complete: got %v, want ErrLeaseLost", err)
	}
	if _, err := s.Hold(ctx, l, 0); err == nil {
		t.Fatal("Hold with a zero TTL: got no error")
	}
}

func testFill(t *testing.T, s *redisstore.Store) {
	ctx := context.Background()
	enc := func(body string) []byte {
		b, err := (&idem.Response{Status: 201, Body: []byte(body)}).AppendBinary(nil)
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	fill := func(f redisstore.Fill, want redisstore.FillResult) {
		t.Helper()
		got, err := s.Fill(ctx, f)
		if err != nil || got != want {
			t.Fatalf("Fill %+v: got %v, %v; want %v", f, got, err, want)
		}
	}
	wantCompleted := func(key idem.Key, token uint64, fp idem.Fingerprint, body string) idem.Record {
		t.Helper()
		rec := get(t, s, key)
		if rec.State != idem.StateCompleted || rec.Token != token || rec.Fingerprint != fp || string(rec.Response.Body) != body {
			t.Fatalf("after Fill: got %+v, want completed, token %d, body %q", rec, token, body)
		}
		return rec
	}

	// Over nothing, then the same again, then an older completion.
	key := scope(2)
	fill(redisstore.Fill{Key: key, Token: 1000, Fingerprint: fpA, TTL: time.Hour, Response: enc("first")}, redisstore.Filled)
	wantCompleted(key, 1000, fpA, "first")
	fill(redisstore.Fill{Key: key, Token: 1000, Fingerprint: fpA, TTL: time.Hour, Response: enc("first")}, redisstore.FillPresent)
	fill(redisstore.Fill{Key: key, Token: 999, Fingerprint: fpA, TTL: time.Hour, Response: enc("older")}, redisstore.FillRefused)
	fill(redisstore.Fill{Key: key, Token: 1001, Fingerprint: fpA, TTL: time.Hour, Response: enc("newer")}, redisstore.Filled)
	wantCompleted(key, 1001, fpA, "newer")
	acq, err := s.Acquire(ctx, idem.AcquireRequest{Key: key, Fingerprint: fpA, LeaseID: idem.NewLeaseID(), TTL: time.Second})
	if err != nil || acq.Outcome != idem.Replay || string(acq.Response.Body) != "newer" {
		t.Fatalf("Acquire after Fill: got %v %v, want the replay", acq.Outcome, err)
	}
	fill(redisstore.Fill{Key: scope(3), Token: 5, Fingerprint: fpA, TTL: 0, Response: enc("x")}, redisstore.FillRefused)

	// Over the completing lease's in-flight record, taking its fingerprint.
	key = scope(4)
	l := lease(t, s, key, fpB, time.Hour)
	fill(redisstore.Fill{Key: key, Token: l.Token, FingerprintFromLease: true, Lease: idem.NewLeaseID(), TTL: time.Hour, Response: enc("x")}, redisstore.FillNoFingerprint)
	fill(redisstore.Fill{Key: key, Token: l.Token, FingerprintFromLease: true, Lease: l.ID, TTL: time.Hour, Response: enc("relayed")}, redisstore.Filled)
	wantCompleted(key, l.Token, fpB, "relayed")
	if err := s.Renew(ctx, l, time.Hour); !errors.Is(err, idem.ErrLeaseLost) {
		t.Fatalf("Renew after Fill: got %v, want ErrLeaseLost", err)
	}
	if err := s.Complete(ctx, l, &idem.Response{Status: 201, Body: []byte("relayed")}, time.Hour); err != nil {
		t.Fatalf("Complete of the same token and response after Fill: got %v, want nil (a repeat)", err)
	}
	if err := s.Complete(ctx, l, &idem.Response{Status: 200}, time.Hour); !errors.Is(err, idem.ErrLeaseLost) {
		t.Fatalf("Complete of the same token with another response after Fill: got %v, want ErrLeaseLost (the record does not hold it)", err)
	}

	// Over another lease's record whose token is ahead of the clock (and
	// of the completion's): the record lasts until the clock passes it.
	key = scope(5)
	l, err = s.RaiseToken(ctx, lease(t, s, key, fpA, time.Hour), uint64(time.Now().Add(time.Hour).UnixMilli()))
	if err != nil {
		t.Fatal(err)
	}
	fill(redisstore.Fill{Key: key, Token: 7, Fingerprint: fpA, TTL: time.Millisecond, Response: enc("old")}, redisstore.Filled)
	time.Sleep(5 * time.Millisecond)
	if rec, ok, _ := s.Get(ctx, key); !ok || rec.Token != 7 || rec.TTL < 59*time.Minute {
		t.Fatalf("completion over a larger token: got %+v %v; want it kept until the clock passes token %d", rec, ok, l.Token)
	}
	if _, err := s.Fill(ctx, redisstore.Fill{Key: key, Token: 0, Response: enc("x"), TTL: time.Second}); err == nil {
		t.Fatal("Fill with token 0: got no error")
	}
}

func testRaiseToken(t *testing.T, s *redisstore.Store) {
	ctx := context.Background()
	key := scope(6)
	l := lease(t, s, key, fpA, time.Second)
	floor := l.Token + 3_600_000
	raised, err := s.RaiseToken(ctx, l, floor)
	if err != nil || raised.Token != floor+1 || raised.ID != l.ID {
		t.Fatalf("RaiseToken: got %+v, %v; want token %d", raised, err, floor+1)
	}
	if again, err := s.RaiseToken(ctx, raised, l.Token); err != nil || again.Token != floor+1 {
		t.Fatalf("RaiseToken below the token: got %+v, %v; want it unchanged", again, err)
	}
	if rec := get(t, s, key); rec.Token != floor+1 || rec.LeaseID != l.ID || rec.State != idem.StateInFlight {
		t.Fatalf("after RaiseToken: got %+v", rec)
	}
	if err := s.Release(ctx, raised); err != nil {
		t.Fatal(err)
	}
	if next := lease(t, s, key, fpA, time.Second); next.Token <= floor+1 {
		t.Fatalf("next token: got %d, want more than %d", next.Token, floor+1)
	}
	if _, err := s.RaiseToken(ctx, l, 1); !errors.Is(err, idem.ErrLeaseLost) {
		t.Fatalf("RaiseToken by a lease no longer live: got %v, want ErrLeaseLost", err)
	}
}
