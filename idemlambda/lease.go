package idemlambda

import (
	"context"
	"fmt"
	"time"

	"github.com/idemkit/idem"
)

// DefaultDeadlineMargin is Config.DeadlineMargin's default: how long past
// the invocation's deadline its lease lasts, for the time Lambda takes to
// stop an invocation that timed out (observed up to about 0.7s) and for
// clock differences between the function and the store.
const DefaultDeadlineMargin = 2 * time.Second

// minLease is the shortest lease idem takes (idem.Guard.WithLease): an
// invocation at its deadline gets it.
const minLease = 10 * time.Millisecond

// guards gives each invocation the Guard whose lease fits it.
//
// An invocation whose deadline is less than the configured lease away
// gets a lease that lasts until the deadline plus the margin, with no
// renewal: the invocation cannot run past its deadline, so the lease does
// not end while it may still run, and the key of an invocation that was
// killed becomes free when the lease ends. An invocation with more time
// than the lease (or no deadline) gets the configured lease, renewed in
// the background while it runs: a killed invocation's key becomes free
// within one lease, not at its deadline (which may be 15 minutes away).
type guards struct {
	cfg    idem.Config // defaults filled in
	base   *idem.Guard
	margin time.Duration
}

func newGuards(store idem.Store, cfg idem.Config, margin time.Duration) (*guards, error) {
	if margin < 0 {
		return nil, fmt.Errorf("idemlambda: Config.DeadlineMargin %v is negative", margin)
	}
	if margin == 0 {
		margin = DefaultDeadlineMargin
	}
	base, err := idem.New(store, cfg)
	if err != nil {
		return nil, err
	}
	return &guards{cfg: base.Config(), base: base, margin: margin}, nil
}

// lease returns the lease an invocation running with ctx gets now, and
// whether it is bounded by the deadline (not renewed).
func (gs *guards) lease(ctx context.Context) (time.Duration, bool) {
	dl, ok := ctx.Deadline()
	if !ok {
		return gs.cfg.Lease, false
	}
	ttl := time.Until(dl) + gs.margin
	if ttl >= gs.cfg.Lease {
		return gs.cfg.Lease, false
	}
	return max(ttl, minLease), true
}

// forCtx returns the Guard for an invocation running with ctx and whether
// its attempts must stop renewal (the lease is bounded by the deadline).
func (gs *guards) forCtx(ctx context.Context) (*idem.Guard, bool, error) {
	ttl, bounded := gs.lease(ctx)
	if !bounded {
		return gs.base, false, nil
	}
	g, err := gs.base.WithLease(ttl)
	return g, true, err
}
