package idem

import (
	"context"
	"fmt"
	"testing"
	"time"
)

type otherKey struct{}

// An attempt's context holds its lease as a *leaseValue, not a copy of
// the Lease (issue 36): LeaseFromContext, the other values and the
// context's name are what they were.
func TestAttemptContextLease(t *testing.T) {
	lease := Lease{Key: Key{1}, ID: LeaseID{2}, Token: 3, TTL: time.Hour}
	parent := context.WithValue(context.Background(), otherKey{}, "v")
	g := &Guard{cfg: Config{Lease: time.Hour}}
	a := g.newAttempt(parent, lease, Fingerprint{4}, time.Now())
	defer a.Stop()
	ctx := a.Context()
	if l, ok := LeaseFromContext(ctx); !ok || l != lease {
		t.Errorf("LeaseFromContext: %v %v, want %v", l, ok, lease)
	}
	if v := ctx.Value(otherKey{}); v != "v" {
		t.Errorf("the parent's value: %v", v)
	}
	was, cancel := context.WithCancelCause(context.WithValue(parent, leaseKey{}, lease))
	defer cancel(nil)
	if got, want := fmt.Sprint(ctx), fmt.Sprint(was); got != want {
		t.Errorf("String %q, want %q", got, want)
	}
	if l, ok := LeaseFromContext(parent); ok {
		t.Errorf("LeaseFromContext without a lease: %v, true", l)
	}
}
