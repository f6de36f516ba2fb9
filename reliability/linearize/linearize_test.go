package linearize

import (
	"context"
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/Shopify/toxiproxy/v2"
	"github.com/anishathalye/porcupine"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"
	"github.com/redis/rueidis"
	"github.com/rs/zerolog"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/pgtest"
	"github.com/idemkit/idem/internal/redisserver"
	"github.com/idemkit/idem/internal/redistest"
	"github.com/idemkit/idem/internal/reltest"
	"github.com/idemkit/idem/memstore"
	"github.com/idemkit/idem/redisstore"
	"github.com/idemkit/idem/tieredstore"
)

var srv *redisserver.Server

func TestMain(m *testing.M) { os.Exit(redistest.Run(m, &srv)) }

// long is far beyond any run: in untimed runs nothing expires.
const long = time.Hour

// newWorkload returns an untimed workload of clients × cycles on store,
// with a window of 4 keys moving every 50 cycles.
func newWorkload(t *testing.T, store idem.Store, clients, cycles int) *workload {
	const window, stride = 4, 50
	return &workload{
		store:     store,
		keys:      newKeys(t, keysFor(clients, cycles, window, stride)),
		fps:       fingerprints(),
		clients:   clients,
		cycles:    cycles,
		window:    window,
		stride:    stride,
		leaseTTL:  long,
		retain:    long,
		pComplete: 0.15,
		rec:       newRecorder(),
	}
}

// result checks a recorded history and reports its row.
func result(t *testing.T, w *workload, store, fault string, model porcupine.Model) {
	t.Helper()
	if w.bad != nil {
		t.Errorf("unexpected error during the run: %v", w.bad)
	}
	h := w.rec.history()
	st := summarize(h)
	t.Logf("%d operations on %d keys (at most %d on one key), %d indeterminate; outcomes %v", st.ops, st.keys, st.perKeyMax, st.unknown, st.outcomes)
	if len(w.rec.samples) > 0 {
		t.Logf("first error of each kind: %q", w.rec.samples)
	}
	res := check(t, model, h, t.Name(), false)
	row := reltest.Row{
		Scenario:     "linearizability",
		Store:        store,
		Fault:        fault,
		Requests:     st.ops,
		Keys:         st.keys,
		ClientErrors: w.rec.errs,
	}
	switch res {
	case porcupine.Ok:
		row.Notes = fmt.Sprintf("linearizable: yes (%d ops, %d indeterminate)", st.ops, st.unknown)
	case porcupine.Unknown:
		row.Notes = fmt.Sprintf("linearizable: unknown, porcupine timed out after %v (%d ops, %d indeterminate)", checkTimeout, st.ops, st.unknown)
		t.Errorf("porcupine could not decide within %v", checkTimeout)
	default:
		row.Notes = fmt.Sprintf("linearizable: NO (%d ops, %d indeterminate)", st.ops, st.unknown)
		t.Errorf("history is not linearizable")
	}
	reltest.Report(t, row)
}

func TestLinearizableMemstore(t *testing.T) {
	w := newWorkload(t, memstore.New(memstore.Options{}), 16, reltest.Scale(200, 2000))
	w.run(1)
	result(t, w, "memory", "none", newModel(stepper{}))
}

// redisStores returns a go-redis and a rueidis store on addr, with the
// per-call timeout callTTL. clientRetry false turns off the client
// libraries' own resending of a script after a network error: every
// execution of a script is then one call in the history, and the workload
// repeats indeterminate calls itself (see TestReleaseRetryMergesAnswers for
// why a transparent resend can make one call's answer non-linearizable).
func redisStores(t *testing.T, addr string, callTTL time.Duration, clientRetry bool) map[string]idem.Store {
	t.Helper()
	return redisStoresPath(t, addr, callTTL, clientRetry, redisstore.PathAuto)
}

// redisStoresPath is redisStores with the stores on path.
func redisStoresPath(t *testing.T, addr string, callTTL time.Duration, clientRetry bool, path redisstore.Path) map[string]idem.Store {
	t.Helper()
	maxRetries := 0 // go-redis default (3)
	if !clientRetry {
		maxRetries = -1
	}
	gc := redis.NewClient(&redis.Options{
		MaxRetries:            maxRetries,
		Addr:                  addr,
		ContextTimeoutEnabled: true,
		DialTimeout:           callTTL,
		ReadTimeout:           callTTL,
		WriteTimeout:          callTTL,
		PoolSize:              32,
	})
	t.Cleanup(func() { gc.Close() })
	g, err := redisstore.New(gc, redisstore.Options{Timeout: callTTL, Path: path})
	if err != nil {
		t.Fatal(err)
	}
	rc, err := rueidis.NewClient(rueidis.ClientOption{
		InitAddress:      []string{addr},
		DisableCache:     true,
		DisableRetry:     !clientRetry,
		ConnWriteTimeout: callTTL,
		Dialer:           net.Dialer{Timeout: callTTL},
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(rc.Close)
	r, err := redisstore.NewRueidis(rc, redisstore.Options{Timeout: callTTL, Path: path})
	if err != nil {
		t.Fatal(err)
	}
	// rueidis+cache: the replay cache on, as Open sets it up (client-side
	// caching; the store above reads through a client without it).
	cc, err := rueidis.NewClient(rueidis.ClientOption{
		InitAddress:      []string{addr},
		DisableRetry:     !clientRetry,
		ConnWriteTimeout: callTTL,
		Dialer:           net.Dialer{Timeout: callTTL},
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(cc.Close)
	rcache, err := redisstore.NewRueidis(cc, redisstore.Options{Timeout: callTTL})
	if err != nil {
		t.Fatal(err)
	}
	return map[string]idem.Store{"go-redis": g, "rueidis": r, "rueidis+cache": rcache}
}

func TestLinearizableRedis(t *testing.T) {
	for _, name := range []string{"go-redis", "rueidis", "rueidis+cache"} {
		t.Run(name, func(t *testing.T) {
			w := newWorkload(t, redisStores(t, srv.Addr(), 2*time.Second, true)[name], 12, reltest.Scale(100, 1000))
			w.callTTL = 5 * time.Second
			w.run(2)
			result(t, w, "redis (single, "+name+")", "none", newModel(stepper{}))
		})
	}
}

// TestLinearizableTiered checks the tiered store (leases and replays on
// Redis, completions committed in PostgreSQL and relayed to Redis) against
// the same model: across both stores, each call takes effect at one
// moment between its invocation and its return.
func TestLinearizableTiered(t *testing.T) {
	for _, verify := range []bool{false, true} {
		name := map[bool]string{false: "lazy", true: "VerifyAcquire"}[verify]
		label := map[bool]string{false: "tiered: redis (single, rueidis) + postgres", true: "tiered: redis (single, rueidis) + postgres (VerifyAcquire)"}[verify]
		t.Run(name, func(t *testing.T) {
			pool := pgtest.New(t)
			rs := redisStores(t, srv.Addr(), 2*time.Second, true)["rueidis"]
			store, err := tieredstore.New(t.Context(), rs.(*redisstore.Store), pool, tieredstore.Options{Migrate: true, VerifyAcquire: verify})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { store.Close() })
			w := newWorkload(t, store, 12, reltest.Scale(150, 1500))
			w.callTTL = 5 * time.Second
			w.run(3)
			result(t, w, label, "none", newModel(stepper{}))
		})
	}
}

// faults injects faults through proxy until stop is closed: in turn,
// latency beyond the client's timeout on replies and on commands,
// reset_peer on replies and on commands, and a black hole (all data
// dropped, then every connection closed). Between faults the proxy is
// clean for a while so that calls complete.
func faults(t *testing.T, proxy *toxiproxy.Proxy, rounds int, stop <-chan struct{}, callTTL time.Duration) map[string]int {
	applied := map[string]int{}
	sleep := func(d time.Duration) bool {
		select {
		case <-stop:
			return false
		case <-time.After(d):
			return true
		}
	}
	add := func(js string) {
		if _, err := proxy.Toxics.AddToxicJson(strings.NewReader(js)); err != nil {
			t.Errorf("toxic %s: %v", js, err)
		}
	}
	remove := func(name string) {
		if err := proxy.Toxics.RemoveToxic(context.Background(), name); err != nil {
			t.Errorf("remove toxic %s: %v", name, err)
		}
	}
	lat := 3 * callTTL.Milliseconds()
	for i := 0; i < 6*rounds; i++ {
		if !sleep(callTTL * 2) {
			return applied
		}
		var window time.Duration
		switch i % 6 {
		case 0, 1:
			dir := []string{"downstream", "upstream"}[i%2]
			add(fmt.Sprintf(`{"name":"f","type":"latency","stream":%q,"attributes":{"latency":%d,"jitter":%d}}`, dir, lat, lat/2))
			applied["latency "+dir]++
			window = callTTL * 2
		case 2, 3:
			dir := []string{"downstream", "upstream"}[i%2]
			add(fmt.Sprintf(`{"name":"f","type":"reset_peer","stream":%q,"attributes":{"timeout":0}}`, dir))
			applied["reset_peer "+dir]++
			window = callTTL / 2
		default:
			dir := []string{"downstream", "upstream"}[i%2]
			add(fmt.Sprintf(`{"name":"f","type":"timeout","stream":%q,"attributes":{"timeout":0}}`, dir))
			applied["black hole "+dir]++
			window = callTTL * 2
		}
		sleep(window) // even when stopping: the toxic goes away below
		if i%6 >= 4 {
			// A black hole drops bytes mid-stream: close every connection
			// before data flows again, as a real network would reset it.
			proxy.Stop()
			remove("f")
			if err := proxy.Start(); err != nil {
				t.Errorf("restart proxy: %v", err)
				return applied
			}
		} else {
			remove("f")
		}
	}
	return applied
}

func TestLinearizableRedisFaults(t *testing.T) {
	linearizableFaults(t, srv.Addr(), redisstore.PathAuto, "redis (single, ")
}

// linearizableFaults runs the faults workload on the server at addr, on
// path; label starts the store's name in the results.
func linearizableFaults(t *testing.T, addr string, path redisstore.Path, label string) {
	const callTTL = 200 * time.Millisecond
	for _, name := range []string{"go-redis", "rueidis", "rueidis+cache"} {
		t.Run(name, func(t *testing.T) {
			ts := toxiproxy.NewServer(toxiproxy.NewMetricsContainer(prometheus.NewRegistry()), zerolog.Nop())
			proxy := toxiproxy.NewProxy(ts, "redis", "127.0.0.1:0", addr)
			if err := proxy.Start(); err != nil {
				t.Fatal(err)
			}
			defer proxy.Stop()
			// The clients run until the faults are done (each of the six
			// kinds `rounds` times), or until they run out of keys.
			rounds := reltest.Scale(1, 10)
			w := newWorkload(t, redisStoresPath(t, proxy.Listen, callTTL, false, path)[name], 12, rounds*1000)
			w.untilStop = true
			w.callTTL = callTTL
			// Few, spaced retries and a wide window of keys keep the
			// indeterminate calls per key few: each one stays pending to the
			// end of the history, and porcupine's search grows fast with
			// them.
			w.window = 8
			w.keys = newKeys(t, keysFor(12, rounds*1000, w.window, w.stride))
			w.retries, w.retryPause = 6, callTTL
			w.pause = 10 * time.Millisecond
			stop := make(chan struct{})
			var applied map[string]int
			var wg sync.WaitGroup
			wg.Add(1)
			go func() {
				defer wg.Done()
				applied = faults(t, proxy, rounds, stop, callTTL)
				w.stop.Store(true)
			}()
			w.run(3)
			close(stop)
			wg.Wait()
			t.Logf("faults applied: %v", applied)
			if w.rec.unknown == 0 {
				t.Errorf("no call was indeterminate: the faults did not bite")
			}
			result(t, w, label+name+")", "toxiproxy: latency 3× client timeout, reset_peer, black hole (up and down); client resends off", newModel(stepper{provisional: path == redisstore.PathNative}))
		})
	}
}

// TestLinearizableExpiry runs memstore on a clock the test owns, with
// leases of a few milliseconds, holders that sometimes outlive them, and a
// short retention, so that takeovers, expired tombstones and expired
// completions happen. Clock steps are tick operations in the history, and
// the timed model checks expiry and the reported TTLs exactly.
func TestLinearizableExpiry(t *testing.T) {
	var clock atomic.Int64
	clock.Store(time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC).UnixNano())
	store := memstore.New(memstore.Options{Clock: func() time.Time { return time.Unix(0, clock.Load()) }})
	clients, cycles := 12, reltest.Scale(150, 1500)
	const window, stride = 4, 50
	w := &workload{
		store:     store,
		keys:      newKeys(t, keysFor(clients, cycles, window, stride)),
		fps:       fingerprints(),
		clients:   clients,
		cycles:    cycles,
		window:    window,
		stride:    stride,
		leaseTTL:  3 * time.Millisecond,
		retain:    20 * time.Millisecond,
		pComplete: 0.2,
		pause:     time.Millisecond,
		holdPause: 4 * time.Millisecond,
		rec:       newRecorder(),
	}
	// The ticker is client `clients`: it advances the clock by 0.1 to 1.5
	// ms about every millisecond of real time.
	tick := func(v int64) {
		call := w.rec.now()
		clock.Store(v)
		w.rec.add(clients, input{kind: opTick, key: -1, ttl: time.Duration(v)}, call, output{}, w.rec.now())
	}
	tick(clock.Load()) // the model's clock starts at zero
	done := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		r := rand.New(rand.NewPCG(4, 4))
		for {
			select {
			case <-done:
				return
			case <-time.After(time.Millisecond):
			}
			tick(clock.Load() + int64(100*time.Microsecond) + r.Int64N(int64(1400*time.Microsecond)))
		}
	}()
	w.run(4)
	close(done)
	wg.Wait()
	result(t, w, "memory (test clock)", "leases of 3ms, holders paused up to 4ms, retention 20ms", newModel(stepper{timed: true}))
}
