package redisstore

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/redis/rueidis"
)

// ErrEvictingPolicy is wrapped by the error of New, NewRueidis and Open
// on a server whose maxmemory-policy evicts keys (allkeys-*, volatile-*),
// unless Options.AllowEviction is set. Redis evicts a completed record
// like any other key: the retry of an evicted key finds no record and runs
// the work again, the one thing idem exists to prevent.
var ErrEvictingPolicy = errors.New("it evicts keys, so a retry of an evicted completed record runs its work again")

// DefaultPolicyRecheck is Options.PolicyRecheck's default.
const DefaultPolicyRecheck = time.Minute

// storeIDSuffix follows the prefix in the name of the key that holds the
// store id (Namespace). Record keys follow the prefix with '{', so it
// never names a record.
const storeIDSuffix = "store-id"

// evicting reports whether a maxmemory-policy value evicts keys: anything
// but noeviction (allkeys-lru, volatile-lru, volatile-ttl, ...).
func evicting(policy string) bool { return policy != "noeviction" }

// PolicyStats is what the store knows of its servers' maxmemory-policy
// (Store.PolicyStats): read when it opened, and again at most every
// Options.PolicyRecheck, since a failover or an operator can change it.
type PolicyStats struct {
	// Policy is the last policy read: the first evicting one when the
	// nodes differ, "" when none could be read.
	Policy string
	// Evicting is true when the last check found a node with an evicting
	// policy.
	Evicting bool
	// Unknown is true when the last check could read no node's policy
	// (CONFIG GET and INFO both refused).
	Unknown bool
	// Checks counts the checks, EvictingChecks those that found an
	// evicting policy and UnknownChecks those that could read none.
	Checks, EvictingChecks, UnknownChecks uint64
	// Allowed is Options.AllowEviction.
	Allowed bool
}

// policyWatch keeps PolicyStats and runs the rechecks.
type policyWatch struct {
	nodes   func(ctx context.Context) ([]policyNode, error)
	every   time.Duration // 0: no recheck
	timeout time.Duration
	allowed bool
	log     *slog.Logger

	next    atomic.Int64 // unix nanoseconds of the next recheck
	running atomic.Bool

	mu    sync.Mutex
	stats PolicyStats
}

// policyNode reads one node's policy.
type policyNode struct {
	addr string
	// config is CONFIG GET maxmemory-policy, info INFO memory.
	config func(ctx context.Context) (string, error)
	info   func(ctx context.Context) (string, error)
}

// policyOf reads a node's maxmemory-policy: CONFIG GET, and INFO memory's
// maxmemory_policy where CONFIG is refused (managed services rename or
// deny it).
func (n policyNode) policyOf(ctx context.Context) (string, error) {
	p, err := n.config(ctx)
	if err == nil && p != "" {
		return p, nil
	}
	if err != nil && !isReplyError(err) {
		return "", err // not reachable: INFO will not answer either
	}
	info, ierr := n.info(ctx)
	if ierr != nil {
		return "", fmt.Errorf("CONFIG GET maxmemory-policy: %v; INFO memory: %w", err, ierr)
	}
	for line := range strings.Lines(info) {
		if v, ok := strings.CutPrefix(strings.TrimSpace(line), "maxmemory_policy:"); ok {
			return v, nil
		}
	}
	return "", fmt.Errorf("CONFIG GET maxmemory-policy: %v; INFO memory has no maxmemory_policy", err)
}

// check reads every node's policy and records the result. It returns the
// evicting node's address and policy, if any, and whether no node
// answered (with the last error).
func (w *policyWatch) check(ctx context.Context) (addr, policy string, unknown bool, err error) {
	ctx, cancel := context.WithTimeout(ctx, w.timeout)
	defer cancel()
	nodes, err := w.nodes(ctx)
	read := 0
	seen := ""
	for _, n := range nodes {
		p, perr := n.policyOf(ctx)
		if perr != nil {
			err = fmt.Errorf("%s: %w", n.addr, perr)
			continue
		}
		read++
		seen = p
		if evicting(p) && policy == "" {
			addr, policy = n.addr, p
		}
	}
	unknown = read == 0
	w.mu.Lock()
	defer w.mu.Unlock()
	w.stats.Checks++
	switch {
	case policy != "":
		w.stats.Policy, w.stats.Evicting, w.stats.Unknown = policy, true, false
		w.stats.EvictingChecks++
	case unknown:
		w.stats.Policy, w.stats.Evicting, w.stats.Unknown = "", false, true
		w.stats.UnknownChecks++
	default:
		w.stats.Policy, w.stats.Evicting, w.stats.Unknown = seen, false, false
	}
	return addr, policy, unknown, err
}

// open is the check when the store opens: an evicting policy is an error
// unless allowed; a policy that cannot be read is a WARN.
func (w *policyWatch) open(ctx context.Context) error {
	addr, policy, unknown, err := w.check(ctx)
	w.next.Store(time.Now().Add(w.every).UnixNano())
	switch {
	case policy != "" && !w.allowed:
		return fmt.Errorf("redisstore: Redis at %s has maxmemory-policy %s: %w; set noeviction (CONFIG SET maxmemory-policy noeviction), "+
			"or allow eviction knowingly: Options.AllowEviction, or allow_eviction=1 in the store URL (idem proxy --store, Caddy's store)",
			addr, policy, ErrEvictingPolicy)
	case policy != "":
		w.log.Warn("redisstore: eviction allowed (Options.AllowEviction, allow_eviction=1): a retry of an evicted completed record runs its work again",
			slog.String("addr", addr), slog.String("maxmemory_policy", policy))
	case unknown && err != nil && !isReplyError(err):
		return &unreachableError{err} // the server did not answer
	case unknown:
		w.log.Warn("redisstore: could not read maxmemory-policy (CONFIG GET and INFO memory refused); make sure it is noeviction: an evicting policy runs the work of evicted records again",
			slog.Any("error", err))
	}
	return nil
}

// tick starts a recheck in the background when one is due; store calls
// call it. It costs a clock read and an atomic load otherwise.
func (w *policyWatch) tick() {
	if w == nil || w.every <= 0 {
		return
	}
	now := time.Now().UnixNano()
	if now < w.next.Load() || !w.running.CompareAndSwap(false, true) {
		return
	}
	w.next.Store(now + int64(w.every))
	go func() {
		defer w.running.Store(false)
		addr, policy, unknown, err := w.check(context.Background())
		switch {
		case policy != "" && !w.allowed:
			w.log.Warn("redisstore: Redis now has an evicting maxmemory-policy (after a failover or a CONFIG SET?): a retry of an evicted completed record runs its work again; set it to noeviction",
				slog.String("addr", addr), slog.String("maxmemory_policy", policy))
		case unknown:
			w.log.Warn("redisstore: could not read maxmemory-policy again", slog.Any("error", err))
		}
	}()
}

func (w *policyWatch) snapshot() PolicyStats {
	if w == nil {
		return PolicyStats{}
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	s := w.stats
	s.Allowed = w.allowed
	return s
}

// PolicyStats reports what the store knows of its servers'
// maxmemory-policy. The proxy exports it as metrics.
func (s *Store) PolicyStats() PolicyStats { return s.policy.snapshot() }

// goredisPolicyNodes lists the nodes of a go-redis client: each primary of
// a cluster, the client itself otherwise (a Sentinel client talks to the
// current primary).
func goredisPolicyNodes(c redis.UniversalClient) func(ctx context.Context) ([]policyNode, error) {
	node := func(addr string, c redis.Cmdable) policyNode {
		return policyNode{addr: addr,
			config: func(ctx context.Context) (string, error) {
				m, err := c.ConfigGet(ctx, "maxmemory-policy").Result()
				return m["maxmemory-policy"], err
			},
			info: func(ctx context.Context) (string, error) { return c.Info(ctx, "memory").Result() },
		}
	}
	return func(ctx context.Context) ([]policyNode, error) {
		switch cc := c.(type) {
		case *redis.ClusterClient:
			var mu sync.Mutex
			var out []policyNode
			err := cc.ForEachMaster(ctx, func(_ context.Context, m *redis.Client) error {
				mu.Lock()
				defer mu.Unlock()
				out = append(out, node(m.Options().Addr, m))
				return nil
			})
			slices.SortFunc(out, func(a, b policyNode) int { return strings.Compare(a.addr, b.addr) })
			return out, err
		case *redis.Client:
			return []policyNode{node(cc.Options().Addr, cc)}, nil
		}
		return []policyNode{node("the server", c)}, nil
	}
}

// rueidisPolicyNodes lists the nodes of a rueidis client (every node of a
// cluster it knows, the current primary behind Sentinel).
func rueidisPolicyNodes(c rueidis.Client) func(ctx context.Context) ([]policyNode, error) {
	return func(ctx context.Context) ([]policyNode, error) {
		var out []policyNode
		for addr, n := range c.Nodes() {
			out = append(out, policyNode{addr: addr,
				config: func(ctx context.Context) (string, error) {
					m, err := n.Do(ctx, n.B().ConfigGet().Parameter("maxmemory-policy").Build()).AsStrMap()
					return m["maxmemory-policy"], err
				},
				info: func(ctx context.Context) (string, error) {
					return n.Do(ctx, n.B().Info().Section("memory").Build()).ToString()
				},
			})
		}
		slices.SortFunc(out, func(a, b policyNode) int { return strings.Compare(a.addr, b.addr) })
		return out, nil
	}
}

// storeID reads the id kept at key, creating it unless create is false
// ("" then when there is none).
type idFunc func(ctx context.Context, key string, create bool) (string, error)

func newStoreID() string {
	var b [16]byte
	rand.Read(b[:]) // never fails (crypto/rand)
	return hex.EncodeToString(b[:])
}

func goredisStoreID(c redis.UniversalClient) idFunc {
	return func(ctx context.Context, key string, create bool) (string, error) {
		if create {
			err := c.SetArgs(ctx, key, newStoreID(), redis.SetArgs{Mode: "NX"}).Err()
			if err != nil && !errors.Is(err, redis.Nil) {
				return "", err
			}
		}
		id, err := c.Get(ctx, key).Result()
		if errors.Is(err, redis.Nil) {
			return "", nil
		}
		return id, err
	}
}

func rueidisStoreID(c rueidis.Client) idFunc {
	return func(ctx context.Context, key string, create bool) (string, error) {
		if create {
			err := c.Do(ctx, c.B().Set().Key(key).Value(newStoreID()).Nx().Build()).Error()
			if err != nil && !rueidis.IsRedisNil(err) {
				return "", err
			}
		}
		id, err := c.Do(ctx, c.B().Get().Key(key).Build()).ToString()
		if rueidis.IsRedisNil(err) {
			return "", nil
		}
		return id, err
	}
}

// opening is what New, NewRueidis and Open do on the server once the
// store is built: check the maxmemory-policy and read (or create) the
// store id.
func (s *Store) opening(nodes func(ctx context.Context) ([]policyNode, error), id idFunc, opts Options) error {
	every := opts.PolicyRecheck
	switch {
	case every == 0:
		every = DefaultPolicyRecheck
	case every < 0:
		every = 0
	}
	timeout := s.timeout
	if timeout == 0 {
		timeout = DefaultTimeout
	}
	log := opts.Logger
	if log == nil {
		log = slog.Default()
	}
	s.policy = &policyWatch{nodes: nodes, every: every, timeout: timeout, allowed: opts.AllowEviction, log: log}
	err := s.policy.open(context.Background())
	var down *unreachableError
	if errors.As(err, &down) && !s.owned {
		// New and NewRueidis never needed the server in v1.0 (a process
		// may start before Redis): check at the first store call instead,
		// in the background (a WARN), and read the id when asked.
		log.Warn("redisstore: Redis did not answer when the store was created; maxmemory-policy is checked at the first store calls", slog.Any("error", down.err))
		s.policy.next.Store(0)
		s.lazy = &lazyID{fn: func() (string, error) {
			ctx, cancel := context.WithTimeout(context.Background(), timeout)
			defer cancel()
			return id(ctx, s.prefix+storeIDSuffix, !opts.NoStoreID)
		}}
		return nil
	}
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	v, err := id(ctx, s.prefix+storeIDSuffix, !opts.NoStoreID)
	if err != nil {
		return fmt.Errorf("redisstore: reading the store id at %s%s: %w", s.prefix, storeIDSuffix, s.explainACL(err))
	}
	s.id = v
	return nil
}

// unreachableError is policyWatch.open's error when no node answered.
type unreachableError struct{ err error }

func (e *unreachableError) Error() string {
	return "redisstore: reading maxmemory-policy: " + e.err.Error()
}
func (e *unreachableError) Unwrap() error { return e.err }

// storeID returns the store id, reading it now if the store was created
// while Redis did not answer; "" while it cannot be read.
func (s *Store) storeID() string {
	if s.lazy == nil {
		return s.id
	}
	s.lazy.mu.Lock()
	defer s.lazy.mu.Unlock()
	if s.lazy.id == "" {
		if v, err := s.lazy.fn(); err == nil && v != "" {
			s.lazy.id = v
		}
	}
	return s.lazy.id
}

// lazyID is the store id read on first use.
type lazyID struct {
	mu sync.Mutex
	id string
	fn func() (string, error)
}
