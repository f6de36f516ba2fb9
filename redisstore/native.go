package redisstore

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/redis/rueidis"
)

// The native path: every transition of the scripts (scripts/*.lua) done
// with plain commands, for servers that have a compare-and-set (SET …
// IFEQ: Valkey ≥ 8.1, Redis ≥ 8.4), including servers without scripting.
// Same state machine, same record values (record.go), same replies: a
// store can switch paths with its records in place. The package
// documentation (doc.go) says how each transition stays atomic and what
// differs from the scripts; in short:
//
//   - every write that depends on the record is SET key new IFEQ <the
//     value read>, with the expiry the script would set (PXAT from the
//     server's TIME read with the value, or KEEPTTL); when the record
//     changed, the transition starts over from a new read;
//   - Acquire claims with SET NX GET PX, TIME in one pipeline (a
//     transaction on Cluster), and keeps the claim's token only when TIME
//     proves it is not below the server's clock at the claim; only when
//     the claim finds a record in flight or a replay do GET and PTTL
//     follow, in a transaction, a second round trip;
//   - Complete and Release of a lease this runner granted are one SET
//     IFEQ, as it remembers the lease's fingerprint.

// maxAhead bounds how far ahead of the server's clock a claim's token may
// be; a Complete or Release with a retention or lease of at most this takes
// the compare-and-set path with an absolute expiry (PXAT max(now+d,
// token+1)), so that every record still expires only after the clock has
// passed its token.
const maxAhead = 250 // ms

// claimLead is how far ahead of its estimate of the server's clock a claim
// puts its token, to cover the time the claim takes to reach the server.
const claimLead = 50 // ms

// shortClaim is the expiry, in ms, of the claim of a lease of at most
// 2*maxAhead, which the second step sets to the lease's.
const shortClaim = 2000

// maxCASAttempts bounds the read, compare-and-set rounds of one transition.
const maxCASAttempts = 16

// maxLeases bounds the leases a native runner remembers (for one-round-trip
// Complete and Release); when full it forgets them all and starts again.
const maxLeases = 1 << 16

// ErrContention is wrapped by the error of a transition on the native path
// whose compare-and-set lost to other writers of the key maxCASAttempts
// times in a row.
var ErrContention = errors.New("redisstore: the record changed under every compare-and-set attempt")

// nval is one command's reply, decoded the same way for both clients.
type nval struct {
	err  error // an error reply to this command (WRONGTYPE, ...)
	null bool
	n    int64
	b    []byte
	arr  []nval
}

// nconn sends commands for the native runner.
type nconn interface {
	// tx sends the commands inside MULTI/EXEC (all on key's slot) and
	// returns each command's reply.
	tx(ctx context.Context, cmds ...[]string) ([]nval, error)
	// pipe sends the commands in one pipeline to key's node: tx on a
	// cluster (the keyless TIME must reach the same node), plain
	// otherwise, where MULTI and EXEC would only cost server time.
	pipe(ctx context.Context, cmds ...[]string) ([]nval, error)
	// one sends one command.
	one(ctx context.Context, cmd ...string) (nval, error)
	// oneNode reports whether every key is on one node, reached through
	// one connection per pipeline: then pipe sends commands on several
	// keys, and a TIME after them, as one plain pipeline (a single node or
	// Sentinel's primary, not Cluster; not a go-redis Ring, which would
	// split it).
	oneNode() bool
}

// nativeRunner implements the runner interface with native commands.
type nativeRunner struct {
	c       nconn
	base    time.Time                   // local monotonic origin for the clock estimate
	clock   atomic.Pointer[clockSample] // the best clock sample; nil: none yet
	dedic   func(ctx context.Context, key string, f func(c nconn) error) error
	closeFn func()
	delFn   func(ctx context.Context, key string) (int64, error)

	mu     sync.Mutex
	leases map[[16]byte]leaseMemo
}

// leaseMemo is what Complete and Release need of a lease this runner
// granted to compare-and-set its record in one round trip.
type leaseMemo struct {
	key   string
	token uint64
	fp    [16]byte
}

func newNativeRunner(c nconn) *nativeRunner {
	return &nativeRunner{c: c, base: time.Now(), leases: map[[16]byte]leaseMemo{}}
}

// serverNowMs is the runner's estimate of the server's clock in ms: a
// lower bound, as long as the server's clock does not go back. Each TIME
// reply, taken at a local time after the server read its clock, gives a
// lower bound of the offset between the clocks; the estimate keeps the
// largest, less 1ms per second since (far more than any clock drift). 0:
// no estimate yet.
func (r *nativeRunner) serverNowMs() int64 {
	c := r.clock.Load()
	if c == nil {
		return 0
	}
	local := time.Since(r.base).Microseconds()
	return (local + c.at(local)) / 1000
}

// clockSample is one TIME reply: server µs − local µs, taken at local µs.
type clockSample struct{ off, local int64 }

// at is the sample's offset decayed to local µs.
func (c *clockSample) at(local int64) int64 { return c.off - (local-c.local)/1000 }

// observe updates the clock estimate with a TIME reply read just now.
func (r *nativeRunner) observe(serverUs int64) {
	local := time.Since(r.base).Microseconds()
	next := &clockSample{off: serverUs - local, local: local}
	for {
		old := r.clock.Load()
		if old != nil {
			cur := old.at(local)
			// Keep a better bound, unless the server's clock went back.
			if next.off <= cur && next.off >= cur-100_000 {
				return
			}
		}
		if r.clock.CompareAndSwap(old, next) {
			return
		}
	}
}

func (r *nativeRunner) remember(id string, m leaseMemo) {
	var k [16]byte
	copy(k[:], id)
	r.mu.Lock()
	if len(r.leases) >= maxLeases {
		clear(r.leases)
	}
	r.leases[k] = m
	r.mu.Unlock()
}

// granted reports whether this runner granted lease id on key with token.
func (r *nativeRunner) granted(id, key string, token int64) bool {
	var k [16]byte
	copy(k[:], id)
	r.mu.Lock()
	m, ok := r.leases[k]
	r.mu.Unlock()
	return ok && m.key == key && m.token == uint64(token)
}

// recall returns and forgets the memo of lease id.
func (r *nativeRunner) recall(id string) (leaseMemo, bool) {
	var k [16]byte
	copy(k[:], id)
	r.mu.Lock()
	m, ok := r.leases[k]
	delete(r.leases, k)
	r.mu.Unlock()
	return m, ok
}

// state is a record as read: its value (nil when absent), whether the key
// holds another type, its PTTL (when read), and the server's time in ms.
type state struct {
	v         []byte
	wrongType bool
	pttl      int64
	now       int64
}

// write is what a transition writes: val with expiry at (PXAT), or the
// expiry kept.
type write struct {
	val     []byte
	at      int64
	keepTTL bool
}

func (r *nativeRunner) del(ctx context.Context, key string) (int64, error) { return r.delFn(ctx, key) }

func (r *nativeRunner) close() { r.closeFn() }

func (r *nativeRunner) run(ctx context.Context, script int, key string, args ...string) (reply, error) {
	return r.runOn(ctx, r.c, script, key, args...)
}

func (r *nativeRunner) runOn(ctx context.Context, c nconn, script int, key string, args ...string) (reply, error) {
	switch script {
	case scriptAcquire:
		return r.acquire(ctx, c, key, args[0], args[1], args[2])
	case scriptGet:
		return r.get(ctx, c, key)
	case scriptComplete, scriptRelease:
		if cmd := r.fastCmd(script, key, args); cmd != nil {
			v, err := c.one(ctx, cmd...)
			if err != nil {
				return reply{}, err
			}
			if rep, ok, err := fastDone(v); ok || err != nil {
				return rep, err
			}
		}
	}
	step, withTTL, err := nativeStep(script, args)
	if err != nil {
		return reply{}, err
	}
	return r.rmw(ctx, c, key, step, withTTL)
}

func (r *nativeRunner) runWait(ctx context.Context, w waitSpec, script int, key string, args ...string) (reply, int64, error) {
	var (
		rep   reply
		acked int64
	)
	err := r.dedic(ctx, key, func(c nconn) error {
		var err error
		if rep, err = r.runOn(ctx, c, script, key, args...); err != nil || rep.n[0] != 1 {
			return err
		}
		v, err := c.one(ctx, "WAIT", strconv.FormatInt(w.replicas, 10), strconv.FormatInt(w.timeoutMs, 10))
		if err == nil {
			err = v.err
		}
		if err != nil {
			return fmt.Errorf("WAIT after the transition: %w", err)
		}
		acked = v.n
		return nil
	})
	return rep, acked, err
}

// read returns the record at key and the server's time, and with withTTL
// its PTTL, sent together in one pipeline (a transaction on Cluster, see
// pipe): not atomic on a single node, which the compare-and-set that
// follows makes up for, as it writes only when the value is still the one
// read. Only RaiseToken's decision uses the PTTL.
func (r *nativeRunner) read(ctx context.Context, c nconn, key string, withTTL bool) (state, error) {
	get, tm := []string{"GET", key}, []string{"TIME"}
	var (
		res []nval
		err error
	)
	if withTTL {
		res, err = c.pipe(ctx, get, []string{"PTTL", key}, tm)
	} else {
		res, err = c.pipe(ctx, get, tm)
	}
	if err != nil {
		return state{}, err
	}
	var st state
	if err := r.decodeState(res, withTTL, &st); err != nil {
		return state{}, err
	}
	return st, nil
}

// decodeState reads the replies to [GET or SET…GET, PTTL, TIME] into st,
// or to [GET or SET…GET, TIME] when not withTTL.
func (r *nativeRunner) decodeState(res []nval, withTTL bool, st *state) error {
	want := 2
	if withTTL {
		want = 3
	}
	if len(res) != want {
		return fmt.Errorf("unexpected reply of %d elements to a pipeline of %d commands", len(res), want)
	}
	if err := decodeValue(res[0], st); err != nil {
		return err
	}
	if withTTL {
		if res[1].err != nil {
			return res[1].err
		}
		st.pttl = res[1].n
	}
	us, err := timeMicros(res[want-1])
	if err != nil {
		return err
	}
	r.observe(us)
	st.now = us / 1000
	return nil
}

// decodeValue reads the reply to GET or SET…GET into st: the value, nil
// when absent; an error reply other than WRONGTYPE is returned.
func decodeValue(g nval, st *state) error {
	switch {
	case g.err != nil:
		if !strings.HasPrefix(g.err.Error(), "WRONGTYPE") {
			return g.err
		}
		st.wrongType = true
	case !g.null:
		st.v = g.b
	}
	return nil
}

// ttlOf returns the PTTL of the record at key if it still holds v, read
// with the value in one transaction; same is false when the key holds
// anything else now (or nothing): the caller claims again, as the TTL of
// another record would not be v's (a completed record's retention as an
// in-flight answer's RetryAfter, another lease's TTL as this one's).
func (r *nativeRunner) ttlOf(ctx context.Context, c nconn, key string, v []byte) (pttl int64, same bool, err error) {
	res, err := c.tx(ctx, []string{"GET", key}, []string{"PTTL", key})
	if err != nil {
		return 0, false, err
	}
	if len(res) != 2 {
		return 0, false, fmt.Errorf("unexpected reply of %d elements to a transaction of 2 commands", len(res))
	}
	if g := res[0]; g.err != nil || g.null || !bytes.Equal(g.b, v) {
		return 0, false, nil
	}
	if res[1].err != nil {
		return 0, false, res[1].err
	}
	return res[1].n, res[1].n != -2, nil
}

func timeMicros(v nval) (int64, error) {
	if v.err != nil {
		return 0, v.err
	}
	if len(v.arr) != 2 {
		return 0, errors.New("unexpected reply to TIME")
	}
	s, err1 := strconv.ParseInt(string(v.arr[0].b), 10, 64)
	us, err2 := strconv.ParseInt(string(v.arr[1].b), 10, 64)
	if err1 != nil || err2 != nil {
		return 0, errors.New("unexpected reply to TIME")
	}
	return s*1_000_000 + us, nil
}

// cas writes w at key if the record is still st's: SET IFEQ the value read
// (NX when absent). It reports whether it wrote.
func (r *nativeRunner) cas(ctx context.Context, c nconn, key string, st state, w write) (bool, error) {
	cmd := []string{"SET", key, string(w.val)}
	switch {
	case st.wrongType:
		// Only Fill writes over a value of another type, as fill.lua does;
		// there is nothing to compare it with.
	case st.v == nil:
		cmd = append(cmd, "NX")
	default:
		cmd = append(cmd, "IFEQ", string(st.v))
	}
	if w.keepTTL {
		cmd = append(cmd, "KEEPTTL")
	} else {
		cmd = append(cmd, "PXAT", strconv.FormatInt(w.at, 10))
	}
	v, err := c.one(ctx, cmd...)
	if err == nil {
		err = v.err
	}
	if err != nil {
		return false, err
	}
	return !v.null, nil
}

// rmw runs a transition as read, decide, compare-and-set, again when the
// record changed in between.
func (r *nativeRunner) rmw(ctx context.Context, c nconn, key string, step func(st state) (reply, *write), withTTL bool) (reply, error) {
	for range maxCASAttempts {
		st, err := r.read(ctx, c, key, withTTL)
		if err != nil {
			return reply{}, err
		}
		rep, w := step(st)
		if w == nil {
			return rep, nil
		}
		if ok, err := r.cas(ctx, c, key, st, *w); err != nil || ok {
			return rep, err
		}
	}
	return reply{}, fmt.Errorf("%w (%d attempts)", ErrContention, maxCASAttempts)
}

func (r *nativeRunner) get(ctx context.Context, c nconn, key string) (reply, error) {
	res, err := c.tx(ctx, []string{"GET", key}, []string{"PTTL", key})
	if err != nil {
		return reply{}, err
	}
	if len(res) != 2 {
		return reply{}, fmt.Errorf("unexpected reply of %d elements to a transaction of 2 commands", len(res))
	}
	g := res[0]
	switch {
	case g.err != nil && strings.HasPrefix(g.err.Error(), "WRONGTYPE"):
		g = nval{b: []byte{}} // reported as an undecodable value, as get.lua does
	case g.err != nil:
		return reply{}, g.err
	case g.null:
		return reply{}, nil
	}
	return reply{n: [3]int64{1, res[1].n, 0}, blob: g.b}, nil
}

// inFlight reports whether v is an in-flight record of lease id.
func inFlightOf(v []byte, id string) bool {
	return len(v) == inFlightLen && v[0] == 'F' && string(v[fpEnd:]) == id
}

func tokenOf(v []byte) int64 { return int64(unpackToken(v[1:tokenEnd])) }

func packTokenBytes(t int64) []byte { return []byte(packToken(uint64(t))) }

// acquire claims the key (see the comment at the top of the file).
func (r *nativeRunner) acquire(ctx context.Context, c nconn, key, id, fp, ttlArg string) (reply, error) {
	a, err := newAcq(key, id, fp, ttlArg)
	if err != nil {
		return reply{}, err
	}
	return r.claimLoop(ctx, c, &a, nil)
}

// acq is one Acquire on the native path: its arguments, and how far
// ahead its next claim's token goes.
type acq struct {
	key, id, fp string
	ttl         int64 // the lease's, in ms
	px          int64 // the claim's expiry, in ms
	short       bool  // a lease of at most 2*maxAhead
	lead        int64
}

func newAcq(key, id, fp, ttlArg string) (acq, error) {
	ttl, err := strconv.ParseInt(ttlArg, 10, 64)
	if err != nil || ttl <= 0 {
		return acq{}, fmt.Errorf("lease TTL %q is not a positive number of ms", ttlArg)
	}
	// A short lease is claimed for shortClaim first, so that it is still
	// there for the second step, which gives it its token and expiry.
	a := acq{key: key, id: id, fp: fp, ttl: ttl, px: ttl, short: ttl <= 2*maxAhead, lead: claimLead}
	if a.short {
		a.px = shortClaim
	}
	return a, nil
}

// claim is one claim of a key: the clock estimate it was made at, its
// token and value, and, once sent, what it found (st: the record, nil
// when the claim took the key, and the server's time read after it).
type claim struct {
	low, t0 int64
	val     []byte
	st      state
}

// nextClaim makes a's next claim: it returns the claim and its command,
// SET key claim NX GET PX px, to be followed by TIME.
func (r *nativeRunner) nextClaim(a *acq) (claim, []string) {
	low := r.serverNowMs() // at most the server's time at the claim
	t0 := low + a.lead
	a.lead = min(2*a.lead, maxAhead-20) // a claim that came too late leads more next time
	val := make([]byte, 0, inFlightLen)
	val = append(append(append(append(val, 'F'), packTokenBytes(t0)...), a.fp...), a.id...)
	return claim{low: low, t0: t0, val: val}, []string{"SET", a.key, string(val), "NX", "GET", "PX", strconv.FormatInt(a.px, 10)}
}

// claimLoop claims a's key until the acquire has its answer. first, when
// not nil, is a claim already sent and read (by a batch, native_batch.go):
// the loop decides on it as on its own first claim.
func (r *nativeRunner) claimLoop(ctx context.Context, c nconn, a *acq, first *claim) (reply, error) {
	for range maxCASAttempts {
		var cl claim
		if first != nil {
			cl, first = *first, nil
		} else {
			var cmd []string
			cl, cmd = r.nextClaim(a)
			res, err := c.pipe(ctx, cmd, []string{"TIME"})
			if err != nil {
				return reply{}, err
			}
			if err := r.decodeState(res, false, &cl.st); err != nil {
				return reply{}, err
			}
		}
		if rep, ok := r.settled(a, &cl); ok {
			return rep, nil
		}
		if rep, done, err := r.afterClaim(ctx, c, a, &cl); done || err != nil {
			return rep, err
		}
	}
	return reply{}, fmt.Errorf("%w (%d attempts)", ErrContention, maxCASAttempts)
}

// tokenHolds reports whether the token of a claim that took the key
// stands. TIME ran after the claim: t0 at least st.now is at least the
// time of the claim. The claim ran after low (a lower bound unless the
// server's clock went back: then t0 beyond st.now+maxAhead shows it), so
// a lease longer than 2*maxAhead expires after the clock has passed t0.
func (cl *claim) tokenHolds() bool {
	return cl.low > 0 && cl.t0 >= cl.st.now && cl.t0-cl.low <= maxAhead && cl.t0-cl.st.now <= maxAhead
}

// settled returns the acquire's answer when its claim gives it with no
// further command: a value of another type (not a record), or a free key
// taken by a lease longer than 2*maxAhead whose token stands. ok false:
// afterClaim goes on.
func (r *nativeRunner) settled(a *acq, cl *claim) (rep reply, ok bool) {
	switch {
	case cl.st.wrongType:
		return reply{}, true // not a record
	case cl.st.v == nil && !a.short && cl.tokenHolds():
		r.remember(a.id, leaseMemo{key: a.key, token: uint64(cl.t0), fp: [16]byte([]byte(a.fp))})
		return reply{n: [3]int64{1, cl.t0, a.ttl}}, true
	}
	return reply{}, false
}

// afterClaim goes on from a claim settled did not answer: done false when
// the acquire must claim again.
func (r *nativeRunner) afterClaim(ctx context.Context, c nconn, a *acq, cl *claim) (rep reply, done bool, err error) {
	st, key, id, fp, ttl := cl.st, a.key, a.id, a.fp, a.ttl
	// The fix: the token becomes the server's time at the claim, larger
	// than every token the key had, and the lease ends ttl after it.
	token, fix, left := st.now, write{at: st.now + ttl}, ttl
	switch {
	case st.v == nil: // claimed just now
		if cl.tokenHolds() {
			// A short lease (settled took the others) keeps its token;
			// the second step only sets its expiry.
			token, fix = cl.t0, write{at: max(st.now+ttl, cl.t0+1)}
		}
	case bytes.Equal(st.v, cl.val) && !r.granted(id, key, cl.t0):
		// Our own claim, sent again by the client library after a lost
		// reply: when it was made is unknown, so the token becomes the
		// time now, and the claim keeps its expiry (later than now, as it
		// is there). (A claim of the same bytes that this runner granted,
		// by an earlier Acquire of the same lease in the same
		// millisecond, is the lease it granted: below.)
		var same bool
		if st.pttl, same, err = r.ttlOf(ctx, c, key, st.v); err != nil {
			return reply{}, true, err
		}
		if !same {
			return reply{}, false, nil // changed since the claim: claim again
		}
		fix, left = write{keepTTL: true}, st.pttl
	default:
		// A record is there. Its TTL, which only the answers about a
		// record in flight or a replay need, takes a second round trip,
		// read with the value in one transaction: when the record is no
		// longer the one the claim found, the claim starts over.
		if withTTL(st.v, fp) {
			var same bool
			if st.pttl, same, err = r.ttlOf(ctx, c, key, st.v); err != nil {
				return reply{}, true, err
			}
			if !same {
				return reply{}, false, nil // changed since the claim: claim again
			}
		}
		rep, w := acquireStep(st, id, fp, ttl)
		if w == nil {
			return rep, true, nil
		}
		ok, err := r.cas(ctx, c, key, st, *w)
		if err != nil {
			return reply{}, true, err
		}
		if ok {
			if rep.n[1]-st.now <= maxAhead {
				r.remember(id, leaseMemo{key: key, token: uint64(rep.n[1]), fp: [16]byte([]byte(fp))})
			}
			return rep, true, nil
		}
		return reply{}, false, nil // the record changed: claim again
	}
	fix.val = append(append([]byte{'F'}, packTokenBytes(token)...), cl.val[tokenEnd:]...)
	ok, err := r.cas(ctx, c, key, state{v: cl.val}, fix)
	if err != nil {
		return reply{}, true, err
	}
	if ok {
		if token-st.now <= maxAhead {
			r.remember(id, leaseMemo{key: key, token: uint64(token), fp: [16]byte([]byte(fp))})
		}
		return reply{n: [3]int64{1, token, left}}, true, nil
	}
	return reply{}, false, nil // the claim expired before the fix: claim again
}

// withTTL reports whether acquireStep's answer about record v depends on
// its PTTL: in flight (also when the fingerprint differs, as an in-flight
// record without an expiry is corrupt), or completed with fingerprint fp.
func withTTL(v []byte, fp string) bool {
	switch n := len(v); {
	case n == 0:
		return false
	case v[0] == 'F' && n == inFlightLen:
		return true
	case v[0] == 'C' && n >= fpEnd:
		return string(v[tokenEnd:fpEnd]) == fp
	}
	return false
}

// acquireStep is acquire.lua on a record that is there, given its PTTL when
// withTTL says so.
func acquireStep(st state, id, fp string, ttl int64) (reply, *write) {
	v, n := st.v, len(st.v)
	switch {
	case n == 0: // an empty string: not a record
	case v[0] == 'F' && n == inFlightLen:
		held := tokenOf(v)
		switch {
		case st.pttl < 0:
			return reply{}, nil
		case string(v[fpEnd:]) == id:
			return reply{n: [3]int64{1, held, st.pttl}}, nil
		case string(v[tokenEnd:fpEnd]) != fp:
			return reply{n: [3]int64{4, held, 0}}, nil
		}
		return reply{n: [3]int64{3, held, st.pttl}}, nil
	case v[0] == 'C' && n >= fpEnd:
		done := tokenOf(v)
		if string(v[tokenEnd:fpEnd]) != fp {
			return reply{n: [3]int64{4, done, 0}}, nil
		}
		return reply{n: [3]int64{2, done, st.pttl}, blob: v}, nil
	case v[0] == 'R' && n == tokenEnd:
		token := max(tokenOf(v)+1, st.now)
		val := append(append(append([]byte{'F'}, packTokenBytes(token)...), fp...), id...)
		return reply{n: [3]int64{1, token, ttl}}, &write{val: val, at: max(st.now+ttl, token+1)}
	}
	return reply{}, nil
}

// fastCmd returns the one SET IFEQ that completes (scriptComplete) or
// releases (scriptRelease) a lease this runner granted, and forgets the
// lease. nil: the caller takes the read, compare-and-set path (a lease
// this runner did not grant or no longer remembers, a retention or keep
// of at most maxAhead, which needs an absolute expiry, or a Complete
// again).
func (r *nativeRunner) fastCmd(script int, key string, args []string) []string {
	if script == scriptComplete && len(args) > 4 && args[4] == "1" {
		return nil
	}
	id, token, px := args[0], args[1], args[2]
	m, found := r.recall(id)
	ms, _ := strconv.ParseInt(px, 10, 64)
	if !found || m.key != key || packToken(m.token) != token || ms <= maxAhead {
		return nil
	}
	held := "F" + token + string(m.fp[:]) + id
	if script == scriptComplete {
		return []string{"SET", key, "C" + token + string(m.fp[:]) + args[3], "IFEQ", held, "PX", px}
	}
	return []string{"SET", key, "R" + token, "IFEQ", held, "PX", px}
}

// fastDone reads the reply to fastCmd's command: ok false when the record
// was not the lease's (nil), and the caller takes the read,
// compare-and-set path.
func fastDone(v nval) (rep reply, ok bool, err error) {
	if v.err != nil || v.null {
		return reply{}, false, v.err
	}
	return reply{n: [3]int64{1}}, true, nil
}

// nativeStep returns the decision of a script other than acquire and get,
// given the record read, and whether it needs the record's PTTL.
func nativeStep(script int, args []string) (step func(st state) (reply, *write), withTTL bool, err error) {
	num := func(i int) (int64, error) {
		n, err := strconv.ParseInt(args[i], 10, 64)
		if err != nil {
			return 0, fmt.Errorf("argument %d %q is not a number", i+1, args[i])
		}
		return n, nil
	}
	switch script {
	case scriptRenew:
		id := args[0]
		ttl, err := num(1)
		if err != nil {
			return nil, false, err
		}
		return func(st state) (reply, *write) {
			if !inFlightOf(st.v, id) {
				return reply{}, nil
			}
			return reply{n: [3]int64{1}}, &write{val: st.v, at: max(st.now+ttl, tokenOf(st.v)+1)}
		}, false, nil
	case scriptHold:
		id := args[0]
		ttl, err := num(1)
		if err != nil {
			return nil, false, err
		}
		return func(st state) (reply, *write) {
			if !inFlightOf(st.v, id) {
				return reply{}, nil
			}
			token := tokenOf(st.v)
			at := max(st.now+ttl, token+1)
			return reply{n: [3]int64{1, token, at - st.now}, blob: st.v[tokenEnd:fpEnd]}, &write{val: st.v, at: at}
		}, false, nil
	case scriptRaise:
		id := args[0]
		floor, err := num(1)
		if err != nil {
			return nil, false, err
		}
		return func(st state) (reply, *write) {
			if !inFlightOf(st.v, id) {
				return reply{}, nil
			}
			if token := tokenOf(st.v); token > floor {
				return reply{n: [3]int64{1, token}}, nil
			}
			token := floor + 1
			val := append(append([]byte{'F'}, packTokenBytes(token)...), st.v[tokenEnd:]...)
			if st.pttl > 0 && token+1 <= st.now+st.pttl {
				// The usual case: the expiry already comes after the new
				// token. KEEPTTL keeps it as it is when the SET runs,
				// so that a Renew between the read and the SET (which
				// leaves the value as it was, so IFEQ still matches)
				// is not undone by the expiry read before it.
				return reply{n: [3]int64{1, token}}, &write{val: val, keepTTL: true}
			}
			return reply{n: [3]int64{1, token}}, &write{val: val, at: max(st.now+max(st.pttl, 1), token+1)}
		}, true, nil
	case scriptComplete:
		id, token, resp := args[0], args[1], args[3]
		ret, err := num(2)
		if err != nil {
			return nil, false, err
		}
		again := len(args) > 4 && args[4] == "1"
		return func(st state) (reply, *write) {
			v := st.v
			switch {
			case inFlightOf(v, id):
				val := append(append([]byte{'C'}, v[1:fpEnd]...), resp...)
				return reply{n: [3]int64{1}}, &write{val: val, at: max(st.now+ret, tokenOf(v)+1)}
			case len(v) >= fpEnd && v[0] == 'C' && string(v[1:tokenEnd]) == token && string(v[fpEnd:]) == resp:
				if again {
					return reply{n: [3]int64{1}}, &write{val: v, keepTTL: true}
				}
				return reply{n: [3]int64{1}}, nil
			}
			return reply{}, nil
		}, false, nil
	case scriptRelease:
		id, token := args[0], args[1]
		keep, err := num(2)
		if err != nil {
			return nil, false, err
		}
		return func(st state) (reply, *write) {
			v := st.v
			switch {
			case inFlightOf(v, id):
				return reply{n: [3]int64{1}}, &write{val: append([]byte{'R'}, v[1:tokenEnd]...), at: max(st.now+keep, tokenOf(v)+1)}
			case len(v) == tokenEnd && v[0] == 'R' && string(v[1:]) == token:
				return reply{n: [3]int64{1}}, nil
			}
			return reply{}, nil
		}, false, nil
	case scriptFill:
		tokenArg, fpArg, resp, lease := args[0], args[1], args[3], args[4]
		left, err := num(2)
		if err != nil {
			return nil, false, err
		}
		if len(tokenArg) != 6 {
			return nil, false, fmt.Errorf("token of %d bytes, want 6", len(tokenArg))
		}
		token := int64(unpackToken([]byte(tokenArg)))
		return func(st state) (reply, *write) {
			if left <= 0 {
				return reply{}, nil
			}
			fp, top := fpArg, token
			if v, n := st.v, len(st.v); n > 0 {
				known := (v[0] == 'F' && n == inFlightLen) || (v[0] == 'C' && n >= fpEnd) || (v[0] == 'R' && n == tokenEnd)
				if known {
					had := tokenOf(v)
					if v[0] == 'C' {
						switch {
						case had == token:
							return reply{n: [3]int64{2}}, nil
						case had > token:
							return reply{}, nil
						}
					}
					if fp == "" && v[0] == 'F' && string(v[fpEnd:]) == lease {
						fp = string(v[tokenEnd:fpEnd])
					}
					top = max(top, had)
				}
			}
			if len(fp) != 16 {
				return reply{n: [3]int64{3}}, nil
			}
			val := "C" + tokenArg + fp + resp
			return reply{n: [3]int64{1}}, &write{val: []byte(val), at: max(st.now+left, top+1)}
		}, false, nil
	}
	return nil, false, fmt.Errorf("redisstore: no native form of script %d", script)
}

// rueidis transport.

type rueidisDoer interface {
	B() rueidis.Builder
	Do(ctx context.Context, cmd rueidis.Completed) rueidis.RedisResult
	DoMulti(ctx context.Context, multi ...rueidis.Completed) []rueidis.RedisResult
}

type rueidisConn struct {
	c       rueidisDoer
	cluster bool
}

func (c rueidisConn) oneNode() bool { return !c.cluster }

func (c rueidisConn) build(cmd []string) rueidis.Completed {
	b := c.c.B().Arbitrary(cmd[0])
	switch cmd[0] {
	case "GET", "SET", "PTTL":
		return b.Keys(cmd[1]).Args(cmd[2:]...).Build().ToRetryable().Pin()
	}
	return b.Args(cmd[1:]...).Build().ToRetryable().Pin()
}

func (c rueidisConn) tx(ctx context.Context, cmds ...[]string) ([]nval, error) {
	multi := make(rueidis.Commands, 0, len(cmds)+2)
	multi = append(multi, c.c.B().Multi().Build().ToRetryable().Pin())
	for _, cmd := range cmds {
		multi = append(multi, c.build(cmd))
	}
	multi = append(multi, c.c.B().Exec().Build().ToRetryable().Pin())
	res := c.c.DoMulti(ctx, multi...)
	for _, r := range res[:len(res)-1] {
		if err := r.Error(); err != nil {
			return nil, err
		}
	}
	arr, err := res[len(res)-1].ToArray()
	if err != nil {
		return nil, err
	}
	out := make([]nval, len(arr))
	for i := range arr {
		out[i] = rueidisVal(&arr[i])
	}
	return out, nil
}

func (c rueidisConn) pipe(ctx context.Context, cmds ...[]string) ([]nval, error) {
	if c.cluster {
		return c.tx(ctx, cmds...)
	}
	multi := make(rueidis.Commands, len(cmds))
	for i, cmd := range cmds {
		multi[i] = c.build(cmd)
	}
	res := c.c.DoMulti(ctx, multi...)
	out := make([]nval, len(res))
	for i := range res {
		m, err := res[i].ToMessage()
		switch {
		case err == nil:
			out[i] = rueidisVal(&m)
		case rueidis.IsRedisNil(err):
			out[i] = nval{null: true}
		default:
			if _, ok := rueidis.IsRedisErr(err); !ok {
				return nil, err
			}
			out[i] = nval{err: err}
		}
	}
	return out, nil
}

func (c rueidisConn) one(ctx context.Context, cmd ...string) (nval, error) {
	res := c.c.Do(ctx, c.build(cmd))
	m, err := res.ToMessage()
	if err != nil {
		if rueidis.IsRedisNil(err) {
			return nval{null: true}, nil
		}
		if _, ok := rueidis.IsRedisErr(err); ok {
			return nval{err: err}, nil
		}
		return nval{}, err
	}
	return rueidisVal(&m), nil
}

// rueidisVal decodes a reply by its type. It asks the type first: the
// conversions that fail (AsInt64 of a string parses it, ToArray of a
// string formats an error with fmt) cost more than the reply's decoding,
// on every claim and completion.
func rueidisVal(m *rueidis.RedisMessage) nval {
	if err := m.Error(); err != nil {
		if rueidis.IsRedisNil(err) {
			return nval{null: true}
		}
		return nval{err: err}
	}
	switch {
	case m.IsInt64():
		n, _ := m.AsInt64()
		return nval{n: n}
	case m.IsMap():
		kv, _ := m.ToMap()
		out := nval{arr: make([]nval, 0, 2*len(kv))}
		for k, v := range kv {
			out.arr = append(out.arr, nval{b: []byte(k)}, rueidisVal(&v))
		}
		return out
	case m.IsArray():
		arr, _ := m.ToArray()
		out := nval{arr: make([]nval, len(arr))}
		for i := range arr {
			out.arr[i] = rueidisVal(&arr[i])
		}
		return out
	}
	b, _ := m.AsBytes()
	return nval{b: b}
}

func newRueidisNative(c rueidis.Client) *nativeRunner {
	r := newNativeRunner(rueidisConn{c: c, cluster: c.Mode() == rueidis.ClientModeCluster})
	r.closeFn = c.Close
	r.delFn = func(ctx context.Context, key string) (int64, error) {
		return c.Do(ctx, c.B().Del().Key(key).Build()).AsInt64()
	}
	r.dedic = func(ctx context.Context, key string, f func(nconn) error) error {
		// Dedicated picks the connection by the slot of the first command.
		return c.Dedicated(func(d rueidis.DedicatedClient) error {
			return f(rueidisConn{c: d})
		})
	}
	return r
}

// go-redis transport.

type goredisConn struct {
	c interface {
		TxPipelined(ctx context.Context, fn func(redis.Pipeliner) error) ([]redis.Cmder, error)
		Pipelined(ctx context.Context, fn func(redis.Pipeliner) error) ([]redis.Cmder, error)
		Do(ctx context.Context, args ...any) *redis.Cmd
	}
	cluster bool
	single  bool // a *redis.Client, or a connection
}

func (c goredisConn) oneNode() bool { return c.single }

func anyArgs(cmd []string) []any {
	out := make([]any, len(cmd))
	for i, a := range cmd {
		out[i] = a
	}
	return out
}

func (c goredisConn) tx(ctx context.Context, cmds ...[]string) ([]nval, error) {
	return c.send(ctx, c.c.TxPipelined, cmds)
}

func (c goredisConn) pipe(ctx context.Context, cmds ...[]string) ([]nval, error) {
	if c.cluster {
		return c.tx(ctx, cmds...)
	}
	return c.send(ctx, c.c.Pipelined, cmds)
}

func (c goredisConn) send(ctx context.Context, pipelined func(context.Context, func(redis.Pipeliner) error) ([]redis.Cmder, error), cmds [][]string) ([]nval, error) {
	res := make([]*redis.Cmd, len(cmds))
	_, err := pipelined(ctx, func(p redis.Pipeliner) error {
		for i, cmd := range cmds {
			res[i] = p.Do(ctx, anyArgs(cmd)...)
		}
		return nil
	})
	if err != nil && !errors.Is(err, redis.Nil) {
		var re redis.Error
		if !errors.As(err, &re) { // a command's error reply is in its result
			return nil, err
		}
	}
	out := make([]nval, len(cmds))
	for i, cmd := range res {
		out[i] = goredisVal(cmd.Val(), cmd.Err())
	}
	return out, nil
}

func (c goredisConn) one(ctx context.Context, cmd ...string) (nval, error) {
	res := c.c.Do(ctx, anyArgs(cmd)...)
	v, err := res.Result()
	if err != nil && !errors.Is(err, redis.Nil) {
		var re redis.Error
		if !errors.As(err, &re) {
			return nval{}, err
		}
	}
	return goredisVal(v, err), nil
}

func goredisVal(v any, err error) nval {
	if errors.Is(err, redis.Nil) {
		return nval{null: true}
	}
	if err != nil {
		return nval{err: err}
	}
	switch v := v.(type) {
	case nil:
		return nval{null: true}
	case int64:
		return nval{n: v}
	case string:
		return nval{b: []byte(v)}
	case map[any]any:
		out := nval{arr: make([]nval, 0, 2*len(v))}
		for k, e := range v {
			out.arr = append(out.arr, goredisVal(k, nil), goredisVal(e, nil))
		}
		return out
	case []any:
		out := nval{arr: make([]nval, len(v))}
		for i, e := range v {
			out.arr[i] = goredisVal(e, nil)
		}
		return out
	}
	return nval{err: fmt.Errorf("unexpected reply %v", v)}
}

func newGoredisNative(c redis.UniversalClient) *nativeRunner {
	_, cluster := c.(*redis.ClusterClient)
	_, single := c.(*redis.Client)
	r := newNativeRunner(goredisConn{c: c, cluster: cluster, single: single})
	r.closeFn = func() { c.Close() }
	r.delFn = func(ctx context.Context, key string) (int64, error) { return c.Del(ctx, key).Result() }
	r.dedic = func(ctx context.Context, key string, f func(nconn) error) error {
		node, ok := c.(*redis.Client)
		if cc, cluster := c.(*redis.ClusterClient); cluster {
			n, err := cc.MasterForKey(ctx, key)
			if err != nil {
				return err
			}
			node, ok = n, true
		}
		if !ok {
			return fmt.Errorf("WAIT needs a *redis.Client or *redis.ClusterClient, not %T", c)
		}
		conn := node.Conn()
		defer conn.Close()
		return f(goredisConn{c: conn, single: true})
	}
	return r
}
