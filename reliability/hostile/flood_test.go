package hostile

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/internal/redisserver"
	"github.com/idemkit/idem/internal/reltest"
	"github.com/idemkit/idem/memstore"
)

// info returns an integer field of INFO on srv.
func info(t *testing.T, srv *redisserver.Server, section, field string) int64 {
	t.Helper()
	out, err := srv.Do("INFO", section)
	if err != nil {
		t.Fatal(err)
	}
	v, ok := redisserver.InfoField(out, field)
	if !ok {
		t.Fatalf("INFO %s: no %s", section, field)
	}
	n, err := strconv.ParseInt(v, 10, 64)
	if err != nil {
		t.Fatalf("INFO %s: %s=%q", section, field, v)
	}
	return n
}

func dbsize(t *testing.T, srv *redisserver.Server) int64 {
	t.Helper()
	out, err := srv.Do("DBSIZE")
	if err != nil {
		t.Fatal(err)
	}
	n, _ := strconv.ParseInt(out, 10, 64)
	return n
}

// TestKeyFlood sends a flood of distinct keys through the middleware to a
// private Redis with a 2s retention: every request stores a record, and
// Redis memory must follow the retention, not the history: DBSIZE and
// used_memory come back near the baseline once retention has passed.
func TestKeyFlood(t *testing.T) {
	t.Parallel()
	srv, err := redisserver.StartServer()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv.Stop)
	store, _ := newRedisStore(t, srv)
	const retention = 2 * time.Second
	a := &app{}
	ts, _ := startServer(t, idemhttp.Middleware(store, idemhttp.Config{Retention: retention, Logger: quietLogger()})(a.handler()), nil)
	client := newClient(10 * time.Second)

	// Baseline with the store's connection open.
	if _, _, err := store.Get(context.Background(), idem.Key{}); err != nil {
		t.Fatal(err)
	}
	base := info(t, srv, "memory", "used_memory")
	// The keys that are not records: the store's id (Prefix+"store-id"),
	// kept for good.
	fixed := dbsize(t, srv)
	records := func() int64 { return dbsize(t, srv) - fixed }

	n := reltest.Scale(3000, 150_000)
	const workers = 16
	var next, failed atomic.Int64
	errs := map[string]int{}
	var errMu sync.Mutex
	stopSampling := make(chan struct{})
	var sampler sync.WaitGroup
	var peakKeys, peakMem int64
	sampler.Go(func() {
		for {
			select {
			case <-stopSampling:
				return
			case <-time.After(100 * time.Millisecond):
			}
			out, err := srv.Do("DBSIZE")
			k, _ := strconv.ParseInt(out, 10, 64)
			k -= fixed
			if err != nil || k <= peakKeys {
				continue
			}
			mem, err := srv.Do("INFO", "memory")
			used, _ := redisserver.InfoField(mem, "used_memory")
			if m, perr := strconv.ParseInt(used, 10, 64); err == nil && perr == nil {
				peakKeys, peakMem = k, m
			}
		}
	})
	start := time.Now()
	var wg sync.WaitGroup
	for range workers {
		wg.Go(func() {
			for {
				i := next.Add(1) - 1
				if i >= int64(n) {
					return
				}
				a, err := post(client, ts.URL+"/charges", fmt.Sprintf("flood-%d-{x}", i), `{"amount":1}`, nil)
				if err != nil || a.status != http.StatusCreated {
					failed.Add(1)
					errMu.Lock()
					if err != nil {
						errs["transport"]++
					} else {
						errs[strconv.Itoa(a.status)]++
					}
					errMu.Unlock()
				}
			}
		})
	}
	wg.Wait()
	floodTime := time.Since(start)
	endKeys, endMem := records(), info(t, srv, "memory", "used_memory")
	close(stopSampling)
	sampler.Wait()
	if endKeys > peakKeys {
		peakKeys, peakMem = endKeys, endMem
	}
	if failed.Load() > 0 {
		t.Errorf("%d of %d flood requests failed: %v", failed.Load(), n, errs)
	}
	if peakKeys > int64(n) || peakKeys == 0 {
		t.Errorf("peak DBSIZE %d for %d keys", peakKeys, n)
	}
	perRecord := float64(peakMem-base) / float64(max(peakKeys, 1))
	rate := float64(n) / floodTime.Seconds()

	// After retention, everything goes: Redis expires the records (lazily
	// and by its active expiry cycle) and shrinks its tables.
	expireStart := time.Now()
	gone := waitFor(retention+30*time.Second, func() bool { return records() == 0 })
	expireTime := time.Since(expireStart)
	if !gone {
		t.Errorf("%d records still there %v after the flood (retention %v)", records(), expireTime, retention)
	}
	tolerance := max(int64(1<<20), (peakMem-base)/10)
	var after int64
	waitFor(10*time.Second, func() bool {
		after = info(t, srv, "memory", "used_memory")
		return after-base <= tolerance
	})
	if after-base > tolerance {
		t.Errorf("used_memory %d after expiry, baseline %d, peak %d: %s not returned", after, base, peakMem, mib(after-base))
	}
	reltest.Report(t, reltest.Row{
		Scenario: "hostile: flood of distinct keys", Store: "redis (single)",
		Fault:    fmt.Sprintf("%d distinct keys through the middleware, %d clients, retention %v", n, workers, retention),
		Requests: n, Keys: n, ClientErrors: errs,
		Notes: fmt.Sprintf("%.0f req/s for %v; peak %d records, used_memory %s over baseline (%.0f B per record); all expired %v after the flood; used_memory then %+d B vs baseline",
			rate, floodTime.Round(time.Millisecond), peakKeys, mib(peakMem-base), perRecord, expireTime.Round(100*time.Millisecond), after-base),
	})
}

// TestKeyFloodMemstore floods memstore through the middleware (in process,
// with a clock that advances 1ms per request and a 100ms retention): with
// no background goroutine, the records held must still follow the
// retention window, not the number of keys ever seen.
func TestKeyFloodMemstore(t *testing.T) {
	t.Parallel()
	var now atomic.Int64
	now.Store(time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC).UnixNano())
	store := memstore.New(memstore.Options{Clock: func() time.Time { return time.Unix(0, now.Load()) }})
	const retention = 100 * time.Millisecond
	a := &app{}
	h := idemhttp.Middleware(store, idemhttp.Config{Retention: retention, Logger: quietLogger()})(a.handler())
	n := reltest.Scale(20_000, 500_000)
	window := int(retention / time.Millisecond) // records live at any moment
	maxHeld := 0
	for i := range n {
		now.Add(int64(time.Millisecond))
		r := httptest.NewRequest(http.MethodPost, "/charges", strings.NewReader(`{"amount":1}`))
		r.Header.Set(idemhttp.HeaderKey, fmt.Sprintf("mflood-%d", i))
		w := httptest.NewRecorder()
		h.ServeHTTP(w, r)
		if w.Code != http.StatusCreated {
			t.Fatalf("request %d: %d %s", i, w.Code, w.Body)
		}
		if i%1000 == 999 {
			maxHeld = max(maxHeld, store.Len())
		}
	}
	// memstore's doc: each call sweeps up to 16 expired records of its
	// shard, so the held records stay near the live window.
	if limit := 4 * window; maxHeld > limit {
		t.Errorf("memstore held up to %d records for a live window of %d (after %d keys), want at most %d", maxHeld, window, n, limit)
	}
	reltest.Report(t, reltest.Row{
		Scenario: "hostile: flood of distinct keys", Store: "memory",
		Fault:    fmt.Sprintf("%d distinct keys, one per ms of store clock, retention %v", n, retention),
		Requests: n, Keys: n,
		Notes: fmt.Sprintf("at most %d records held (live window %d)", maxHeld, window),
	})
}
