package redisstore_test

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"os"
	"strconv"
	"strings"
	"sync/atomic"
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

// One private redis-server and one private 3-primary cluster (with a
// replica each) for the whole package.
var (
	single  *redisserver.Server
	cluster *redisserver.Cluster
)

func TestMain(m *testing.M) {
	single = redisserver.MustStartServer()
	var err error
	if cluster, err = redisserver.StartCluster(3, 1); err != nil {
		single.Stop()
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	code := m.Run()
	stopKinds()
	single.Stop()
	cluster.Stop()
	os.Exit(code)
}

// client is one way of reaching Redis: a client library on a deployment.
type client struct {
	name  string
	store func(t testing.TB, opts redisstore.Options) *redisstore.Store
	// set writes a raw value, for corrupting records.
	set func(ctx context.Context, key, value string) error
}

func goredisClient(t testing.TB, c redis.UniversalClient, name string) client {
	t.Cleanup(func() { c.Close() })
	return client{
		name: "go-redis/" + name,
		store: func(t testing.TB, opts redisstore.Options) *redisstore.Store {
			s, err := redisstore.New(c, opts)
			if err != nil {
				t.Fatal(err)
			}
			return s
		},
		set: func(ctx context.Context, key, value string) error { return c.Set(ctx, key, value, 0).Err() },
	}
}

func rueidisClient(t testing.TB, addrs []string, name string) client {
	c, err := rueidis.NewClient(rueidis.ClientOption{InitAddress: addrs, DisableCache: true})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(c.Close)
	return client{
		name: "rueidis/" + name,
		store: func(t testing.TB, opts redisstore.Options) *redisstore.Store {
			if opts.CacheSize == 0 {
				opts.CacheSize = -1 // the path without the replay cache; cachedClients has it
			}
			s, err := redisstore.NewRueidis(c, opts)
			if err != nil {
				t.Fatal(err)
			}
			return s
		},
		set: func(ctx context.Context, key, value string) error {
			return c.Do(ctx, c.B().Set().Key(key).Value(value).Build()).Error()
		},
	}
}

func clients(t testing.TB) []client {
	return []client{
		goredisClient(t, redis.NewClient(&redis.Options{Addr: single.Addr()}), "single"),
		rueidisClient(t, []string{single.Addr()}, "single"),
		goredisClient(t, redis.NewClusterClient(&redis.ClusterOptions{Addrs: cluster.Addrs()}), "cluster"),
		rueidisClient(t, cluster.Addrs(), "cluster"),
	}
}

func TestConformance(t *testing.T) {
	for _, c := range append(clients(t), cachedClients(t)...) {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			storetest.Run(t, func(t *testing.T, prefix string) storetest.Fixture {
				s := c.store(t, redisstore.Options{Prefix: prefix})
				return storetest.Fixture{
					Store: s,
					Sleep: time.Sleep,
					Corrupt: func(key idem.Key) error {
						return c.set(context.Background(), s.KeyName(key), "not a record")
					},
				}
			})
		})
	}
}

func TestPrefixValidation(t *testing.T) {
	c := redis.NewClient(&redis.Options{Addr: single.Addr()})
	defer c.Close()
	for _, p := range []string{"a{b", "x}", "{}"} {
		if _, err := redisstore.New(c, redisstore.Options{Prefix: p}); err == nil {
			t.Errorf("New with Prefix %q: got nil error, want one", p)
		}
	}
}

func scope(i int) idem.Key {
	k, err := idem.Scope{Tenant: "t", Method: "POST", Route: "/pay"}.Key("key-" + strconv.Itoa(i))
	if err != nil {
		panic(err)
	}
	return k
}

// countHook counts the commands go-redis sends.
type countHook struct{ n *atomic.Int64 }

func (h countHook) DialHook(next redis.DialHook) redis.DialHook { return next }
func (h countHook) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error { h.n.Add(1); return next(ctx, cmd) }
}
func (h countHook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error { h.n.Add(int64(len(cmds))); return next(ctx, cmds) }
}

// countingRueidis counts the commands rueidis sends.
type countingRueidis struct {
	rueidis.Client
	n *atomic.Int64
}

func (c countingRueidis) Do(ctx context.Context, cmd rueidis.Completed) rueidis.RedisResult {
	c.n.Add(1)
	return c.Client.Do(ctx, cmd)
}

func (c countingRueidis) DoMulti(ctx context.Context, cmds ...rueidis.Completed) []rueidis.RedisResult {
	c.n.Add(int64(len(cmds)))
	return c.Client.DoMulti(ctx, cmds...)
}

// DoCache counts the replay cache's read as a command: with a client built
// with DisableCache (as here), rueidis sends it as a plain GET.
func (c countingRueidis) DoCache(ctx context.Context, cmd rueidis.Cacheable, ttl time.Duration) rueidis.RedisResult {
	c.n.Add(1)
	return c.Client.DoCache(ctx, cmd, ttl)
}

// TestRoundTrips counts the commands each client sends (one command, one
// round trip): acquire+complete is exactly two, a replay exactly one.
func TestRoundTrips(t *testing.T) {
	ctx := context.Background()
	var sent atomic.Int64
	gr := redis.NewClient(&redis.Options{Addr: single.Addr()})
	gr.AddHook(countHook{&sent})
	defer gr.Close()
	ru, err := rueidis.NewClient(rueidis.ClientOption{InitAddress: []string{single.Addr()}, DisableCache: true})
	if err != nil {
		t.Fatal(err)
	}
	defer ru.Close()
	viaGoredis, _ := redisstore.New(gr, redisstore.Options{Prefix: redistest.Prefix("rt-go-redis")})
	viaRueidis, _ := redisstore.NewRueidis(countingRueidis{ru, &sent}, redisstore.Options{Prefix: redistest.Prefix("rt-rueidis")})
	for name, s := range map[string]*redisstore.Store{"go-redis": viaGoredis, "rueidis": viaRueidis} {
		t.Run(name, func(t *testing.T) {
			g, err := idem.New(s, idem.Config{})
			if err != nil {
				t.Fatal(err)
			}
			work := func(context.Context) (*idem.Response, error) { return &idem.Response{Status: 201}, nil }
			// Warm up: the first call of each script loads it (NOSCRIPT, then EVAL).
			if _, err := g.Do(ctx, scope(-1), idem.Fingerprint{}, work); err != nil {
				t.Fatal(err)
			}
			for i := range 20 {
				before := sent.Load()
				if _, err := g.Do(ctx, scope(i), idem.Fingerprint{}, work); err != nil {
					t.Fatal(err)
				}
				if got := sent.Load() - before; got != 2 {
					t.Fatalf("first request: got %d commands, want 2", got)
				}
				before = sent.Load()
				res, err := g.Do(ctx, scope(i), idem.Fingerprint{}, work)
				if err != nil || !res.Replayed {
					t.Fatalf("repeat: got %+v, %v; want a replay", res, err)
				}
				if got := sent.Load() - before; got != 1 {
					t.Fatalf("replay: got %d commands, want 1", got)
				}
			}
		})
	}
}

// TestMemory checks the stored size of completed records on the server.
func TestMemory(t *testing.T) {
	ctx := context.Background()
	c := clients(t)[1]
	s := c.store(t, redisstore.Options{}) // the default prefix: the size depends on the key's length
	tenant := redistest.Prefix("mem")     // unique keys under it, run after run
	key := func(name string) idem.Key {
		k, err := idem.Scope{Tenant: tenant}.Key(name)
		if err != nil {
			t.Fatal(err)
		}
		return k
	}
	complete := func(k idem.Key, body []byte) int {
		t.Helper()
		acq, err := s.Acquire(ctx, idem.AcquireRequest{Key: k, LeaseID: idem.NewLeaseID(), TTL: time.Second})
		if err != nil || acq.Outcome != idem.Acquired {
			t.Fatalf("acquire: %v %v", acq.Outcome, err)
		}
		resp := &idem.Response{Status: 200, Header: http.Header{"Content-Type": {"application/json"}}, Body: body}
		if err := s.Complete(ctx, acq.Lease, resp, time.Hour); err != nil {
			t.Fatal(err)
		}
		out, err := single.Do("MEMORY", "USAGE", s.KeyName(k))
		if err != nil {
			t.Fatal(err)
		}
		n, err := strconv.Atoi(out)
		if err != nil {
			t.Fatalf("MEMORY USAGE: %q", out)
		}
		return n
	}
	small := jsonBody(100)
	if got := complete(key("small"), small); got > 200 {
		t.Errorf("MEMORY USAGE of a completed record with a 100-byte JSON body: got %d bytes, want <= 200", got)
	} else {
		t.Logf("MEMORY USAGE, 100-byte JSON body: %d bytes", got)
	}
	big := jsonBody(4096)
	if got := complete(key("big"), big); got >= len(big) {
		t.Errorf("MEMORY USAGE of a completed record with a 4 KiB JSON body: got %d bytes, want less than the body (compressed)", got)
	} else {
		t.Logf("MEMORY USAGE, 4 KiB JSON body: %d bytes", got)
	}
}

// jsonBody returns a JSON document of exactly n bytes (n >= 32) that looks
// like an API response: a list of charges, padded with a note.
func jsonBody(n int) []byte {
	var b strings.Builder
	b.WriteString(`{"items":[`)
	for i := 0; ; i++ {
		item := fmt.Sprintf(`{"id":"ch_%06d","amount":%d,"currency":"eur"},`, i, 100+i*7)
		if b.Len()+len(item)+len(`],"note":""}`) > n {
			break
		}
		b.WriteString(item)
	}
	s := strings.TrimSuffix(b.String(), ",") + `],"note":"`
	return []byte(s + strings.Repeat("x", n-len(s)-2) + `"}`)
}

// TestServerDown: with Redis gone, Do fails with a *StoreError and never
// runs the work; once Redis is back, the same store works again by itself.
func TestServerDown(t *testing.T) {
	srv, err := redisserver.StartServer()
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Stop()
	ctx := context.Background()
	gr := redis.NewClient(&redis.Options{Addr: srv.Addr(), MaxRetries: 1, DialTimeout: 200 * time.Millisecond})
	defer gr.Close()
	viaGoredis, _ := redisstore.New(gr, redisstore.Options{})
	viaRueidis := rueidisClient(t, []string{srv.Addr()}, "down").store(t, redisstore.Options{})
	stores := map[string]*redisstore.Store{"go-redis": viaGoredis, "rueidis": viaRueidis}

	ran := 0
	work := func(context.Context) (*idem.Response, error) { ran++; return &idem.Response{Status: 200}, nil }
	srv.Kill()
	for name, s := range stores {
		g, _ := idem.New(s, idem.Config{})
		// No deadline of our own: Options.Timeout must end the call, even
		// with rueidis's default retry-until-cancelled policy.
		start := time.Now()
		_, err := g.Do(ctx, scope(1), idem.Fingerprint{}, work)
		if took := time.Since(start); took > redisstore.DefaultTimeout+2*time.Second {
			t.Errorf("%s, server down: Do took %v, want it bounded by the store timeout %v", name, took, redisstore.DefaultTimeout)
		}
		var se *idem.StoreError
		if !errors.As(err, &se) || se.Op != "acquire" {
			t.Errorf("%s, server down: got %v, want a *StoreError from acquire", name, err)
		}
	}
	if ran != 0 {
		t.Fatalf("work ran %d times while the store was down, want 0", ran)
	}
	if err := srv.Restart(); err != nil {
		t.Fatal(err)
	}
	for name, s := range stores {
		g, _ := idem.New(s, idem.Config{})
		var err error
		for range 50 { // the clients reconnect on their own
			if _, err = g.Do(ctx, scope(len(name)), idem.Fingerprint{}, work); err == nil {
				break
			}
			time.Sleep(50 * time.Millisecond)
		}
		if err != nil {
			t.Errorf("%s, server back: got %v, want success", name, err)
		}
	}
	if ran != 2 {
		t.Fatalf("after the restart the work ran %d times, want 2", ran)
	}
}

func TestOpen(t *testing.T) {
	ctx := context.Background()
	urls := map[string]string{
		"single":  "redis://" + single.Addr(),
		"valkey":  "valkey://" + single.Addr(), // the same scheme under Valkey's name
		"cluster": "redis://" + cluster.Addrs()[0] + "?addr=" + cluster.Addrs()[1],
	}
	for name, url := range urls {
		s, err := redisstore.Open(url, redisstore.Options{Prefix: redistest.Prefix("open")})
		if err != nil {
			t.Fatalf("Open(%s): %v", name, err)
		}
		g, _ := idem.New(s, idem.Config{})
		for i, want := range []bool{false, true} {
			res, err := g.Do(ctx, scope(7), idem.Fingerprint{}, func(context.Context) (*idem.Response, error) {
				return &idem.Response{Status: 200}, nil
			})
			if err != nil || res.Replayed != want {
				t.Errorf("%s, call %d: got %+v, %v; want Replayed %t", name, i, res, err, want)
			}
		}
		s.Close()
	}
	for _, bad := range []string{"http://" + single.Addr(), "redis://" + single.Addr() + "/notadb", "://"} {
		if _, err := redisstore.Open(bad, redisstore.Options{}); err == nil {
			t.Errorf("Open(%q): got nil error, want one", bad)
		}
	}
	if _, err := redisstore.Open("redis://"+single.Addr(), redisstore.Options{Prefix: "a{b}"}); err == nil {
		t.Error("Open with a bad prefix: got nil error, want one")
	}
}

// TestForeignValues: values idem did not write (another Redis type, an
// in-flight record someone made persistent) are reported, not obeyed.
func TestForeignValues(t *testing.T) {
	ctx := context.Background()
	c := redis.NewClient(&redis.Options{Addr: single.Addr()})
	defer c.Close()
	s, _ := redisstore.New(c, redisstore.Options{Prefix: redistest.Prefix("foreign")})
	req := func(k idem.Key) idem.AcquireRequest {
		return idem.AcquireRequest{Key: k, LeaseID: idem.NewLeaseID(), TTL: time.Second}
	}

	hash := scope(1)
	if err := c.HSet(ctx, s.KeyName(hash), "f", "v").Err(); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Acquire(ctx, req(hash)); !errors.Is(err, idem.ErrCorrupt) {
		t.Errorf("Acquire on a hash: got %v, want ErrCorrupt", err)
	}
	if _, _, err := s.Get(ctx, hash); !errors.Is(err, idem.ErrCorrupt) {
		t.Errorf("Get on a hash: got %v, want ErrCorrupt", err)
	}
	l := idem.Lease{Key: hash, ID: idem.NewLeaseID(), Token: 1, TTL: time.Second}
	for name, err := range map[string]error{
		"Renew":    s.Renew(ctx, l, time.Second),
		"Complete": s.Complete(ctx, l, &idem.Response{Status: 200}, time.Hour),
		"Release":  s.Release(ctx, l),
	} {
		if !errors.Is(err, idem.ErrLeaseLost) {
			t.Errorf("%s on a hash: got %v, want ErrLeaseLost", name, err)
		}
	}
	if typ := c.Type(ctx, s.KeyName(hash)).Val(); typ != "hash" {
		t.Errorf("the hash was changed into a %s", typ)
	}

	persisted := scope(2)
	acq, err := s.Acquire(ctx, req(persisted))
	if err != nil || acq.Outcome != idem.Acquired {
		t.Fatalf("Acquire: %v %v", acq.Outcome, err)
	}
	c.Persist(ctx, s.KeyName(persisted))
	if _, err := s.Acquire(ctx, req(persisted)); !errors.Is(err, idem.ErrCorrupt) {
		t.Errorf("Acquire on an in-flight record without expiry: got %v, want ErrCorrupt (else it is in flight forever)", err)
	}
}

// Open refuses what rueidis would read loosely, before connecting, and
// never repeats the URL (it may hold a password).
func TestOpenRejectsBadURLs(t *testing.T) {
	for _, u := range []string{
		"redis:127.0.0.1:6379",                // no //: rueidis would use localhost:6379
		"redis://",                            // no host
		"redis://:secret@127.0.0.1:1?dbb=2",   // unknown parameter
		"redis://:secret@127.0.0.1:1/0/1",     // bad path
		"http://127.0.0.1:6379",               // not Redis
		"redis://:secret@127.0.0.1:1#section", // fragment
		"redis://:secret@127.0.0.1:%zz",       // does not parse
		"redis://:secret@127.0.0.1:1?addr=",   // an empty address
		"redis://127.0.0.1:1?master_set=",     // an empty master set
	} {
		_, err := redisstore.Open(u, redisstore.Options{})
		if !errors.Is(err, redisstore.ErrBadURL) {
			t.Errorf("Open(%q): got %v, want ErrBadURL", u, err)
		} else if strings.Contains(err.Error(), "secret") {
			t.Errorf("Open(%q): the error %q shows the password", u, err)
		}
	}
}

// Open's store bounds each call by Options.Timeout (DefaultTimeout): a
// Redis that stops answering fails the call with the deadline, however
// long rueidis would go on retrying.
func TestOpenBoundsCalls(t *testing.T) {
	srv := redisserver.MustStartServer()
	defer srv.Stop()
	s, err := redisstore.Open("redis://"+srv.Addr(), redisstore.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	k, _ := idem.Scope{Method: "POST", Route: "/t"}.Key("bounded")
	if err := srv.Pause(); err != nil { // SIGSTOP: connections stay open, nothing answers
		t.Fatal(err)
	}
	defer srv.Resume()
	done := make(chan error, 1)
	go func() {
		_, err := s.Acquire(context.Background(), idem.AcquireRequest{Key: k, LeaseID: idem.NewLeaseID(), TTL: time.Second})
		done <- err
	}()
	select {
	case err := <-done:
		if !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("Acquire on a silent Redis: got %v, want an error with context.DeadlineExceeded (Options.Timeout)", err)
		}
	case <-time.After(4 * redisstore.DefaultTimeout):
		t.Fatalf("Acquire on a silent Redis still waiting after %v", 4*redisstore.DefaultTimeout)
	}
}
