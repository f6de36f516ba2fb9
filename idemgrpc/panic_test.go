package idemgrpc_test

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/protobuf/types/known/structpb"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/idemkit/idem/idemgrpc"
	"github.com/idemkit/idem/memstore"
)

// A panic after the handler returned (here in the user's ShouldStore; the
// same for OnOutcome or encode) must free the key as a handler's panic
// does. It does not: the attempt is neither completed nor released, its
// renewal goes on, and the key is in flight for as long as the process
// lives: past many leases.
func TestPanicAfterHandlerReleases(t *testing.T) {
	var panicked atomic.Bool
	var outcomes atomic.Int64
	s := newServer(t, memstore.New(memstore.Options{}), idemgrpc.Config{
		Lease: 150 * time.Millisecond,
		ShouldStore: func(ctx context.Context, c codes.Code) bool {
			if !panicked.Swap(true) {
				panic("policy bug")
			}
			return idemgrpc.DefaultShouldStore(ctx, c)
		},
		OnOutcome: func(context.Context, string, idemgrpc.Outcome) { outcomes.Add(1) },
	}, func(ctx context.Context, m string, req *structpb.Struct) (*wrapperspb.StringValue, error) {
		return wrapperspb.String("ok"), nil
	})
	if a := s.call(t.Context(), methodCharge, "k", nil); a.err == nil {
		t.Fatal("first call: want the recovered panic's error")
	}
	if n := outcomes.Load(); n != 1 {
		t.Errorf("OnOutcome after the panic: called %d times, want 1 (released)", n)
	}
	time.Sleep(1 * time.Second) // more than six leases
	if a := s.call(t.Context(), methodCharge, "k", nil); a.err != nil {
		t.Fatalf("retry after %v (lease 150ms): got %v, want a new execution: the key stays in flight", time.Second, a.err)
	}
}

// OnOutcome panicking as it reports OutcomeExecuted, before the outcome is
// stored: the key is released (nothing more is reported), the panic goes
// on, and a retry runs the handler again.
func TestPanicInOnOutcomeReleases(t *testing.T) {
	var panicked atomic.Bool
	var outcomes atomic.Int64
	s := newServer(t, memstore.New(memstore.Options{}), idemgrpc.Config{
		OnOutcome: func(_ context.Context, _ string, o idemgrpc.Outcome) {
			outcomes.Add(1)
			if o == idemgrpc.OutcomeExecuted && !panicked.Swap(true) {
				panic("metrics bug")
			}
		},
	}, charge)
	if a := s.call(t.Context(), methodCharge, "k", nil); a.err == nil {
		t.Fatal("first call: want the recovered panic's error")
	}
	if n := outcomes.Load(); n != 1 {
		t.Errorf("OnOutcome after the panic: called %d times, want 1 (executed)", n)
	}
	if a := s.call(t.Context(), methodCharge, "k", nil); a.err != nil || a.replayed() {
		t.Fatalf("retry: got %v (replayed %t), want a new execution", a.err, a.replayed())
	}
	wantRuns(t, s, 2)
}
