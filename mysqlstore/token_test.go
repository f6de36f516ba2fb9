package mysqlstore_test

import (
	"errors"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/mysqlstore"
)

// TestOvertakenDraw replays, step by step, an Acquire whose draw is
// overtaken: B draws a token, A draws a larger one, is granted the key and
// releases it, and only then does B's insert find A's tombstone. B must
// not be granted a token above the counter, or a later grant of the key,
// after a Delete, could carry the same token as B's; and B, a zombie by
// then, must not be told that the later holder's completion is its own.
func TestOvertakenDraw(t *testing.T) {
	db := srv.New(t)
	ctx := t.Context()
	a := newStore(t, db, mysqlstore.Options{Migrate: true})
	b := newStore(t, db, mysqlstore.Options{})
	key := newKey(1)

	var tokenA uint64
	var draws []int64
	mysqlstore.SetAfterDraw(b, func(drawn int64) {
		draws = append(draws, drawn)
		if len(draws) > 1 {
			return
		}
		// Between B's draw and its insert: A is granted the key, with a
		// larger token, and releases it.
		la := lease(t, a, key, time.Minute)
		tokenA = la.Token
		if la.Token <= uint64(drawn) {
			t.Fatalf("A's token %d, drawn after B's %d, is not larger", la.Token, drawn)
		}
		if err := a.Release(ctx, la); err != nil {
			t.Fatal(err)
		}
	})
	lb := lease(t, b, key, time.Minute)
	if lb.Token <= tokenA {
		t.Fatalf("B's token after A's release: got %d, want more than A's %d", lb.Token, tokenA)
	}
	if err := b.Complete(ctx, lb, resp, time.Hour); err != nil {
		t.Fatalf("B's Complete: got %v, want nil", err)
	}
	if err := b.Complete(ctx, lb, resp, time.Hour); err != nil {
		t.Fatalf("B's Complete repeated: got %v, want nil (a repeat)", err)
	}
	if ok, err := a.Delete(ctx, key); !ok || err != nil {
		t.Fatalf("Delete: got %v, %v; want true, nil", ok, err)
	}
	lc := lease(t, a, key, time.Minute)
	if lc.Token <= lb.Token {
		t.Errorf("C's token after the Delete: got %d, want more than B's %d (draws by B: %v)", lc.Token, lb.Token, draws)
	}
	if err := a.Complete(ctx, lc, resp, time.Hour); err != nil {
		t.Fatalf("C's Complete: got %v, want nil", err)
	}
	if err := b.Complete(ctx, lb, resp, time.Hour); !errors.Is(err, idem.ErrLeaseLost) {
		t.Errorf("B's Complete after C completed: got %v, want ErrLeaseLost", err)
	}
}

// TestRepeatNeedsLease checks that Complete and Release accept a repeat
// only from the lease that completed or released the record: a lease with
// the record's token but another lease id is lost, and so is one with the
// record's lease id but another token (completeSQL and releaseSQL match
// both).
func TestRepeatNeedsLease(t *testing.T) {
	db := srv.New(t)
	ctx := t.Context()
	s := newStore(t, db, mysqlstore.Options{Migrate: true})

	l := lease(t, s, newKey(1), time.Minute)
	if err := s.Complete(ctx, l, resp, time.Hour); err != nil {
		t.Fatal(err)
	}
	other := l
	other.ID = idem.NewLeaseID()
	if err := s.Complete(ctx, other, resp, time.Hour); !errors.Is(err, idem.ErrLeaseLost) {
		t.Errorf("Complete by another lease with the completed record's token: got %v, want ErrLeaseLost", err)
	}
	stale := l
	stale.Token++
	if err := s.Complete(ctx, stale, resp, time.Hour); !errors.Is(err, idem.ErrLeaseLost) {
		t.Errorf("Complete with the completed record's lease id and another token: got %v, want ErrLeaseLost", err)
	}
	if err := s.Complete(ctx, l, resp, time.Hour); err != nil {
		t.Errorf("Complete repeated by its lease: got %v, want nil", err)
	}

	l = lease(t, s, newKey(2), time.Minute)
	if err := s.Release(ctx, l); err != nil {
		t.Fatal(err)
	}
	other = l
	other.ID = idem.NewLeaseID()
	if err := s.Release(ctx, other); !errors.Is(err, idem.ErrLeaseLost) {
		t.Errorf("Release by another lease with the tombstone's token: got %v, want ErrLeaseLost", err)
	}
	stale = l
	stale.Token++
	if err := s.Release(ctx, stale); !errors.Is(err, idem.ErrLeaseLost) {
		t.Errorf("Release with the tombstone's lease id and another token: got %v, want ErrLeaseLost", err)
	}
	if err := s.Release(ctx, l); err != nil {
		t.Errorf("Release repeated by its lease: got %v, want nil", err)
	}
}
