package redisstore_test

import (
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/redisserver"
	"github.com/idemkit/idem/internal/redistest"
	"github.com/idemkit/idem/redisstore"
)

// traceRounds traces s's native path (TraceNative): sent(f) returns the
// round trips f sent, each as its commands ("CLAIM" for SET … NX GET, "CAS"
// for SET … IFEQ, else the command's name), a run of n equal ones as
// "NAME*n".
func traceRounds(t *testing.T, s *redisstore.Store) (sent func(f func()) []string) {
	t.Helper()
	if _, _, err := s.Get(t.Context(), scope(0)); err != nil { // picks the path
		t.Fatal(err)
	}
	var (
		mu     sync.Mutex
		rounds []string
	)
	redisstore.TraceNative(s, func(cmds [][]string) {
		var names []string
		for _, cmd := range cmds {
			name := cmd[0]
			if name == "SET" {
				args := strings.ToUpper(strings.Join(cmd[3:], " "))
				switch {
				case strings.Contains(args, "IFEQ"):
					name = "CAS"
				case strings.Contains(args, "NX") && strings.Contains(args, "GET"):
					name = "CLAIM"
				}
			}
			names = append(names, name)
		}
		var parts []string
		for i := 0; i < len(names); {
			j := i
			for j < len(names) && names[j] == names[i] {
				j++
			}
			if j-i > 1 {
				parts = append(parts, fmt.Sprintf("%s*%d", names[i], j-i))
			} else {
				parts = append(parts, names[i])
			}
			i = j
		}
		mu.Lock()
		rounds = append(rounds, strings.Join(parts, " "))
		mu.Unlock()
	})
	return func(f func()) []string {
		mu.Lock()
		rounds = nil
		mu.Unlock()
		f()
		mu.Lock()
		defer mu.Unlock()
		return rounds
	}
}

// TestNativeBatchPipeline: on a single node, a batch on the native path
// sends the claims of its keys in one pipeline (SET … NX GET PX for each
// key, then TIME), and the completions and releases of the leases the
// store granted in one pipeline of SET … IFEQ; only a claim whose token
// did not stand takes one more round trip (its fix).
func TestNativeBatchPipeline(t *testing.T) {
	srvs := startKinds(t)
	for _, kind := range []redisserver.Kind{redisserver.Valkey9, redisserver.Redis8} {
		for _, c := range []client{
			goredisClient(t, redis.NewClient(&redis.Options{Addr: srvs[kind].Addr()}), "single"),
			rueidisClient(t, []string{srvs[kind].Addr()}, "single"),
		} {
			t.Run(string(kind)+"/"+c.name, func(t *testing.T) {
				testNativeBatchPipeline(t, c)
			})
		}
	}
}

func testNativeBatchPipeline(t *testing.T, c client) {
	ctx := t.Context()
	s := c.store(t, redisstore.Options{Prefix: redistest.Prefix("nbatch"), Path: redisstore.PathNative})
	sent := traceRounds(t, s)
	const n = 16
	acquire := func() []idem.Lease {
		t.Helper()
		reqs := make([]idem.AcquireRequest, n)
		for i := range reqs {
			reqs[i] = idem.AcquireRequest{Key: randomKey(), LeaseID: idem.NewLeaseID(), Fingerprint: idem.Fingerprint{1}, TTL: time.Minute}
		}
		var acqs []idem.AcquireResult
		rounds := sent(func() { acqs = s.AcquireMany(ctx, reqs) })
		if want := fmt.Sprintf("CLAIM*%d TIME", n); len(rounds) == 0 || rounds[0] != want {
			t.Fatalf("AcquireMany of %d free keys: first round trip %q, want %q", n, rounds, want)
		}
		for _, r := range rounds[1:] { // a token that did not stand, fixed
			if r != "CAS" {
				t.Errorf("AcquireMany of %d free keys: sent %q, want %q, then at most one CAS per key", n, rounds, rounds[0])
				break
			}
		}
		var leases []idem.Lease
		for i, a := range acqs {
			if a.Err != nil || a.Outcome != idem.Acquired {
				t.Fatalf("AcquireMany answer %d: %v %v, want Acquired", i, a.Outcome, a.Err)
			}
			leases = append(leases, a.Lease)
		}
		return leases
	}
	leases := acquire()
	cs := make([]idem.Completion, len(leases))
	for i, l := range leases {
		cs[i] = idem.Completion{Lease: l, Response: &idem.Response{Status: 200 + i}, Retention: time.Minute}
	}
	var errs []error
	if got, want := sent(func() { errs = s.CompleteMany(ctx, cs) }), fmt.Sprintf("CAS*%d", n); len(got) != 1 || got[0] != want {
		t.Errorf("CompleteMany of %d leases the store granted: sent %q, want [%q]", n, got, want)
	}
	for i, err := range errs {
		if err != nil {
			t.Fatalf("CompleteMany answer %d: %v", i, err)
		}
	}
	leases = acquire()
	if got, want := sent(func() { errs = s.ReleaseMany(ctx, leases) }), fmt.Sprintf("CAS*%d", n); len(got) != 1 || got[0] != want {
		t.Errorf("ReleaseMany of %d leases the store granted: sent %q, want [%q]", n, got, want)
	}
	for i, err := range errs {
		if err != nil {
			t.Fatalf("ReleaseMany answer %d: %v", i, err)
		}
	}
	if m := redisstore.LeaseMemos(s); m != 0 {
		t.Errorf("%d leases remembered after all ended, want 0", m)
	}
}

// TestNativeBatchMixed: batches of every case on the native path (free
// keys, completed ones, keys in flight and their holder's repeat,
// mismatches, the same key twice with two leases or with one, short
// leases, a released record, values that are not records; then
// completions and releases of leases the store granted, did not grant,
// lost, and twice) give the answers the single calls give in batch order,
// on a single node (where the claims of the keys go out in one pipeline)
// and on Cluster (where each key takes its own path).
func TestNativeBatchMixed(t *testing.T) {
	srvs := startKinds(t)
	for _, kind := range []redisserver.Kind{redisserver.Valkey9, redisserver.Redis8} {
		raw := redis.NewClient(&redis.Options{Addr: srvs[kind].Addr()})
		t.Cleanup(func() { raw.Close() })
		for _, c := range []client{
			goredisClient(t, redis.NewClient(&redis.Options{Addr: srvs[kind].Addr()}), "single"),
			rueidisClient(t, []string{srvs[kind].Addr()}, "single"),
		} {
			t.Run(string(kind)+"/"+c.name, func(t *testing.T) {
				testNativeBatchMixed(t, c, raw, true)
			})
		}
	}
	t.Run("valkey-cluster", func(t *testing.T) {
		clus, err := redisserver.StartCluster(3, 0, redisserver.WithKind(redisserver.Valkey9))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(clus.Stop)
		raw := redis.NewClusterClient(&redis.ClusterOptions{Addrs: clus.Addrs()})
		t.Cleanup(func() { raw.Close() })
		for _, c := range []client{
			goredisClient(t, redis.NewClusterClient(&redis.ClusterOptions{Addrs: clus.Addrs()}), "cluster"),
			rueidisClient(t, clus.Addrs(), "cluster"),
		} {
			t.Run(c.name, func(t *testing.T) {
				testNativeBatchMixed(t, c, raw, false)
			})
		}
	})
}

func testNativeBatchMixed(t *testing.T, c client, raw redis.UniversalClient, oneNode bool) {
	ctx := t.Context()
	const ttl = time.Minute
	fp1, fp2 := idem.Fingerprint{1}, idem.Fingerprint{2}
	var (
		fresh1, fresh2, done, done2, busy, dup, dupSame, short, shortDup, released, corrupt, hash idem.Key
	)
	for _, k := range []*idem.Key{&fresh1, &fresh2, &done, &done2, &busy, &dup, &dupSame, &short, &shortDup, &released, &corrupt, &hash} {
		*k = randomKey()
	}
	holder, dupID, dupSameID, shortDupID := idem.NewLeaseID(), idem.NewLeaseID(), idem.NewLeaseID(), idem.NewLeaseID()

	// side is one of the two stores, with the records each batch finds.
	type side struct {
		s, other *redisstore.Store // other: another store, whose leases s did not grant
		held     idem.Lease        // busy's lease, granted by other
		gone     uint64            // released's token before the release
	}
	setup := func(name string) *side {
		prefix := redistest.Prefix("nbmix-" + name)
		sd := &side{
			s:     c.store(t, redisstore.Options{Prefix: prefix, Path: redisstore.PathNative}),
			other: c.store(t, redisstore.Options{Prefix: prefix, Path: redisstore.PathNative}),
		}
		acquire := func(k idem.Key, id idem.LeaseID, fp idem.Fingerprint) idem.Lease {
			t.Helper()
			a, err := sd.other.Acquire(ctx, idem.AcquireRequest{Key: k, LeaseID: id, Fingerprint: fp, TTL: ttl})
			if err != nil || a.Outcome != idem.Acquired {
				t.Fatalf("%s: setup: acquire: %v %v", name, a.Outcome, err)
			}
			return a.Lease
		}
		for _, k := range []idem.Key{done, done2} {
			if err := sd.other.Complete(ctx, acquire(k, idem.NewLeaseID(), fp1), &idem.Response{Status: 201}, ttl); err != nil {
				t.Fatalf("%s: setup: complete: %v", name, err)
			}
		}
		sd.held = acquire(busy, holder, fp1)
		l := acquire(released, idem.NewLeaseID(), fp1)
		if err := sd.other.Release(ctx, l); err != nil {
			t.Fatalf("%s: setup: release: %v", name, err)
		}
		sd.gone = l.Token
		if err := raw.Set(ctx, sd.s.KeyName(corrupt), "not a record", 0).Err(); err != nil {
			t.Fatal(err)
		}
		if err := raw.HSet(ctx, sd.s.KeyName(hash), "f", "v").Err(); err != nil {
			t.Fatal(err)
		}
		return sd
	}
	single, batched := setup("single"), setup("batched")
	var sent func(f func()) []string
	if oneNode {
		sent = traceRounds(t, batched.s)
	}

	req := func(k idem.Key, id idem.LeaseID, fp idem.Fingerprint, ttl time.Duration) idem.AcquireRequest {
		return idem.AcquireRequest{Key: k, LeaseID: id, Fingerprint: fp, TTL: ttl}
	}
	reqs := []idem.AcquireRequest{
		req(fresh1, idem.NewLeaseID(), fp1, ttl),
		req(busy, idem.NewLeaseID(), fp1, ttl), // in flight
		req(dup, dupID, fp1, ttl),
		req(done, idem.NewLeaseID(), fp1, ttl), // replay
		req(busy, holder, fp1, ttl),            // the holder's repeat
		req(short, idem.NewLeaseID(), fp1, 500*time.Millisecond),
		req(dup, idem.NewLeaseID(), fp1, ttl), // in flight: dup's first lease
		req(done2, idem.NewLeaseID(), fp2, ttl),
		req(dupSame, dupSameID, fp1, ttl),
		req(released, idem.NewLeaseID(), fp1, ttl),
		req(busy, idem.NewLeaseID(), fp2, ttl), // mismatch
		req(fresh2, idem.NewLeaseID(), fp1, ttl),
		req(dupSame, dupSameID, fp1, ttl), // the same lease again
		req(corrupt, idem.NewLeaseID(), fp1, ttl),
		req(shortDup, shortDupID, fp1, 500*time.Millisecond),
		req(hash, idem.NewLeaseID(), fp1, ttl),
		req(shortDup, shortDupID, fp1, 500*time.Millisecond), // the same short lease again
		req(done, idem.NewLeaseID(), fp1, ttl),               // replay again
	}
	wantOutcomes := []idem.Outcome{idem.Acquired, idem.InFlight, idem.Acquired, idem.Replay, idem.Acquired, idem.Acquired,
		idem.InFlight, idem.Mismatch, idem.Acquired, idem.Acquired, idem.Mismatch, idem.Acquired, idem.Acquired, idem.NoOutcome,
		idem.Acquired, idem.NoOutcome, idem.Acquired, idem.Replay}
	var got []idem.AcquireResult
	acquireMany := func() { got = batched.s.AcquireMany(ctx, reqs) }
	if oneNode {
		rounds := sent(acquireMany)
		distinct := 12 // the keys of reqs
		if want := fmt.Sprintf("CLAIM*%d TIME", distinct); len(rounds) == 0 || rounds[0] != want {
			t.Errorf("AcquireMany: first round trip of %q, want %q", rounds, want)
		}
	} else {
		acquireMany()
	}
	// answers checks one side's answers, and returns them as text, the
	// same on both sides when the answers agree.
	answers := func(name string, sd *side, as []idem.AcquireResult) []string {
		t.Helper()
		var out []string
		tokens := map[idem.LeaseID]uint64{}
		for i, a := range as {
			r := reqs[i]
			line := fmt.Sprintf("%d %v", i, a.Outcome)
			switch {
			case a.Err != nil:
				line = fmt.Sprintf("%d corrupt %v", i, errors.Is(a.Err, idem.ErrCorrupt))
				if wantOutcomes[i] != idem.NoOutcome || !errors.Is(a.Err, idem.ErrCorrupt) {
					t.Errorf("%s: answer %d: %v, want %v", name, i, a.Err, wantOutcomes[i])
				}
			case a.Outcome != wantOutcomes[i]:
				t.Errorf("%s: answer %d: %v, want %v", name, i, a.Outcome, wantOutcomes[i])
			case a.Outcome == idem.Acquired:
				l := a.Lease
				if l.Key != r.Key || l.ID != r.LeaseID || l.TTL <= 0 || l.TTL > r.TTL || l.Token == 0 {
					t.Errorf("%s: answer %d: lease %+v, want key %v, id %v, a token, a TTL in (0, %v]", name, i, l, r.Key, r.LeaseID, r.TTL)
				}
				if tok, ok := tokens[l.ID]; ok && tok != l.Token {
					t.Errorf("%s: answer %d: token %d, want %d, as the lease's first answer", name, i, l.Token, tok)
				}
				tokens[l.ID] = l.Token
				if r.Key == busy && l.Token != sd.held.Token {
					t.Errorf("%s: answer %d: holder's repeat with token %d, want the held %d", name, i, l.Token, sd.held.Token)
				}
				if r.Key == released && l.Token <= sd.gone {
					t.Errorf("%s: answer %d: token %d after a release of %d", name, i, l.Token, sd.gone)
				}
			case a.Outcome == idem.InFlight:
				if a.RetryAfter <= 0 || a.RetryAfter > ttl {
					t.Errorf("%s: answer %d: retry after %v, want (0, %v]", name, i, a.RetryAfter, ttl)
				}
			case a.Outcome == idem.Replay:
				line += fmt.Sprint(" ", a.Response.Status)
			}
			out = append(out, line)
		}
		return out
	}
	var want []idem.AcquireResult
	for _, r := range reqs {
		a, err := single.s.Acquire(ctx, r)
		want = append(want, idem.AcquireResult{Acquisition: a, Err: err})
	}
	if g, w := answers("batched", batched, got), answers("single", single, want); strings.Join(g, "\n") != strings.Join(w, "\n") {
		t.Fatalf("AcquireMany answers:\n%s\nsingle calls:\n%s", strings.Join(g, "\n"), strings.Join(w, "\n"))
	}

	// Completions: leases s granted (fresh1, dup, dupSame twice, and
	// released's with a retention of at most 250ms, which takes the read,
	// compare-and-set path), one another store granted (busy's holder),
	// the same lease as the holder's repeat answered it, a lost one
	// (done's, a lease it never had), dup's again with another response
	// (lost: completed). (Not the short leases: they may have expired.)
	completions := func(as []idem.AcquireResult, sd *side) []idem.Completion {
		resp := func(st int) *idem.Response { return &idem.Response{Status: st} }
		return []idem.Completion{
			{Lease: as[0].Lease, Response: resp(200), Retention: ttl},
			{Lease: as[2].Lease, Response: resp(201), Retention: ttl},
			{Lease: as[8].Lease, Response: resp(202), Retention: ttl},
			{Lease: sd.held, Response: resp(203), Retention: ttl},
			{Lease: as[12].Lease, Response: resp(202), Retention: ttl}, // dupSame's again
			{Lease: idem.Lease{Key: done, ID: idem.NewLeaseID(), Token: 1, TTL: ttl}, Response: resp(204), Retention: ttl},
			{Lease: as[9].Lease, Response: resp(205), Retention: 200 * time.Millisecond},
			{Lease: as[2].Lease, Response: resp(206), Retention: ttl}, // dup's again, another response
			{Lease: as[4].Lease, Response: resp(203), Retention: ttl}, // busy's holder's repeat: the same lease, completed
		}
	}
	errText := func(errs []error) string {
		var out []string
		for i, err := range errs {
			out = append(out, fmt.Sprintf("%d %v %v", i, err == nil, errors.Is(err, idem.ErrLeaseLost)))
		}
		return strings.Join(out, "\n")
	}
	var errs []error
	completeMany := func() { errs = batched.s.CompleteMany(ctx, completions(got, batched)) }
	if oneNode {
		// The first appearances of fresh1, dup, dupSame and released
		// were granted by s: one pipeline of 3 (released's retention
		// takes the read, compare-and-set path).
		if rounds := sent(completeMany); len(rounds) == 0 || rounds[0] != "CAS*3" {
			t.Errorf("CompleteMany: first round trip of %q, want \"CAS*3\"", rounds)
		}
	} else {
		completeMany()
	}
	var wantErrs []error
	for _, c := range completions(want, single) {
		wantErrs = append(wantErrs, single.s.Complete(ctx, c.Lease, c.Response, c.Retention))
	}
	if g, w := errText(errs), errText(wantErrs); g != w {
		t.Fatalf("CompleteMany answers (i, nil, lost):\n%s\nsingle calls:\n%s", g, w)
	}
	if wantErrs[0] != nil || !errors.Is(wantErrs[5], idem.ErrLeaseLost) || !errors.Is(wantErrs[7], idem.ErrLeaseLost) {
		t.Errorf("single completions: %v, want 0 done, 5 and 7 lost", wantErrs)
	}

	// Releases: fresh2's (granted by s) twice, and two lost ones (leases
	// done2 and dup never had).
	releases := func(as []idem.AcquireResult) []idem.Lease {
		return []idem.Lease{as[11].Lease, {Key: done2, ID: idem.NewLeaseID(), Token: 1, TTL: ttl}, as[11].Lease,
			{Key: dup, ID: idem.NewLeaseID(), Token: 1, TTL: ttl}}
	}
	releaseMany := func() { errs = batched.s.ReleaseMany(ctx, releases(got)) }
	if oneNode {
		if rounds := sent(releaseMany); len(rounds) == 0 || rounds[0] != "CAS" {
			t.Errorf("ReleaseMany: first round trip of %q, want \"CAS\"", rounds)
		}
	} else {
		releaseMany()
	}
	wantErrs = wantErrs[:0]
	for _, l := range releases(want) {
		wantErrs = append(wantErrs, single.s.Release(ctx, l))
	}
	if g, w := errText(errs), errText(wantErrs); g != w {
		t.Fatalf("ReleaseMany answers (i, nil, lost):\n%s\nsingle calls:\n%s", g, w)
	}
}
