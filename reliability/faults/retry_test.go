package faults

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/reltest"
)

// TestRetryAfterLostReply drives the store directly, the way a client
// library resends a script after a lost reply: the same call, with the
// same lease id, token and arguments. Replies are lost by delaying them
// beyond the store's timeout (the scripts do run).
//
//   - Acquire's reply lost: a second caller gets InFlight (an HTTP client
//     would get 409), never the key; the resent Acquire gets its own lease
//     back with the same token.
//   - Complete's reply lost: the record is completed although the caller
//     saw an error; the resent Complete succeeds; Release and Renew of that
//     lease are refused and change nothing; every later Acquire replays
//     the body, including one with the old lease id.
//   - Acquire's reply lost and resent only after the lease ended and
//     another caller took the key: the resend gets InFlight, and the
//     stale lease's Complete is refused, so the key's result is the new
//     holder's.
func TestRetryAfterLostReply(t *testing.T) {
	t.Parallel()
	for _, client := range clients {
		t.Run(client, func(t *testing.T) {
			n := reltest.Scale(16, 128)
			o := harnessOpts{}
			if client == "go-redis" {
				o.warmPool = 2*n + 8 // no dialing while replies are late
			}
			h := newHarness(t, client, o)
			// Load the scripts first: on a cold script cache the first call
			// is an EVALSHA answered NOSCRIPT, and with that reply late
			// the EVAL that would run the script is never sent.
			h.warm(4)
			if client == "rueidis" {
				// rueidis runs a lone call with a deadline synchronously and
				// closes the connection when the deadline passes; the next
				// calls then wait for a new connection, whose handshake is
				// as late as every reply, and never reach Redis. Bursts of
				// concurrent calls switch its connections to pipelining,
				// where a deadline abandons the reply, not the connection.
				h.burst(64, 4)
			}
			s := h.store
			var calls, lostReplies, dups, lost atomic.Int64
			ctxCall := func() (context.Context, context.CancelFunc) {
				calls.Add(1)
				return ctxTimeout(5 * time.Second)
			}
			// call runs a store call once the fault is gone, resending it
			// (the same call, as a client library would) while the store
			// fails, at most 5 times: a slow moment of a loaded machine
			// must not pass for a wrong answer.
			var resent atomic.Int64
			call := func(f func(ctx context.Context) error) error {
				var err error
				for range 5 {
					ctx, cancel := ctxCall()
					err = f(ctx)
					cancel()
					var se *idem.StoreError
					if !errors.As(err, &se) {
						return err
					}
					resent.Add(1)
				}
				return err
			}
			fp := idem.SumFingerprint([]byte("amount=100"), "POST")
			body := func(k string) []byte { return []byte("result of " + k) }

			// 1 and 2: the reply to Acquire, then to Complete, is lost.
			keys := keyNames("lost", n)
			ids := make([]idem.LeaseID, n)
			for i := range ids {
				ids[i] = idem.NewLeaseID()
			}
			toxic := h.proxy.add(t, "latency", "downstream", delayAttrs)
			parallel(n, n, func(i int) {
				ctx, cancel := ctxCall()
				defer cancel()
				acq, err := s.Acquire(ctx, idem.AcquireRequest{Key: idemKey(keys[i]), Fingerprint: fp, LeaseID: ids[i], TTL: lease})
				if err == nil {
					t.Errorf("%s: Acquire answered %v despite the late reply", keys[i], acq.Outcome)
					return
				}
				lostReplies.Add(1)
			})
			h.proxy.remove(t, toxic)
			leases := make([]idem.Lease, n)
			parallel(n, n, func(i int) {
				k := idemKey(keys[i])
				var acq idem.Acquisition
				err := call(func(ctx context.Context) (err error) {
					acq, err = s.Acquire(ctx, idem.AcquireRequest{Key: k, Fingerprint: fp, LeaseID: idem.NewLeaseID(), TTL: lease})
					return err
				})
				if err != nil || acq.Outcome != idem.InFlight || acq.RetryAfter <= 0 || acq.RetryAfter > lease {
					t.Errorf("%s: another caller got %v (retry after %v), %v; want in flight for at most %v", keys[i], acq.Outcome, acq.RetryAfter, err, lease)
					if err == nil && acq.Outcome == idem.Acquired {
						dups.Add(1)
					}
				}
				err = call(func(ctx context.Context) (err error) {
					acq, err = s.Acquire(ctx, idem.AcquireRequest{Key: k, Fingerprint: fp, LeaseID: ids[i], TTL: lease})
					return err
				})
				if err != nil || acq.Outcome != idem.Acquired || acq.Lease.ID != ids[i] {
					t.Errorf("%s: the resent Acquire got %v, %v; want its own lease back", keys[i], acq.Outcome, err)
					return
				}
				leases[i] = acq.Lease
				var rec idem.Record
				var ok bool
				err = call(func(ctx context.Context) (err error) {
					rec, ok, err = s.Get(ctx, k)
					return err
				})
				if err != nil || !ok || rec.State != idem.StateInFlight || rec.LeaseID != ids[i] || rec.Token != acq.Lease.Token {
					t.Errorf("%s: record %+v, %v after the resent Acquire; want in flight under the lease with token %d", keys[i], rec, err, acq.Lease.Token)
				}
			})

			toxic = h.proxy.add(t, "latency", "downstream", delayAttrs)
			parallel(n, n, func(i int) {
				if leases[i].Token == 0 {
					return
				}
				ctx, cancel := ctxCall()
				defer cancel()
				if err := s.Complete(ctx, leases[i], &idem.Response{Status: 201, Body: body(keys[i])}, time.Hour); err == nil {
					t.Errorf("%s: Complete answered despite the late reply", keys[i])
					return
				}
				lostReplies.Add(1)
			})
			h.proxy.remove(t, toxic)
			parallel(n, n, func(i int) {
				k, l := idemKey(keys[i]), leases[i]
				if l.Token == 0 {
					return
				}
				completed := func(when string) {
					var rec idem.Record
					var ok bool
					err := call(func(ctx context.Context) (err error) {
						rec, ok, err = s.Get(ctx, k)
						return err
					})
					if err != nil || !ok || rec.State != idem.StateCompleted || string(rec.Response.Body) != string(body(keys[i])) || rec.Token != l.Token {
						t.Errorf("%s %s: record %+v, %v; want completed with its body and token %d", keys[i], when, rec, err, l.Token)
						lost.Add(1)
					}
				}
				completed("after the Complete whose reply was lost")
				err := call(func(ctx context.Context) error {
					return s.Complete(ctx, l, &idem.Response{Status: 201, Body: body(keys[i])}, time.Hour)
				})
				if err != nil {
					t.Errorf("%s: the resent Complete: %v, want nil", keys[i], err)
				}
				err = call(func(ctx context.Context) error {
					return s.Release(ctx, l)
				})
				if !errors.Is(err, idem.ErrLeaseLost) {
					t.Errorf("%s: Release after the completion: %v, want ErrLeaseLost", keys[i], err)
				}
				err = call(func(ctx context.Context) error {
					return s.Renew(ctx, l, lease)
				})
				if !errors.Is(err, idem.ErrLeaseLost) {
					t.Errorf("%s: Renew after the completion: %v, want ErrLeaseLost", keys[i], err)
				}
				completed("after the resent Complete, a Release and a Renew")
				for _, id := range []idem.LeaseID{idem.NewLeaseID(), l.ID} {
					var acq idem.Acquisition
					err := call(func(ctx context.Context) (err error) {
						acq, err = s.Acquire(ctx, idem.AcquireRequest{Key: k, Fingerprint: fp, LeaseID: id, TTL: lease})
						return err
					})
					if err != nil || acq.Outcome != idem.Replay || string(acq.Response.Body) != string(body(keys[i])) {
						t.Errorf("%s: a later Acquire got %v, %v; want a replay of its body", keys[i], acq.Outcome, err)
						if err == nil && acq.Outcome == idem.Acquired {
							dups.Add(1)
						}
					}
				}
			})

			// 3: the reply to Acquire is lost and the resend comes after the
			// lease ended and another caller took the key.
			late := keyNames("late", n)
			short := 1500 * time.Millisecond
			staleIDs := make([]idem.LeaseID, n)
			for i := range staleIDs {
				staleIDs[i] = idem.NewLeaseID()
			}
			toxic = h.proxy.add(t, "latency", "downstream", delayAttrs)
			sent := time.Now()
			parallel(n, n, func(i int) {
				ctx, cancel := ctxCall()
				defer cancel()
				if _, err := s.Acquire(ctx, idem.AcquireRequest{Key: idemKey(late[i]), Fingerprint: fp, LeaseID: staleIDs[i], TTL: short}); err == nil {
					t.Errorf("%s: Acquire answered despite the late reply", late[i])
					return
				}
				lostReplies.Add(1)
			})
			h.proxy.remove(t, toxic)
			staleTokens := make([]uint64, n)
			for i := range late { // read the tokens while the leases live
				var rec idem.Record
				var ok bool
				err := call(func(ctx context.Context) (err error) {
					rec, ok, err = s.Get(ctx, idemKey(late[i]))
					return err
				})
				if err != nil || !ok || rec.State != idem.StateInFlight || rec.LeaseID != staleIDs[i] {
					t.Fatalf("%s: record %+v, %v; want in flight under the unanswered lease", late[i], rec, err)
				}
				staleTokens[i] = rec.Token
			}
			time.Sleep(time.Until(sent.Add(short + 50*time.Millisecond))) // the unanswered leases end
			parallel(n, n, func(i int) {
				k, id := idemKey(late[i]), idem.NewLeaseID()
				var acq idem.Acquisition
				var err error
				// A lease runs from when its script ran, which on a loaded
				// machine may be later than sent: wait out what is left.
				for deadline := time.Now().Add(5 * time.Second); ; {
					err = call(func(ctx context.Context) (err error) {
						acq, err = s.Acquire(ctx, idem.AcquireRequest{Key: k, Fingerprint: fp, LeaseID: id, TTL: lease})
						return err
					})
					if err != nil || acq.Outcome != idem.InFlight || time.Now().After(deadline) {
						break
					}
					time.Sleep(max(acq.RetryAfter, time.Millisecond))
				}
				if err != nil || acq.Outcome != idem.Acquired || acq.Lease.Token <= staleTokens[i] {
					t.Errorf("%s: the caller after the lease got %v (token %d), %v; want the key with a token above %d", late[i], acq.Outcome, acq.Lease.Token, err, staleTokens[i])
					return
				}
				holder := acq.Lease
				err = call(func(ctx context.Context) (err error) {
					acq, err = s.Acquire(ctx, idem.AcquireRequest{Key: k, Fingerprint: fp, LeaseID: staleIDs[i], TTL: short})
					return err
				})
				if err != nil || acq.Outcome != idem.InFlight {
					t.Errorf("%s: the late resend of the first Acquire got %v, %v; want in flight", late[i], acq.Outcome, err)
					if err == nil && acq.Outcome == idem.Acquired {
						dups.Add(1)
					}
				}
				stale := idem.Lease{Key: k, ID: staleIDs[i], Token: staleTokens[i], TTL: short}
				err = call(func(ctx context.Context) error {
					return s.Complete(ctx, stale, &idem.Response{Status: 201, Body: []byte("stale")}, time.Hour)
				})
				if !errors.Is(err, idem.ErrLeaseLost) {
					t.Errorf("%s: Complete by the stale lease: %v, want ErrLeaseLost", late[i], err)
				}
				err = call(func(ctx context.Context) error {
					return s.Complete(ctx, holder, &idem.Response{Status: 201, Body: body(late[i])}, time.Hour)
				})
				if err != nil {
					t.Errorf("%s: Complete by the holder: %v", late[i], err)
				}
				err = call(func(ctx context.Context) (err error) {
					acq, err = s.Acquire(ctx, idem.AcquireRequest{Key: k, Fingerprint: fp, LeaseID: idem.NewLeaseID(), TTL: lease})
					return err
				})
				if err != nil || acq.Outcome != idem.Replay || string(acq.Response.Body) != string(body(late[i])) {
					t.Errorf("%s: after the holder's Complete: %v, %v; want a replay of the holder's body", late[i], acq.Outcome, err)
					lost.Add(1)
				}
			})

			// Nothing is left in flight.
			stuck := 0
			for _, k := range append(keys, late...) {
				var rec idem.Record
				var ok bool
				err := call(func(ctx context.Context) (err error) {
					rec, ok, err = s.Get(ctx, idemKey(k))
					return err
				})
				if err != nil || !ok || rec.State != idem.StateCompleted {
					stuck++
					t.Errorf("%s: record %+v, %v at the end; want completed", k, rec, err)
				}
			}
			reltest.Report(t, reltest.Row{
				Scenario:     "retried script after a lost reply",
				Store:        "redis (single, " + client + ")",
				Fault:        lateReplies + ", during Acquire and Complete; the call resent with the same lease id",
				Requests:     int(calls.Load()),
				Keys:         2 * n,
				Duplicates:   int(dups.Load()),
				Lost:         int(lost.Load()),
				Stuck:        stuck,
				ClientErrors: map[string]int{"timeout": int(lostReplies.Load())},
				Notes: fmt.Sprintf("%d replies lost (store calls timed out), %d calls resent after a slow answer once the fault was gone; resent Acquire got its own lease and token back while others got in flight; "+
					"resent Complete succeeded and the body was replayed; a resend after the lease ended and another caller took the key got in flight and its Complete was refused", lostReplies.Load(), resent.Load()),
			})
		})
	}
}
