package redisstore

import (
	"cmp"
	"context"
	"embed"
	"encoding/base64"
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	neturl "net/url"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/redis/rueidis"

	"github.com/idemkit/idem"
)

//go:embed scripts/*.lua
var scriptFS embed.FS

var scriptSources = func() (src [nScripts]string) {
	for i, name := range scriptFiles {
		b, err := scriptFS.ReadFile("scripts/" + name)
		if err != nil {
			panic(err) // embedded at build time
		}
		src[i] = string(b)
	}
	return src
}()

// openFlushDelay is the rueidis MaxFlushDelay that Open sets.
const openFlushDelay = 20 * time.Microsecond

// openRetryDelay lets the client Open creates resend a script (safe: the
// scripts tolerate it) at most three times, 10ms, 20ms and 40ms apart with
// jitter, instead of rueidis's default of retrying until the context ends.
func openRetryDelay(attempts int, _ rueidis.Completed, _ error) time.Duration {
	if attempts >= 3 {
		return -1
	}
	d := 10 * time.Millisecond << attempts
	return d/2 + rand.N(d/2)
}

// DefaultPrefix starts every key name unless Options.Prefix says otherwise.
const DefaultPrefix = "idem:"

// Options tunes a Store. The zero value means the defaults.
type Options struct {
	// Prefix starts every key name: a record lives at
	// Prefix + "{" + key + "}". Default "idem:". It must not contain '{'
	// or '}', so that the record's digest is its Redis Cluster hash tag.
	Prefix string

	// Timeout bounds each store call whose context has no earlier
	// deadline, so that a down or unreachable Redis fails the call (and
	// the request gets 503) instead of hanging: rueidis, for one, retries
	// a retryable script until its context ends by default. Negative means
	// no bound besides the caller's context. Default DefaultTimeout, for
	// the client Open creates as for one given to New or NewRueidis. (A
	// deadline per call cost no measurable throughput on the benchmark
	// machine: 10 allocations and about 770 bytes per acquire+complete
	// pair; BENCHMARKS.md.)
	Timeout time.Duration

	// WaitReplicas, when positive, makes Complete wait until at least this
	// many replicas of the key's primary have acknowledged the completed
	// record: the complete script and WAIT WaitReplicas WaitTimeout go
	// out together on one connection to that primary. When fewer
	// acknowledge within WaitTimeout, Complete returns an *idem.StoreError
	// matching ErrNotReplicated; the record stays written on the primary.
	// Acquire, Renew and Release never wait. Zero (the default) sends no
	// WAIT and costs nothing. See the package documentation for what it
	// buys and what it does not.
	WaitReplicas int

	// WaitTimeout bounds the wait for replicas (WAIT's timeout). Default
	// DefaultWaitTimeout (1s) when WaitReplicas is set. It should be
	// well under Timeout, which bounds the whole call, and must be under
	// a go-redis client's ReadTimeout.
	WaitTimeout time.Duration

	// CacheSize bounds the replay cache: completed records kept in this
	// process, which Redis keeps coherent (server-assisted client-side
	// caching), so that a replay costs no round trip. See the package
	// documentation for what it guarantees. Negative turns the cache off.
	//
	// With Open, it is the bytes each connection to a Redis node may keep
	// (rueidis's CacheSizeEachConn; Open uses up to four connections per
	// node, one per node of a cluster); 0 means DefaultCacheSize (16 MiB).
	// With NewRueidis, the client's own cache holds the records, bounded
	// by the client's CacheSizeEachConn; the store reads replays through
	// it unless CacheSize is negative (with a client built with
	// DisableCache, a replay then costs one GET instead of one script).
	// New (go-redis) has no cache and ignores it.
	CacheSize int

	// Path chooses Lua scripts or native commands (SET … IFEQ) for the
	// transitions: PathAuto (the default) asks the server on the first
	// call and takes native commands where SET has IFEQ (Valkey ≥ 8.1,
	// Redis ≥ 8.4), Lua elsewhere. PathLua and PathNative force a path, for
	// tests and operators. See the package documentation for what each
	// path guarantees.
	Path Path

	// AllowEviction lets the store open on a server whose
	// maxmemory-policy evicts keys (allkeys-*, volatile-*; the default of
	// managed Redis services is volatile-lru). Without it New, NewRueidis
	// and Open refuse such a server with an error wrapping
	// ErrEvictingPolicy: Redis evicts completed records like any other
	// key once it reaches maxmemory, and the retry of an evicted key runs
	// its work again. Set it only where a second run is harmless. A store
	// URL's allow_eviction=1 sets it for Open. Default false.
	AllowEviction bool

	// PolicyRecheck is how often the store reads maxmemory-policy again
	// after opening, since a failover (to a replica configured otherwise)
	// or a CONFIG SET can change it: at most this often, in the
	// background, on a store call. An evicting policy found then is logged
	// at WARN and counted (PolicyStats); the store keeps serving. Default
	// DefaultPolicyRecheck (1 minute); negative: never.
	PolicyRecheck time.Duration

	// NoStoreID keeps New, NewRueidis and Open from creating the store id
	// (see Namespace) when the database has none: for tools that create
	// nothing (idem inspect, purge and gc). Namespace then names no id,
	// and no blob carries it. Default false.
	NoStoreID bool

	// Logger receives the WARNs of the maxmemory-policy checks. Default
	// slog.Default().
	Logger *slog.Logger
}

// DefaultTimeout is Options.Timeout's default.
const DefaultTimeout = 3 * time.Second

// Store is an idem.Store on Redis: one string key per record, every
// transition one Lua script and one round trip on the Lua path, plain
// commands around SET … IFEQ on the native path (see the package doc's
// Paths), time from Redis TIME. It runs on a single node, with Sentinel,
// and on Redis Cluster.
type Store struct {
	r       runner
	prefix  string
	timeout time.Duration // 0: none
	owned   bool          // Close closes the client

	waitReplicas int           // Options.WaitReplicas; 0: no WAIT
	waitTimeout  time.Duration // Options.WaitTimeout

	cache *replayCache // nil: off (go-redis, or Options.CacheSize < 0); cache.go

	policy *policyWatch // maxmemory-policy checks; policy.go
	id     string       // the store id (Namespace); "" when none
	lazy   *lazyID      // set when the store was created while Redis did not answer; policy.go
}

var _ idem.Store = (*Store)(nil)

// New returns a Store over a go-redis client: *redis.Client, a Sentinel
// failover client, or *redis.ClusterClient. The client stays the caller's.
func New(c redis.UniversalClient, opts Options) (*Store, error) {
	if c == nil {
		return nil, errors.New("redisstore: New: nil client")
	}
	if err := waitOptions(&opts); err != nil {
		return nil, err
	}
	if opts.WaitReplicas > 0 {
		if err := checkGoredisWait(c, opts.WaitTimeout); err != nil {
			return nil, err
		}
	}
	r, err := newPathRunner(opts.Path, newGoredisRunner(c), newGoredisNative(c), probeWith(goredisConn{c: c}))
	if err != nil {
		return nil, err
	}
	s, err := newStore(r, opts, false)
	if err != nil {
		return nil, err
	}
	if err := s.opening(goredisPolicyNodes(c), goredisStoreID(c), opts); err != nil {
		return nil, err
	}
	return s, nil
}

// NewRueidis returns a Store over a rueidis client (single node, Sentinel
// or Cluster; rueidis pipelines concurrent calls automatically). The
// client stays the caller's.
func NewRueidis(c rueidis.Client, opts Options) (*Store, error) {
	if c == nil {
		return nil, errors.New("redisstore: NewRueidis: nil client")
	}
	r, err := newPathRunner(opts.Path, newRueidisRunner(c), newRueidisNative(c), probeWith(rueidisConn{c: c}))
	if err != nil {
		return nil, err
	}
	s, err := newStore(r, opts, false)
	if err != nil {
		return nil, err
	}
	if err := s.opening(rueidisPolicyNodes(c), rueidisStoreID(c), opts); err != nil {
		return nil, err
	}
	if opts.CacheSize >= 0 {
		s.cache = newReplayCache(c, opts.CacheSize)
	}
	return s, nil
}

// Open connects to Redis at url and returns a Store that owns the
// client; Close closes it. It uses rueidis, the faster of the two clients
// for idem's scripts, with a flush delay of 20µs so that concurrent calls
// share write system calls: on the benchmark machine that raised
// acquire+complete throughput by about a quarter and lowered p99
// (BENCHMARKS.md); an idle caller waits at most those 20µs more.
//
// The client has server-assisted client-side caching on, for the replay
// cache (Options.CacheSize; the package documentation says what it
// guarantees), unless Options.CacheSize is negative or the URL says
// client_cache=0. Where the server refuses it (no RESP3, before Redis 6;
// an ACL without CLIENT TRACKING), Open runs without it.
//
// Accepted forms:
//
//	redis://[user:pass@]host:port[/db]             single node
//	rediss://...                                   the same over TLS
//	redis://host:port?addr=host2:port2&addr=...    Redis Cluster (found by asking the nodes)
//	redis://host:port?master_set=NAME&addr=...     Sentinel: the addresses are sentinels
//	valkey://..., valkeys://...                    any of these forms: valkey is redis, valkeys rediss
//
// Anything else is an error wrapping ErrBadURL, before any connection is
// tried: a URL without a host (redis:host:port, with the // missing, would
// otherwise mean localhost:6379), an unknown scheme, or a query parameter
// other than addr, master_set, db, dial_timeout, write_timeout,
// skip_verify, protocol, client_cache, max_retries and client_name
// (rueidis.ParseURL's) and allow_eviction, or one without a value.
//
// allow_eviction=1 (or true) sets Options.AllowEviction: like New and
// NewRueidis, Open refuses a server whose maxmemory-policy evicts keys
// (ErrEvictingPolicy) without it.
// Errors never repeat the URL, which may hold a password.
func Open(url string, opts Options) (*Store, error) {
	if err := checkURL(url); err != nil {
		return nil, err
	}
	url, allow, err := cutAllowEviction(url)
	if err != nil {
		return nil, err
	}
	opts.AllowEviction = opts.AllowEviction || allow
	o, err := rueidis.ParseURL(url)
	if err != nil {
		return nil, fmt.Errorf("redisstore: Open: %w: %w", ErrBadURL, err)
	}
	// The replay cache reads through rueidis's client-side caching
	// (cache.go); a URL's client_cache=0 turns it off like CacheSize < 0.
	o.DisableCache = o.DisableCache || opts.CacheSize < 0
	o.CacheSizeEachConn = cmp.Or(max(opts.CacheSize, 0), DefaultCacheSize)
	o.MaxFlushDelay = openFlushDelay
	o.RetryDelay = openRetryDelay
	if o.ConnWriteTimeout == 0 {
		o.ConnWriteTimeout = DefaultTimeout // notice a silent server
	}
	c, err := rueidis.NewClient(o)
	if err != nil && !o.DisableCache && errors.Is(err, rueidis.ErrNoCache) {
		// A server without RESP3 (Redis < 6), or a user the ACL denies
		// CLIENT TRACKING: run without the cache.
		o.DisableCache = true
		c, err = rueidis.NewClient(o)
	}
	if err != nil {
		return nil, fmt.Errorf("redisstore: Open: %w", err)
	}
	r, err := newPathRunner(opts.Path, newRueidisRunner(c), newRueidisNative(c), probeWith(rueidisConn{c: c}))
	if err != nil {
		c.Close()
		return nil, err
	}
	s, err := newStore(r, opts, true)
	if err == nil {
		err = s.opening(rueidisPolicyNodes(c), rueidisStoreID(c), opts)
	}
	if err != nil {
		c.Close()
		return nil, err
	}
	if !o.DisableCache {
		s.cache = newReplayCache(c, o.CacheSizeEachConn)
	}
	return s, nil
}

// ErrBadURL is wrapped by Open's errors about the form of its URL.
var ErrBadURL = errors.New("not a Redis URL of a form Open accepts (redis://[user:pass@]host:port[/db], rediss://…, valkey://…, valkeys://…, ?addr=…, ?master_set=…)")

// urlParams are the query parameters Open understands (rueidis.ParseURL's).
var urlParams = map[string]bool{"addr": true, "master_set": true, "db": true, "dial_timeout": true, "write_timeout": true,
	"skip_verify": true, "protocol": true, "client_cache": true, "max_retries": true, "client_name": true,
	"allow_eviction": true}

// cutAllowEviction removes allow_eviction from a URL's query, which
// rueidis does not know, and reports its value.
func cutAllowEviction(raw string) (string, bool, error) {
	u, err := neturl.Parse(raw)
	if err != nil || !u.Query().Has("allow_eviction") {
		return raw, false, nil
	}
	q := u.Query()
	v := q.Get("allow_eviction")
	allow, err := strconv.ParseBool(v)
	if err != nil || len(q["allow_eviction"]) > 1 {
		return "", false, fmt.Errorf("redisstore: Open: %w: allow_eviction=%q: want 1 (or true) to allow an evicting maxmemory-policy, 0 (or false) to refuse it", ErrBadURL, v)
	}
	q.Del("allow_eviction")
	u.RawQuery = q.Encode()
	return u.String(), allow, nil
}

// checkURL rejects what rueidis.ParseURL would read loosely: a URL that
// does not parse, has no host, or carries a parameter it would ignore.
func checkURL(raw string) error {
	bad := func(why string) error { return fmt.Errorf("redisstore: Open: %w: %s", ErrBadURL, why) }
	u, err := neturl.Parse(raw)
	if err != nil {
		return bad("it does not parse as a URL (not shown: it may hold a password)")
	}
	switch u.Scheme {
	case "redis", "rediss", "valkey", "valkeys":
	case "unix":
		return nil
	default:
		return bad(fmt.Sprintf("unknown scheme %q", u.Scheme))
	}
	if u.Opaque != "" || u.Host == "" {
		return bad(fmt.Sprintf("no host: write %s://host:port (is the // after %s: missing?)", u.Scheme, u.Scheme))
	}
	if u.Fragment != "" {
		return bad("a #fragment means nothing here")
	}
	for name, values := range u.Query() {
		if !urlParams[name] {
			return bad(fmt.Sprintf("unknown query parameter %q", name))
		}
		if slices.Contains(values, "") {
			return bad(fmt.Sprintf("query parameter %q without a value", name))
		}
	}
	return nil
}

func newStore(r runner, opts Options, owned bool) (*Store, error) {
	if opts.Prefix == "" {
		opts.Prefix = DefaultPrefix
	}
	if strings.ContainsAny(opts.Prefix, "{}") {
		return nil, fmt.Errorf("redisstore: Options.Prefix %q contains '{' or '}'", opts.Prefix)
	}
	if err := waitOptions(&opts); err != nil {
		return nil, err
	}
	switch {
	case opts.Timeout == 0:
		opts.Timeout = DefaultTimeout
	case opts.Timeout < 0:
		opts.Timeout = 0
	}
	if opts.WaitReplicas > 0 && opts.Timeout > 0 && opts.WaitTimeout >= opts.Timeout {
		return nil, fmt.Errorf("redisstore: Options.WaitTimeout %v is not shorter than Options.Timeout %v", opts.WaitTimeout, opts.Timeout)
	}
	return &Store{r: r, prefix: opts.Prefix, timeout: opts.Timeout, owned: owned,
		waitReplicas: opts.WaitReplicas, waitTimeout: opts.WaitTimeout}, nil
}

// Close closes the client if Open created it; otherwise the client is the
// caller's and Close does nothing.
func (s *Store) Close() error {
	if s.owned {
		s.r.close()
	}
	return nil
}

// Namespace implements idem.Namespacer: the key prefix and the store id,
// as in redis prefix "idem:" store 3f0c…. The store id is 32 random hex
// digits kept in the database itself, at Prefix + "store-id" (a key
// without expiry), created by the first store that opens on it. So two
// stores have one Namespace exactly when they read the same records: the
// same prefix in the same database of the same server (or of its
// replicas, which copy the id), whatever address reaches it. Another
// database, another server, or a database flushed since (FLUSHDB removes
// the id with the records) has another. The names of the blobs of large
// responses (idem.NewBlobName) carry its digest, so that a sweep
// (blobstore.Sweep, idem gc) judges only its own records' blobs.
//
// v1.0's Namespace was the prefix alone (LegacyNamespace), the same for
// every database: the blobs it named are left alone by sweeps.
func (s *Store) Namespace() string {
	id := s.storeID()
	if id == "" {
		// Redis did not answer yet, or Options.NoStoreID on a database no
		// store wrote to: v1.0's namespace, which no sweep judges
		// (blobstore.SweepResult.NoStoreID), neither the blobs named with
		// it nor, through a store that has it, anyone else's.
		return s.LegacyNamespace()
	}
	return fmt.Sprintf("redis prefix %q store %s", s.prefix, id)
}

// LegacyNamespace is the Namespace of v1.0, the key prefix alone, as in
// redis prefix "idem:": the blobs written by v1.0 carry its digest. It
// cannot tell two databases or servers apart, so a sweep leaves those
// blobs alone (blobstore.Sweep); their replays read them as before.
func (s *Store) LegacyNamespace() string { return fmt.Sprintf("redis prefix %q", s.prefix) }

// KeyName returns the Redis key that holds k's record.
func (s *Store) KeyName(k idem.Key) string {
	var b [22]byte // k.String(), without a string of its own
	base64.RawURLEncoding.Encode(b[:], k[:])
	return s.prefix + "{" + string(b[:]) + "}"
}

// Acquire implements idem.Store.
func (s *Store) Acquire(ctx context.Context, req idem.AcquireRequest) (idem.Acquisition, error) {
	if err := req.Validate(); err != nil {
		return idem.Acquisition{}, err
	}
	if s.cache != nil {
		return s.acquireCached(ctx, req)
	}
	return s.acquire(ctx, req, s.KeyName(req.Key), cacheMark{})
}

// acquire runs the acquire script; name is req.Key's KeyName. m is the
// replay cache's mark, taken before the call, for its hint.
func (s *Store) acquire(ctx context.Context, req idem.AcquireRequest, name string, m cacheMark) (idem.Acquisition, error) {
	r, err := s.runName(ctx, "acquire", req.Key, name, scriptAcquire,
		string(req.LeaseID[:]), string(req.Fingerprint[:]), strconv.FormatInt(req.TTL.Milliseconds(), 10))
	if err != nil {
		return idem.Acquisition{}, err
	}
	token, left := uint64(r.n[1]), msDuration(r.n[2])
	switch r.n[0] {
	case 1:
		return idem.Acquisition{Outcome: idem.Acquired, Lease: idem.Lease{Key: req.Key, ID: req.LeaseID, Token: token, TTL: left}}, nil
	case 2:
		rec, err := decodeRecord(r.blob)
		if err != nil {
			return idem.Acquisition{}, &idem.StoreError{Op: "acquire", Key: req.Key, Err: err}
		}
		s.cache.completed(name, m, left)
		return idem.Acquisition{Outcome: idem.Replay, Response: rec.Response}, nil
	case 3:
		return idem.Acquisition{Outcome: idem.InFlight, RetryAfter: left}, nil
	case 4:
		return idem.Acquisition{Outcome: idem.Mismatch}, nil
	}
	return idem.Acquisition{}, &idem.StoreError{Op: "acquire", Key: req.Key, Err: fmt.Errorf("%w: the value at %s is not a record", idem.ErrCorrupt, name)}
}

// Renew implements idem.Store.
func (s *Store) Renew(ctx context.Context, l idem.Lease, ttl time.Duration) error {
	ms, err := millis("lease TTL", ttl)
	if err != nil {
		return err
	}
	r, err := s.run(ctx, "renew", l.Key, scriptRenew, string(l.ID[:]), strconv.FormatInt(ms, 10))
	return leaseResult(r, err)
}

// Complete implements idem.Store.
func (s *Store) Complete(ctx context.Context, l idem.Lease, resp *idem.Response, retention time.Duration) error {
	ms, err := millis("retention", retention)
	if err != nil {
		return err
	}
	blob, err := resp.AppendBinary(nil)
	if err != nil {
		return &idem.StoreError{Op: "complete", Key: l.Key, Err: err}
	}
	args := []string{string(l.ID[:]), packToken(l.Token), strconv.FormatInt(ms, 10), string(blob)}
	name := s.KeyName(l.Key)
	mark := s.cache.mark(name)
	if s.waitReplicas > 0 {
		err = s.completeWait(ctx, l.Key, append(args, "1")...)
	} else {
		r, runErr := s.runName(ctx, "complete", l.Key, name, scriptComplete, args...)
		err = leaseResult(r, runErr)
	}
	if err == nil {
		s.cache.completed(name, mark, msDuration(ms))
	}
	return err
}

// Release implements idem.Store. The released record is kept for the
// lease's TTL so that the next token is larger.
func (s *Store) Release(ctx context.Context, l idem.Lease) error {
	ms := max(l.TTL.Milliseconds(), 1)
	r, err := s.run(ctx, "release", l.Key, scriptRelease, string(l.ID[:]), packToken(l.Token), strconv.FormatInt(ms, 10))
	return leaseResult(r, err)
}

// Get implements idem.Store.
func (s *Store) Get(ctx context.Context, key idem.Key) (idem.Record, bool, error) {
	r, err := s.run(ctx, "get", key, scriptGet)
	if err != nil || r.n[0] == 0 {
		return idem.Record{}, false, err
	}
	rec, err := decodeRecord(r.blob)
	if err != nil {
		return idem.Record{}, false, &idem.StoreError{Op: "get", Key: key, Err: err}
	}
	rec.TTL = msDuration(r.n[1])
	return rec, true, nil
}

// Delete implements idem.Store.
func (s *Store) Delete(ctx context.Context, key idem.Key) (bool, error) {
	if err := ctx.Err(); err != nil {
		return false, &idem.StoreError{Op: "delete", Key: key, Err: err}
	}
	ctx, cancel := s.bound(ctx)
	defer cancel()
	s.policy.tick()
	s.cache.forget(s.KeyName(key))
	n, err := s.r.del(ctx, s.KeyName(key))
	// and any hint a call in flight set, and void those still to come
	// (cache.go: the invalidation may arrive after the reply).
	s.cache.forget(s.KeyName(key))
	if err != nil {
		return false, &idem.StoreError{Op: "delete", Key: key, Err: err}
	}
	return n > 0, nil
}

func (s *Store) run(ctx context.Context, op string, key idem.Key, script int, args ...string) (reply, error) {
	return s.runName(ctx, op, key, s.KeyName(key), script, args...)
}

// runName is run with key's KeyName, name, made by the caller.
func (s *Store) runName(ctx context.Context, op string, key idem.Key, name string, script int, args ...string) (reply, error) {
	if err := ctx.Err(); err != nil { // send nothing for a cancelled call
		return reply{}, &idem.StoreError{Op: op, Key: key, Err: err}
	}
	ctx, cancel := s.bound(ctx)
	defer cancel()
	s.policy.tick()
	r, err := s.r.run(ctx, script, name, args...)
	if err != nil {
		return reply{}, &idem.StoreError{Op: op, Key: key, Err: s.explainACL(err)}
	}
	return r, nil
}

// explainACL adds to a Redis permission error what the store needs. The
// error is kept (errors.Is and As still reach it). Redis reports a missing
// key pattern or script command as NOPERM, but a command missing inside a
// script (Redis 7.0) only as "The user executing the script can't run this
// command", without naming it (found by reliability/hostile).
func (s *Store) explainACL(err error) error {
	if !permissionError(err) {
		return err
	}
	return fmt.Errorf("%w (the Redis user needs the keys ~%s* and the commands +evalsha +eval +get +set +time +pttl +pexpireat +del on the Lua path; +multi +exec +get +set +time +pttl +del +command|docs on the native path; "+
		"and for the replay cache +client|tracking +client|caching +multi +exec; at open, +config|get or +info to read maxmemory-policy)", err, s.prefix)
}

// permissionError reports whether err is a Redis error reply refusing a
// command or key to the store's user, from either client.
func permissionError(err error) bool {
	if redis.IsPermissionError(err) {
		return true
	}
	var msg string
	var goredisErr redis.Error
	var rueidisErr *rueidis.RedisError
	switch {
	case errors.As(err, &rueidisErr):
		msg = rueidisErr.Error()
	case errors.As(err, &goredisErr):
		msg = goredisErr.Error()
	default:
		return false // not a reply from Redis
	}
	// A script's refused command has no NOPERM prefix on Redis 7.0.
	return strings.HasPrefix(msg, "NOPERM") || strings.Contains(msg, "can't run this command")
}

// bound applies Options.Timeout unless ctx ends sooner.
func (s *Store) bound(ctx context.Context) (context.Context, context.CancelFunc) {
	if s.timeout == 0 {
		return ctx, func() {}
	}
	if dl, ok := ctx.Deadline(); ok && time.Until(dl) <= s.timeout {
		return ctx, func() {}
	}
	return context.WithTimeout(ctx, s.timeout)
}

// leaseResult maps the {1}/{0} reply of renew, complete and release.
func leaseResult(r reply, err error) error {
	switch {
	case err != nil:
		return err
	case r.n[0] == 1:
		return nil
	}
	return idem.ErrLeaseLost
}

func millis(what string, d time.Duration) (int64, error) {
	if d < time.Millisecond {
		return 0, fmt.Errorf("redisstore: %s %v is shorter than 1ms", what, d)
	}
	return d.Milliseconds(), nil
}

func msDuration(ms int64) time.Duration {
	return time.Duration(max(ms, 0)) * time.Millisecond
}

// packToken writes a token the way the scripts store it: 6 bytes, big-endian.
func packToken(t uint64) string {
	var b [8]byte
	binary.BigEndian.PutUint64(b[:], t)
	return string(b[2:])
}
