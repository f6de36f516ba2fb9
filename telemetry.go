package idem

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"go.opentelemetry.io/otel/attribute"

	"github.com/idemkit/idem/internal/telemetry"
)

// observedStore is a Store whose every call is a span (idem.acquire,
// idem.complete, ...; a child of the caller's span) and a point of the
// idem.store.duration histogram. The Guard uses it when Config has a
// tracer or meter provider.
type observedStore struct {
	Store
	t    *telemetry.T
	kind string // e.g. "redisstore"
}

func newObservedStore(s Store, t *telemetry.T) *observedStore {
	kind := strings.TrimPrefix(fmt.Sprintf("%T", s), "*")
	kind, _, _ = strings.Cut(kind, ".")
	return &observedStore{Store: s, t: t, kind: kind}
}

// result names the outcome of a call that answers only an error.
func result(err error) string {
	switch {
	case err == nil:
		return "ok"
	case errors.Is(err, ErrLeaseLost):
		return "lease_lost"
	case errors.Is(err, ErrNotReplicated):
		return "not_replicated"
	}
	return "error"
}

func (s *observedStore) Acquire(ctx context.Context, req AcquireRequest) (Acquisition, error) {
	ctx, op := s.t.StartOp(ctx, "acquire", s.kind, req.Key.String())
	acq, err := s.Store.Acquire(ctx, req)
	res := "error"
	var attrs []attribute.KeyValue
	if err == nil {
		switch acq.Outcome {
		case Acquired:
			res = "acquired"
			attrs = append(attrs, telemetry.AttrToken.Int64(int64(acq.Lease.Token)))
		case Replay:
			res = "replay"
		case InFlight:
			res = "in_flight"
			attrs = append(attrs, telemetry.AttrLeaseLeft.Int64(acq.RetryAfter.Milliseconds()))
		case Mismatch:
			res = "mismatch"
		default:
			res = "unknown"
		}
	}
	op.End(ctx, res, err, attrs...)
	return acq, err
}

func (s *observedStore) Renew(ctx context.Context, l Lease, ttl time.Duration) error {
	ctx, op := s.t.StartOp(ctx, "renew", s.kind, l.Key.String())
	err := s.Store.Renew(ctx, l, ttl)
	op.End(ctx, result(err), err, telemetry.AttrToken.Int64(int64(l.Token)))
	return err
}

func (s *observedStore) Complete(ctx context.Context, l Lease, resp *Response, retention time.Duration) error {
	ctx, op := s.t.StartOp(ctx, "complete", s.kind, l.Key.String())
	err := s.Store.Complete(ctx, l, resp, retention)
	op.End(ctx, result(err), err, telemetry.AttrToken.Int64(int64(l.Token)))
	return err
}

func (s *observedStore) Release(ctx context.Context, l Lease) error {
	ctx, op := s.t.StartOp(ctx, "release", s.kind, l.Key.String())
	err := s.Store.Release(ctx, l)
	op.End(ctx, result(err), err, telemetry.AttrToken.Int64(int64(l.Token)))
	return err
}
