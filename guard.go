package idem

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"reflect"
	"sync"
	"time"

	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemkit/idem/internal/telemetry"
)

// Defaults for Config's zero fields.
const (
	DefaultLease           = 30 * time.Second
	DefaultRetention       = 24 * time.Hour
	DefaultMaxResponseSize = 1 << 20
)

// Config tunes a Guard. The zero value means the defaults.
type Config struct {
	// Lease is how long a holder owns a key before another caller may take
	// it over; a crashed holder blocks its key for at most this long. While
	// work runs past a third of it, the lease is renewed in the background
	// every third. Default 30s; at least 10ms.
	Lease time.Duration

	// Retention is how long a completed result is kept and replayed.
	// Default 24h; at least 1ms.
	Retention time.Duration

	// MaxResponseSize is the largest body stored, in bytes, before
	// compression. A larger body is not stored: the key is completed with
	// the status and headers and Response.BodyOmitted set, and the work is
	// never run again for it. Default 1 MiB; at most MaxEncodedBody. A
	// response whose body is in a blob store (Response.Blob) is stored
	// whatever its size.
	MaxResponseSize int

	// TracerProvider and MeterProvider, when set, make the Guard report
	// through OpenTelemetry: a span per store call (idem.acquire,
	// idem.complete, idem.release, idem.renew; children of the caller's
	// span, with the key's digest, never the raw key, the store, the
	// result, the fencing token and, when in flight, the lease left), the
	// histogram idem.store.duration, the counters idem.outcomes (Do's
	// outcomes, layer "guard") and idem.lease.renewals, and the event
	// idem.lease_lost on the caller's span. Default nil: none of it, at no
	// cost. Pass otel.GetTracerProvider() and otel.GetMeterProvider() to
	// use the global ones.
	TracerProvider trace.TracerProvider
	MeterProvider  metric.MeterProvider

	// OnRenew, when set, is called after each background lease renewal
	// with its result: nil, ErrLeaseLost (the lease is gone: the work's
	// context is cancelled), or the store's error (renewal is retried until
	// the lease may have ended, which then counts as ErrLeaseLost). For
	// metrics and logs; it must not block.
	OnRenew func(key Key, err error)

	// CompleteRetry, when positive, is how long a completion that failed
	// with a store error (a *StoreError other than ErrLeaseLost,
	// ErrNotReplicated and ErrCorrupt: the store unreachable or timing
	// out) is tried again, by Attempt.Complete and Guard.FinishMany,
	// before the key is released as it is without retries. It is for work
	// whose effect is already applied: a store outage shorter than the
	// lease left then does not make the work run again. A repeated
	// completion is safe: the store answers a resend of the same
	// completion as it answered the first.
	//
	// The tries back off from 20ms, doubling to 500ms, with jitter, and
	// stop when the context ends, and before the lease may end: renewal
	// stops when the attempt finishes, so the window is bounded by the
	// lease time left at that moment (by the Guard's own clock, from the
	// last successful renewal or the acquire), less a tenth of the lease.
	// Default 0: no retry. Negative is an error.
	CompleteRetry time.Duration

	// Seal, when set, seals every response the Guard stores (Complete,
	// FinishMany, Attempt.Stored) and opens every sealed one it reads: the
	// status, headers and body are encrypted and authenticated under the
	// Sealer's key, bound to the record's key and fingerprint as associated
	// data. Clear records written before sealing was turned on still
	// replay. A sealed record that does not open is never replayed nor run
	// again: Do and Begin return a *SealError (ErrUnsealable). idemhttp also
	// seals the blobs it writes with it. Default nil: records are stored in
	// clear, and a sealed record read is ErrUnsealable.
	Seal Sealer

	// SealOpenOnly, with Seal set, stores new responses in clear while
	// sealed ones still open: the way to turn sealing off (set it, wait out
	// the Retention, then drop Seal).
	SealOpenOnly bool
}

// Guard runs work at most once per key, replaying the stored result to
// repeats. It is safe for concurrent use.
type Guard struct {
	store Store
	// ops is the store the Guard calls: store itself, or store observed
	// through OpenTelemetry.
	ops Store
	tel *telemetry.T // nil without providers
	cfg Config
	// forgets bounds the background releases in flight (see Begin).
	forgets chan struct{}
}

// New returns a Guard over store. It validates cfg and fills in defaults.
func New(store Store, cfg Config) (*Guard, error) {
	if isNilStore(store) {
		return nil, errors.New("idem: New: nil Store (did opening the store fail?)")
	}
	if cfg.Lease == 0 {
		cfg.Lease = DefaultLease
	}
	if cfg.Retention == 0 {
		cfg.Retention = DefaultRetention
	}
	if cfg.MaxResponseSize == 0 {
		cfg.MaxResponseSize = DefaultMaxResponseSize
	}
	switch {
	case cfg.Lease < 10*time.Millisecond:
		return nil, fmt.Errorf("idem: Config.Lease %v is shorter than 10ms", cfg.Lease)
	case cfg.Retention < time.Millisecond:
		return nil, fmt.Errorf("idem: Config.Retention %v is shorter than 1ms", cfg.Retention)
	case cfg.MaxResponseSize < 0 || cfg.MaxResponseSize > MaxEncodedBody:
		return nil, fmt.Errorf("idem: Config.MaxResponseSize %d is outside 1..%d", cfg.MaxResponseSize, MaxEncodedBody)
	case cfg.CompleteRetry < 0:
		return nil, fmt.Errorf("idem: Config.CompleteRetry %v is negative", cfg.CompleteRetry)
	}
	tel, err := telemetry.New(cfg.TracerProvider, cfg.MeterProvider)
	if err != nil {
		return nil, fmt.Errorf("idem: OpenTelemetry instruments: %w", err)
	}
	g := &Guard{store: store, ops: store, tel: tel, cfg: cfg, forgets: make(chan struct{}, maxForgets)}
	if tel != nil {
		g.ops = newObservedStore(store, tel)
	}
	return g, nil
}

// isNilStore reports whether s is nil, or an interface holding a nil
// pointer (a *redisstore.Store left nil because Open failed, say), which
// would pass a plain nil check and panic on the first call.
func isNilStore(s Store) bool {
	if s == nil {
		return true
	}
	switch v := reflect.ValueOf(s); v.Kind() {
	case reflect.Pointer, reflect.Map, reflect.Slice, reflect.Func, reflect.Chan, reflect.Interface:
		return v.IsNil()
	}
	return false
}

// WithLease returns a Guard like g whose attempts hold their keys for
// lease: the same store, telemetry and configuration otherwise. It costs
// one small allocation, so a caller whose lease depends on the request
// (idemlambda bounds it by the invocation's deadline) may make one per
// request. A lease shorter than 10ms is an error, as in New.
func (g *Guard) WithLease(lease time.Duration) (*Guard, error) {
	if lease < 10*time.Millisecond {
		return nil, fmt.Errorf("idem: Guard.WithLease: lease %v is shorter than 10ms", lease)
	}
	c := *g
	c.cfg.Lease = lease
	return &c, nil
}

// Config returns the guard's configuration with defaults filled in.
func (g *Guard) Config() Config { return g.cfg }

// Store returns the store given to New, as it was given (not wrapped for
// telemetry): s.(BatchStore) tells whether it does batches in one step.
func (g *Guard) Store() Store { return g.store }

// Result is what Do returns for work that ran or was replayed.
type Result struct {
	Response *Response
	// Replayed reports that the response came from the store and the work
	// did not run in this call.
	Replayed bool
}

// Do runs fn once for key. A repeat with the same fingerprint gets the
// stored response (Replayed is true); while another caller holds the key
// Do returns an *InFlightError; a repeat with another fingerprint returns
// ErrMismatch. When the store fails before fn runs, Do returns a
// *StoreError and fn is not run.
//
// fn's context carries the lease (LeaseFromContext) and is cancelled with
// cause ErrLeaseLost if the lease is lost. If fn returns an error or
// panics, the key is released so a later call may run it again, and the
// error (or panic) is passed on. If fn succeeds but its result cannot be
// stored (the lease was lost, the store failed), Do returns the response
// with that error: the work ran, and a later call may run it again. With
// ErrNotReplicated the result was stored, and later calls replay it, but
// a failover may still lose it. A completed record whose sealed response
// does not open (see Config.Seal) is a *SealError: fn is not run.
func (g *Guard) Do(ctx context.Context, key Key, fp Fingerprint, fn func(context.Context) (*Response, error)) (Result, error) {
	att, acq, err := g.Begin(ctx, key, fp)
	if err != nil {
		var se *SealError
		if errors.As(err, &se) {
			g.tel.Outcome(ctx, "guard", "unsealable")
		} else {
			g.tel.Outcome(ctx, "guard", "store_error")
		}
		return Result{}, err
	}
	switch acq.Outcome {
	case Replay:
		g.tel.Outcome(ctx, "guard", "replayed")
		telemetry.Event(ctx, telemetry.EventReplay)
		return Result{Response: acq.Response, Replayed: true}, nil
	case InFlight:
		g.tel.Outcome(ctx, "guard", "in_flight")
		return Result{}, &InFlightError{RetryAfter: acq.RetryAfter}
	case Mismatch:
		g.tel.Outcome(ctx, "guard", "mismatch")
		return Result{}, ErrMismatch
	case Acquired:
		g.tel.Outcome(ctx, "guard", "executed")
	default:
		return Result{}, &StoreError{Op: "acquire", Key: key, Err: fmt.Errorf("unknown outcome %v", acq.Outcome)}
	}
	// Finishing must not fail because the caller's context ended meanwhile
	// (nor be cut short by its deadline); the store's own timeouts bound it.
	finish := context.WithoutCancel(ctx)
	done := false
	defer func() {
		if !done { // fn panicked: free the key, let the panic go on
			att.Release(finish)
		}
	}()
	resp, err := fn(att.Context())
	done = true
	if err != nil {
		if rerr := att.Release(finish); rerr != nil {
			err = errors.Join(err, rerr)
		}
		return Result{}, err
	}
	if resp == nil {
		resp = &Response{}
	}
	return Result{Response: resp}, att.Complete(finish, resp)
}

// Begin is the lower-level form of Do for callers that need to decide per
// result whether to store it (the HTTP middleware stores 2xx and releases
// on 5xx). It acquires key and returns the acquisition. When its Outcome is
// Acquired, the *Attempt is non-nil and must be finished with Complete or
// Release; until then its lease is renewed in the background. A replayed
// response that is sealed is opened (Config.Seal); one that does not open
// gives a *SealError, with the Acquisition's Outcome Replay and its
// Response nil.
func (g *Guard) Begin(ctx context.Context, key Key, fp Fingerprint) (*Attempt, Acquisition, error) {
	if err := ctx.Err(); err != nil {
		return nil, Acquisition{}, &StoreError{Op: "acquire", Key: key, Err: err}
	}
	sent := time.Now()
	req := AcquireRequest{Key: key, Fingerprint: fp, LeaseID: NewLeaseID(), TTL: g.cfg.Lease}
	acq, err := g.ops.Acquire(ctx, req)
	if err != nil {
		// The acquire may have been applied with its reply lost: release
		// the lease nobody will hold, in the background, rather than leave
		// the key blocked for a whole lease. During an outage every call
		// fails, so at most maxForgets of these run at once; the others are
		// skipped (their keys free up when the lease ends).
		select {
		case g.forgets <- struct{}{}:
			go func() {
				defer func() { <-g.forgets }()
				g.forget(context.Background(), Lease{Key: key, ID: req.LeaseID, TTL: req.TTL})
			}()
		default:
		}
		return nil, acq, err
	}
	if acq.Outcome == Replay {
		return nil, acq, g.openReplay(key, fp, &acq)
	}
	if acq.Outcome != Acquired {
		return nil, acq, nil
	}
	return g.newAttempt(ctx, acq.Lease, fp, sent), acq, nil
}

// openReplay opens acq's Response when it is sealed. When it does not
// open, acq.Response is set to nil and the error is a *SealError.
func (g *Guard) openReplay(key Key, fp Fingerprint, acq *Acquisition) error {
	if !acq.Response.Sealed() {
		return nil
	}
	resp, err := OpenResponse(g.cfg.Seal, key, fp, acq.Response)
	acq.Response = resp
	return err
}

// forgetTimeout bounds a background release; maxForgets bounds how many
// run at once.
const (
	forgetTimeout = 5 * time.Second
	maxForgets    = 64
)

// forget releases l, best effort, within forgetTimeout: ErrLeaseLost (it
// was never acquired, or already finished) and store errors are ignored.
func (g *Guard) forget(ctx context.Context, l Lease) {
	ctx, cancel := context.WithTimeout(ctx, forgetTimeout)
	defer cancel()
	g.ops.Release(ctx, l)
}

// LeaseFromContext returns the lease of the work running with ctx: its Key
// and its fencing Token.
func LeaseFromContext(ctx context.Context) (Lease, bool) {
	if l, ok := ctx.Value(leaseKey{}).(*leaseValue); ok {
		return Lease(*l), true
	}
	return Lease{}, false
}

type leaseKey struct{}

// leaseValue is the lease as the attempt's context holds it, the value of
// leaseKey{}: a pointer to the Attempt's lease (never written once the
// attempt is made), so that the context costs no copy of the lease boxed
// in an interface. Only LeaseFromContext reads it, the key being
// unexported. String makes the context's name (context.WithValue's
// String) what it was with the lease itself as the value.
type leaseValue Lease

func (*leaseValue) String() string { return "idem.Lease" }

// errFinished is the cancellation cause of an attempt's context after
// Complete or Release.
var errFinished = errors.New("idem: attempt finished")

// Attempt is a held key with background lease renewal.
type Attempt struct {
	g      *Guard
	lease  Lease
	fp     Fingerprint // bound into a sealed response's associated data
	ctx    context.Context
	cancel context.CancelCauseFunc

	mu    sync.Mutex
	timer *time.Timer
	// validUntil is a local, conservative end of the lease: the moment the
	// last successful acquire or renew was sent, plus the lease.
	validUntil time.Time
	// stopRenew cancels the renewal in progress, if any.
	stopRenew    context.CancelFunc
	renewStopped bool // StopRenewal
	finished     bool
	lost         bool
	sealing      *sealState // made by the first Stored that seals
}

func (g *Guard) newAttempt(parent context.Context, l Lease, fp Fingerprint, sent time.Time) *Attempt {
	a := &Attempt{g: g, lease: l, fp: fp, validUntil: sent.Add(l.TTL)}
	a.ctx, a.cancel = context.WithCancelCause(context.WithValue(parent, leaseKey{}, (*leaseValue)(&a.lease)))
	// Short work pays no renewal: the first one fires after a third of the
	// lease.
	a.mu.Lock() // renew may run before AfterFunc returns
	a.timer = time.AfterFunc(l.TTL/3, a.renew)
	a.mu.Unlock()
	return a
}

// Context returns the context the work should run with. It carries the
// lease and is cancelled, with cause ErrLeaseLost, when the lease is lost,
// and with another cause once the attempt is finished.
func (a *Attempt) Context() context.Context { return a.ctx }

// Lease returns the held lease.
func (a *Attempt) Lease() Lease { return a.lease }

// Retention returns the guard's Retention: how long the completed record
// is kept, for callers that complete it themselves (pgstore.CompleteTx).
func (a *Attempt) Retention() time.Duration { return a.g.cfg.Retention }

// Stored returns resp as Complete stores it: without its body when that
// is larger than the guard's MaxResponseSize (see Config), and, when the
// guard seals (Config.Seal set, SealOpenOnly not), a copy that AppendBinary
// seals, bound to the attempt's key and fingerprint. Pass it, not resp, to
// a store's own completion (pgstore.CompleteTx, tieredstore.CompleteTx and
// Relay): every response Stored returns for one attempt encodes the same
// content to the same bytes, so that a store recognises a repeated
// completion. It returns resp itself when there is nothing to change, and
// never changes resp; the copy shares resp's Header and Body, so neither
// may change once passed (a store writing it again writes what it sealed
// first).
func (a *Attempt) Stored(resp *Response) *Response {
	if resp == nil || resp.sealed != nil {
		return resp // sealed already: written as it was read
	}
	if resp.Blob == nil && (resp.BodyOmitted || len(resp.Body) > a.g.cfg.MaxResponseSize) {
		resp = omitBody(resp)
	} else if resp.sealing != nil {
		c := *resp // another attempt's: seal it with this one's
		c.sealing = nil
		resp = &c
	}
	st := a.sealState()
	if st == nil {
		return resp
	}
	c := *resp
	c.sealing = st
	return &c
}

// sealState returns the attempt's sealing state, nil when the guard does
// not seal.
func (a *Attempt) sealState() *sealState {
	if a.g.cfg.Seal == nil || a.g.cfg.SealOpenOnly {
		return nil
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.sealing == nil {
		a.sealing = &sealState{s: a.g.cfg.Seal, ad: recordAD(a.lease.Key, a.fp)}
	}
	return a.sealing
}

// Open returns resp, a response of the attempt's key and fingerprint read
// from the store (tieredstore's AlreadyCompletedError holds one), as Begin
// returns a replay: opened when it is sealed (a *SealError when it does
// not open), as it is otherwise.
func (a *Attempt) Open(resp *Response) (*Response, error) {
	return OpenResponse(a.g.cfg.Seal, a.lease.Key, a.fp, resp)
}

// sealStored is Stored, sealed at once when the guard seals, so that a
// Sealer's failure is known before the store is called (and never taken
// for the store's).
func (a *Attempt) sealStored(resp *Response) (*Response, error) {
	stored := a.Stored(resp)
	if stored.sealing != nil {
		if _, err := stored.AppendBinary(nil); err != nil {
			return nil, fmt.Errorf("idem: complete %s: %w", a.lease.Key, err)
		}
	}
	return stored, nil
}

// Complete stores resp and ends the attempt. A body larger than the
// guard's MaxResponseSize is not stored (see Config). A response with a
// Blob is stored as it is, reference and all: the caller has written the
// whole blob before (idemhttp does, for large bodies), so a completed
// record never points to a blob still being written. When the guard seals
// (Config.Seal), the response is sealed once, before the store is called
// (see Stored); a Sealer's error releases the key and is returned. If the
// lease was lost,
// Complete returns ErrLeaseLost and writes nothing. If the store fails,
// Complete releases the key (best effort) so that a retry need not wait
// for the lease to end, and returns the store's error; ErrNotReplicated
// is the exception: the record was written, so nothing is released. With
// the guard's CompleteRetry set, a failed completion is tried again first,
// within the lease time left (see Config.CompleteRetry). A nil or
// unencodable resp is an error that leaves the attempt open. Use a context
// that is not cancelled with the request (context.WithoutCancel).
func (a *Attempt) Complete(ctx context.Context, resp *Response) error {
	if err := resp.validate(); err != nil {
		return err
	}
	if err := a.finish(); err != nil {
		if errors.Is(err, ErrLeaseLost) {
			// The loss may be only local (no renewal got through in
			// time) while the store still holds the lease: free the key
			// rather than leave it blocked until the lease ends. The store
			// checks the lease id, so this cannot touch another holder's.
			a.g.forget(ctx, a.lease)
		}
		return err
	}
	resp, err := a.sealStored(resp)
	if err != nil {
		a.g.forget(ctx, a.lease)
		return err
	}
	start := time.Now()
	err = a.g.ops.Complete(ctx, a.lease, resp, a.g.cfg.Retention)
	if a.g.cfg.CompleteRetry > 0 && retryableComplete(err) {
		err = a.retryComplete(ctx, start, resp, err)
	}
	if err != nil && !errors.Is(err, ErrLeaseLost) && !errors.Is(err, ErrNotReplicated) {
		a.g.forget(ctx, a.lease)
	}
	return err
}

// The backoff between completion retries (Config.CompleteRetry): from
// completeRetryMin, doubling up to completeRetryMax.
const (
	completeRetryMin = 20 * time.Millisecond
	completeRetryMax = 500 * time.Millisecond
)

// retryableComplete reports whether a completion that failed with err may
// be tried again: a store error that is not an answer (ErrLeaseLost,
// ErrNotReplicated) nor a record that will stay corrupt.
func retryableComplete(err error) bool {
	var se *StoreError
	return errors.As(err, &se) && !errors.Is(err, ErrLeaseLost) &&
		!errors.Is(err, ErrNotReplicated) && !errors.Is(err, ErrCorrupt)
}

// completeBackoff is the wait before the n-th retry (0 for the first),
// jittered over its upper half.
func completeBackoff(n int) time.Duration {
	d := completeRetryMax
	if n < 8 {
		d = min(completeRetryMin<<n, completeRetryMax)
	}
	return d/2 + rand.N(d/2+1)
}

// retryWait returns the wait before the n-th retry, shortened so that
// the retry leaves completeRetryMin before end; false if none can.
func retryWait(n int, end time.Time) (time.Duration, bool) {
	wait := min(completeBackoff(n), time.Until(end)-completeRetryMin)
	return wait, wait >= 0
}

// sleepCtx waits d, and reports false if ctx ended first.
func sleepCtx(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
		return false
	}
}

// retryUntil returns when the completion retries of a finished attempt,
// the first try sent at start, stop: after CompleteRetry, and a tenth of
// the lease before the lease may end. Renewal has stopped, so validUntil
// no longer moves.
func (a *Attempt) retryUntil(start time.Time) time.Time {
	a.mu.Lock()
	end := a.validUntil.Add(-a.lease.TTL / 10)
	a.mu.Unlock()
	if limit := start.Add(a.g.cfg.CompleteRetry); limit.Before(end) {
		end = limit
	}
	return end
}

// retryComplete tries the completion of resp again, with backoff, while
// it fails with a retryable error (err, the first time) and until
// retryUntil; it returns the last answer.
func (a *Attempt) retryComplete(ctx context.Context, start time.Time, resp *Response, err error) error {
	end := a.retryUntil(start)
	for n := 0; retryableComplete(err); n++ {
		wait, ok := retryWait(n, end)
		if !ok || !sleepCtx(ctx, wait) {
			return err
		}
		rctx, cancel := context.WithDeadline(ctx, end)
		err = a.g.ops.Complete(rctx, a.lease, resp, a.g.cfg.Retention)
		cancel()
	}
	return err
}

// omitBody returns resp without its body, and without the headers that
// describe the body.
func omitBody(resp *Response) *Response {
	omitted := &Response{Status: resp.Status, Header: resp.Header.Clone(), BodyOmitted: true}
	omitted.Header.Del("Content-Length")
	omitted.Header.Del("Content-Encoding")
	return omitted
}

// Release ends the attempt without a result, so the key can be run again.
// After a lost lease it returns ErrLeaseLost, having still asked the store
// to release (the loss may be only local; see Complete).
func (a *Attempt) Release(ctx context.Context) error {
	if err := a.finish(); err != nil {
		if errors.Is(err, ErrLeaseLost) {
			a.g.ops.Release(ctx, a.lease) // ErrLeaseLost unless the loss was only local
		}
		return err
	}
	return a.g.ops.Release(ctx, a.lease)
}

// Stop ends the attempt without touching the store: renewal stops and
// the work's context is cancelled. It is for callers that finished the
// record themselves, such as pgstore.CompleteTx inside their own
// transaction (call StopRenewal before CompleteTx, Stop after the commit,
// Release after a rollback). It returns ErrLeaseLost if the lease was lost
// before.
func (a *Attempt) Stop() error { return a.finish() }

// StopRenewal stops the background renewal and leaves the attempt open and
// its context live; the lease then lasts until the end the last successful
// renewal (or the acquire) gave it. Call it before completing the record inside
// your own transaction (pgstore.CompleteTx): otherwise a renewal can wait
// on the row the transaction locked, find the record completed once it
// commits, and cancel, with ErrLeaseLost, the very context the commit runs
// with (found by the crash suite, reliability/crash).
func (a *Attempt) StopRenewal() {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.renewStopped = true
	a.timer.Stop()
	if a.stopRenew != nil {
		a.stopRenew()
	}
}

// finish stops renewal, cancelling one in progress, and cancels the work's
// context. It fails if the attempt already finished or its lease was lost.
func (a *Attempt) finish() error {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.finished {
		return errors.New("idem: attempt already completed or released")
	}
	a.finished = true
	a.timer.Stop()
	if a.stopRenew != nil {
		a.stopRenew()
	}
	a.cancel(errFinished)
	if a.lost {
		return ErrLeaseLost
	}
	return nil
}

// renew runs on the timer. The store call runs without the lock, so
// Complete and Release never wait for it: they cancel it.
func (a *Attempt) renew() {
	a.mu.Lock()
	if a.finished || a.lost || a.renewStopped {
		a.mu.Unlock()
		return
	}
	left := time.Until(a.validUntil)
	if left <= 0 {
		a.loseLocked()
		a.mu.Unlock()
		a.onRenew(ErrLeaseLost)
		return
	}
	ctx, cancel := context.WithTimeout(context.WithoutCancel(a.ctx), left)
	a.stopRenew = cancel
	a.mu.Unlock()

	sent := time.Now()
	err := a.g.ops.Renew(ctx, a.lease, a.g.cfg.Lease)
	cancel()

	a.mu.Lock()
	defer a.mu.Unlock()
	a.stopRenew = nil
	if a.finished || a.renewStopped {
		return // finished or stopped meanwhile; the answer no longer matters
	}
	a.onRenew(err)
	switch {
	case err == nil:
		a.validUntil = sent.Add(a.g.cfg.Lease)
		a.timer.Reset(a.g.cfg.Lease / 3)
	case errors.Is(err, ErrLeaseLost):
		a.loseLocked()
	default:
		// The store is unreachable or slow: try again soon, and give the
		// lease up once it may have ended.
		if left = time.Until(a.validUntil); left <= 0 {
			a.loseLocked()
			a.onRenew(ErrLeaseLost)
			return
		}
		a.timer.Reset(min(a.g.cfg.Lease/10, left))
	}
}

func (a *Attempt) loseLocked() {
	a.lost = true
	telemetry.Event(a.ctx, telemetry.EventLeaseLost, telemetry.AttrToken.Int64(int64(a.lease.Token)))
	a.cancel(ErrLeaseLost)
}

// onRenew reports a renewal's result to Config.OnRenew and to the
// telemetry.
func (a *Attempt) onRenew(err error) {
	if a.g.cfg.OnRenew != nil {
		a.g.cfg.OnRenew(a.lease.Key, err)
	}
	a.g.tel.Renewal(result(err))
}
