package redisstore_test

import (
	"errors"
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

// TestNativeCommands: the commands each native transition sends, round
// trip by round trip, and their answers. A claim of a free key is SET NX
// GET and TIME, without the PTTL; only a claim that found a record in
// flight or a replay reads it again with its PTTL (GET and PTTL in a
// transaction), in a second round trip, and a record changed by then
// (gone, completed, taken by another lease) is claimed again. Complete and Release of a lease the store granted are
// one SET IFEQ without GET; Renew reads no PTTL, RaiseToken does.
func TestNativeCommands(t *testing.T) {
	srvs := startKinds(t)
	for _, kind := range []redisserver.Kind{redisserver.Valkey9, redisserver.Redis8} {
		raw := redis.NewClient(&redis.Options{Addr: srvs[kind].Addr()})
		t.Cleanup(func() { raw.Close() })
		for _, c := range []client{
			goredisClient(t, redis.NewClient(&redis.Options{Addr: srvs[kind].Addr()}), "single"),
			rueidisClient(t, []string{srvs[kind].Addr()}, "single"), // no replay cache
		} {
			t.Run(string(kind)+"/"+c.name, func(t *testing.T) {
				testNativeCommands(t, c, raw)
			})
		}
	}
}

func testNativeCommands(t *testing.T, c client, raw *redis.Client) {
	ctx := t.Context()
	s := c.store(t, redisstore.Options{Prefix: redistest.Prefix("seq"), Path: redisstore.PathNative})
	if _, _, err := s.Get(ctx, scope(0)); err != nil { // picks the path
		t.Fatal(err)
	}
	var (
		mu     sync.Mutex
		rounds [][]string
		after  func(round int) // run after each round trip, if set
	)
	redisstore.TraceNative(s, func(cmds [][]string) {
		mu.Lock()
		rounds = append(rounds, nil)
		n := len(rounds)
		for _, cmd := range cmds {
			rounds[n-1] = append(rounds[n-1], cmd[0])
			if cmd[0] == "SET" && len(cmd) > 3 && cmd[3] == "IFEQ" {
				for _, a := range cmd[5:] {
					if strings.EqualFold(a, "GET") {
						rounds[n-1][len(rounds[n-1])-1] = "SET…GET"
					}
				}
			}
		}
		f := after
		mu.Unlock()
		if f != nil {
			f(n)
		}
	})
	// sent returns the round trips of f: "SET TIME | GET PTTL".
	sent := func(f func()) string {
		mu.Lock()
		rounds = nil
		mu.Unlock()
		f()
		mu.Lock()
		defer mu.Unlock()
		var out []string
		for _, r := range rounds {
			out = append(out, strings.Join(r, " "))
		}
		return strings.Join(out, " | ")
	}
	acquire := func(key idem.Key, lease idem.LeaseID, fp byte, ttl time.Duration) (a idem.Acquisition, err error) {
		return s.Acquire(ctx, idem.AcquireRequest{Key: key, LeaseID: lease, Fingerprint: idem.Fingerprint{fp}, TTL: ttl})
	}
	// fresh is a claim of a free key: one round trip, unless the claim's
	// token missed the server's clock (then a second SET fixes it).
	fresh := func(what, got string) {
		t.Helper()
		if got != "SET TIME" && got != "SET TIME | SET" {
			t.Errorf("%s: sent %q, want \"SET TIME\" (or \"SET TIME | SET\" when the claim's token is fixed)", what, got)
		}
	}
	want := func(what, got, want string) {
		t.Helper()
		if got != want {
			t.Errorf("%s: sent %q, want %q", what, got, want)
		}
	}

	// A free key, then its completion and replays.
	key := scope(1)
	var a idem.Acquisition
	var err error
	fresh("acquire of a free key", sent(func() { a, err = acquire(key, idem.NewLeaseID(), 1, 5*time.Second) }))
	if err != nil || a.Outcome != idem.Acquired {
		t.Fatalf("acquire of a free key: %v, %v", a.Outcome, err)
	}
	first := a.Lease
	want("complete", sent(func() { err = s.Complete(ctx, first, &idem.Response{Status: 201}, time.Minute) }), "SET")
	if err != nil {
		t.Fatal(err)
	}
	want("replay", sent(func() { a, err = acquire(key, idem.NewLeaseID(), 1, 5*time.Second) }), "SET TIME | GET PTTL")
	if err != nil || a.Outcome != idem.Replay || a.Response.Status != 201 {
		t.Fatalf("replay: %v, %v", a.Outcome, err)
	}
	want("mismatch on a completed record", sent(func() { a, err = acquire(key, idem.NewLeaseID(), 2, 5*time.Second) }), "SET TIME")
	if err != nil || a.Outcome != idem.Mismatch {
		t.Fatalf("mismatch on a completed record: %v, %v", a.Outcome, err)
	}

	// A record in flight: its holder's repeat, a copy, a mismatch, Renew,
	// RaiseToken, then Release and a claim of the released record.
	key = scope(2)
	a, err = acquire(key, idem.NewLeaseID(), 1, 5*time.Second)
	if err != nil || a.Outcome != idem.Acquired {
		t.Fatalf("acquire: %v, %v", a.Outcome, err)
	}
	held := a.Lease
	want("repeat of the holder's acquire", sent(func() { a, err = acquire(key, held.ID, 1, 5*time.Second) }), "SET TIME | GET PTTL")
	if err != nil || a.Outcome != idem.Acquired || a.Lease.Token != held.Token || a.Lease.TTL <= 0 || a.Lease.TTL > 5*time.Second {
		t.Fatalf("repeat of the holder's acquire: %v, %v, token %d, TTL %v; want Acquired with token %d and a TTL within (0, 5s]",
			a.Outcome, err, a.Lease.Token, a.Lease.TTL, held.Token)
	}
	want("acquire of a key in flight", sent(func() { a, err = acquire(key, idem.NewLeaseID(), 1, 5*time.Second) }), "SET TIME | GET PTTL")
	if err != nil || a.Outcome != idem.InFlight || a.RetryAfter <= 0 || a.RetryAfter > 5*time.Second {
		t.Fatalf("acquire of a key in flight: %v, %v, retry after %v; want InFlight within (0, 5s]", a.Outcome, err, a.RetryAfter)
	}
	want("mismatch on a record in flight", sent(func() { a, err = acquire(key, idem.NewLeaseID(), 2, 5*time.Second) }), "SET TIME | GET PTTL")
	if err != nil || a.Outcome != idem.Mismatch {
		t.Fatalf("mismatch on a record in flight: %v, %v", a.Outcome, err)
	}
	want("renew", sent(func() { err = s.Renew(ctx, held, 8*time.Second) }), "GET TIME | SET")
	if err != nil {
		t.Fatal(err)
	}
	want("raise", sent(func() { held, err = s.RaiseToken(ctx, held, held.Token+10) }), "GET PTTL TIME | SET")
	if err != nil {
		t.Fatal(err)
	}
	want("release of a raised lease (not the token it was granted)", sent(func() { err = s.Release(ctx, held) }), "GET TIME | SET")
	if err != nil {
		t.Fatal(err)
	}
	want("acquire of a released record", sent(func() { a, err = acquire(key, idem.NewLeaseID(), 1, 5*time.Second) }), "SET TIME | SET")
	if err != nil || a.Outcome != idem.Acquired || a.Lease.Token <= held.Token {
		t.Fatalf("acquire of a released record: %v, %v, token %d; want Acquired with a token > %d", a.Outcome, err, a.Lease.Token, held.Token)
	}
	want("release", sent(func() { err = s.Release(ctx, a.Lease) }), "SET")
	if err != nil {
		t.Fatal(err)
	}

	// A record the claim found, gone before its PTTL: the key is claimed
	// again.
	key = scope(3)
	a, err = acquire(key, idem.NewLeaseID(), 1, 5*time.Second)
	if err != nil || a.Outcome != idem.Acquired {
		t.Fatalf("acquire: %v, %v", a.Outcome, err)
	}
	mu.Lock()
	after = func(round int) {
		if round == 1 {
			if err := raw.Del(ctx, s.KeyName(key)).Err(); err != nil {
				t.Error(err)
			}
		}
	}
	mu.Unlock()
	got := sent(func() { a, err = acquire(key, idem.NewLeaseID(), 1, 5*time.Second) })
	mu.Lock()
	after = nil
	mu.Unlock()
	if !strings.HasPrefix(got, "SET TIME | GET PTTL | ") {
		t.Errorf("acquire of a record gone before its PTTL: sent %q, want \"SET TIME | GET PTTL | \" and a claim", got)
	} else {
		fresh("the claim after the record was gone", strings.TrimPrefix(got, "SET TIME | GET PTTL | "))
	}
	if err != nil || a.Outcome != idem.Acquired {
		t.Fatalf("acquire of a record gone before its PTTL: %v, %v; want Acquired", a.Outcome, err)
	}

	// A record in flight when the claim found it, completed by its holder
	// before the PTTL round trip: the claim starts over and answers
	// replay, never in flight with the completed record's retention (24h)
	// as RetryAfter (natsjs naks with it, SQS sets it as the visibility).
	{
		key := scope(4)
		a, err := acquire(key, idem.NewLeaseID(), 1, 5*time.Second)
		if err != nil || a.Outcome != idem.Acquired {
			t.Fatalf("acquire: %v, %v", a.Outcome, err)
		}
		holder := a.Lease
		mu.Lock()
		after = func(round int) {
			if round == 1 {
				if err := s.Complete(ctx, holder, &idem.Response{Status: 201}, 24*time.Hour); err != nil {
					t.Error(err)
				}
			}
		}
		mu.Unlock()
		sent(func() { a, err = acquire(key, idem.NewLeaseID(), 1, 5*time.Second) })
		mu.Lock()
		after = nil
		mu.Unlock()
		if err != nil {
			t.Fatal(err)
		}
		if a.Outcome != idem.Replay {
			t.Errorf("a record completed between the claim and its PTTL: %v, want the replay", a.Outcome)
		}
		if a.Outcome == idem.InFlight && a.RetryAfter > 5*time.Second {
			t.Errorf("in flight with RetryAfter %v, longer than any lease the key had (5s): the completed record's retention", a.RetryAfter)
		}
	}

	// The holder's repeated acquire (same lease id) finds its record;
	// before the PTTL, that lease ends and another takes the key for 60s:
	// the repeat must not be told it holds the key (with the other
	// lease's TTL).
	{
		key := scope(5)
		a, err := acquire(key, idem.NewLeaseID(), 1, 5*time.Second)
		if err != nil || a.Outcome != idem.Acquired {
			t.Fatalf("acquire: %v, %v", a.Outcome, err)
		}
		holder := a.Lease
		var other idem.Acquisition
		mu.Lock()
		after = func(round int) {
			if round == 1 {
				if err := raw.Del(ctx, s.KeyName(key)).Err(); err != nil { // the lease expired
					t.Error(err)
				}
				other, err = acquire(key, idem.NewLeaseID(), 1, 60*time.Second)
				if err != nil {
					t.Error(err)
				}
			}
		}
		mu.Unlock()
		sent(func() { a, err = acquire(key, holder.ID, 1, 5*time.Second) })
		mu.Lock()
		after = nil
		mu.Unlock()
		if err != nil || a.Outcome != idem.InFlight {
			t.Errorf("the repeat after the other took the key: %v, %v; want in flight", a.Outcome, err)
		}
		if a.Outcome == idem.Acquired && other.Outcome == idem.Acquired {
			t.Errorf("both hold the key: the repeat (token %d, TTL %v) and the other lease (token %d, TTL %v)", a.Lease.Token, a.Lease.TTL, other.Lease.Token, other.Lease.TTL)
		}
	}

	// A Renew whose record is taken over between its read and its SET
	// (the lease expired, another took the key for 60s): its SET IFEQ
	// finds another record and writes nothing; Renew reads again and
	// reports the lease lost, and the other lease's record stands.
	{
		key := scope(6)
		a, err := acquire(key, idem.NewLeaseID(), 1, 5*time.Second)
		if err != nil || a.Outcome != idem.Acquired {
			t.Fatalf("acquire: %v, %v", a.Outcome, err)
		}
		holder := a.Lease
		var other idem.Acquisition
		mu.Lock()
		after = func(round int) {
			if round == 1 {
				if err := raw.Del(ctx, s.KeyName(key)).Err(); err != nil { // the lease expired
					t.Error(err)
				}
				var oerr error
				if other, oerr = acquire(key, idem.NewLeaseID(), 1, 60*time.Second); oerr != nil {
					t.Error(oerr)
				}
			}
		}
		mu.Unlock()
		sent(func() { err = s.Renew(ctx, holder, 8*time.Second) })
		mu.Lock()
		after = nil
		mu.Unlock()
		if !errors.Is(err, idem.ErrLeaseLost) {
			t.Errorf("Renew of a lease whose record was taken over before its SET: %v, want ErrLeaseLost", err)
		}
		if other.Outcome != idem.Acquired {
			t.Fatalf("the other lease's acquire: %v, want Acquired", other.Outcome)
		}
		rec, ok, err := s.Get(ctx, key)
		if err != nil || !ok || rec.State != idem.StateInFlight || rec.Token != other.Lease.Token {
			t.Errorf("after that Renew: %+v (found %v, %v), want the other lease's record in flight with token %d", rec, ok, err, other.Lease.Token)
		}
	}

	// Release of a lease this store granted (one SET IFEQ, the fast
	// path) after its record was taken over (the lease expired, another
	// took the key): the SET finds another record and writes nothing;
	// Release reports the lease lost, and the other lease's record stands.
	{
		key := scope(7)
		a, err := acquire(key, idem.NewLeaseID(), 1, 5*time.Second)
		if err != nil || a.Outcome != idem.Acquired {
			t.Fatalf("acquire: %v, %v", a.Outcome, err)
		}
		holder := a.Lease
		if err := raw.Del(ctx, s.KeyName(key)).Err(); err != nil { // the lease expired
			t.Fatal(err)
		}
		other, err := acquire(key, idem.NewLeaseID(), 1, 60*time.Second)
		if err != nil || other.Outcome != idem.Acquired {
			t.Fatalf("the other lease's acquire: %v, %v", other.Outcome, err)
		}
		if err := s.Release(ctx, holder); !errors.Is(err, idem.ErrLeaseLost) {
			t.Errorf("Release of a lease whose record was taken over: %v, want ErrLeaseLost", err)
		}
		rec, ok, err := s.Get(ctx, key)
		if err != nil || !ok || rec.State != idem.StateInFlight || rec.Token != other.Lease.Token {
			t.Errorf("after that Release: %+v (found %v, %v), want the other lease's record in flight with token %d", rec, ok, err, other.Lease.Token)
		}
	}

	// An in-flight record without an expiry is corrupt, whatever the
	// fingerprint (as acquire.lua says): the claim reads its PTTL.
	if err := raw.Persist(ctx, s.KeyName(key)).Err(); err != nil {
		t.Fatal(err)
	}
	want("acquire of an in-flight record without an expiry", sent(func() { _, err = acquire(key, idem.NewLeaseID(), 2, 5*time.Second) }), "SET TIME | GET PTTL")
	if !errors.Is(err, idem.ErrCorrupt) {
		t.Errorf("acquire of an in-flight record without an expiry: %v, want ErrCorrupt", err)
	}
	// An empty value is not a record either.
	if err := raw.Set(ctx, s.KeyName(key), "", 0).Err(); err != nil {
		t.Fatal(err)
	}
	want("acquire of an empty value", sent(func() { _, err = acquire(key, idem.NewLeaseID(), 1, 5*time.Second) }), "SET TIME")
	if !errors.Is(err, idem.ErrCorrupt) {
		t.Errorf("acquire of an empty value: %v, want ErrCorrupt", err)
	}
}
