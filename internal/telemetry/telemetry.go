// Package telemetry holds idem's OpenTelemetry instruments, shared by the
// Guard and the layers over it. A nil *T records nothing and costs
// nothing: every method checks for it first, so code that was given no
// provider pays one nil check.
package telemetry

import (
	"context"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/trace"
)

// ScopeName is the instrumentation scope of idem's tracer and meter.
const ScopeName = "github.com/idemkit/idem"

// Attribute keys. Keys are never raw: idem.key is the record key's digest,
// as the logs show it.
const (
	AttrKey       = attribute.Key("idem.key")
	AttrStore     = attribute.Key("idem.store")
	AttrOp        = attribute.Key("idem.op")
	AttrOutcome   = attribute.Key("idem.outcome")
	AttrResult    = attribute.Key("idem.result")
	AttrToken     = attribute.Key("idem.token")
	AttrLeaseLeft = attribute.Key("idem.lease_left_ms")
	AttrAttempt   = attribute.Key("idem.attempt")
	AttrLayer     = attribute.Key("idem.layer")
)

// Span events on the caller's span.
const (
	EventReplay     = "idem.replay"
	EventWait       = "idem.wait"
	EventLeaseLost  = "idem.lease_lost"
	EventClientGone = "idem.client_gone"
)

// T is the set of instruments of one configuration.
type T struct {
	tracer    trace.Tracer // nil: no spans
	storeDur  metric.Float64Histogram
	outcomes  metric.Int64Counter
	renewals  metric.Int64Counter
	deadLtrs  metric.Int64Counter
	anonymous metric.Int64Counter
	hasMeters bool
}

// New returns the instruments of tp and mp, or nil when both are nil.
func New(tp trace.TracerProvider, mp metric.MeterProvider) (*T, error) {
	if tp == nil && mp == nil {
		return nil, nil
	}
	t := &T{}
	if tp != nil {
		t.tracer = tp.Tracer(ScopeName)
	}
	if mp != nil {
		m := mp.Meter(ScopeName)
		var err error
		if t.storeDur, err = m.Float64Histogram("idem.store.duration", metric.WithUnit("s"),
			metric.WithDescription("Latency of idempotency store calls, by operation, store and result."),
			metric.WithExplicitBucketBoundaries(.0001, .00025, .0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5)); err != nil {
			return nil, err
		}
		if t.outcomes, err = m.Int64Counter("idem.outcomes",
			metric.WithDescription("What idem did with a request or message, by layer (guard, http, grpc, msg, lambda) and outcome.")); err != nil {
			return nil, err
		}
		if t.renewals, err = m.Int64Counter("idem.lease.renewals",
			metric.WithDescription("Background lease renewals by result: ok, lease_lost, error.")); err != nil {
			return nil, err
		}
		if t.deadLtrs, err = m.Int64Counter("idem.dead_letters",
			metric.WithDescription("Messages dead-lettered after too many failures.")); err != nil {
			return nil, err
		}
		if t.anonymous, err = m.Int64Counter("idem.anonymous",
			metric.WithDescription("Keyed requests that no tenant source identified, by layer (http, grpc, lambda), refused or not.")); err != nil {
			return nil, err
		}
		t.hasMeters = true
	}
	return t, nil
}

// Op is a store operation in progress: its span, if any, and its start.
type Op struct {
	t     *T
	span  trace.Span
	op    string
	store string
	start time.Time
}

// StartOp starts the span (a child of ctx's) and the clock of store
// operation op on key (its digest). Call End with its result.
func (t *T) StartOp(ctx context.Context, op, store, key string) (context.Context, Op) {
	o := Op{t: t, op: op, store: store, start: time.Now()}
	if t.tracer != nil {
		ctx, o.span = t.tracer.Start(ctx, "idem."+op, trace.WithSpanKind(trace.SpanKindInternal),
			trace.WithAttributes(AttrKey.String(key), AttrStore.String(store)))
	}
	return ctx, o
}

// End records the operation's result ("ok", "replay", "in_flight",
// "lease_lost", "error", ...), err (set on the span as its status) and
// extra attributes for the span.
func (o Op) End(ctx context.Context, result string, err error, attrs ...attribute.KeyValue) {
	if o.t.hasMeters {
		o.t.storeDur.Record(ctx, time.Since(o.start).Seconds(), metric.WithAttributes(
			AttrOp.String(o.op), AttrStore.String(o.store), AttrResult.String(result)))
	}
	if o.span != nil {
		o.span.SetAttributes(AttrResult.String(result))
		o.span.SetAttributes(attrs...)
		if err != nil && result == "error" {
			o.span.RecordError(err)
			o.span.SetStatus(codes.Error, err.Error())
		}
		o.span.End()
	}
}

// Outcome counts one outcome of layer and, for a replay, marks ctx's span
// with an event.
func (t *T) Outcome(ctx context.Context, layer, outcome string, attrs ...attribute.KeyValue) {
	if t == nil {
		return
	}
	if t.hasMeters {
		t.outcomes.Add(ctx, 1, metric.WithAttributes(AttrLayer.String(layer), AttrOutcome.String(outcome)))
	}
	if t.tracer != nil {
		span := trace.SpanFromContext(ctx)
		span.SetAttributes(append(attrs, AttrOutcome.String(outcome))...)
	}
}

// Renewal counts a background lease renewal's result: ok, lease_lost or
// error.
func (t *T) Renewal(result string) {
	if t == nil || !t.hasMeters {
		return
	}
	t.renewals.Add(context.Background(), 1, metric.WithAttributes(AttrResult.String(result)))
}

// Anonymous counts a keyed request of layer that no tenant source
// identified.
func (t *T) Anonymous(ctx context.Context, layer string) {
	if t == nil || !t.hasMeters {
		return
	}
	t.anonymous.Add(ctx, 1, metric.WithAttributes(AttrLayer.String(layer)))
}

// DeadLetter counts a dead-lettered message.
func (t *T) DeadLetter(ctx context.Context) {
	if t == nil || !t.hasMeters {
		return
	}
	t.deadLtrs.Add(ctx, 1)
}

// Event adds the event name to ctx's span, if it records. It costs
// nothing when ctx has no span.
func Event(ctx context.Context, name string, attrs ...attribute.KeyValue) {
	span := trace.SpanFromContext(ctx)
	if !span.IsRecording() {
		return
	}
	span.AddEvent(name, trace.WithAttributes(attrs...))
}
