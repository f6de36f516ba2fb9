package bench

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/redisstore"
	"github.com/idemkit/idem/seal"
)

// Impl is one implementation idem bench can put in front of the handler.
type Impl struct {
	Name string
	// Color is its color in the SVG charts ("#rrggbb"); empty: gray.
	Color string
	// OnlyB: a baseline without an idempotency layer, run in scenario b
	// only.
	OnlyB bool
	// Peer: another library's idempotency layer (internal/benchpeers),
	// which idem's targets are checked against.
	Peer bool
	// Extra: runs only when --impls names it (a variant measured on
	// purpose, such as idem-sealed), not by default.
	Extra bool
	// Build starts one instance: its own clients and in-process state,
	// against Redis at env.RedisURL, in front of env.App. With
	// --instances N it is called N times per run.
	Build func(ctx context.Context, env Env) (Server, error)
}

// Env is what an implementation is built with.
type Env struct {
	RedisURL string
	App      *App
	Logger   *slog.Logger
}

// Server is one instance of an implementation: Serve answers HTTP on ln
// until Close, which also closes the instance's clients.
type Server interface {
	Serve(ln net.Listener) error
	Close() error
}

// ImplNames returns the names of impls, in order.
func ImplNames(impls []Impl) []string {
	names := make([]string, len(impls))
	for i, im := range impls {
		names[i] = im.Name
	}
	return names
}

// Builtin returns the implementations of the idem command, in report
// order. "none" runs only in scenario b, as its baseline.
func Builtin() []Impl {
	var out []Impl
	for _, name := range []string{"none", "naive", "watch", "lua", "idem-rueidis", "idem-goredis", "idem-wait", "idem-409", "idem-sealed", "idem-v1off"} {
		out = append(out, Impl{Name: name, Color: implColors[name], OnlyB: name == "none", Extra: name == "idem-sealed" || name == "idem-v1off",
			Build: func(ctx context.Context, env Env) (Server, error) { return buildBuiltin(ctx, name, env) }})
	}
	return out
}

const (
	// PoolSize is the connection pool of every go-redis client in the
	// bench (the three baselines and idem-goredis), as in BENCHMARKS.md.
	PoolSize = 64
	// benchPendingTTL and Retention are the baselines' TTLs for PENDING
	// and COMPLETED records; idem gets the same retention (its lease is
	// its default 30s). Short, so that a run against a given Redis
	// (--redis) leaves nothing behind for long.
	benchPendingTTL = 5 * time.Minute
	Retention       = 10 * time.Minute
	// benchWait is idem-wait's idemhttp Config.Wait: a request whose key
	// is in flight waits for the result (woken as soon as it completes in
	// this process) up to this long, longer than idemhttp.DefaultWait
	// (idem-rueidis). idem-409 has no wait (Config.Wait negative, the
	// default before DefaultWait): 409 at once.
	benchWait = 2 * time.Second
	// watchAttempts bounds the WATCH/MULTI/EXEC retries after a conflict.
	watchAttempts = 5
)

// App is the one handler every implementation protects: a "payment" that
// counts its executions per Idempotency-Key, sleeps, and answers 201 with
// a small JSON body. Implementations on another HTTP stack than net/http
// serve the same through Exec, Sleep and Body.
type App struct {
	sleep time.Duration
	mu    sync.Mutex
	execs map[string]int
}

// NewApp returns the handler, sleeping for sleep per execution.
func NewApp(sleep time.Duration) *App {
	return &App{sleep: sleep, execs: map[string]int{}}
}

// Exec counts one execution for key and returns its number. The key is
// copied: on fasthttp (fiber, its net/http adaptor) header strings point
// into buffers reused after the request.
func (a *App) Exec(key string) int {
	a.mu.Lock()
	defer a.mu.Unlock()
	n := a.execs[key] + 1
	if n == 1 {
		key = strings.Clone(key)
	}
	a.execs[key] = n
	return n
}

// Sleep is the handler's work.
func (a *App) Sleep() time.Duration { return a.sleep }

// Body is the 201 answer's JSON body for execution n of key.
func Body(key string, n int) string {
	return fmt.Sprintf(`{"payment":%q,"execution":%d,"status":"captured"}`, key, n)
}

func (a *App) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	_, _ = io.Copy(io.Discard, r.Body)
	key := r.Header.Get(idemhttp.HeaderKey)
	n := a.Exec(key)
	if a.sleep > 0 {
		t := time.NewTimer(a.sleep)
		select {
		case <-t.C:
		case <-r.Context().Done():
			t.Stop()
		}
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(http.StatusCreated)
	io.WriteString(w, Body(key, n))
}

// Counts returns a copy of the executions per key.
func (a *App) Counts() map[string]int {
	a.mu.Lock()
	defer a.mu.Unlock()
	m := make(map[string]int, len(a.execs))
	for k, v := range a.execs {
		m[k] = v
	}
	return m
}

// httpServer serves a net/http handler.
type httpServer struct {
	srv     *http.Server
	closeFn func()
}

// NetHTTP returns a Server that serves h with net/http; Close also calls
// closeFn (nil: nothing), for the instance's clients.
func NetHTTP(h http.Handler, logger *slog.Logger, closeFn func()) Server {
	return &httpServer{srv: &http.Server{Handler: h, ReadHeaderTimeout: 10 * time.Second,
		ErrorLog: slog.NewLogLogger(logger.Handler(), slog.LevelWarn)}, closeFn: closeFn}
}

func (s *httpServer) Serve(ln net.Listener) error { return s.srv.Serve(ln) }

func (s *httpServer) Close() error {
	err := s.srv.Close()
	if s.closeFn != nil {
		s.closeFn()
	}
	return err
}

// buildBuiltin wraps env.App in the named built-in implementation.
func buildBuiltin(ctx context.Context, impl string, env Env) (Server, error) {
	app, logger := env.App, env.Logger
	switch impl {
	case "none":
		return NetHTTP(app, logger, nil), nil
	case "idem-rueidis", "idem-wait", "idem-409", "idem-sealed", "idem-v1off":
		cfg := idemhttp.Config{Retention: Retention, Logger: logger}
		switch impl {
		case "idem-wait":
			cfg.Wait = benchWait
		case "idem-409":
			cfg.Wait = -1
		case "idem-v1off":
			cfg.V1Scopes = -1 // no look-up of v1.0's keys: a store read less per first request
		case "idem-sealed":
			ring, err := benchRing()
			if err != nil {
				return nil, err
			}
			cfg.Seal = ring
		}
		st, err := redisstore.Open(env.RedisURL, redisstore.Options{})
		if err != nil {
			return nil, err
		}
		mw := idemhttp.Middleware(st, cfg)
		return NetHTTP(mw(app), logger, func() { st.Close() }), nil
	}
	rdb, err := NewGoredis(env.RedisURL)
	if err != nil {
		return nil, err
	}
	var h http.Handler
	switch impl {
	case "idem-goredis":
		st, err := redisstore.New(rdb, redisstore.Options{})
		if err != nil {
			rdb.Close()
			return nil, err
		}
		h = idemhttp.Middleware(st, idemhttp.Config{Retention: Retention, Logger: logger})(app)
	case "naive":
		h = &naiveLayer{rdb: rdb, next: app, logger: logger}
	case "watch":
		h = &watchLayer{rdb: rdb, next: app, logger: logger}
	case "lua":
		if err := luaAcquire.Load(ctx, rdb).Err(); err != nil {
			rdb.Close()
			return nil, fmt.Errorf("lua: SCRIPT LOAD: %w", err)
		}
		h = &luaLayer{rdb: rdb, next: app, logger: logger}
	default:
		rdb.Close()
		return nil, fmt.Errorf("unknown implementation %q", impl)
	}
	return NetHTTP(h, logger, func() { rdb.Close() }), nil
}

// benchRing returns idem-sealed's key ring: one fresh random AES-256 key,
// the primary, as an operator's --seal-keys file would hold it.
func benchRing() (*seal.Ring, error) {
	key := make([]byte, seal.KeySize)
	if _, err := rand.Read(key); err != nil {
		return nil, err
	}
	return seal.ParseRing("bench " + base64.StdEncoding.EncodeToString(key))
}

// NewGoredis returns a go-redis client for url with the bench's pool size.
func NewGoredis(url string) (*redis.Client, error) {
	o, err := redis.ParseURL(url)
	if err != nil {
		return nil, fmt.Errorf("--redis: %w", err)
	}
	o.PoolSize = PoolSize
	return redis.NewClient(o), nil
}

// The baselines store one JSON record per key, as the usual blog-post
// designs do.
const (
	statusPending   = "PENDING"
	statusCompleted = "COMPLETED"
)

type benchRecord struct {
	Status string `json:"status"`
	Code   int    `json:"code,omitempty"`
	Body   []byte `json:"body,omitempty"`
}

var pendingJSON, _ = json.Marshal(benchRecord{Status: statusPending})

// teeWriter passes the response through and keeps a copy of it.
type teeWriter struct {
	http.ResponseWriter
	code int
	body bytes.Buffer
}

func (t *teeWriter) WriteHeader(code int) {
	if t.code == 0 {
		t.code = code
	}
	t.ResponseWriter.WriteHeader(code)
}

func (t *teeWriter) Write(b []byte) (int, error) {
	if t.code == 0 {
		t.code = http.StatusOK
	}
	t.body.Write(b)
	return t.ResponseWriter.Write(b)
}

func (t *teeWriter) ok() bool { return t.code >= 200 && t.code < 300 }

func (t *teeWriter) record() []byte {
	b, _ := json.Marshal(benchRecord{Status: statusCompleted, Code: t.code, Body: t.body.Bytes()})
	return b
}

// answerRecord answers from a stored record: the response if COMPLETED,
// 409 if PENDING.
func answerRecord(w http.ResponseWriter, raw []byte) {
	var rec benchRecord
	if err := json.Unmarshal(raw, &rec); err != nil {
		http.Error(w, "corrupted idempotency record", http.StatusInternalServerError)
		return
	}
	switch rec.Status {
	case statusCompleted:
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set(idemhttp.HeaderReplayed, "true")
		w.WriteHeader(rec.Code)
		_, _ = w.Write(rec.Body)
	case statusPending:
		http.Error(w, "request processing in progress", http.StatusConflict)
	default:
		http.Error(w, "corrupted idempotency record", http.StatusInternalServerError)
	}
}

func redisKey(prefix string, r *http.Request) (string, bool) {
	k := r.Header.Get(idemhttp.HeaderKey)
	return prefix + k, k != ""
}

// finish stores a 2xx response as COMPLETED, or deletes the PENDING record
// so that a retry can run.
func finish(ctx context.Context, rdb *redis.Client, key string, t *teeWriter, logger *slog.Logger) {
	var err error
	if t.ok() {
		err = rdb.Set(ctx, key, t.record(), Retention).Err()
	} else {
		err = rdb.Del(ctx, key).Err()
	}
	if err != nil {
		logger.Warn("bench: storing the outcome failed", "key", key, "error", err)
	}
}

// naiveLayer is the textbook check-then-act: GET, and if absent run the
// handler and SET the response. Racy on purpose: two requests that GET
// before either SETs both run the handler.
type naiveLayer struct {
	rdb    *redis.Client
	next   http.Handler
	logger *slog.Logger
}

func (l *naiveLayer) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	key, ok := redisKey("naive:", r)
	if !ok {
		http.Error(w, "Idempotency-Key header is required", http.StatusBadRequest)
		return
	}
	ctx := r.Context()
	raw, err := l.rdb.Get(ctx, key).Bytes()
	switch {
	case err == nil:
		answerRecord(w, raw)
		return
	case !errors.Is(err, redis.Nil):
		http.Error(w, "failed to check idempotency key", http.StatusServiceUnavailable)
		return
	}
	t := &teeWriter{ResponseWriter: w}
	l.next.ServeHTTP(t, r)
	if t.ok() {
		if err := l.rdb.Set(context.WithoutCancel(ctx), key, t.record(), Retention).Err(); err != nil {
			l.logger.Warn("bench: naive SET failed", "key", key, "error", err)
		}
	}
}

// watchLayer is the textbook transaction version: WATCH the key, GET it, and
// if absent SET it PENDING inside MULTI/EXEC; a conflict (EXEC aborted
// because the key changed) retries the whole read-modify-write. COMPLETED
// replays, PENDING gets 409; after the handler a 2xx is stored as
// COMPLETED, anything else deletes the record.
type watchLayer struct {
	rdb    *redis.Client
	next   http.Handler
	logger *slog.Logger
}

func (l *watchLayer) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	key, ok := redisKey("watch:", r)
	if !ok {
		http.Error(w, "Idempotency-Key header is required", http.StatusBadRequest)
		return
	}
	ctx := r.Context()
	acquired, existing, err := l.acquire(ctx, key)
	if err != nil {
		http.Error(w, "idempotency check failed", http.StatusServiceUnavailable)
		return
	}
	if !acquired {
		answerRecord(w, existing)
		return
	}
	t := &teeWriter{ResponseWriter: w}
	l.next.ServeHTTP(t, r)
	finish(context.WithoutCancel(ctx), l.rdb, key, t, l.logger)
}

var errTxRetries = errors.New("WATCH/MULTI/EXEC: still conflicting after retries")

func (l *watchLayer) acquire(ctx context.Context, key string) (acquired bool, existing []byte, err error) {
	for range watchAttempts {
		existing = nil
		err := l.rdb.Watch(ctx, func(tx *redis.Tx) error {
			raw, err := tx.Get(ctx, key).Bytes()
			if err == nil {
				existing = raw
				return nil
			}
			if !errors.Is(err, redis.Nil) {
				return err
			}
			_, err = tx.TxPipelined(ctx, func(p redis.Pipeliner) error {
				p.Set(ctx, key, pendingJSON, benchPendingTTL)
				return nil
			})
			return err
		}, key)
		switch {
		case err == nil:
			return existing == nil, existing, nil
		case errors.Is(err, redis.TxFailedErr):
			continue // the key changed under us: read it again
		default:
			return false, nil, err
		}
	}
	return false, nil, errTxRetries
}

// luaAcquire is the textbook acquire script: return the record if there is
// one, else SET it PENDING with a TTL and return ACQUIRED. One EVALSHA.
var luaAcquire = redis.NewScript(`
local existing = redis.call('GET', KEYS[1])
if existing then
  return existing
end
redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2])
return 'ACQUIRED'
`)

// luaLayer is the textbook Lua version: the acquire script (EVALSHA), the
// handler, then SET COMPLETED with the longer TTL or DEL on failure.
type luaLayer struct {
	rdb    *redis.Client
	next   http.Handler
	logger *slog.Logger
}

func (l *luaLayer) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	key, ok := redisKey("lua:", r)
	if !ok {
		http.Error(w, "Idempotency-Key header is required", http.StatusBadRequest)
		return
	}
	ctx := r.Context()
	res, err := luaAcquire.Run(ctx, l.rdb, []string{key}, pendingJSON, int(benchPendingTTL/time.Second)).Text()
	if err != nil {
		http.Error(w, "idempotency check failed", http.StatusServiceUnavailable)
		return
	}
	if res != "ACQUIRED" {
		answerRecord(w, []byte(res))
		return
	}
	t := &teeWriter{ResponseWriter: w}
	l.next.ServeHTTP(t, r)
	finish(context.WithoutCancel(ctx), l.rdb, key, t, l.logger)
}
