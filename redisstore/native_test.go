package redisstore_test

import (
	"context"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/redis/rueidis"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/redisserver"
	"github.com/idemkit/idem/internal/redistest"
	"github.com/idemkit/idem/redisstore"
	"github.com/idemkit/idem/storetest"
)

// servers starts one private server of each kind (redisserver.Kinds) for the
// test, once per test binary. A kind whose binary is missing fails the
// test: scripts/test.sh builds them (scripts/build-redis-servers.sh).
var (
	serversOnce sync.Once
	servers     map[redisserver.Kind]*redisserver.Server
	serversErr  error
)

func startKinds(t *testing.T) map[redisserver.Kind]*redisserver.Server { return startKindsB(t) }

func startKindsB(t testing.TB) map[redisserver.Kind]*redisserver.Server {
	t.Helper()
	serversOnce.Do(func() {
		servers = map[redisserver.Kind]*redisserver.Server{}
		var errs []error
		for _, k := range redisserver.Kinds {
			if k == redisserver.Redis7 {
				servers[k] = single
				continue
			}
			s, err := redisserver.StartServer(redisserver.WithKind(k))
			if err != nil {
				errs = append(errs, err)
				continue
			}
			servers[k] = s
		}
		serversErr = errors.Join(errs...)
	})
	if serversErr != nil {
		t.Fatal(serversErr)
	}
	return servers
}

func stopKinds() {
	for k, s := range servers {
		if k != redisserver.Redis7 {
			s.Stop()
		}
	}
}

// wantPath is the path PathAuto must pick on each kind.
var wantPath = map[redisserver.Kind]redisstore.Path{
	redisserver.Redis7:       redisstore.PathLua,
	redisserver.Valkey9:      redisstore.PathNative,
	redisserver.Redis8:       redisstore.PathNative,
	redisserver.Valkey9NoLua: redisstore.PathNative,
}

// TestConformanceServers runs the store suite on every server kind, on
// each path the server supports, with both client libraries.
func TestConformanceServers(t *testing.T) {
	for kind, srv := range startKinds(t) {
		for _, path := range []redisstore.Path{redisstore.PathAuto, redisstore.PathLua, redisstore.PathNative} {
			if path == redisstore.PathNative && wantPath[kind] != redisstore.PathNative ||
				path == redisstore.PathLua && kind == redisserver.Valkey9NoLua {
				continue // refused: TestPathRefused
			}
			for _, c := range []client{
				goredisClient(t, redis.NewClient(&redis.Options{Addr: srv.Addr()}), "single"),
				rueidisClient(t, []string{srv.Addr()}, "single"),
			} {
				t.Run(string(kind)+"/"+path.String()+"/"+c.name, func(t *testing.T) {
					t.Parallel()
					storetest.Run(t, func(t *testing.T, prefix string) storetest.Fixture {
						s := c.store(t, redisstore.Options{Prefix: prefix, Path: path})
						return storetest.Fixture{
							Store: s,
							Sleep: time.Sleep,
							Corrupt: func(key idem.Key) error {
								return c.set(context.Background(), s.KeyName(key), "not a record")
							},
						}
					})
					s := c.store(t, redisstore.Options{Prefix: redistest.Prefix("path"), Path: path})
					if _, _, err := s.Get(t.Context(), scope(0)); err != nil {
						t.Fatal(err)
					}
					want := wantPath[kind]
					if path != redisstore.PathAuto {
						want = path
					}
					if got := s.Path(); got != want {
						t.Errorf("Path() after a call = %v, want %v", got, want)
					}
				})
			}
		}
	}
}

// TestPathRefused: a forced path the server cannot take fails every call
// with an error that names what is missing.
func TestPathRefused(t *testing.T) {
	srvs := startKinds(t)
	ctx := t.Context()
	req := idem.AcquireRequest{Key: scope(1), LeaseID: idem.NewLeaseID(), Fingerprint: idem.Fingerprint{1}, TTL: time.Second}

	c := redis.NewClient(&redis.Options{Addr: srvs[redisserver.Redis7].Addr()})
	defer c.Close()
	s, err := redisstore.New(c, redisstore.Options{Prefix: redistest.Prefix("refused"), Path: redisstore.PathNative})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := s.Acquire(ctx, req); !errors.Is(err, redisstore.ErrNoCAS) {
		t.Errorf("PathNative on Redis 7.0: Acquire error %v, want ErrNoCAS", err)
	}

	for _, name := range []string{"go-redis", "rueidis"} {
		var s *redisstore.Store
		if name == "go-redis" {
			c := redis.NewClient(&redis.Options{Addr: srvs[redisserver.Valkey9NoLua].Addr()})
			defer c.Close()
			s, err = redisstore.New(c, redisstore.Options{Prefix: redistest.Prefix("refused"), Path: redisstore.PathLua})
		} else {
			s, err = redisstore.Open("redis://"+srvs[redisserver.Valkey9NoLua].Addr(), redisstore.Options{Prefix: redistest.Prefix("refused"), Path: redisstore.PathLua})
		}
		if err != nil {
			t.Fatal(err)
		}
		defer s.Close()
		_, err := s.Acquire(ctx, req)
		if err == nil || !strings.Contains(err.Error(), "scripting") {
			t.Errorf("%s: PathLua on Valkey without Lua: Acquire error %v, want one naming the missing scripting", name, err)
		}
	}
}

// serverMs is the server's clock in ms.
func serverMs(t *testing.T, c *redis.Client) int64 {
	t.Helper()
	tm, err := c.Time(t.Context()).Result()
	if err != nil {
		t.Fatal(err)
	}
	return tm.UnixMilli()
}

// TestNativeTokens: a claim whose token the client guessed wrong (its
// estimate of the server's clock is 10s behind, or ahead) still gets a
// token from the server's clock at the claim, so tokens keep growing per
// key; and records keep their expiry (a compare-and-set without PX would
// drop it).
func TestNativeTokens(t *testing.T) {
	srv := startKinds(t)[redisserver.Valkey9]
	c := redis.NewClient(&redis.Options{Addr: srv.Addr()})
	defer c.Close()
	for _, name := range []string{"go-redis", "rueidis"} {
		t.Run(name, func(t *testing.T) {
			var s *redisstore.Store
			var err error
			if name == "go-redis" {
				s, err = redisstore.New(c, redisstore.Options{Prefix: redistest.Prefix("tokens"), Path: redisstore.PathNative})
			} else {
				s, err = redisstore.Open("redis://"+srv.Addr(), redisstore.Options{Prefix: redistest.Prefix("tokens"), Path: redisstore.PathNative})
			}
			if err != nil {
				t.Fatal(err)
			}
			defer s.Close()
			ctx := t.Context()
			key := scope(7)
			fp := idem.Fingerprint{7}
			var last uint64
			for i, skew := range []int64{0, -10_000, 10_000, 0, -10_000, 10_000} {
				// A fresh key takes the claim's token (and a released one
				// max(last+1, server time)).
				fresh := scope(1000 + i)
				redisstore.SkewClock(s, skew)
				before := serverMs(t, c)
				a, err := s.Acquire(ctx, idem.AcquireRequest{Key: fresh, LeaseID: idem.NewLeaseID(), Fingerprint: fp, TTL: 5 * time.Second})
				after := serverMs(t, c)
				if err != nil || a.Outcome != idem.Acquired {
					t.Fatalf("acquire %d: %v, %v", i, a.Outcome, err)
				}
				if tok := a.Lease.Token; int64(tok) < before || int64(tok) > after+250 {
					t.Errorf("acquire %d of a fresh key (clock estimate %+dms off): token %d, want within [%d, %d+250] (the server's clock)",
						i, skew, tok, before, after)
				}
				redisstore.SkewClock(s, skew)
				before = serverMs(t, c)
				a, err = s.Acquire(ctx, idem.AcquireRequest{Key: key, LeaseID: idem.NewLeaseID(), Fingerprint: fp, TTL: 5 * time.Second})
				after = serverMs(t, c)
				if err != nil || a.Outcome != idem.Acquired {
					t.Fatalf("acquire %d: %v, %v", i, a.Outcome, err)
				}
				tok := a.Lease.Token
				if tok <= last || int64(tok) < before || int64(tok) > after+250 {
					t.Errorf("acquire %d (clock estimate %+dms off): token %d, want > %d (the last) and within [%d, %d+250] (the server's clock)",
						i, skew, tok, last, before, after)
				}
				last = tok
				if pttl := c.PTTL(ctx, s.KeyName(key)).Val(); pttl <= 0 || pttl > 5*time.Second {
					t.Errorf("acquire %d: PTTL %v, want within (0, 5s]", i, pttl)
				}
				if err := s.Renew(ctx, a.Lease, 8*time.Second); err != nil {
					t.Fatal(err)
				}
				if pttl := c.PTTL(ctx, s.KeyName(key)).Val(); pttl <= 5*time.Second || pttl > 8*time.Second {
					t.Errorf("renew %d: PTTL %v, want within (5s, 8s]", i, pttl)
				}
				if err := s.Release(ctx, a.Lease); err != nil {
					t.Fatal(err)
				}
				if pttl := c.PTTL(ctx, s.KeyName(key)).Val(); pttl <= 0 {
					t.Errorf("release %d: PTTL %v, want > 0", i, pttl)
				}
			}
			a, err := s.Acquire(ctx, idem.AcquireRequest{Key: key, LeaseID: idem.NewLeaseID(), Fingerprint: fp, TTL: 5 * time.Second})
			if err != nil || a.Outcome != idem.Acquired || a.Lease.Token <= last {
				t.Fatalf("last acquire: %v, %v, token %d, want Acquired with a token > %d", a.Outcome, err, a.Lease.Token, last)
			}
			if err := s.Complete(ctx, a.Lease, &idem.Response{Status: 201, Body: []byte("ok")}, time.Minute); err != nil {
				t.Fatal(err)
			}
			if pttl := c.PTTL(ctx, s.KeyName(key)).Val(); pttl <= 50*time.Second || pttl > time.Minute {
				t.Errorf("complete: PTTL %v, want within (50s, 1m]", pttl)
			}
		})
	}
}

// TestSwitchPaths: records written on one path are read and moved on by the
// other, on the same server.
func TestSwitchPaths(t *testing.T) {
	srv := startKinds(t)[redisserver.Valkey9]
	prefix := redistest.Prefix("switch")
	c := redis.NewClient(&redis.Options{Addr: srv.Addr()})
	defer c.Close()
	lua, err := redisstore.New(c, redisstore.Options{Prefix: prefix, Path: redisstore.PathLua})
	if err != nil {
		t.Fatal(err)
	}
	rc, err := rueidis.NewClient(rueidis.ClientOption{InitAddress: []string{srv.Addr()}, DisableCache: true})
	if err != nil {
		t.Fatal(err)
	}
	defer rc.Close()
	native, err := redisstore.NewRueidis(rc, redisstore.Options{Prefix: prefix, Path: redisstore.PathNative})
	if err != nil {
		t.Fatal(err)
	}
	ctx := t.Context()
	fp := idem.Fingerprint{9}
	stores := [2]*redisstore.Store{lua, native}
	names := [2]string{"lua", "native"}
	for i := range 4 {
		first, second := stores[i%2], stores[1-i%2]
		key := scope(100 + i)
		req := idem.AcquireRequest{Key: key, LeaseID: idem.NewLeaseID(), Fingerprint: fp, TTL: 5 * time.Second}
		a, err := first.Acquire(ctx, req)
		if err != nil || a.Outcome != idem.Acquired {
			t.Fatalf("%s acquire: %v %v", names[i%2], a.Outcome, err)
		}
		// The other path sees the lease in flight, and its holder's repeat.
		if b, err := second.Acquire(ctx, idem.AcquireRequest{Key: key, LeaseID: idem.NewLeaseID(), Fingerprint: fp, TTL: time.Second}); err != nil || b.Outcome != idem.InFlight {
			t.Errorf("%s acquire of a lease in flight: %v %v, want InFlight", names[1-i%2], b.Outcome, err)
		}
		if b, err := second.Acquire(ctx, req); err != nil || b.Outcome != idem.Acquired || b.Lease.Token != a.Lease.Token {
			t.Errorf("%s repeat of the holder's acquire: %v %v, token %d, want Acquired with %d", names[1-i%2], b.Outcome, err, b.Lease.Token, a.Lease.Token)
		}
		if err := second.Release(ctx, a.Lease); err != nil {
			t.Fatalf("%s release: %v", names[1-i%2], err)
		}
		req.LeaseID = idem.NewLeaseID()
		a2, err := first.Acquire(ctx, req)
		if err != nil || a2.Outcome != idem.Acquired || a2.Lease.Token <= a.Lease.Token {
			t.Fatalf("%s acquire after release: %v %v token %d, want Acquired with a token > %d", names[i%2], a2.Outcome, err, a2.Lease.Token, a.Lease.Token)
		}
		resp := &idem.Response{Status: 200, Body: []byte("switched")}
		if err := second.Complete(ctx, a2.Lease, resp, time.Minute); err != nil {
			t.Fatalf("%s complete: %v", names[1-i%2], err)
		}
		for j, s := range stores {
			r, err := s.Acquire(ctx, idem.AcquireRequest{Key: key, LeaseID: idem.NewLeaseID(), Fingerprint: fp, TTL: time.Second})
			if err != nil || r.Outcome != idem.Replay || string(r.Response.Body) != "switched" {
				t.Errorf("%s acquire of the completed key: %v %v, want the replay", names[j], r.Outcome, err)
			}
		}
	}
}

// TestNativeLeaseMemos: Complete and Release forget the lease they end, so
// that the runner's memory holds only leases in flight.
func TestNativeLeaseMemos(t *testing.T) {
	srv := startKinds(t)[redisserver.Valkey9]
	s, err := redisstore.Open("redis://"+srv.Addr(), redisstore.Options{Prefix: redistest.Prefix("memos"), Path: redisstore.PathNative})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	ctx := t.Context()
	for i := range 50 {
		a, err := s.Acquire(ctx, idem.AcquireRequest{Key: scope(i), LeaseID: idem.NewLeaseID(), Fingerprint: idem.Fingerprint{1}, TTL: 5 * time.Second})
		if err != nil || a.Outcome != idem.Acquired {
			t.Fatal(a.Outcome, err)
		}
		if i%2 == 0 {
			err = s.Release(ctx, a.Lease)
		} else {
			err = s.Complete(ctx, a.Lease, &idem.Response{Status: 200}, time.Minute)
		}
		if err != nil {
			t.Fatal(err)
		}
	}
	if n := redisstore.LeaseMemos(s); n != 0 {
		t.Errorf("%d leases remembered after all ended, want 0", n)
	}
}

// TestNativeProvisionalToken: an Acquire whose claim's token does not
// stand (here the clock estimate is 10s behind the server's) shows a Get
// between its two round trips the claim, in flight with the lease and its
// provisional token, below the token the second step writes and the
// Acquire grants; a Get after it shows the granted one. The package
// documentation says so ("its provisional token is visible to Get"), and
// the linearizability model of the native path allows it
// (reliability/linearize, stepper.provisional).
func TestNativeProvisionalToken(t *testing.T) {
	srv := startKinds(t)[redisserver.Valkey9]
	c := redis.NewClient(&redis.Options{Addr: srv.Addr()})
	defer c.Close()
	prefix := redistest.Prefix("provisional")
	s, err := redisstore.New(c, redisstore.Options{Prefix: prefix, Path: redisstore.PathNative})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	inspect, err := redisstore.New(c, redisstore.Options{Prefix: prefix, Path: redisstore.PathNative})
	if err != nil {
		t.Fatal(err)
	}
	defer inspect.Close()
	ctx := t.Context()
	fp := idem.Fingerprint{9}
	// A first Acquire gives the store its clock estimate (TIME).
	if a, err := s.Acquire(ctx, idem.AcquireRequest{Key: scope(1), LeaseID: idem.NewLeaseID(), Fingerprint: fp, TTL: 5 * time.Second}); err != nil || a.Outcome != idem.Acquired {
		t.Fatal(a.Outcome, err)
	}
	redisstore.SkewClock(s, -10_000)
	key, id := scope(2), idem.NewLeaseID()
	var (
		seen  idem.Record
		found bool
		gerr  error
		once  sync.Once
	)
	redisstore.TraceNative(s, func(cmds [][]string) {
		if cmds[0][0] == "SET" && len(cmds[0]) > 3 && cmds[0][3] == "NX" {
			once.Do(func() { seen, found, gerr = inspect.Get(ctx, key) })
		}
	})
	a, err := s.Acquire(ctx, idem.AcquireRequest{Key: key, LeaseID: id, Fingerprint: fp, TTL: 5 * time.Second})
	if err != nil || a.Outcome != idem.Acquired {
		t.Fatal(a.Outcome, err)
	}
	if gerr != nil || !found {
		t.Fatalf("get between the claim and its second step: found %v, %v", found, gerr)
	}
	if seen.State != idem.StateInFlight || seen.LeaseID != id || seen.Fingerprint != fp || seen.Token >= a.Lease.Token {
		t.Errorf("get between the claim and its second step: %v lease %v token %d, want in flight, lease %v, a token below the granted %d",
			seen.State, seen.LeaseID, seen.Token, id, a.Lease.Token)
	}
	after, found, err := inspect.Get(ctx, key)
	if err != nil || !found || after.Token != a.Lease.Token || after.LeaseID != id {
		t.Errorf("get after the acquire: found %v, %v, token %d lease %v, want token %d lease %v", found, err, after.Token, after.LeaseID, a.Lease.Token, id)
	}
}
