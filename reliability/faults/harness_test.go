// Package faults attacks idem's Redis store through toxiproxy (run in
// process) and through the Redis server itself: lost and late replies,
// reset connections, a black hole, SCRIPT FLUSH, a restart and a full
// memory. Every scenario drives idemhttp's middleware over redisstore with
// both Redis clients (rueidis through redisstore.Open, go-redis through
// redisstore.New), each against its own private redis-server, and reports a
// row for RELIABILITY.md with reltest.Report.
//
// What is counted, per idempotency key:
//   - executions of the handler, each with its fencing token and the body
//     it produced (the body names the execution, so a re-execution is
//     visible in what clients get);
//   - what every client got: 2xx bodies (original or replayed) and every
//     other status, by code;
//   - the result of every Store.Complete, by key and token (a wrapper
//     around the store).
//
// From these: a duplicate is an execution beyond the first for a key; a
// lost completion is a key whose final stored response differs from a
// 2xx body a client got before; a stuck key is one that is not completed
// once the faults are gone and every key was retried for a lease plus a
// grace. A duplicate (or lost completion) is "explained" when the
// execution before it had its Complete fail: idemhttp then still sends the
// handler's response and a retry runs the handler again (see idemhttp's
// package documentation), which is at-least-once, not a bug. An
// unexplained one, after a Complete that succeeded, would be a bug; every
// scenario asserts there are none.
package faults

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"net"
	"net/http"
	"net/http/httptest"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	toxiproxy "github.com/Shopify/toxiproxy/v2"
	"github.com/redis/go-redis/v9"
	"github.com/redis/rueidis"
	"github.com/rs/zerolog"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/internal/redisserver"
	"github.com/idemkit/idem/internal/reltest"
	"github.com/idemkit/idem/redisstore"
)

// Timing of every scenario. The store timeout is well above what a Redis
// round trip takes on a loaded machine under -race, and the injected
// latency well above the timeout, so that a delayed reply always times out
// and an undelayed one almost never does.
const (
	storeTimeout  = 500 * time.Millisecond
	injectedDelay = 2000 * time.Millisecond
	lease         = 2 * time.Second
	grace         = 2 * time.Second
	route         = "charges"
)

// lateReplies describes the latency fault in the rows.
var lateReplies = fmt.Sprintf("latency toxic (%v) on Redis replies, store timeout %v", injectedDelay, storeTimeout)

// clients are the two Redis client libraries redisstore runs on: rueidis
// as redisstore.Open sets it up, and go-redis.
var clients = []string{"rueidis", "go-redis"}

// noRetry, appended to "rueidis", makes the harness build the rueidis
// client itself with DisableRetry and use redisstore.NewRueidis (see
// TestResetPeer).
const noRetry = " (NewRueidis, DisableRetry)"

// ---------------------------------------------------------------------------
// toxiproxy, in process

// faultProxy is one toxiproxy proxy in front of a Redis server.
type faultProxy struct {
	srv   *toxiproxy.ApiServer
	proxy *toxiproxy.Proxy
	addr  string
}

func newFaultProxy(t testing.TB, upstream string) *faultProxy {
	t.Helper()
	srv := toxiproxy.NewServer(toxiproxy.NewMetricsContainer(nil), zerolog.Nop())
	p := toxiproxy.NewProxy(srv, "redis", "127.0.0.1:0", upstream)
	if err := srv.Collection.Add(p, true); err != nil {
		t.Fatalf("toxiproxy: %v", err)
	}
	fp := &faultProxy{srv: srv, proxy: p, addr: p.Listen}
	t.Cleanup(func() { srv.Collection.Clear() })
	return fp
}

// add adds a toxic; stream is "upstream" (client to Redis) or "downstream"
// (Redis to client). It returns the toxic's name, for remove.
func (f *faultProxy) add(t testing.TB, typ, stream string, attrs map[string]int64) string {
	t.Helper()
	name := typ + "_" + stream
	var a []string
	for k, v := range attrs {
		a = append(a, fmt.Sprintf("%q:%d", k, v))
	}
	js := fmt.Sprintf(`{"name":%q,"type":%q,"stream":%q,"toxicity":1,"attributes":{%s}}`, name, typ, stream, strings.Join(a, ","))
	if _, err := f.proxy.Toxics.AddToxicJson(strings.NewReader(js)); err != nil {
		t.Errorf("toxiproxy: adding %s: %v", js, err)
	}
	return name
}

// remove removes a toxic added by add.
func (f *faultProxy) remove(t testing.TB, name string) {
	t.Helper()
	if err := f.proxy.Toxics.RemoveToxic(context.Background(), name); err != nil {
		t.Errorf("toxiproxy: removing %s: %v", name, err)
	}
}

// reset removes every toxic.
func (f *faultProxy) reset() { f.proxy.Toxics.ResetToxics(context.Background()) }

// ---------------------------------------------------------------------------
// the store, wrapped to record what each call answered

// recStore records, per key and fencing token, what Complete answered, and
// counts the acquisitions (records created) and the failures of each call.
type recStore struct {
	*redisstore.Store

	mu        sync.Mutex
	completes map[leaseRef]error
	acquired  int
	failures  map[string]int    // op -> store errors
	oom       map[string]int    // op -> errors that are Redis's OOM refusal
	firstErr  map[string]string // op -> the first error's text
}

type leaseRef struct {
	key   idem.Key
	token uint64
}

func (s *recStore) Acquire(ctx context.Context, req idem.AcquireRequest) (idem.Acquisition, error) {
	acq, err := s.Store.Acquire(ctx, req)
	s.mu.Lock()
	defer s.mu.Unlock()
	if err != nil {
		s.failed("acquire", err)
	} else if acq.Outcome == idem.Acquired {
		s.acquired++
	}
	return acq, err
}

func (s *recStore) Complete(ctx context.Context, l idem.Lease, resp *idem.Response, retention time.Duration) error {
	err := s.Store.Complete(ctx, l, resp, retention)
	s.mu.Lock()
	defer s.mu.Unlock()
	s.completes[leaseRef{l.Key, l.Token}] = err
	if err != nil {
		s.failed("complete", err)
	}
	return err
}

func (s *recStore) Release(ctx context.Context, l idem.Lease) error {
	err := s.Store.Release(ctx, l)
	if err != nil && !errors.Is(err, idem.ErrLeaseLost) {
		s.mu.Lock()
		s.failed("release", err)
		s.mu.Unlock()
	}
	return err
}

// failed counts a failure; the caller holds s.mu.
func (s *recStore) failed(op string, err error) {
	s.failures[op]++
	if strings.Contains(err.Error(), "OOM") {
		s.oom[op]++
	}
	if _, ok := s.firstErr[op]; !ok {
		s.firstErr[op] = err.Error()
	}
}

// firstError returns the text of op's first failure, or "".
func (s *recStore) firstError(op string) string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.firstErr[op]
}

// completeResult reports what Complete answered for a lease, and whether
// it was called at all.
func (s *recStore) completeResult(k idem.Key, token uint64) (error, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	err, ok := s.completes[leaseRef{k, token}]
	return err, ok
}

// acquiredCount returns how many Acquire calls answered Acquired: the
// records created.
func (s *recStore) acquiredCount() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.acquired
}

// oomCount returns how many of op's failures were Redis refusing a write
// for lack of memory.
func (s *recStore) oomCount(op string) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.oom[op]
}

func (s *recStore) failureCount(op string) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.failures[op]
}

// ---------------------------------------------------------------------------
// the ledger: executions and what clients saw

type execution struct {
	token uint64
	body  string
	at    time.Time
}

type keyState struct {
	execs []execution
	acked []string // 2xx bodies clients got, originals and replays
}

type ledger struct {
	mu   sync.Mutex
	keys map[string]*keyState
}

func (l *ledger) state(key string) *keyState {
	st := l.keys[key]
	if st == nil {
		st = &keyState{}
		l.keys[key] = st
	}
	return st
}

// ---------------------------------------------------------------------------
// the harness

// harness is one scenario's world: a private redis-server, toxiproxy in
// front of it, a store on one client library through the proxy, and an
// HTTP server with idemhttp's middleware and a handler that counts its
// executions.
type harness struct {
	t      *testing.T
	client string
	redis  *redisserver.Server
	proxy  *faultProxy
	store  *recStore
	http   *httptest.Server
	hc     *http.Client
	// goredis is the go-redis client, nil for rueidis.
	goredis *redis.Client
	ledger  ledger
	pad     int           // extra response bytes per execution
	lease   time.Duration // the middleware's lease

	// onExec, when set, runs in the handler after the execution is
	// counted and before the response is written.
	onExec atomic.Pointer[func(key string, n int)]

	mu       sync.Mutex
	requests int
	errs     map[string]int
	phase    string // suffix of the error labels, e.g. "recovery"
}

type harnessOpts struct {
	redisArgs []string
	lease     time.Duration
	pad       int
	// timeout is the store's timeout (default storeTimeout).
	timeout time.Duration
	// warmPool, for go-redis, opens this many pooled connections before
	// the scenario starts, so that no store call has to dial (and
	// handshake) while a fault is in place.
	warmPool int
}

func newHarness(t *testing.T, client string, o harnessOpts) *harness {
	t.Helper()
	if o.lease == 0 {
		o.lease = lease
	}
	if o.timeout == 0 {
		o.timeout = storeTimeout
	}
	srv, err := redisserver.StartServer(redisserver.WithArgs(o.redisArgs...))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv.Stop)
	h := &harness{t: t, client: client, redis: srv, pad: o.pad, lease: o.lease, errs: map[string]int{}}
	h.ledger.keys = map[string]*keyState{}
	h.proxy = newFaultProxy(t, srv.Addr())

	var store *redisstore.Store
	switch client {
	case "rueidis" + noRetry:
		c, err := rueidis.NewClient(rueidis.ClientOption{InitAddress: []string{h.proxy.addr}, DisableCache: true, DisableRetry: true})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(c.Close)
		if store, err = redisstore.NewRueidis(c, redisstore.Options{Timeout: o.timeout}); err != nil {
			t.Fatal(err)
		}
	case "rueidis":
		store, err = redisstore.Open("redis://"+h.proxy.addr, redisstore.Options{Timeout: o.timeout})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { store.Close() })
	case "go-redis":
		c := redis.NewClient(&redis.Options{
			Addr:                  h.proxy.addr,
			ContextTimeoutEnabled: true, // the store's timeout bounds reads and writes
			DialTimeout:           o.timeout,
			PoolSize:              max(64, o.warmPool),
		})
		t.Cleanup(func() { c.Close() })
		h.goredis = c
		if o.warmPool > 0 {
			warmPool(t, c, o.warmPool)
		}
		store, err = redisstore.New(c, redisstore.Options{Timeout: o.timeout})
		if err != nil {
			t.Fatal(err)
		}
	default:
		t.Fatalf("unknown client %q", client)
	}
	h.store = &recStore{Store: store, completes: map[leaseRef]error{}, failures: map[string]int{}, oom: map[string]int{}, firstErr: map[string]string{}}

	mux := http.NewServeMux()
	mux.HandleFunc("POST /charges", h.handle)
	mw := idemhttp.Middleware(h.store, idemhttp.Config{
		Lease:  o.lease,
		Route:  func(*http.Request) string { return route },
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil)),
	})
	h.http = httptest.NewServer(mw(mux))
	t.Cleanup(h.http.Close)
	h.hc = &http.Client{
		Timeout:   15 * time.Second,
		Transport: &http.Transport{MaxIdleConnsPerHost: 128, DialContext: (&net.Dialer{Timeout: 5 * time.Second}).DialContext},
	}
	t.Cleanup(h.hc.CloseIdleConnections)
	return h
}

// handle is the protected handler: it counts the execution and answers
// 201 with a body that names the execution and its fencing token.
func (h *harness) handle(w http.ResponseWriter, r *http.Request) {
	key := r.Header.Get(idemhttp.HeaderKey)
	l, ok := idem.LeaseFromContext(r.Context())
	if !ok {
		h.t.Errorf("handler for %s ran without a lease", key)
	}
	body := fmt.Sprintf("charged %s token=%d", key, l.Token)
	h.ledger.mu.Lock()
	st := h.ledger.state(key)
	n := len(st.execs) + 1
	body += " exec=" + strconv.Itoa(n)
	if h.pad > 0 {
		body += " " + padding(key, n, h.pad)
	}
	st.execs = append(st.execs, execution{token: l.Token, body: body, at: time.Now()})
	h.ledger.mu.Unlock()
	if f := h.onExec.Load(); f != nil {
		(*f)(key, n)
	}
	w.Header().Set("Content-Type", "text/plain")
	w.WriteHeader(http.StatusCreated)
	io.WriteString(w, body)
}

// padding returns n bytes that zstd cannot shrink much, derived from the
// key and execution so that each execution's body differs.
func padding(key string, exec, n int) string {
	var b strings.Builder
	x := uint64(exec) * 0x9E3779B97F4A7C15
	for _, c := range key {
		x = (x ^ uint64(c)) * 0x100000001B3
	}
	const alphabet = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789+/"
	for range n {
		x ^= x << 13
		x ^= x >> 7
		x ^= x << 17
		b.WriteByte(alphabet[x%64])
	}
	return b.String()
}

// idemKey is the scoped key the middleware derives for a client key.
func idemKey(clientKey string) idem.Key {
	k, err := idem.Scope{Method: http.MethodPost, Route: route}.Key(clientKey)
	if err != nil {
		panic(err)
	}
	return k
}

// result is what a client got for one request.
type result struct {
	status   int // 0: no response (transport error)
	body     string
	replayed bool
}

func (r result) ok() bool { return r.status >= 200 && r.status < 300 }

// post sends the request for key (always the same body for a key) and
// records what came back.
func (h *harness) post(ctx context.Context, key string) result {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, h.http.URL+"/charges", strings.NewReader("amount=100&ref="+key))
	if err != nil {
		h.t.Fatal(err)
	}
	req.Header.Set(idemhttp.HeaderKey, key)
	req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	var res result
	resp, err := h.hc.Do(req)
	if err == nil {
		b, rerr := io.ReadAll(resp.Body)
		resp.Body.Close()
		if rerr == nil {
			res = result{status: resp.StatusCode, body: string(b), replayed: resp.Header.Get(idemhttp.HeaderReplayed) == "true"}
		}
		if resp.StatusCode == http.StatusServiceUnavailable && resp.Header.Get("Retry-After") == "" {
			h.t.Errorf("503 for %s without Retry-After", key)
		}
	}
	h.mu.Lock()
	h.requests++
	if !res.ok() {
		label := "transport"
		if res.status != 0 {
			label = strconv.Itoa(res.status)
		}
		if h.phase != "" {
			label += " " + h.phase
		}
		h.errs[label]++
	}
	h.mu.Unlock()
	if res.ok() {
		h.ledger.mu.Lock()
		st := h.ledger.state(key)
		st.acked = append(st.acked, res.body)
		h.ledger.mu.Unlock()
	}
	return res
}

func (h *harness) setPhase(p string) {
	h.mu.Lock()
	h.phase = p
	h.mu.Unlock()
}

// executions returns how many times the handler ran for key.
func (h *harness) executions(key string) int {
	h.ledger.mu.Lock()
	defer h.ledger.mu.Unlock()
	if st := h.ledger.keys[key]; st != nil {
		return len(st.execs)
	}
	return 0
}

// totalExecutions returns how many times the handler ran, over all keys.
func (h *harness) totalExecutions() int {
	h.ledger.mu.Lock()
	defer h.ledger.mu.Unlock()
	n := 0
	for _, st := range h.ledger.keys {
		n += len(st.execs)
	}
	return n
}

// errorCounts returns a copy of the client-visible errors.
func (h *harness) errorCounts() map[string]int {
	h.mu.Lock()
	defer h.mu.Unlock()
	m := make(map[string]int, len(h.errs))
	for k, v := range h.errs {
		m[k] = v
	}
	return m
}

func (h *harness) errorCount(label string) int {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.errs[label]
}

// parallel runs f(i) for i in [0, n) on at most workers goroutines.
func parallel(n, workers int, f func(i int)) {
	var wg sync.WaitGroup
	next := atomic.Int64{}
	for range min(n, workers) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				i := int(next.Add(1)) - 1
				if i >= n {
					return
				}
				f(i)
			}
		}()
	}
	wg.Wait()
}

// settle is run once the faults are gone: every key is retried until a
// request for it is answered with a replay, for at most a lease plus a
// grace (a key may be blocked until the lease of an attempt whose reply
// was lost ends: it answers 409 meanwhile). Its requests' errors are
// labelled "recovery".
func (h *harness) settle(keys []string) {
	h.setPhase("recovery")
	defer h.setPhase("")
	deadline := time.Now().Add(h.lease + grace)
	parallel(len(keys), 16, func(i int) {
		for {
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			res := h.post(ctx, keys[i])
			cancel()
			if res.ok() && res.replayed {
				return
			}
			if time.Now().After(deadline) {
				return
			}
			if !res.ok() {
				time.Sleep(50 * time.Millisecond)
			}
		}
	})
}

// tally is what check found.
type tally struct {
	keys                         int
	duplicates, unexplDups       int
	lost, unexplLost             int
	stuck                        int
	dupKeys, lostKeys, stuckKeys []string
}

// check compares, for every key, the executions, what clients got and the
// stored record. expectLoss, when set, names keys whose record may be gone
// for a reason outside idem (Redis restarted): their re-execution is
// counted as a duplicate and a lost completion but not as unexplained.
func (h *harness) check(expectLoss func(key string) bool) tally {
	h.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	h.ledger.mu.Lock()
	defer h.ledger.mu.Unlock()
	keys := make([]string, 0, len(h.ledger.keys))
	for k := range h.ledger.keys {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	var tl tally
	tl.keys = len(keys)
	for _, key := range keys {
		st := h.ledger.keys[key]
		k := idemKey(key)
		explained := func(token uint64) bool {
			if expectLoss != nil && expectLoss(key) {
				return true
			}
			err, called := h.store.completeResult(k, token)
			return !called || err != nil
		}
		// Duplicates: every execution but the first; unexplained when the
		// execution before it had been completed.
		if n := len(st.execs); n > 1 {
			tl.duplicates += n - 1
			tl.dupKeys = append(tl.dupKeys, key)
			for _, e := range st.execs[:n-1] {
				if !explained(e.token) {
					tl.unexplDups++
					h.t.Errorf("%s (%s): executed %d times although execution token=%d was completed", key, h.client, n, e.token)
				}
			}
		}
		rec, found, err := h.get(ctx, k)
		if err != nil {
			h.t.Errorf("Get %s: %v", key, err)
			continue
		}
		if !found || rec.State != idem.StateCompleted {
			tl.stuck++
			tl.stuckKeys = append(tl.stuckKeys, key)
			state := "absent"
			if found {
				state = rec.State.String()
			}
			h.t.Errorf("%s (%s): %s after the faults were removed and it was retried for lease + grace", key, h.client, state)
			continue
		}
		final := string(rec.Response.Body)
		if len(st.execs) == 0 || st.execs[len(st.execs)-1].body != final {
			h.t.Errorf("%s (%s): stored body %.60q is not the last execution's", key, h.client, final)
		}
		lostHere, unexpl := false, false
		for _, b := range st.acked {
			if b == final {
				continue
			}
			lostHere = true
			tok := uint64(0)
			for _, e := range st.execs {
				if e.body == b {
					tok = e.token
				}
			}
			if !explained(tok) {
				unexpl = true
				h.t.Errorf("%s (%s): a client got %.60q, whose execution was completed, but the key now replays %.60q", key, h.client, b, final)
			}
		}
		if lostHere {
			tl.lost++
			tl.lostKeys = append(tl.lostKeys, key)
		}
		if unexpl {
			tl.unexplLost++
		}
	}
	return tl
}

// get reads a record, asking again (up to 5 times) when the store fails:
// checks run on a loaded machine.
func (h *harness) get(ctx context.Context, k idem.Key) (rec idem.Record, found bool, err error) {
	for range 5 {
		if rec, found, err = h.store.Get(ctx, k); err == nil || ctx.Err() != nil {
			return
		}
	}
	return
}

// report writes the scenario's row.
func (h *harness) report(scenario, fault string, tl tally, notes string) {
	h.t.Helper()
	reltest.Report(h.t, reltest.Row{
		Scenario:     scenario,
		Store:        "redis (single, " + h.client + ")",
		Fault:        fault,
		Requests:     h.requests,
		Keys:         tl.keys,
		Duplicates:   tl.duplicates,
		Lost:         tl.lost,
		Stuck:        tl.stuck,
		ClientErrors: h.errorCounts(),
		Notes:        notes,
	})
}

// keyNames returns n fresh client keys.
func keyNames(prefix string, n int) []string {
	keys := make([]string, n)
	for i := range keys {
		keys[i] = fmt.Sprintf("%s-%04d", prefix, i)
	}
	return keys
}

// ctxTimeout is a request context bounded to d.
func ctxTimeout(d time.Duration) (context.Context, context.CancelFunc) {
	return context.WithTimeout(context.Background(), d)
}

// warm sends one request for each of n fresh keys, so that the clients'
// connections exist and the scripts are loaded before a fault is
// injected, and fails the test unless each is executed (a request that
// fails is sent again, up to 5 times).
func (h *harness) warm(n int) []string {
	h.t.Helper()
	keys := keyNames("warm", n)
	parallel(n, n, func(i int) {
		for attempt := 1; ; attempt++ {
			ctx, cancel := ctxTimeout(10 * time.Second)
			res := h.post(ctx, keys[i])
			cancel()
			if res.status == http.StatusCreated {
				return
			}
			if attempt == 5 || res.ok() {
				h.t.Errorf("warm-up %s: status %d replayed=%v %q", keys[i], res.status, res.replayed, res.body)
				return
			}
		}
	})
	return keys
}

// load sends requests for random keys from workers goroutines until stop
// is closed; each request is bounded to 5s.
func (h *harness) load(keys []string, workers int, stop <-chan struct{}) {
	var wg sync.WaitGroup
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r := rand.New(rand.NewPCG(uint64(w), uint64(time.Now().UnixNano())))
			for {
				select {
				case <-stop:
					return
				default:
				}
				ctx, cancel := ctxTimeout(5 * time.Second)
				h.post(ctx, keys[r.IntN(len(keys))])
				cancel()
				time.Sleep(time.Millisecond)
			}
		}()
	}
	wg.Wait()
}

// warmPool makes c open n connections: n concurrent BLPOPs on distinct
// empty lists each hold a connection for 100ms without blocking Redis (sent
// with Do: go-redis's BLPop rounds timeouts up to a second).
func warmPool(t testing.TB, c *redis.Client, n int) {
	t.Helper()
	parallel(n, n, func(i int) {
		ctx, cancel := ctxTimeout(5 * time.Second)
		defer cancel()
		if err := c.Do(ctx, "BLPOP", fmt.Sprintf("warm-pool-%d", i), "0.1").Err(); err != nil && !errors.Is(err, redis.Nil) {
			t.Errorf("warming the pool: %v", err)
		}
	})
	if st := c.PoolStats(); int(st.TotalConns) < n {
		t.Errorf("pool has %d connections after warming, want %d", st.TotalConns, n)
	}
}

// burst sends rounds of n concurrent Get calls through the store.
func (h *harness) burst(n, rounds int) {
	h.t.Helper()
	for range rounds {
		parallel(n, n, func(i int) {
			ctx, cancel := ctxTimeout(5 * time.Second)
			defer cancel()
			if _, _, err := h.store.Get(ctx, idemKey(fmt.Sprintf("burst-%d", i))); err != nil {
				h.t.Errorf("burst: %v", err)
			}
		})
	}
}
