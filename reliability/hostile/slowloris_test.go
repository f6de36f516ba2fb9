package hostile

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/internal/reltest"
)

// slowKind is how a slow client misbehaves.
type slowKind int

const (
	slowHeader slowKind = iota // sends a header one byte every 100ms, never ending it
	silent                     // connects and sends nothing
	slowBody                   // sends a complete keyed request head, then the body one byte every 100ms
)

// slowConn opens one misbehaving connection to addr and returns how long
// the server took to close it, or -1 if it was still open after giveUp.
// For slowBody, key is the Idempotency-Key it uses.
func slowConn(addr string, kind slowKind, key string, giveUp time.Duration) time.Duration {
	start := time.Now()
	conn, err := net.DialTimeout("tcp", addr, 2*time.Second)
	if err != nil {
		return 0 // refused at once counts as cut off
	}
	defer conn.Close()
	conn.SetDeadline(start.Add(giveUp))
	stop := make(chan struct{})
	var wg sync.WaitGroup
	defer wg.Wait()
	defer close(stop)
	wg.Go(func() {
		var first string
		switch kind {
		case silent:
			return
		case slowHeader:
			first = "POST /charges HTTP/1.1\r\nHost: slow\r\nIdempotency-Key: slowloris\r\nX-Slow: "
		case slowBody:
			first = "POST /charges HTTP/1.1\r\nHost: slow\r\nContent-Type: application/json\r\nContent-Length: 100000\r\nIdempotency-Key: " + key + "\r\n\r\n"
		}
		if _, err := io.WriteString(conn, first); err != nil {
			return
		}
		tick := time.NewTicker(100 * time.Millisecond)
		defer tick.Stop()
		for {
			select {
			case <-stop:
				return
			case <-tick.C:
				if _, err := conn.Write([]byte{'a'}); err != nil {
					return
				}
			}
		}
	})
	// The server closes the connection (perhaps after an error answer):
	// read until EOF or an error other than our own deadline.
	buf := make([]byte, 512)
	for {
		_, err := conn.Read(buf)
		if err == nil {
			continue
		}
		if ne, ok := err.(net.Error); ok && ne.Timeout() {
			return -1
		}
		return time.Since(start)
	}
}

// traffic sends well-behaved keyed requests (a new key, then its repeat)
// until ctx ends and counts what came back.
type traffic struct {
	ok, failed atomic.Int64
	slowest    atomic.Int64 // ns
	mu         sync.Mutex
	errors     map[string]int
}

func (tr *traffic) run(ctx context.Context, c *http.Client, url, tag string) {
	for i := 0; ctx.Err() == nil; i++ {
		key := fmt.Sprintf("%s-normal-%d", tag, i)
		for rep := range 2 {
			start := time.Now()
			a, err := post(c, url, key, `{"amount":1}`, nil)
			d := time.Since(start)
			for {
				old := tr.slowest.Load()
				if int64(d) <= old || tr.slowest.CompareAndSwap(old, int64(d)) {
					break
				}
			}
			replayed := a.header.Get(idemhttp.HeaderReplayed) == "true"
			switch {
			case err == nil && a.status == http.StatusCreated && replayed == (rep == 1):
				tr.ok.Add(1)
			default:
				tr.failed.Add(1)
				tr.mu.Lock()
				if tr.errors == nil {
					tr.errors = map[string]int{}
				}
				if err != nil {
					tr.errors["transport"]++
				} else {
					tr.errors[fmt.Sprint(a.status)]++
				}
				tr.mu.Unlock()
			}
		}
		select {
		case <-ctx.Done():
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// attack opens n connections of each kind in kinds (round robin) and
// waits for all of them to be cut or to reach giveUp; it returns the
// times to cut-off per kind (-1 for still open).
func attack(addr string, n int, kinds []slowKind, tag string, giveUp time.Duration) map[slowKind][]time.Duration {
	out := map[slowKind][]time.Duration{}
	var mu sync.Mutex
	var wg sync.WaitGroup
	for i := range n {
		kind := kinds[i%len(kinds)]
		wg.Go(func() {
			d := slowConn(addr, kind, fmt.Sprintf("%s-slowbody-%d", tag, i), giveUp)
			mu.Lock()
			out[kind] = append(out[kind], d)
			mu.Unlock()
		})
	}
	wg.Wait()
	return out
}

// cutStats summarises the cut-off times: how many were still open, and
// the earliest and latest cut.
func cutStats(ds []time.Duration) (open int, first, last time.Duration) {
	first = time.Hour
	for _, d := range ds {
		if d < 0 {
			open++
			continue
		}
		first, last = min(first, d), max(last, d)
	}
	return open, first, last
}

var kindName = map[slowKind]string{slowHeader: "slow header", silent: "silent", slowBody: "slow body"}

// TestSlowloris opens many connections that send their headers a byte at
// a time, or nothing, and keyed requests whose body trickles in, against a
// server with ReadHeaderTimeout (1s) and ReadTimeout (3s). They must be
// cut off at those timeouts, well-behaved keyed requests must succeed
// meanwhile, and the keys of the slow-body requests must not be left
// blocked (the middleware reads the body before it acquires the key).
func TestSlowloris(t *testing.T) {
	t.Parallel()
	store, prefix := newRedisStore(t, rdb)
	a := &app{}
	const headerTimeout, readTimeout = time.Second, 3 * time.Second
	ts, _ := startServer(t, idemhttp.Middleware(store, idemhttp.Config{Logger: quietLogger()})(a.handler()), func(s *http.Server) {
		s.ReadHeaderTimeout = headerTimeout
		s.ReadTimeout = readTimeout
		s.IdleTimeout = 5 * time.Second
	})
	addr := ts.Listener.Addr().String()
	n := reltest.Scale(60, 600)
	client := newClient(5 * time.Second)

	ctx, cancel := context.WithCancel(context.Background())
	var tr traffic
	var wg sync.WaitGroup
	wg.Go(func() { tr.run(ctx, client, ts.URL+"/charges", "slowloris") })
	start := time.Now()
	cuts := attack(addr, n, []slowKind{slowHeader, silent, slowBody}, "slowloris", 15*time.Second)
	attackTime := time.Since(start)
	cancel()
	wg.Wait()

	var notes []string
	for _, kind := range []slowKind{slowHeader, silent, slowBody} {
		limit := headerTimeout
		if kind == slowBody {
			limit = readTimeout
		}
		open, first, last := cutStats(cuts[kind])
		if open > 0 {
			t.Errorf("%s: %d of %d connections still open after 15s", kindName[kind], open, len(cuts[kind]))
		}
		if first < limit*8/10 {
			t.Errorf("%s: a connection was cut after %v, before the %v timeout", kindName[kind], first, limit)
		}
		if last > limit+4*time.Second {
			t.Errorf("%s: a connection was cut only after %v (timeout %v)", kindName[kind], last, limit)
		}
		notes = append(notes, fmt.Sprintf("%d %s cut after %v–%v (timeout %v)", len(cuts[kind]), kindName[kind],
			first.Round(time.Millisecond), last.Round(time.Millisecond), limit))
	}
	if tr.failed.Load() > 0 || tr.ok.Load() == 0 {
		t.Errorf("normal keyed requests during the attack: %d ok, %d failed (%v)", tr.ok.Load(), tr.failed.Load(), tr.errors)
	}
	if slowest := time.Duration(tr.slowest.Load()); slowest > 4*time.Second {
		t.Errorf("slowest normal request during the attack: %v", slowest)
	}
	// The slow-body requests never reached the store: their keys are free.
	slowKeys := 0
	for i := range n {
		if slowKind(i%3) != slowBody {
			continue
		}
		slowKeys++
		key := fmt.Sprintf("slowloris-slowbody-%d", i)
		if got := mustPost(t, client, ts.URL+"/charges", key, `{"amount":1}`, nil); got.status != http.StatusCreated || got.header.Get(idemhttp.HeaderReplayed) != "" {
			t.Errorf("key %s after its slow body was cut: %d %q, want a first execution (201)", key, got.status, got.body)
		}
	}
	if got, want := len(keysWith(t, rdb, prefix)), int(tr.ok.Load()+tr.failed.Load())/2+slowKeys; got > want+1 {
		t.Errorf("%d records, want at most %d (normal keys and the slow-body keys retried afterwards)", got, want+1)
	}
	reltest.Report(t, reltest.Row{
		Scenario: "hostile: slowloris (middleware)", Store: "redis (single)",
		Fault:    fmt.Sprintf("%d slow connections (header byte by byte, silent, body byte by byte); ReadHeaderTimeout 1s, ReadTimeout 3s", n),
		Requests: n + int(tr.ok.Load()+tr.failed.Load()), Keys: int(tr.ok.Load()+tr.failed.Load())/2 + slowKeys,
		ClientErrors: tr.errors,
		Notes: fmt.Sprintf("%s; meanwhile %d normal keyed requests ok, slowest %v; attack lasted %v; slow-body keys free afterwards",
			joinNotes(notes), tr.ok.Load(), time.Duration(tr.slowest.Load()).Round(time.Millisecond), attackTime.Round(time.Millisecond)),
	})
}

// TestSlowlorisNoTimeouts shows why the timeouts matter: behind a server
// with none (http.ListenAndServe, as in the README's first example), a
// connection sending its header a byte at a time is never cut off.
func TestSlowlorisNoTimeouts(t *testing.T) {
	t.Parallel()
	store, _ := newRedisStore(t, rdb)
	ts, _ := startServer(t, idemhttp.Middleware(store, idemhttp.Config{Logger: quietLogger()})((&app{}).handler()), nil)
	const hold = 3 * time.Second
	n := reltest.Scale(4, 40)
	cuts := attack(ts.Listener.Addr().String(), n, []slowKind{slowHeader, silent}, "nolimit", hold)
	open := 0
	for _, ds := range cuts {
		o, _, _ := cutStats(ds)
		open += o
	}
	if open != n {
		t.Errorf("%d of %d slow connections to a server without timeouts were closed within %v; expected all to stay open", n-open, n, hold)
	}
	reltest.Report(t, reltest.Row{
		Scenario: "hostile: slowloris, server without timeouts", Store: "redis (single)",
		Fault:    fmt.Sprintf("%d slow connections against http.Server{} (no ReadHeaderTimeout)", n),
		Requests: n, Notes: fmt.Sprintf("%d of %d still open after %v: set ReadHeaderTimeout", open, n, hold),
	})
}

func joinNotes(s []string) string {
	s = slices.Clip(s)
	out := ""
	for i, x := range s {
		if i > 0 {
			out += "; "
		}
		out += x
	}
	return out
}
