// Package engine owns the life of a keyed request for idemhttp and idemgrpc:
// acquiring its key (waiting for an in-flight holder when asked to), the
// decision to run, replay or refuse, the context the work runs in, and
// completing or releasing the key once the work has returned, with the
// outcome's telemetry. What a protocol answers, and how it captures and
// encodes a response, stays in its package.
//
// A request's life, as an adapter drives it:
//
//	d := e.Acquire(ctx, parent, key, fp, method)
//	switch d.Outcome {
//	case OutcomeExecuted: // run: the key is held
//		w := e.Start(d, report) // or e.StartIn(&state.work, d, report)
//		defer w.End() // releases the key if neither Complete nor Release ran (a panic)
//		... run the handler with w.Ctx; then w.Complete(resp), or w.Release()
//	case OutcomeReplayed: // answer with d.Response
//	case ...:             // answer the refusal
//	}
package engine

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"time"

	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/telemetry"
	"github.com/idemkit/idem/internal/waiters"
	"github.com/idemkit/idem/memstore"
)

// Outcome is what a protocol layer did with a request of a covered method:
// the one list of names idemhttp and idemgrpc report (OnOutcome, the
// counter idem.outcomes, the span attribute idem.outcome). Each package
// defines its public constants from these.
type Outcome string

const (
	OutcomePassedThrough Outcome = "passed_through" // no key, none required: the handler ran unprotected
	OutcomeExecuted      Outcome = "executed"       // the handler ran under a lease; its response was stored
	OutcomeReplayed      Outcome = "replayed"       // the stored response was replayed
	OutcomeInFlight      Outcome = "in_flight"      // in flight (after the wait, if any)
	OutcomeMismatch      Outcome = "mismatch"       // the key was used with another request
	OutcomeRejected      Outcome = "rejected"       // the request was refused before its key was acquired
	OutcomeStoreError    Outcome = "store_error"    // the store failed (or the handler ran unprotected: FailOpen); idemgrpc: a stored outcome could not be decoded
	OutcomeGone          Outcome = "gone"           // the client left before the key was acquired: nothing ran
	OutcomeReleased      Outcome = "released"       // the handler ran under a lease; the key was released
	OutcomeReplayFailed  Outcome = "replay_failed"  // the stored body could not be read (idemhttp's blob store)
	OutcomeQuotaExceeded Outcome = "quota_exceeded" // the tenant's quota refused a new key (idemhttp's Quota): nothing claimed
	OutcomeUnsealable    Outcome = "unsealable"     // the key is completed but its sealed response cannot be opened (idem.ErrUnsealable): nothing ran, nothing replayed
)

// Config is what the engine takes from idemhttp's and idemgrpc's Config.
type Config struct {
	// Name is the package, "idemhttp" or "idemgrpc": the prefix of New's
	// errors, and without "idem" the layer in telemetry ("http", "grpc").
	Name string

	// Lease, Retention, MaxResponseSize, OnRenew, TracerProvider and
	// MeterProvider go to the idem.Guard (see idem.Config).
	Lease, Retention time.Duration
	MaxResponseSize  int
	OnRenew          func(key idem.Key, err error)
	TracerProvider   trace.TracerProvider
	MeterProvider    metric.MeterProvider
	// Seal and SealOpenOnly go to the idem.Guard too.
	Seal         idem.Sealer
	SealOpenOnly bool

	// Wait, when positive, makes Acquire wait up to this long for an
	// in-flight key's result (Config.Wait of both packages, through
	// WaitOrDefault).
	Wait time.Duration

	// MaxExecution and StopContext bound the work's context (Config's
	// fields of the same name).
	MaxExecution time.Duration
	StopContext  context.Context

	// FailOpen is only logged with a store failure: the adapter decides
	// what it means.
	FailOpen bool

	// Logger receives store failures and lost leases. Default
	// slog.Default().
	Logger *slog.Logger

	// V1Scopes is how long after New the key that v1.0 derived for a
	// request is looked up too, when it differs from today's (Fallback):
	// zero means the retention (the longest a record stored before an
	// upgrade can live once the upgraded process runs), negative never.
	// A memory store (*memstore.Store, or a wrapper of one with an
	// Unwrap() idem.Store method) is never looked up: it holds only what
	// this process stored, and one build holds one version of idem, so
	// no record of v1.0 can be in it.
	V1Scopes time.Duration
}

// DefaultWait is the default of idemhttp's and idemgrpc's Config.Wait
// (and of idem proxy's --wait): long enough for the usual handler to
// finish, so that its copies get its result rather than a refusal and
// a retry; short enough that a copy of long work is soon told to come
// back later.
const DefaultWait = 500 * time.Millisecond

// WaitOrDefault turns a Config.Wait of idemhttp or idemgrpc into the
// engine's Wait: zero is the package's default def, a negative value no
// wait at all (an in-flight key is refused at once).
func WaitOrDefault(wait, def time.Duration) time.Duration {
	switch {
	case wait == 0:
		return def
	case wait < 0:
		return 0
	}
	return wait
}

// Engine runs keyed requests for one middleware or interceptor.
type Engine struct {
	cfg     Config
	layer   string
	g       *idem.Guard
	tel     *telemetry.T // nil without providers
	waiters waiters.Set
	v1Until time.Time // Fallback looks up v1.0's keys until then
}

// New returns an engine over store, or the configuration's error (prefixed
// with cfg.Name).
func New(store idem.Store, cfg Config) (*Engine, error) {
	switch {
	case cfg.Wait < 0:
		return nil, fmt.Errorf("%s: Config.Wait %v is negative", cfg.Name, cfg.Wait)
	case cfg.MaxExecution < 0:
		return nil, fmt.Errorf("%s: Config.MaxExecution %v is negative", cfg.Name, cfg.MaxExecution)
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	// idem.New refuses a nil store, and an interface holding a nil pointer.
	g, err := idem.New(store, idem.Config{Lease: cfg.Lease, Retention: cfg.Retention, MaxResponseSize: cfg.MaxResponseSize,
		OnRenew: cfg.OnRenew, TracerProvider: cfg.TracerProvider, MeterProvider: cfg.MeterProvider,
		Seal: cfg.Seal, SealOpenOnly: cfg.SealOpenOnly})
	if err != nil {
		return nil, fmt.Errorf("%s: %w", cfg.Name, err)
	}
	tel, err := telemetry.New(cfg.TracerProvider, cfg.MeterProvider)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", cfg.Name, err)
	}
	e := &Engine{cfg: cfg, layer: strings.TrimPrefix(cfg.Name, "idem"), g: g, tel: tel}
	switch {
	case localOnly(store): // see Config.V1Scopes
	case cfg.V1Scopes == 0:
		e.v1Until = time.Now().Add(g.Config().Retention)
	case cfg.V1Scopes > 0:
		e.v1Until = time.Now().Add(cfg.V1Scopes)
	}
	return e, nil
}

// localOnly reports whether store is a *memstore.Store, itself or under
// wrappers that keep its records as they are (an Unwrap() idem.Store
// method: idem proxy's metrics, say): a store that holds only what this
// process stored.
func localOnly(store idem.Store) bool {
	for {
		switch s := store.(type) {
		case *memstore.Store:
			return true
		case interface{ Unwrap() idem.Store }:
			store = s.Unwrap()
		default:
			return false
		}
	}
}

// Anonymous counts a keyed request that no tenant source identified (the
// counter idem.anonymous).
func (e *Engine) Anonymous(ctx context.Context) { e.tel.Anonymous(ctx, e.layer) }

// FallingBack reports whether Fallback still looks up v1.0's keys: for
// Config.V1Scopes after New. An adapter derives a request's v1.0 key only
// then.
func (e *Engine) FallingBack() bool { return time.Now().Before(e.v1Until) }

// Fallback keeps a record stored by v1.0 answering after an upgrade that
// changed how a request's key or fingerprint is derived (the Host in the
// scope, credentials in normal form, API-key headers, paths as the
// upstream sees them, an anonymous caller's cookies). d is Acquire's
// decision for today's key and fingerprint; old and oldFP are what v1.0
// derived for the same request.
//
// When d acquired the key and a record under another old key exists, d's
// key is released and the old record answers: its replay (its
// fingerprint equal to oldFP), a mismatch, or in flight (a v1.0 process
// still holds it, during a rolling upgrade: answered at once,
// Retry-After the time left on its lease). When the key is the same and
// d is a mismatch that v1.0's fingerprint explains, the record answers as
// it would have to v1.0. Otherwise, and once FallingBack is over, d is
// returned as it is. A failure to read the old record is a store error
// (the key released): a request that may have run before is not run
// again on a guess. An old record whose sealed response does not open is
// OutcomeUnsealable, as Acquire answers it.
//
// The cost is one Get for each request that acquires its key (or meets a
// mismatch) while the fallback lasts; replays of records stored since the
// upgrade cost nothing more. A v1.0 process that acquires the old key
// after the Get (both versions serving one key at the same moment) is not
// seen.
func (e *Engine) Fallback(ctx context.Context, d Decision, key idem.Key, fp idem.Fingerprint, old idem.Key, oldFP idem.Fingerprint) Decision {
	switch {
	case !e.FallingBack():
		return d
	case d.Outcome == OutcomeExecuted && old != key:
	case d.Outcome == OutcomeMismatch && old == key && oldFP != fp:
	default:
		return d
	}
	rec, ok, err := e.g.Store().Get(ctx, old)
	if err != nil {
		e.cfg.Logger.LogAttrs(ctx, slog.LevelWarn, "idem: store failed before the handler ran (looking up the key v1.0 derived)",
			slog.String("key", key.String()), slog.String("v1_key", old.String()), slog.Any("error", err))
	}
	held := d.Outcome == OutcomeExecuted
	switch {
	case err != nil:
		if held {
			e.Release(context.WithoutCancel(ctx), d.Attempt)
		}
		return Decision{Outcome: OutcomeStoreError, Err: err}
	case !ok || rec.State == idem.StateReleased || (!held && rec.Fingerprint != oldFP):
		return d
	}
	if held {
		e.Release(context.WithoutCancel(ctx), d.Attempt)
	}
	switch {
	case rec.Fingerprint != oldFP:
		return Decision{Outcome: OutcomeMismatch}
	case rec.State == idem.StateCompleted:
		// Read with Get, the record is as the store keeps it: a sealed
		// one is opened here, as Begin opens its replays.
		resp, err := idem.OpenResponse(e.g.Config().Seal, old, rec.Fingerprint, rec.Response)
		if se := sealError(err); se != nil {
			return e.unsealable(ctx, se, "")
		}
		return Decision{Outcome: OutcomeReplayed, Response: resp}
	}
	return Decision{Outcome: OutcomeInFlight, RetryAfter: max(rec.TTL, time.Millisecond)}
}

// Report records outcome o of the request whose context is ctx: the
// counter idem.outcomes and the span attribute idem.outcome. The adapter
// calls its OnOutcome after it.
func (e *Engine) Report(ctx context.Context, o Outcome) {
	e.tel.Outcome(ctx, e.layer, string(o))
}

// Decision is what Acquire decided for a keyed request. Outcome says which
// of the other fields is set:
//
//	OutcomeExecuted    run the work under Attempt (Start); its outcome,
//	                   executed or released, is reported by the Work,
//	                   through the Reporter given to Start
//	OutcomeReplayed    answer with Response, the stored one
//	OutcomeMismatch    the key was used with another fingerprint
//	OutcomeInFlight    in flight (past the wait); RetryAfter is the time
//	                   until the holder's lease ends
//	OutcomeGone        the client left (ctx is done): nothing ran, nobody
//	                   to answer
//	OutcomeStoreError  Err is the store's failure (logged); Unknown when
//	                   the store answered an outcome it may not (logged)
//	OutcomeUnsealable  the key is completed, but its sealed response does
//	                   not open: Err is the *idem.SealError (logged, at
//	                   ERROR). The work ran once; it is neither replayed
//	                   nor run again
//
// Acquire reports none of them: the adapter reports the others, with its
// own OnOutcome.
type Decision struct {
	Outcome    Outcome
	Attempt    *idem.Attempt
	Response   *idem.Response
	RetryAfter time.Duration
	Err        error
	Unknown    bool

	fp idem.Fingerprint // the request's, for Start
}

// waitDeadline is when a request that came at now stops waiting for an
// in-flight key: after wait, and before the request's own deadline (a
// gRPC client's, say) by a fifth of the time it has, 10ms to 100ms, so
// that its caller hears "in flight" rather than nothing.
func waitDeadline(ctx context.Context, now time.Time, wait time.Duration) time.Time {
	end := now.Add(wait)
	if dl, ok := ctx.Deadline(); ok {
		margin := min(max(dl.Sub(now)/5, 10*time.Millisecond), 100*time.Millisecond)
		if d := dl.Add(-margin); d.Before(end) {
			end = d
		}
	}
	return end
}

// Acquire acquires key for a request with fingerprint fp, and with
// Config.Wait waits for an in-flight holder: it wakes as soon as a holder
// in this process finishes the key, and is handed the response it stored;
// for a holder in another process it asks the store again after growing
// pauses. With a wait, the copies of a request (same key, same
// fingerprint) in this process ask the store one at a time: a copy that
// arrives while another holds the key, or is asking the store for it,
// waits for that one without asking (a retry storm's copies cost no store
// call each), and asks the store itself only when that one is done without
// a response for it (released, or the store said anything but acquired or
// replay: in flight elsewhere, say, when each copy then polls on its own)
// or when the wait ends. ctx is the request's: once it is done, the client
// is gone.
// parent is the work's parent context (ctx's values; with ctx's
// cancellation or without it); the acquire itself is bounded by the
// store's timeouts. method, when not empty, is logged with a store failure.
func (e *Engine) Acquire(ctx, parent context.Context, key idem.Key, fp idem.Fingerprint, method string) Decision {
	deadline := waitDeadline(ctx, time.Now(), e.cfg.Wait)
	pause := waiters.FirstPause
	// ask.asking: this request asks the store for the copies of it that
	// arrive meanwhile (waiters.JoinOrAsk); ask tells them what it
	// learnt, once, whatever happens (a store that panics included).
	ask := asker{e: e, key: key, fp: fp}
	defer ask.answer(false)
	if left := time.Until(deadline); left > 0 {
		switch j, live, done := e.waiters.JoinOrAsk(ctx, key, fp, left); j {
		case waiters.Asking:
			ask.asking = true
		case waiters.Waited:
			telemetry.Event(ctx, telemetry.EventWait)
			pause = 2 * pause
			if !live {
				return Decision{Outcome: OutcomeGone}
			}
			if stored := done.For(fp); stored != nil {
				return Decision{Outcome: OutcomeReplayed, Response: stored}
			}
			// Released, or the wait is over: the store decides.
		}
	}
	for {
		att, acq, err := e.g.Begin(parent, key, fp)
		switch {
		case err == nil && acq.Outcome == idem.Replay:
			// The copies waiting for this request are handed the replay.
			ask.replay(acq.Response)
		case err != nil || acq.Outcome != idem.Acquired:
			ask.answer(false) // they ask the store themselves
		}
		if se := sealError(err); se != nil {
			// Not the store's failure: the record is there, completed,
			// and cannot be read. Never a fallback, never a run.
			return e.unsealable(ctx, se, method)
		}
		if err != nil && ctx.Err() != nil {
			return Decision{Outcome: OutcomeGone} // or an outer deadline passed
		}
		if err != nil {
			attrs := []slog.Attr{slog.String("key", key.String()), slog.Bool("fail_open", e.cfg.FailOpen), slog.Any("error", err)}
			if method != "" {
				attrs = append([]slog.Attr{slog.String("method", method)}, attrs...)
			}
			e.cfg.Logger.LogAttrs(ctx, slog.LevelWarn, "idem: store failed before the handler ran", attrs...)
			return Decision{Outcome: OutcomeStoreError, Err: err}
		}
		switch acq.Outcome {
		case idem.Acquired:
			// Held until Release or the Work's End wakes its waiters.
			if ask.asking {
				ask.answer(true) // its copies now wait for that
			} else {
				e.waiters.Hold(key, fp)
			}
			if ctx.Err() != nil {
				// The client left before the key was acquired: nothing
				// has run, so nothing runs.
				e.Release(context.WithoutCancel(ctx), att)
				return Decision{Outcome: OutcomeGone}
			}
			return Decision{Outcome: OutcomeExecuted, Attempt: att, fp: fp}
		case idem.Replay:
			return Decision{Outcome: OutcomeReplayed, Response: acq.Response}
		case idem.Mismatch:
			return Decision{Outcome: OutcomeMismatch}
		case idem.InFlight:
			left := time.Until(deadline)
			if left <= 0 {
				return Decision{Outcome: OutcomeInFlight, RetryAfter: acq.RetryAfter}
			}
			if pause == waiters.FirstPause {
				telemetry.Event(ctx, telemetry.EventWait)
			}
			// A holder in this process wakes its waiters when it is done:
			// they ask the store again only then, or at the end of the
			// wait or of the holder's lease. One elsewhere is polled.
			until := min(left, acq.RetryAfter+time.Millisecond)
			live, done := e.waiters.Wait(ctx, key, min(pause, until), until)
			if !live {
				return Decision{Outcome: OutcomeGone}
			}
			if stored := done.For(fp); stored != nil {
				// A holder in this process stored it: the store's answer,
				// without asking it.
				return Decision{Outcome: OutcomeReplayed, Response: stored}
			}
			pause = min(2*pause, waiters.MaxPause)
		default: // a store answering something else is a broken store
			e.cfg.Logger.LogAttrs(ctx, slog.LevelError, "idem: store gave an unknown outcome",
				slog.String("key", key.String()), slog.Any("outcome", acq.Outcome))
			return Decision{Outcome: OutcomeStoreError, Unknown: true}
		}
	}
}

// sealError returns the *idem.SealError in err's tree (errors.As), or nil.
// Its target is made only for an error: a nil one costs no allocation.
func sealError(err error) *idem.SealError {
	if err == nil {
		return nil
	}
	var se *idem.SealError
	if errors.As(err, &se) {
		return se
	}
	return nil
}

// asker is what Acquire tells the copies of its request that wait for
// its answer (waiters.JoinOrAsk), when it asks the store for them
// (asking): once, with the first of its methods called.
type asker struct {
	e      *Engine
	key    idem.Key
	fp     idem.Fingerprint
	asking bool
}

// answer answers the copies: with acquired, they now wait for the
// holder's Wake; otherwise they ask the store themselves.
func (a *asker) answer(acquired bool) {
	if a.asking {
		a.asking = false
		a.e.waiters.Answer(a.key, a.fp, nil, acquired)
	}
}

// replay hands the copies resp, the replay the store gave.
func (a *asker) replay(resp *idem.Response) {
	if a.asking {
		a.asking = false
		a.e.waiters.AnswerReplay(a.key, a.fp, resp)
	}
}

// unsealable logs, at ERROR, a completed record whose sealed response does
// not open, with the record's key (its digest, as every line names it) and
// the id of the key that sealed it, never content, and returns the
// decision OutcomeUnsealable.
func (e *Engine) unsealable(ctx context.Context, se *idem.SealError, method string) Decision {
	attrs := []slog.Attr{slog.String("key", se.Key.String()), slog.String("key_id", se.KeyID), slog.Any("error", se.Err)}
	if method != "" {
		attrs = append([]slog.Attr{slog.String("method", method)}, attrs...)
	}
	e.cfg.Logger.LogAttrs(ctx, slog.LevelError, "idem: the stored response is sealed and cannot be opened (altered, or under a key id not in the ring); it ran once and is neither replayed nor run again", attrs...)
	return Decision{Outcome: OutcomeUnsealable, Err: se}
}

// Release releases att's key when no work was started under it (the
// client left at the acquire; an adapter's own check failed), logs a
// failure, and wakes the requests of this process that wait for the key.
// A decision to run (OutcomeExecuted) ends either here or in its Work's
// End, never in both: requests of this process that wait for its key wait
// for that without asking the store.
func (e *Engine) Release(ctx context.Context, att *idem.Attempt) {
	e.release(ctx, att)
	e.waiters.Wake(att.Lease().Key, nil)
}

// release releases att's key, and logs a failure.
func (e *Engine) release(ctx context.Context, att *idem.Attempt) {
	switch err := att.Release(ctx); {
	case err == nil:
	case errors.Is(err, idem.ErrLeaseLost):
		e.cfg.Logger.LogAttrs(ctx, slog.LevelWarn, "idem: lease lost before the release; another request may hold the key",
			slog.String("key", att.Lease().Key.String()), slog.Any("error", err))
	default:
		e.cfg.Logger.LogAttrs(ctx, slog.LevelWarn, "idem: release failed; the key stays blocked until its lease ends",
			slog.String("key", att.Lease().Key.String()), slog.Any("error", err))
	}
}

// Work is one run of a request's work under its lease. Build it with
// Start, end it with End (deferred), and in between either Complete or
// Release the key once the work has returned. A panic anywhere after
// Start (the work, or what the adapter does after it) skips both: End
// then releases the key, and the panic goes on.
//
// The outcome is reported once, through the Reporter given to Start:
// OutcomeReleased after the key is released (by Release or End),
// OutcomeExecuted just before Complete stores the response (so that a
// retry replaying it finds the execution counted).
type Work struct {
	// Ctx is the work's context: the attempt's (cancelled when the lease
	// is lost), bounded by Config.MaxExecution (cause
	// idem.ErrMaxExecution) and stopped by Config.StopContext (cause
	// idem.ErrStopped).
	Ctx context.Context
	// Finish is Ctx without its cancellation, for what comes after the
	// work: completing, releasing, logging.
	Finish context.Context
	// Attempt holds the lease.
	Attempt *idem.Attempt

	e        *Engine
	fp       idem.Fingerprint
	stop     workStop
	report   Reporter
	settled  bool           // Complete or Release ran
	reported bool           // report was called
	stored   bool           // the response is stored: End hands it over
	handed   waiters.Result // set once, with stored
}

// Reporter is told a work's outcome, executed or released (see Work):
// typically the adapter's per-request state, which holds what its report
// needs, so that no closure is made for it.
type Reporter interface {
	Report(Outcome)
}

// Start starts the work of d, a decision to run (OutcomeExecuted), under
// its attempt. report is told the work's outcome once, executed or
// released (see Work); it may be nil.
func (e *Engine) Start(d Decision, report Reporter) *Work {
	w := new(Work)
	e.StartIn(w, d, report)
	return w
}

// StartIn is Start with the Work in w, a zero Work the caller allocated
// (a field of its per-request state, say), which it must not copy.
func (e *Engine) StartIn(w *Work, d Decision, report Reporter) {
	ctx, stop := e.workContext(d.Attempt.Context())
	*w = Work{Ctx: ctx, Finish: context.WithoutCancel(ctx), Attempt: d.Attempt, e: e, fp: d.fp, stop: stop, report: report}
}

// workContext adds MaxExecution and StopContext to the attempt's context.
// stop releases its resources once the work has returned.
func (e *Engine) workContext(parent context.Context) (ctx context.Context, stop workStop) {
	if e.cfg.MaxExecution <= 0 && e.cfg.StopContext == nil {
		return parent, workStop{}
	}
	ctx, cancel := context.WithCancelCause(parent)
	stop.cancel = cancel
	if e.cfg.StopContext != nil {
		stop.unhook = context.AfterFunc(e.cfg.StopContext, func() { cancel(idem.ErrStopped) })
	}
	if e.cfg.MaxExecution > 0 {
		ctx, stop.cancelTimer = context.WithTimeoutCause(ctx, e.cfg.MaxExecution, idem.ErrMaxExecution)
	}
	return ctx, stop
}

// workStop is what workContext made, kept in the Work (rather than a
// closure over it).
type workStop struct {
	cancel      context.CancelCauseFunc // nil: workContext added nothing
	unhook      func() bool             // StopContext's AfterFunc; nil without one
	cancelTimer context.CancelFunc      // MaxExecution's; nil without one
}

// stop releases what workContext made: StopContext's hook, then
// MaxExecution's timer, then the work context itself.
func (s workStop) stop() {
	if s.cancel == nil {
		return
	}
	if s.unhook != nil {
		s.unhook()
	}
	if s.cancelTimer != nil {
		s.cancelTimer()
	}
	s.cancel(nil)
}

// Release releases the key, then reports OutcomeReleased: the work's
// result is not kept, and a retry runs it again.
func (w *Work) Release() {
	w.settled = true
	w.e.release(w.Finish, w.Attempt)
	w.outcome(OutcomeReleased)
}

// Complete reports OutcomeExecuted, then stores resp as the key's
// response, and logs a failure. Once it is stored, End hands it to the
// requests of this process that wait for the key.
func (w *Work) Complete(resp *idem.Response) error {
	w.outcome(OutcomeExecuted)
	err := w.Attempt.Complete(w.Finish, resp)
	w.settled = true
	switch {
	case err == nil:
		w.handed, w.stored = waiters.Result{Fingerprint: w.fp, Response: resp}, true
	case errors.Is(err, idem.ErrNotReplicated):
		w.log(slog.LevelWarn, "idem: response stored, but not on enough replicas; a failover may lose it", err)
	default:
		w.log(slog.LevelWarn, "idem: handler ran but its response was not stored; a retry will run it again", err)
	}
	return err
}

// outcome reports o, unless an outcome was reported already.
func (w *Work) outcome(o Outcome) {
	if w.reported || w.report == nil {
		return
	}
	w.reported = true // before: a report that panics is not made twice
	w.report.Report(o)
}

// Failed logs that the work ran but its result cannot be stored (why is
// err); the caller then releases the key.
func (w *Work) Failed(msg string, err error) { w.log(slog.LevelError, msg, err) }

func (w *Work) log(level slog.Level, msg string, err error) {
	w.e.cfg.Logger.LogAttrs(w.Finish, level, msg,
		slog.String("key", w.Attempt.Lease().Key.String()), slog.Uint64("token", w.Attempt.Lease().Token), slog.Any("error", err))
}

// ClientGone logs that the client left (why is err) while the work ran,
// which went on to its end.
func (w *Work) ClientGone(err error) {
	w.e.cfg.Logger.LogAttrs(w.Finish, slog.LevelDebug, "idem: the client left while the handler ran; its response was kept for the retry",
		slog.String("key", w.Attempt.Lease().Key.String()), slog.Any("error", err))
}

// End releases the key if neither Complete nor Release ran (a panic after
// Start: the panic goes on once End returns), wakes the requests of this
// process that wait for the key (handing them the stored response, if
// any), then frees the work context. Defer it right after Start.
func (w *Work) End() {
	defer func() { // also when the release's report panics
		var handed *waiters.Result
		if w.stored {
			handed = &w.handed // in the Work: never written again
		}
		w.e.waiters.Wake(w.Attempt.Lease().Key, handed)
		w.stop.stop()
	}()
	if !w.settled {
		w.Release()
	}
}
