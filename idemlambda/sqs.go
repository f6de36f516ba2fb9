package idemlambda

import (
	"cmp"
	"context"
	"errors"
	"log/slog"
	"net/http"
	"time"

	"github.com/aws/aws-lambda-go/events"
	"github.com/aws/aws-lambda-go/lambdacontext"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/telemetry"
)

// SQSConfig tunes WrapSQS. The zero value means the defaults; the fields
// Config has too mean what they mean there.
type SQSConfig struct {
	// Key returns a record's idempotency key. Default SQSMessageID: SQS
	// gives a message the same id on every delivery, and a new id when it
	// is sent again. A record whose key cannot be taken (an error, or "")
	// is reported as failed and its handler does not run.
	Key func(events.SQSMessage) (string, error)

	// Payload selects the part of a record that must be the same every
	// time its key is used (see Config.Payload). A record that reuses a
	// key with another payload is reported as failed, without running.
	// Default nil: no check.
	Payload func(events.SQSMessage) any

	// Namespace scopes the keys: idem.Scope{Method: "lambda/sqs", Route:
	// Namespace}. Default: the function's name (lambdacontext.FunctionName).
	Namespace string

	// FIFO, for a FIFO queue, stops at the first record that fails: it and
	// every later record of the batch are reported as failed, and the
	// later ones are not run (their keys are released), so SQS delivers
	// them again in order. Default false: every record is tried.
	FIFO bool

	// Lease, DeadlineMargin, Retention and CompleteRetry: see Config
	// (defaults 30s, DefaultDeadlineMargin, 24h, and Lease; a negative
	// CompleteRetry: no retry).
	Lease          time.Duration
	DeadlineMargin time.Duration
	Retention      time.Duration
	CompleteRetry  time.Duration

	// OnRenew, Seal and SealOpenOnly: see Config.
	OnRenew      func(key idem.Key, err error)
	Seal         idem.Sealer
	SealOpenOnly bool

	// TracerProvider and MeterProvider: see Config; each record's outcome
	// is counted in idem.outcomes (layer "lambda").
	TracerProvider trace.TracerProvider
	MeterProvider  metric.MeterProvider

	// OnOutcome, when set, is called once for every record of a batch,
	// with what WrapSQS did with it (see Config.OnOutcome). It must not
	// block.
	OnOutcome func(ctx context.Context, m events.SQSMessage, o Outcome)

	// Logger receives the records reported as failed without running,
	// results not stored and sealed results that do not open. Default
	// slog.Default().
	Logger *slog.Logger
}

// WrapSQS returns a handler for SQS batch events with partial batch
// responses (the event source mapping's ReportBatchItemFailures): each
// record has its own key and runs h at most once per completed key, in
// the order of the batch.
//
// The keys of the whole batch are acquired in one store step (one round
// trip on a BatchStore), with one lease each (bounded as Wrap's). Then,
// record by record: a key acquired runs h, and is completed (one store
// call) as soon as h returns nil, or released when h fails or panics; a
// key that already completed is a success without running h (a
// redelivery, or a message sent twice with the same key); a key that
// an earlier record of the same batch held has that record's answer; a key in
// flight elsewhere, a payload mismatch, a key that cannot be taken, a
// store failure and an error from h are reported in BatchItemFailures,
// so SQS delivers those records again and deletes the others. A key that
// completed but whose sealed result cannot be opened (SQSConfig.Seal) is a
// success too, logged at ERROR with the key id: h ran for it once. A record
// whose result could not be stored after h succeeded is a success (h's
// effect happened; redelivering it would run h again) and is logged.
//
// The returned error is always nil: every failure is a record's. h's
// context carries the record's lease and fencing token (FencingToken).
func WrapSQS(store idem.Store, cfg SQSConfig, h func(context.Context, events.SQSMessage) error) (func(context.Context, events.SQSEvent) (events.SQSEventResponse, error), error) {
	if h == nil {
		return nil, errors.New("idemlambda: WrapSQS: nil handler")
	}
	gs, err := newGuards(store, guardConfig(cfg.Lease, cfg.Retention, 0, cfg.CompleteRetry, cfg.OnRenew,
		cfg.Seal, cfg.SealOpenOnly, cfg.TracerProvider, cfg.MeterProvider), cfg.DeadlineMargin)
	if err != nil {
		return nil, err
	}
	tel, err := telemetry.New(cfg.TracerProvider, cfg.MeterProvider)
	if err != nil {
		return nil, err
	}
	if cfg.Key == nil {
		cfg.Key = SQSMessageID
	}
	b := &batch{cfg: cfg, h: h, gs: gs, tel: tel, log: cmp.Or(cfg.Logger, slog.Default()),
		scope: idem.Scope{Method: "lambda/sqs", Route: cmp.Or(cfg.Namespace, lambdacontext.FunctionName)}}
	return b.invoke, nil
}

type batch struct {
	cfg   SQSConfig
	h     func(context.Context, events.SQSMessage) error
	gs    *guards
	tel   *telemetry.T // nil without providers
	scope idem.Scope
	log   *slog.Logger
}

// report tells the telemetry and SQSConfig.OnOutcome what record m became.
func (b *batch) report(ctx context.Context, m events.SQSMessage, o Outcome) {
	b.tel.Outcome(ctx, layer, string(o))
	if b.cfg.OnOutcome != nil {
		b.cfg.OnOutcome(ctx, m, o)
	}
}

// executed is the stored result of a record whose handler succeeded.
var executed = &idem.Response{Status: http.StatusOK}

func (b *batch) invoke(ctx context.Context, ev events.SQSEvent) (events.SQSEventResponse, error) {
	n := len(ev.Records)
	var resp events.SQSEventResponse
	fail := func(i int) {
		resp.BatchItemFailures = append(resp.BatchItemFailures, events.SQSBatchItemFailure{ItemIdentifier: ev.Records[i].MessageId})
	}
	if n == 0 {
		return resp, nil
	}
	// Keys first: a record without one fails alone.
	reqs := make([]idem.BeginRequest, 0, n)
	at := make([]int, n) // record -> index in reqs, or -1
	for i, m := range ev.Records {
		at[i] = -1
		ck, err := clientKey(b.cfg.Key, m)
		if err != nil {
			b.log.WarnContext(ctx, "idemlambda: SQS record without a usable idempotency key; reported as failed",
				"messageId", m.MessageId, "error", err)
			continue
		}
		key, err := b.scope.Key(ck)
		if err != nil {
			b.log.WarnContext(ctx, "idemlambda: SQS record with an invalid idempotency key; reported as failed",
				"messageId", m.MessageId, "error", err)
			continue
		}
		fp, err := fingerprint(b.cfg.Payload, m)
		if err != nil {
			b.log.WarnContext(ctx, "idemlambda: SQS record's payload does not encode; reported as failed",
				"messageId", m.MessageId, "error", err)
			continue
		}
		at[i] = len(reqs)
		reqs = append(reqs, idem.BeginRequest{Key: key, Fingerprint: fp})
	}
	g, bounded, err := b.gs.forCtx(ctx)
	if err != nil {
		return resp, err
	}
	begun := g.BeginMany(ctx, reqs)
	finish := context.WithoutCancel(ctx)
	open := make([]bool, len(begun)) // attempts not finished yet
	for j, bg := range begun {
		if bg.Attempt != nil {
			open[j] = true
			if bounded {
				bg.Attempt.StopRenewal()
			}
		}
	}
	// Whatever happens (a panic in h), no acquired key stays held until
	// its lease ends: release the attempts not finished, in one step.
	running := -1 // the record whose h runs
	defer func() {
		if running >= 0 { // h panicked
			b.report(ctx, ev.Records[running], OutcomeReleased)
		}
		var rel []idem.Finish
		for j, o := range open {
			if o {
				rel = append(rel, idem.Finish{Attempt: begun[j].Attempt})
			}
		}
		if len(rel) > 0 {
			g.FinishMany(finish, rel)
		}
	}()
	// earlier holds, per key acquired by this batch, whether its record
	// succeeded.
	earlier := map[idem.Key]*bool{}
	stopped := false
	for i, m := range ev.Records {
		j := at[i]
		if j < 0 {
			b.report(ctx, m, OutcomeRejected)
			fail(i)
			stopped = stopped || b.cfg.FIFO
			continue
		}
		if stopped {
			b.report(ctx, m, OutcomeReleased) // not run: its key, if acquired, released
			fail(i)
			continue
		}
		bg := begun[j]
		var se *idem.SealError
		switch {
		case errors.As(bg.Err, &se):
			// Completed before, its result sealed and unreadable: done,
			// as a replay is (a failure would be delivered again, and
			// never run).
			logUnsealable(ctx, b.log, se, m.MessageId)
			b.report(ctx, m, OutcomeUnsealable)
			continue
		case bg.Err != nil:
			b.log.WarnContext(ctx, "idemlambda: the store failed before the SQS record ran; reported as failed",
				"messageId", m.MessageId, "error", bg.Err)
			b.report(ctx, m, OutcomeStoreError)
			fail(i)
			stopped = b.cfg.FIFO
			continue
		case bg.Acquisition.Outcome == idem.Replay:
			b.report(ctx, m, OutcomeReplayed)
			continue // done before: a success
		case bg.Acquisition.Outcome == idem.InFlight && earlier[reqs[j].Key] != nil:
			// The same key earlier in this batch (a message delivered
			// twice in one batch) held it: its answer is this one's.
			if !*earlier[reqs[j].Key] {
				b.report(ctx, m, OutcomeInFlight)
				fail(i)
				stopped = b.cfg.FIFO
			} else {
				b.report(ctx, m, OutcomeReplayed)
			}
			continue
		case bg.Acquisition.Outcome != idem.Acquired:
			// In flight elsewhere (SQS delivers it again later) or a
			// payload mismatch (it fails until it is dead-lettered by
			// the queue's redrive policy).
			if bg.Acquisition.Outcome == idem.Mismatch {
				b.report(ctx, m, OutcomeMismatch)
			} else {
				b.report(ctx, m, OutcomeInFlight)
			}
			fail(i)
			stopped = b.cfg.FIFO
			continue
		}
		att := bg.Attempt
		ok := false
		earlier[reqs[j].Key] = &ok
		running = i
		herr := b.h(att.Context(), m) // a panic: the deferred release frees the key
		running = -1
		open[j] = false
		if herr != nil {
			if rerr := att.Release(finish); rerr != nil {
				b.log.WarnContext(ctx, "idemlambda: release after a handler error failed; the key is free once the lease ends",
					"messageId", m.MessageId, "error", rerr)
			}
			b.report(ctx, m, OutcomeReleased)
			fail(i)
			stopped = b.cfg.FIFO
			continue
		}
		ok = true
		b.report(ctx, m, OutcomeExecuted)
		if err := att.Complete(finish, executed); err != nil {
			b.log.WarnContext(ctx, "idemlambda: the SQS record's handler ran but its result was not stored; a redelivery may run it again",
				"messageId", m.MessageId, "error", err)
		}
	}
	return resp, nil
}
