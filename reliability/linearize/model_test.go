package linearize

import (
	"encoding/base64"
	"fmt"
	"hash/fnv"
	"net/http"
	"slices"
	"strings"
	"time"

	"github.com/anishathalye/porcupine"

	"github.com/idemkit/idem"
)

// The sequential specification of one key's record, as store.go, doc.go and
// SPEC.md §1 state it:
//
//	absent ──Acquire──▶ in_flight(lease id, token, fingerprint)
//	in_flight ──Complete(lease)──▶ completed(response, token, fingerprint)
//	in_flight ──Release(lease)───▶ released(token)  (absent to Acquire)
//	in_flight ──Renew(lease)─────▶ in_flight        (lease extended)
//	in_flight, lease expired ──Acquire──▶ in_flight(new lease, larger token)
//
//   - Acquire on absent or released: Acquired, with a token larger than every
//     token the key had before (floor). On in_flight with the same lease id:
//     Acquired with the same token (a repeat). Otherwise Mismatch when the
//     fingerprint differs, else InFlight (in_flight) or Replay with the
//     stored response byte for byte (completed).
//   - Complete(lease): ok on in_flight with that lease id, and again (a
//     repeat) on completed with the lease's token and the same response;
//     with the lease's token and another response, ok or LeaseLost (the
//     Redis store answers LeaseLost: see idem.Store's Complete), no change;
//     else LeaseLost, no change.
//   - Release(lease): ok on in_flight with that lease id, and again on
//     released with the lease's token; else LeaseLost, no change.
//   - Renew(lease): ok on in_flight with that lease id; else LeaseLost.
//   - Get: absent, or the record's state, token, fingerprint, lease id and
//     response (a released record is returned as released with its token).
//     With provisional (redisstore's native path, see its package
//     documentation: a claim whose token does not stand shows Get its
//     provisional token until the second step of the Acquire replaces it),
//     a Get of an in-flight record may also show its lease and fingerprint
//     with a token below the lease's, until the record is known to hold the
//     lease's token: a Get that showed it, or the holder's own Renew or
//     repeated Acquire (which come after its Acquire returned). It changes
//     nothing and teaches no token.
//
// Time. The model has two modes.
//
// Untimed (timed == false), used with real clocks (memstore on time.Now,
// Redis TIME): leases, tombstones and retention are an hour, far beyond any
// run, so nothing expires and time plays no part; TTLs in outputs are not
// checked.
//
// Timed (timed == true), used with memstore on a clock the test owns: the
// test advances the clock with tick operations that are part of the history
// (an atomic store the store reads once inside its critical section, so a
// tick is linearizable with the store's operations), the state carries the
// clock and the record's expiry, and expiry is exact: a record whose expiry
// is <= now is absent. Expiry of a write at now for ttl is
// max(now+ttl, (token+1) ms), the rule the stores document (a record
// expires only after the clock passed its token). In this mode the TTLs the
// store reports (Acquired lease TTL, InFlight RetryAfter, Get TTL) are
// checked exactly too.
//
// Indeterminate calls (a timeout or connection error: the call may have
// taken effect, at any moment after its invocation, or not at all) have
// output unknown and, in the history, a return after every other event. The
// model lets an unknown call do what it would have done had it run, with any
// output; as its return is at the end of the history, porcupine can also
// linearize it last, which is the same as its never having happened. A
// lease's token, unknown when its Acquire's reply was lost, is learnt from
// the first definite output that shows it (a repeated Acquire, Get,
// Complete or Release with the lease).

type opKind uint8

const (
	opAcquire opKind = iota + 1
	opComplete
	opRelease
	opRenew
	opGet
	opTick // timed mode: the store clock is set to input.ttl (Unix ns)
)

func (k opKind) String() string {
	return [...]string{"?", "acquire", "complete", "release", "renew", "get", "tick"}[k]
}

// input is one call. key indexes the test's keys (-1 for ticks, which go
// to every partition).
type input struct {
	kind  opKind
	key   int
	fp    uint8         // acquire: fingerprint index
	lease idem.LeaseID  // acquire, complete, release, renew
	token uint64        // complete, release: the lease's token
	resp  string        // complete: canonical response (canon)
	ttl   time.Duration // acquire, renew: lease; complete: retention; release: lease TTL; tick: clock (ns)
}

// output is one call's result.
type output struct {
	unknown bool // indeterminate: timeout or connection error

	outcome idem.Outcome // acquire
	ok      bool         // complete, release, renew: nil (true) or ErrLeaseLost
	found   bool         // get
	state   idem.State   // get
	token   uint64       // acquire (Acquired), get
	fp      uint8        // get (fpNone for none or an unknown fingerprint)
	lease   idem.LeaseID // get
	resp    string       // acquire (Replay), get (completed): canon
	ttl     time.Duration
}

// fpNone is a Get's fingerprint index for the zero Fingerprint.
const fpNone = 255

const (
	kAbsent uint8 = iota
	kInFlight
	kCompleted
	kReleased
)

// state is one key's record. It is comparable: porcupine compares states
// with ==.
type state struct {
	kind  uint8
	token uint64 // 0: not known yet (the reply of its Acquire was lost)
	floor uint64 // largest token the key is known to have had
	fp    uint8
	lease idem.LeaseID
	resp  string
	now   int64 // timed: the store clock, Unix ns
	exp   int64 // timed: when the record expires (<= now: absent)
	// settled: in flight, the record is known to hold the lease's token
	// (provisional: no Get may show another one from now on).
	settled bool
}

// expiry is the stores' rule: the later of now+ttl and the millisecond
// after the token.
func expiry(now int64, ttl time.Duration, token uint64) int64 {
	return max(now+int64(ttl), int64(token+1)*int64(time.Millisecond))
}

// learn fixes s's token to t when it is not known yet, and reports whether
// t is consistent with it.
func (s state) learn(t uint64) (state, bool) {
	if s.token == 0 {
		if t <= s.floor {
			return s, false
		}
		s.token, s.floor = t, t
		return s, true
	}
	return s, s.token == t
}

// stepper is the model's step function; broken variants replace parts of
// it in the self-tests.
type stepper struct {
	timed bool
	// noRelease: a broken model in which Release does not free the key
	// (the self-test shows that the checker then rejects real histories).
	noRelease bool
	// provisional: a Get may show an in-flight record's provisional token
	// (redisstore's native path; see the header comment).
	provisional bool
}

func (m stepper) step(s state, in input, out output) (bool, state) {
	if m.timed {
		if in.kind == opTick {
			if in.ttl < time.Duration(s.now) {
				return false, s // the clock never steps back
			}
			s.now = int64(in.ttl)
			return true, s
		}
		if s.kind != kAbsent && s.exp <= s.now {
			s = state{floor: s.floor, now: s.now} // expired: absent
		}
	} else if in.kind == opTick {
		return false, s
	}
	left := time.Duration(s.exp - s.now)
	switch in.kind {
	case opAcquire:
		return m.acquire(s, in, out, left)
	case opComplete:
		return m.complete(s, in, out)
	case opRelease:
		return m.release(s, in, out)
	case opRenew:
		if s.kind == kInFlight && s.lease == in.lease {
			if m.timed {
				s.exp = expiry(s.now, in.ttl, s.token)
			}
			if !out.unknown {
				s.settled = true // its Acquire returned before it
			}
			return out.unknown || out.ok, s
		}
		return out.unknown || !out.ok, s
	case opGet:
		return m.get(s, out, left)
	}
	return false, s
}

func (m stepper) acquire(s state, in input, out output, left time.Duration) (bool, state) {
	switch {
	case s.kind == kAbsent || s.kind == kReleased:
		n := state{kind: kInFlight, floor: s.floor, fp: in.fp, lease: in.lease, now: s.now}
		if out.unknown {
			if m.timed {
				return false, s // timed runs have no faults
			}
			return true, n
		}
		if out.outcome != idem.Acquired || out.token <= s.floor {
			return false, s
		}
		if m.timed && out.ttl != in.ttl {
			return false, s
		}
		n.token, n.floor = out.token, out.token
		if m.timed {
			n.exp = expiry(s.now, in.ttl, n.token)
		}
		return true, n
	case out.unknown:
		return true, s
	case s.kind == kInFlight && s.lease == in.lease:
		if out.outcome != idem.Acquired || (m.timed && out.ttl != left) {
			return false, s
		}
		n, ok := s.learn(out.token)
		n.settled = true // its first Acquire returned before it
		return ok, n
	case s.fp != in.fp:
		return out.outcome == idem.Mismatch, s
	case s.kind == kInFlight:
		return out.outcome == idem.InFlight && (!m.timed || out.ttl == left), s
	default: // completed
		return out.outcome == idem.Replay && out.resp == s.resp, s
	}
}

func (m stepper) complete(s state, in input, out output) (bool, state) {
	switch {
	case s.kind == kInFlight && s.lease == in.lease:
		n, ok := s.learn(in.token)
		if !ok {
			// The lease's token contradicts the record's: the call is not
			// this lease's repeat. Only an indeterminate call may pass.
			return out.unknown, s
		}
		n.kind, n.lease, n.resp = kCompleted, idem.LeaseID{}, in.resp
		if m.timed {
			n.exp = expiry(n.now, in.ttl, n.token)
		}
		return out.unknown || out.ok, n
	case s.kind == kCompleted && s.token == in.token && s.resp == in.resp:
		return out.unknown || out.ok, s
	case s.kind == kCompleted && s.token == in.token:
		return true, s // another response: either answer, nothing changes
	}
	return out.unknown || !out.ok, s
}

func (m stepper) release(s state, in input, out output) (bool, state) {
	switch {
	case s.kind == kInFlight && s.lease == in.lease:
		n, ok := s.learn(in.token)
		if !ok {
			return out.unknown, s
		}
		if m.noRelease {
			return out.unknown || out.ok, n
		}
		n.kind, n.fp, n.lease = kReleased, fpNone, idem.LeaseID{}
		if m.timed {
			n.exp = expiry(n.now, in.ttl, n.token)
		}
		return out.unknown || out.ok, n
	case s.kind == kReleased && s.token == in.token:
		return out.unknown || out.ok, s
	}
	return out.unknown || !out.ok, s
}

func (m stepper) get(s state, out output, left time.Duration) (bool, state) {
	if out.unknown {
		return true, s
	}
	if s.kind == kAbsent {
		return !out.found, s
	}
	if !out.found || (m.timed && out.ttl != left) {
		return false, s
	}
	if m.provisional && s.kind == kInFlight && !s.settled && out.token != s.token &&
		(s.token == 0 || out.token < s.token) {
		// The claim of the lease's Acquire, before its second step
		// replaced the token.
		return out.state == idem.StateInFlight && out.fp == s.fp && out.lease == s.lease, s
	}
	n, ok := s.learn(out.token)
	if !ok {
		return false, s
	}
	switch s.kind {
	case kInFlight:
		ok = out.state == idem.StateInFlight && out.fp == s.fp && out.lease == s.lease
		n.settled = true
	case kCompleted:
		ok = out.state == idem.StateCompleted && out.fp == s.fp && out.resp == s.resp
	case kReleased:
		ok = out.state == idem.StateReleased
	}
	return ok, n
}

// newModel returns the porcupine model over one key's state, partitioned
// by key (ticks belong to every partition).
func newModel(m stepper) porcupine.Model {
	return porcupine.Model{
		Partition: partition,
		Init:      func() any { return state{} },
		Step: func(s, in, out any) (bool, any) {
			return m.step(s.(state), in.(input), out.(output))
		},
		Hash: func(s any) uint64 {
			st := s.(state)
			h := fnv.New64a()
			fmt.Fprintf(h, "%d|%d|%d|%d|%x|%d|%d|%t|", st.kind, st.token, st.floor, st.fp, st.lease, st.now, st.exp, st.settled)
			h.Write([]byte(st.resp))
			return h.Sum64()
		},
		DescribeOperation: describeOp,
		DescribeState:     describeState,
	}
}

// partition splits a history by key; tick operations, which touch every
// key's clock, are copied into each partition. (Ticks come from one
// client, so they are totally ordered, and per-key linearizations that
// each place them consistently with real time merge into one.)
func partition(h []porcupine.Operation) [][]porcupine.Operation {
	byKey := map[int][]porcupine.Operation{}
	var ticks []porcupine.Operation
	for _, op := range h {
		in := op.Input.(input)
		if in.kind == opTick {
			ticks = append(ticks, op)
			continue
		}
		byKey[in.key] = append(byKey[in.key], op)
	}
	keys := make([]int, 0, len(byKey))
	for k := range byKey {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	out := make([][]porcupine.Operation, 0, len(keys))
	for _, k := range keys {
		out = append(out, append(byKey[k], ticksFor(byKey[k], ticks)...))
	}
	return out
}

// ticksFor returns the ticks that matter to ops: those that overlap their
// span, and the last one before it (which sets the clock the first op
// sees). Leaving out the earlier ones only drops clock values that are
// overwritten before any of the key's operations.
func ticksFor(ops, ticks []porcupine.Operation) []porcupine.Operation {
	if len(ticks) == 0 || len(ops) == 0 {
		return nil
	}
	lo, hi := ops[0].Call, ops[0].Return
	for _, op := range ops {
		lo, hi = min(lo, op.Call), max(hi, op.Return)
	}
	var out []porcupine.Operation
	last := -1
	for i, tk := range ticks {
		switch {
		case tk.Return < lo:
			if last < 0 || tk.Return > ticks[last].Return {
				last = i
			}
		case tk.Call <= hi:
			out = append(out, tk)
		}
	}
	if last >= 0 {
		out = append(out, ticks[last])
	}
	return out
}

func short(id idem.LeaseID) string { return base64.RawURLEncoding.EncodeToString(id[:3]) }

func describeOp(i, o any) string {
	in, out := i.(input), o.(output)
	var b strings.Builder
	fmt.Fprintf(&b, "%s(k%d", in.kind, in.key)
	switch in.kind {
	case opAcquire:
		fmt.Fprintf(&b, " fp%d lease %s", in.fp, short(in.lease))
	case opComplete, opRelease:
		fmt.Fprintf(&b, " lease %s tok %d", short(in.lease), in.token)
	case opRenew:
		fmt.Fprintf(&b, " lease %s", short(in.lease))
	case opTick:
		return fmt.Sprintf("tick(%d)", in.ttl)
	}
	b.WriteString(") -> ")
	if out.unknown {
		b.WriteString("unknown")
		return b.String()
	}
	switch in.kind {
	case opAcquire:
		b.WriteString(out.outcome.String())
		switch out.outcome {
		case idem.Acquired:
			fmt.Fprintf(&b, " tok %d", out.token)
		case idem.Replay:
			fmt.Fprintf(&b, " %s", respTag(out.resp))
		}
	case opComplete, opRelease, opRenew:
		if out.ok {
			b.WriteString("ok")
		} else {
			b.WriteString("lease lost")
		}
	case opGet:
		if !out.found {
			b.WriteString("absent")
		} else {
			fmt.Fprintf(&b, "%s tok %d fp%d lease %s %s", out.state, out.token, out.fp, short(out.lease), respTag(out.resp))
		}
	}
	return b.String()
}

func describeState(s any) string {
	st := s.(state)
	names := [...]string{"absent", "in_flight", "completed", "released"}
	return fmt.Sprintf("%s tok %d floor %d fp%d lease %s %s exp %d", names[st.kind], st.token, st.floor, st.fp, short(st.lease), respTag(st.resp), st.exp-st.now)
}

// respTag names a canonical response by its first line in descriptions.
func respTag(c string) string {
	if c == "" {
		return ""
	}
	head, _, _ := strings.Cut(c, "\n")
	return fmt.Sprintf("[%s, %d bytes]", head, len(c))
}

// canon is a response's canonical form: status, headers in order, the
// omitted flag and the body byte for byte. Replays must reproduce it
// exactly.
func canon(r *idem.Response) string {
	if r == nil {
		return ""
	}
	var b strings.Builder
	fmt.Fprintf(&b, "%d %s omitted=%t\n", r.Status, r.Header.Get("X-Lease"), r.BodyOmitted)
	keys := make([]string, 0, len(r.Header))
	for k := range r.Header {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	for _, k := range keys {
		fmt.Fprintf(&b, "%s: %q\n", k, r.Header[http.CanonicalHeaderKey(k)])
	}
	b.WriteString("\n")
	b.Write(r.Body)
	return b.String()
}
