package clients

import (
	"bytes"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/internal/proctest"
	"github.com/idemkit/idem/internal/redistest"
	"github.com/idemkit/idem/memstore"
	"github.com/idemkit/idem/redisstore"
)

// Timings of the counting upstream.
const (
	workTime  = time.Second            // /pay and /stream: a payment provider's time to create a payment
	flakyWork = 100 * time.Millisecond // /flaky once it succeeds
)

// upstream is the counting service behind idem: a payment provider that
// acts as soon as a request reaches it and then takes its time to answer,
// whatever its client does meanwhile (so a client that leaves does not
// undo the payment). Counts are per Idempotency-Key, which idem proxy and
// the middleware's handler forward.
//
//   - POST /pay: one effect, then workTime, then 201 with a JSON body that
//     names the effect (a re-execution has another body).
//   - POST /stream: one effect, 201 and the first half of the body at once,
//     workTime later the second half.
//   - POST /flaky: the first request of a key answers 503 at once without
//     an effect; later ones are /pay with flakyWork.
type upstream struct {
	srv *httptest.Server
	seq atomic.Int64

	mu   sync.Mutex
	keys map[string]*ledger
}

// ledger is what the upstream did for one key.
type ledger struct {
	calls   int      // requests that reached the handler
	effects []string // the 201 body of each effect, in order
	running int      // handlers still running
	// via is the X-Idem-Instance header of each call: the idem proxy a
	// load balancer sent it to (HAProxy's http-send-name-header).
	via []string
}

func startUpstream(t *testing.T) *upstream {
	u := &upstream{keys: map[string]*ledger{}}
	mux := http.NewServeMux()
	mux.HandleFunc("POST /pay", func(w http.ResponseWriter, r *http.Request) {
		u.call(r)
		defer u.done(r)
		u.pay(w, r, workTime)
	})
	mux.HandleFunc("POST /stream", func(w http.ResponseWriter, r *http.Request) {
		u.call(r)
		defer u.done(r)
		u.stream(w, r)
	})
	mux.HandleFunc("POST /flaky", func(w http.ResponseWriter, r *http.Request) {
		n := u.call(r)
		defer u.done(r)
		if n == 1 {
			http.Error(w, "provider overloaded, nothing done", http.StatusServiceUnavailable)
			return
		}
		u.pay(w, r, flakyWork)
	})
	u.srv = httptest.NewUnstartedServer(mux)
	u.srv.Config.ErrorLog = slog.NewLogLogger(slog.DiscardHandler, slog.LevelError)
	u.srv.Start()
	t.Cleanup(u.srv.Close)
	return u
}

// call counts a request of r's key and returns how many reached the
// handler so far; done must follow.
func (u *upstream) call(r *http.Request) int {
	u.mu.Lock()
	defer u.mu.Unlock()
	l := u.ledger(r.Header.Get(idemhttp.HeaderKey))
	l.calls++
	l.running++
	l.via = append(l.via, r.Header.Get(headerInstance))
	return l.calls
}

func (u *upstream) done(r *http.Request) {
	u.mu.Lock()
	defer u.mu.Unlock()
	u.ledger(r.Header.Get(idemhttp.HeaderKey)).running--
}

// effect records an effect of r's key and returns its body.
func (u *upstream) effect(r *http.Request, reqBody []byte, pad int) string {
	key := r.Header.Get(idemhttp.HeaderKey)
	body := fmt.Sprintf(`{"id":"pay_%d_%s","key":%q,"request":%s,"pad":%q}`,
		u.seq.Add(1), randomHex(6), key, reqBody, strings.Repeat("x", pad))
	u.mu.Lock()
	defer u.mu.Unlock()
	l := u.ledger(key)
	l.effects = append(l.effects, body)
	return body
}

func (u *upstream) ledger(key string) *ledger {
	l := u.keys[key]
	if l == nil {
		l = &ledger{}
		u.keys[key] = l
	}
	return l
}

// snapshot returns a copy of key's ledger.
func (u *upstream) snapshot(key string) ledger {
	u.mu.Lock()
	defer u.mu.Unlock()
	l := *u.ledger(key)
	l.effects = append([]string(nil), l.effects...)
	l.via = append([]string(nil), l.via...)
	return l
}

func (u *upstream) pay(w http.ResponseWriter, r *http.Request, work time.Duration) {
	reqBody, _ := io.ReadAll(r.Body)
	body := u.effect(r, reqBody, 0)
	time.Sleep(work) // the payment is made; the answer takes its time
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Content-Length", fmt.Sprint(len(body)))
	w.WriteHeader(http.StatusCreated)
	io.WriteString(w, body)
}

func (u *upstream) stream(w http.ResponseWriter, r *http.Request) {
	reqBody, _ := io.ReadAll(r.Body)
	body := u.effect(r, reqBody, 4096)
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(http.StatusCreated)
	half := len(body) / 2
	io.WriteString(w, body[:half])
	http.NewResponseController(w).Flush()
	time.Sleep(workTime)
	io.WriteString(w, body[half:]) // fails when the reader is gone: the effect stands
}

// target is one system under test: a base URL that clients send to, and
// how to tell, for a key, what it did.
type target struct {
	name  string // "idem proxy", "middleware" or "Caddy"
	store string // "memory" or "redis (single)", for the report
	short string // for keys: "proxy-mem", ...
	url   string
	// proxies are the `idem proxy` processes behind url (two behind nginx);
	// nil for the middleware and Caddy.
	proxies []*proctest.Proxy
	// caddies are the Caddy processes (idem-caddy, the idempotency
	// handler in front of reverse_proxy) behind url; nil for the others.
	caddies []*proctest.Caddy
	mw      *mwServer // nil for a proxy
}

// startProxyTarget runs `idem proxy` in front of up on store ("memory" or
// a redis:// URL).
func startProxyTarget(t *testing.T, up *upstream, store string) *target {
	tg := &target{name: "idem proxy", store: "memory", short: "proxy-mem"}
	args := []string{"--upstream", up.srv.URL, "--store", store}
	if store != "memory" {
		tg.store, tg.short = "redis (single)", "proxy-redis"
		args = append(args, "--prefix", redistest.Prefix("clients"))
	}
	p := proctest.StartProxy(t, args...)
	tg.url, tg.proxies = "http://"+p.Addr, []*proctest.Proxy{p}
	return tg
}

// caddyfile is the Caddyfile of a Caddy target: one site on addr (for
// every Host: nginx sends its upstream block's name), its
// access log as JSON on stderr (where the test reads each request's
// idempotency_outcome), and the idempotency handler on store in front of
// reverse_proxy to upstream, with no order line (the directive is ordered
// before reverse_proxy).
func caddyfile(addr, upstream, store, prefix string) string {
	host, port, _ := net.SplitHostPort(addr)
	prefixLine := ""
	if prefix != "" {
		prefixLine = "\t\tprefix " + prefix + "\n"
	}
	return fmt.Sprintf(`{
	admin off
	auto_https off
	persist_config off
	log {
		output stderr
		format json
		level WARN
	}
}
http://:%s {
	bind %s
	log {
		output stderr
		format json
	}
	reverse_proxy %s
	idempotency {
		store %s
%s	}
}
`, port, host, strings.TrimPrefix(upstream, "http://"), store, prefixLine)
}

// startCaddyTarget runs Caddy with idem (idem-caddy) in front of up on
// store ("memory" or a redis:// URL).
func startCaddyTarget(t *testing.T, up *upstream, store string) *target {
	tg := &target{name: "Caddy", store: "memory", short: "caddy-mem"}
	prefix := ""
	if store != "memory" {
		tg.store, tg.short, prefix = "redis (single)", "caddy-redis", redistest.Prefix("clients")
	}
	c := proctest.StartCaddy(t, func(addr string) string { return caddyfile(addr, up.srv.URL, store, prefix) })
	tg.url, tg.caddies = "http://"+c.Addr, []*proctest.Caddy{c}
	return tg
}

// mwServer is an API server in this process whose POST handlers sit behind
// idemhttp.Middleware and call the upstream (the payment provider) the way
// idiomatic Go code does: with r.Context(), forwarding the key, streaming
// the provider's answer back (502 when the call fails).
type mwServer struct {
	srv      *httptest.Server
	provider string
	client   *http.Client

	mu        sync.Mutex
	outcomes  map[string][]string // middleware outcomes per client key
	cancelled map[string]int      // handlers whose context was cancelled while they ran
}

func startMiddlewareTarget(t *testing.T, up *upstream, redis bool) *target {
	tg := &target{name: "middleware", store: "memory", short: "mw-mem"}
	var store idem.Store = memstore.New(memstore.Options{})
	if redis {
		s := redistest.Store(t, rdb, redisstore.Options{})
		store, tg.store, tg.short = s, "redis (single)", "mw-redis"
	}
	m := &mwServer{
		provider:  up.srv.URL,
		client:    &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{MaxIdleConnsPerHost: 64}},
		outcomes:  map[string][]string{},
		cancelled: map[string]int{},
	}
	t.Cleanup(m.client.CloseIdleConnections)
	mux := http.NewServeMux()
	mux.HandleFunc("POST /{op}", m.handle)
	mw := idemhttp.Middleware(store, idemhttp.Config{
		Logger: slog.New(slog.DiscardHandler),
		OnOutcome: func(r *http.Request, o idemhttp.Outcome) {
			m.mu.Lock()
			defer m.mu.Unlock()
			k := r.Header.Get(idemhttp.HeaderKey)
			m.outcomes[k] = append(m.outcomes[k], string(o))
		},
	})
	m.srv = httptest.NewUnstartedServer(mw(mux))
	m.srv.Config.ErrorLog = slog.NewLogLogger(slog.DiscardHandler, slog.LevelError)
	m.srv.Start()
	t.Cleanup(m.srv.Close)
	tg.url, tg.mw = m.srv.URL, m
	return tg
}

// handle creates a payment at the provider with the request's context.
func (m *mwServer) handle(w http.ResponseWriter, r *http.Request) {
	key := r.Header.Get(idemhttp.HeaderKey)
	defer func() {
		if r.Context().Err() != nil {
			m.mu.Lock()
			m.cancelled[key]++
			m.mu.Unlock()
		}
	}()
	body, err := io.ReadAll(r.Body)
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	req, err := http.NewRequestWithContext(r.Context(), http.MethodPost, m.provider+"/"+r.PathValue("op"), bytes.NewReader(body))
	if err != nil {
		http.Error(w, err.Error(), http.StatusInternalServerError)
		return
	}
	req.Header.Set("Content-Type", r.Header.Get("Content-Type"))
	req.Header.Set(idemhttp.HeaderKey, key)
	resp, err := m.client.Do(req)
	if err != nil {
		http.Error(w, "payment provider: "+err.Error(), http.StatusBadGateway)
		return
	}
	defer resp.Body.Close()
	w.Header().Set("Content-Type", resp.Header.Get("Content-Type"))
	w.WriteHeader(resp.StatusCode)
	rc := http.NewResponseController(w)
	buf := make([]byte, 4096)
	for {
		n, err := resp.Body.Read(buf)
		if n > 0 {
			w.Write(buf[:n])
			rc.Flush()
		}
		if err != nil {
			return // io.EOF, or the provider's answer was cut: nothing more to send
		}
	}
}

// outcomesOf returns what the middleware did with the requests of key, or
// what the proxies behind the target logged for it.
func (tg *target) outcomesOf(key, path string) []string {
	if tg.mw != nil {
		tg.mw.mu.Lock()
		defer tg.mw.mu.Unlock()
		return append([]string(nil), tg.mw.outcomes[key]...)
	}
	// The proxy logs the stored key: no Authorization, so no tenant; the
	// route is the path.
	k, err := idem.Scope{Method: http.MethodPost, Route: path}.Key(key)
	if err != nil {
		return []string{"bad key: " + err.Error()}
	}
	var out []string
	for _, p := range tg.proxies {
		out = append(out, outcomes(p.LogText(), k.String())...)
	}
	for _, c := range tg.caddies {
		out = append(out, caddyOutcomes(c.LogText(), k.String())...)
	}
	return out
}

// cancelledHandlers is how many handlers of key saw their context
// cancelled (the middleware only).
func (tg *target) cancelledHandlers(key string) int {
	if tg.mw == nil {
		return 0
	}
	tg.mw.mu.Lock()
	defer tg.mw.mu.Unlock()
	return tg.mw.cancelled[key]
}

// env is one test's systems: the counting upstream and the six targets
// in front of it (idem proxy, the middleware and Caddy, each on memory and
// on the private Redis).
type env struct {
	up      *upstream
	targets []*target
}

func newEnv(t *testing.T) *env {
	t.Helper()
	up := startUpstream(t)
	return &env{up: up, targets: []*target{
		startProxyTarget(t, up, "memory"),
		startProxyTarget(t, up, "redis://"+rdb.Addr()),
		startMiddlewareTarget(t, up, false),
		startMiddlewareTarget(t, up, true),
		startCaddyTarget(t, up, "memory"),
		startCaddyTarget(t, up, "redis://"+rdb.Addr()),
	}}
}
