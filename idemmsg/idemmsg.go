package idemmsg

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"strconv"
	"sync"
	"time"

	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/telemetry"
)

// DefaultMaxFailures is Config.MaxFailures's default.
const DefaultMaxFailures = 5

// Stored statuses and markers; see the package documentation.
const (
	// StatusExecuted is the status stored for an executed key.
	StatusExecuted = 200
	// StatusDeadLettered is the status stored for a dead-lettered key,
	// with OutcomeHeader set to "dead-lettered" and the error text as body.
	StatusDeadLettered = 500
	// OutcomeHeader names the stored header that marks a dead-lettered key.
	OutcomeHeader = "Idem-Outcome"
	// MaxErrorText is the longest error text kept for a dead-lettered key,
	// in bytes; a longer text is cut.
	MaxErrorText = 4 << 10
)

const deadLetteredValue = "dead-lettered"

// Config tunes a Deduplicator. The zero value means the defaults.
type Config struct {
	// Namespace scopes the keys: use the stream or queue and the consumer
	// group, so that two groups that each handle the same message do not
	// share a record. Keys are idem.Scope{Method: "msg", Route: Namespace}.
	Namespace string

	// Lease is how long a consumer owns a key before another may take it
	// over; it is renewed while the handler runs. Default 30s (idem.Config).
	Lease time.Duration

	// Retention is how long a completed key (executed or dead-lettered)
	// is remembered. Default 24h.
	Retention time.Duration

	// MaxFailures is the delivery count (Delivery.Attempt) at which a
	// failing handler's error is recorded as the key's result: the delivery
	// is DeadLettered and so is every later one. Default 5; 1 dead-letters
	// on the first failure. Negative is an error.
	MaxFailures int

	// Fingerprint, when set, summarises a delivery's content; a key
	// delivered again with another fingerprint is refused with
	// idem.ErrMismatch. Default: none (the zero Fingerprint for every
	// delivery), since identical messages can be legitimate.
	Fingerprint func(d Delivery) idem.Fingerprint

	// OnRenew, when set, is called after each background lease renewal
	// (see idem.Config.OnRenew). It must not block.
	OnRenew func(key idem.Key, err error)

	// Seal, when set, seals the results stored at rest, and SealOpenOnly
	// stores new ones in clear while sealed ones still open: see
	// idem.Config's fields of the same names. A key whose stored result
	// is sealed and does not open is never handled again: Handle returns
	// an *idem.SealError (idem.ErrUnsealable), which the adapters treat as
	// permanent, as a mismatch (see the package documentation).
	Seal         idem.Sealer
	SealOpenOnly bool

	// Logger receives the ERROR line of each delivery whose key's stored
	// result is sealed and cannot be opened, naming the key and the key
	// id, never content. Default slog.Default().
	Logger *slog.Logger

	// CompleteRetry is how long recording a handler's result (Executed or
	// DeadLettered; by Handle and HandleBatch) is tried again when the
	// store fails, before the key is released: the handler's effect is
	// applied, and a released key would run it again on the next delivery.
	// A store that is back within it records the result as if it had never
	// been away. The tries stop before the lease may end, by this
	// consumer's clock: renewal stops when the handler returns, so they
	// are bounded by the lease left then (see idem.Config.CompleteRetry).
	// Default: Lease, which means as long as the lease allows. Negative: no
	// retry.
	CompleteRetry time.Duration

	// TracerProvider and MeterProvider, when set, report through
	// OpenTelemetry what idem.Config says of them, plus each delivery's
	// outcome in the counter idem.outcomes (layer "msg") and as the
	// attributes idem.outcome and idem.attempt of the caller's span, and
	// the counter idem.dead_letters. Default nil: none of it, at no cost.
	TracerProvider trace.TracerProvider
	MeterProvider  metric.MeterProvider
}

// Delivery is one delivery of a message, as the broker gave it.
type Delivery struct {
	// Key identifies the message: 1 to 255 printable ASCII bytes
	// (idem.ValidateKey).
	Key string
	// Attempt is the broker's delivery count, 1 for the first delivery.
	// Values below 1 count as 1.
	Attempt int
	// Body is the message content, read only by Config.Fingerprint. It may
	// be nil.
	Body []byte
}

// Outcome is what Handle decided for a delivery. Its String is the word
// the telemetry reports; Executed, Replayed and Released share theirs
// ("executed", "replayed", "released") with Guard, idemhttp and idemgrpc.
type Outcome uint8

const (
	// NoOutcome is the zero Outcome: Handle decided nothing, as in the
	// zero Result that comes with an invalid key, a mismatch or a store
	// failure before the handler ran. It prints as "none".
	NoOutcome Outcome = iota
	// Executed: the handler ran and its success is recorded. Acknowledge.
	Executed
	// Replayed: the key already completed; the handler did not run.
	// Acknowledge.
	Replayed
	// InFlight: another consumer holds the key's lease; the handler did not
	// run. Redeliver after Result.RetryAfter.
	InFlight
	// Released: the handler returned Result.Err; the key was released.
	// Redeliver, with backoff.
	Released
	// DeadLettered: the failure is recorded as the key's result, on this
	// delivery or an earlier one; Result.Err holds the error (its kept
	// text, for an earlier one). Acknowledge, or route the message to the
	// broker's dead-letter destination.
	DeadLettered
)

func (o Outcome) String() string {
	switch o {
	case NoOutcome:
		return "none"
	case Executed:
		return "executed"
	case Replayed:
		return "replayed"
	case InFlight:
		return "in_flight"
	case Released:
		return "released"
	case DeadLettered:
		return "dead_lettered"
	}
	return "outcome(" + strconv.Itoa(int(o)) + ")"
}

// Ack reports whether the broker should be told the message is done:
// true for Executed, Replayed and DeadLettered.
func (o Outcome) Ack() bool { return o == Executed || o == Replayed || o == DeadLettered }

// Result is the decision for one delivery.
type Result struct {
	Outcome Outcome
	// RetryAfter is set for InFlight: the time until the holder's lease
	// ends, on the store's clock.
	RetryAfter time.Duration
	// Err is the handler's error for Released and DeadLettered; for a key
	// dead-lettered by an earlier delivery, an error with the kept text.
	Err error
}

// Deduplicator runs a message handler at most once per completed key. It
// is safe for concurrent use.
type Deduplicator struct {
	guard *idem.Guard
	tel   *telemetry.T // nil without providers
	scope idem.Scope
	cfg   Config

	srcMu  sync.Mutex
	source string // the first source Serve accepted with Config.Namespace empty
}

// ErrSharedNamespace is wrapped by the error of Serve, and so of an
// adapter's Run, when a Deduplicator whose Config.Namespace is empty is
// asked to serve a second source with the broker's own message ids as
// keys. Those ids are unique only within their stream or queue (Redis
// stream entry ids repeat across streams; a message fanned out to two
// queues keeps its message-id): one record would answer both, and the
// second message would be acked without running.
var ErrSharedNamespace = errors.New("idemmsg: a Deduplicator with an empty Config.Namespace serves one stream or queue when keys are the broker's message ids")

// Serve is called by the adapters when they start consuming source (a
// stream, queue or subject) with keys that are unique only within it:
// the broker's message ids, not a key the caller chose (Consumer.Key,
// KeyField). With Config.Namespace empty, a second source is refused with
// an error wrapping ErrSharedNamespace; with a Namespace, every source is
// accepted: the namespace says which streams share records (one per
// stream and group, as Config.Namespace says, or one for several whose ids
// name the same messages, a queue and its retry queue). Keys are not
// changed, so that records stored before stay valid. Safe for concurrent
// use.
func (d *Deduplicator) Serve(source string) error {
	if d.cfg.Namespace != "" {
		return nil
	}
	d.srcMu.Lock()
	defer d.srcMu.Unlock()
	switch d.source {
	case "":
		d.source = source
	case source:
	default:
		return fmt.Errorf("%w: it serves %s, and now %s, whose message ids may be the same: give %s its own Deduplicator, "+
			"with Config.Namespace set to the stream (or queue) and group (and keep this one, whose records stay valid, for %s)",
			ErrSharedNamespace, d.source, source, source, d.source)
	}
	return nil
}

// New returns a Deduplicator over store. It validates cfg and fills in
// defaults.
func New(store idem.Store, cfg Config) (*Deduplicator, error) {
	switch {
	case cfg.MaxFailures == 0:
		cfg.MaxFailures = DefaultMaxFailures
	case cfg.MaxFailures < 0:
		return nil, fmt.Errorf("idemmsg: Config.MaxFailures %d is negative", cfg.MaxFailures)
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.CompleteRetry == 0 {
		cfg.CompleteRetry = cmp.Or(cfg.Lease, idem.DefaultLease)
	}
	g, err := idem.New(store, idem.Config{Lease: cfg.Lease, Retention: cfg.Retention, OnRenew: cfg.OnRenew,
		CompleteRetry: max(cfg.CompleteRetry, 0), TracerProvider: cfg.TracerProvider, MeterProvider: cfg.MeterProvider,
		Seal: cfg.Seal, SealOpenOnly: cfg.SealOpenOnly})
	if err != nil {
		return nil, err
	}
	tel, err := telemetry.New(cfg.TracerProvider, cfg.MeterProvider)
	if err != nil {
		return nil, err
	}
	gc := g.Config()
	cfg.Lease, cfg.Retention = gc.Lease, gc.Retention
	return &Deduplicator{guard: g, tel: tel, scope: idem.Scope{Method: "msg", Route: cfg.Namespace}, cfg: cfg}, nil
}

// Config returns the configuration with defaults filled in.
func (d *Deduplicator) Config() Config { return d.cfg }

// Key returns the record key of a message key.
func (d *Deduplicator) Key(msgKey string) (idem.Key, error) { return d.scope.Key(msgKey) }

// Handle decides what to do with delivery dl and runs fn when the key is
// free. See the package documentation for the outcomes and the broker
// action each calls for.
//
// fn's context carries the lease and its fencing token
// (idem.LeaseFromContext) and is cancelled if the lease is lost. If fn
// panics, the key is released and the panic goes on.
//
// Errors: an invalid key (wrapping idem.ErrInvalidKey), a fingerprint
// mismatch (idem.ErrMismatch) or a completed key whose sealed result does
// not open (an *idem.SealError, idem.ErrUnsealable: fn did not run, and
// is never run for the key; logged at ERROR to Config.Logger) with a zero
// Result; a *idem.StoreError with a
// zero Result when the store failed before fn ran (fn did not run). When
// fn ran but its result could not be recorded, even when tried again for
// Config.CompleteRetry, Handle returns the Result (Executed, Released)
// together with the store's error.
func (d *Deduplicator) Handle(ctx context.Context, dl Delivery, fn func(ctx context.Context) error) (Result, error) {
	res, err := d.handle(ctx, dl, fn)
	if d.tel != nil {
		d.observe(ctx, dl, res, err)
	}
	return res, err
}

// observe reports Handle's decision to the telemetry.
func (d *Deduplicator) observe(ctx context.Context, dl Delivery, res Result, err error) {
	outcome := res.Outcome.String()
	switch {
	case res.Outcome != NoOutcome:
	case errors.Is(err, idem.ErrMismatch):
		outcome = "mismatch"
	case errors.Is(err, idem.ErrInvalidKey):
		outcome = "rejected"
	case errors.Is(err, idem.ErrUnsealable):
		outcome = "unsealable"
	default:
		outcome = "store_error"
	}
	d.tel.Outcome(ctx, "msg", outcome, telemetry.AttrAttempt.Int(max(dl.Attempt, 1)))
	if res.Outcome == DeadLettered && !errors.As(res.Err, new(*DeadLetterError)) { // recorded now, not earlier
		d.tel.DeadLetter(ctx)
	}
}

func (d *Deduplicator) handle(ctx context.Context, dl Delivery, fn func(ctx context.Context) error) (Result, error) {
	key, err := d.scope.Key(dl.Key)
	if err != nil {
		return Result{}, err
	}
	var fp idem.Fingerprint
	if d.cfg.Fingerprint != nil {
		fp = d.cfg.Fingerprint(dl)
	}
	att, acq, err := d.guard.Begin(ctx, key, fp)
	if ue := d.unsealable(ctx, err); ue != nil {
		return Result{}, ue
	}
	if err != nil {
		var se *idem.StoreError
		if !errors.As(err, &se) {
			err = &idem.StoreError{Op: "acquire", Key: key, Err: err}
		}
		return Result{}, err
	}
	switch acq.Outcome {
	case idem.Replay:
		if text, ok := deadLetterText(acq.Response); ok {
			return Result{Outcome: DeadLettered, Err: &DeadLetterError{Text: text}}, nil
		}
		return Result{Outcome: Replayed}, nil
	case idem.InFlight:
		return Result{Outcome: InFlight, RetryAfter: acq.RetryAfter}, nil
	case idem.Mismatch:
		return Result{}, idem.ErrMismatch
	case idem.Acquired:
	default:
		return Result{}, &idem.StoreError{Op: "acquire", Key: key, Err: fmt.Errorf("unknown outcome %v", acq.Outcome)}
	}

	// Recording the result must not fail because the caller's context
	// ended meanwhile; the store's own timeouts bound it.
	finish := context.WithoutCancel(ctx)
	done := false
	defer func() {
		if !done { // fn panicked: free the key, let the panic go on
			att.Release(finish)
		}
	}()
	ferr := fn(att.Context())
	done = true

	if ferr == nil {
		return Result{Outcome: Executed}, att.Complete(finish, &idem.Response{Status: StatusExecuted})
	}
	// A handler stopped from outside (the consumer shutting down, the
	// lease lost) did not fail on its own: never dead-letter for that.
	stopped := ctx.Err() != nil || context.Cause(att.Context()) != nil
	if !stopped && max(dl.Attempt, 1) >= d.cfg.MaxFailures {
		if err := att.Complete(finish, deadLetterResponse(ferr)); err != nil {
			if errors.Is(err, idem.ErrNotReplicated) {
				return Result{Outcome: DeadLettered, Err: ferr}, err // recorded
			}
			// Not recorded (Complete released the key unless the lease
			// was lost): the next delivery fails and tries again.
			return Result{Outcome: Released, Err: ferr}, err
		}
		return Result{Outcome: DeadLettered, Err: ferr}, nil
	}
	return Result{Outcome: Released, Err: ferr}, att.Release(finish)
}

// unsealable returns err when it is an *idem.SealError (a completed key
// whose sealed result does not open), logged at ERROR with the key and
// the key id; nil otherwise.
func (d *Deduplicator) unsealable(ctx context.Context, err error) error {
	var se *idem.SealError
	if !errors.As(err, &se) {
		return nil
	}
	d.cfg.Logger.LogAttrs(ctx, slog.LevelError, "idem: the stored result is sealed and cannot be opened (altered, or under a key id not in the ring); "+
		"the key completed before and the message is not handled again",
		slog.String("namespace", d.cfg.Namespace), slog.String("key", se.Key.String()), slog.String("key_id", se.KeyID), slog.Any("error", se.Err))
	return se
}

// DeadLetterError is Result.Err for a key dead-lettered by an earlier
// delivery: the error text that was kept.
type DeadLetterError struct {
	Text string
}

func (e *DeadLetterError) Error() string { return e.Text }

func deadLetterResponse(err error) *idem.Response {
	text := err.Error()
	if len(text) > MaxErrorText {
		text = text[:MaxErrorText]
	}
	return &idem.Response{
		Status: StatusDeadLettered,
		Header: http.Header{OutcomeHeader: {deadLetteredValue}, "Content-Type": {"text/plain; charset=utf-8"}},
		Body:   []byte(text),
	}
}

// deadLetterText reports whether resp marks a dead-lettered key, and its
// kept error text.
func deadLetterText(resp *idem.Response) (string, bool) {
	if resp == nil || resp.Header.Get(OutcomeHeader) != deadLetteredValue {
		return "", false
	}
	return string(resp.Body), true
}
