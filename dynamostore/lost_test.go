package dynamostore_test

import (
	"context"
	"errors"
	"net"
	"net/url"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/service/dynamodb"
	"github.com/aws/smithy-go"
	smithyhttp "github.com/aws/smithy-go/transport/http"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/dynamostore"
)

// fault is what lossy does to one call.
type fault int

const (
	pass   fault = iota
	lost         // sent and applied, its answer lost (the connection reset)
	unsent       // never sent (the connection refused)
)

// lossy loses the answers of the calls it is told to, as the SDK reports
// them: a *smithyhttp.RequestSendError inside the operation's error.
type lossy struct {
	*dynamodb.Client
	mu     sync.Mutex
	faults map[string][]fault // of the next calls of each operation, in order
	calls  map[string]int
	hook   func() // called at every fault, before the error is returned
}

func newLossy() *lossy {
	return &lossy{Client: client, faults: map[string][]fault{}, calls: map[string]int{}}
}

// arm sets the faults of op's next calls.
func (l *lossy) arm(op string, fs ...fault) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.faults[op] = fs
}

func (l *lossy) count(op string) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.calls[op]
}

func (l *lossy) next(op string) fault {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.calls[op]++
	f := pass
	if q := l.faults[op]; len(q) > 0 {
		f, l.faults[op] = q[0], q[1:]
	}
	return f
}

func sendErr(op string, f fault) error {
	ne := &net.OpError{Op: "read", Net: "tcp", Err: syscall.ECONNRESET}
	if f == unsent {
		ne = &net.OpError{Op: "dial", Net: "tcp", Err: syscall.ECONNREFUSED}
	}
	return &smithy.OperationError{ServiceID: "DynamoDB", OperationName: op,
		Err: &smithyhttp.RequestSendError{Err: &url.Error{Op: "Post", URL: "http://127.0.0.1/", Err: ne}}}
}

// do applies f to one call of op, made by send.
func do[T any](l *lossy, op string, send func() (T, error)) (T, error) {
	f := l.next(op)
	var zero T
	switch f {
	case pass:
		return send()
	case lost:
		send()
	}
	if l.hook != nil {
		l.hook()
	}
	return zero, sendErr(op, f)
}

func (l *lossy) GetItem(ctx context.Context, in *dynamodb.GetItemInput, opts ...func(*dynamodb.Options)) (*dynamodb.GetItemOutput, error) {
	return do(l, "GetItem", func() (*dynamodb.GetItemOutput, error) { return l.Client.GetItem(ctx, in, opts...) })
}

func (l *lossy) UpdateItem(ctx context.Context, in *dynamodb.UpdateItemInput, opts ...func(*dynamodb.Options)) (*dynamodb.UpdateItemOutput, error) {
	return do(l, "UpdateItem", func() (*dynamodb.UpdateItemOutput, error) { return l.Client.UpdateItem(ctx, in, opts...) })
}

func (l *lossy) DeleteItem(ctx context.Context, in *dynamodb.DeleteItemInput, opts ...func(*dynamodb.Options)) (*dynamodb.DeleteItemOutput, error) {
	return do(l, "DeleteItem", func() (*dynamodb.DeleteItemOutput, error) { return l.Client.DeleteItem(ctx, in, opts...) })
}

// TestLostAnswers: a request whose answer is lost is sent again where
// that is safe, and the repeat of a write that applied gives the answer
// the first attempt would have (see "Lost answers" in the package doc).
func TestLostAnswers(t *testing.T) {
	ctx := t.Context()
	ns := newNamespace("lost")
	api := newLossy()
	st := mustNew(t, api, dynamostore.Options{Table: table, Namespace: ns})
	fp := idem.Fingerprint{1}
	acquire := func(what string, key idem.Key, id idem.LeaseID) idem.Acquisition {
		t.Helper()
		acq, err := st.Acquire(ctx, idem.AcquireRequest{Key: key, Fingerprint: fp, LeaseID: id, TTL: time.Minute})
		if err != nil {
			t.Fatalf("%s: %v", what, err)
		}
		return acq
	}
	// sends runs f and checks how many calls of op it made.
	sends := func(what, op string, want int, f func()) {
		t.Helper()
		before := api.count(op)
		f()
		if got := api.count(op) - before; got != want {
			t.Errorf("%s: %d %s calls, want %d", what, got, op, want)
		}
	}
	state := func(what string, key idem.Key, want idem.State) idem.Record {
		t.Helper()
		rec, ok, err := st.Get(ctx, key)
		if err != nil || !ok || rec.State != want {
			t.Fatalf("%s: Get: %v, %v, %v; want a record %v", what, rec.State, ok, err, want)
		}
		return rec
	}

	key, id := idem.Key{1}, idem.NewLeaseID()
	var l idem.Lease
	api.arm("UpdateItem", lost)
	sends("Acquire, answer lost", "UpdateItem", 2, func() {
		acq := acquire("Acquire, answer lost", key, id)
		_, _, tok, ok, err := dynamostore.Raw(ctx, client, table, ns, key)
		if acq.Outcome != idem.Acquired || acq.Lease.ID != id || !ok || err != nil || acq.Lease.Token != tok {
			t.Fatalf("Acquire, answer lost: got %v lease %v token %d; want acquired, lease %v, the stored token %d (%v, %v)",
				acq.Outcome, acq.Lease.ID, acq.Lease.Token, id, tok, ok, err)
		}
		l = acq.Lease
	})
	if acq := acquire("Acquire by another lease", key, idem.NewLeaseID()); acq.Outcome != idem.InFlight {
		t.Errorf("Acquire by another lease: got %v, want in_flight", acq.Outcome)
	}

	api.arm("UpdateItem", lost)
	sends("Renew, answer lost", "UpdateItem", 2, func() {
		if err := st.Renew(ctx, l, 2*time.Minute); err != nil {
			t.Errorf("Renew, answer lost: got %v, want nil", err)
		}
	})
	if rec := state("after Renew", key, idem.StateInFlight); rec.TTL <= time.Minute {
		t.Errorf("after Renew: TTL %v, want more than 1m", rec.TTL)
	}

	api.arm("GetItem", lost)
	sends("Get, answer lost", "GetItem", 2, func() { state("Get, answer lost", key, idem.StateInFlight) })

	resp := &idem.Response{Status: 201, Body: []byte("made")}
	api.arm("UpdateItem", lost)
	sends("Complete, answer lost", "UpdateItem", 2, func() {
		if err := st.Complete(ctx, l, resp, time.Hour); err != nil {
			t.Errorf("Complete, answer lost: got %v, want nil", err)
		}
	})
	if rec := state("after Complete", key, idem.StateCompleted); string(rec.Response.Body) != "made" {
		t.Errorf("after Complete: body %q, want %q", rec.Response.Body, "made")
	}

	key2 := idem.Key{2}
	l2 := acquire("Acquire of key 2", key2, idem.NewLeaseID()).Lease
	api.arm("UpdateItem", lost)
	sends("Release, answer lost", "UpdateItem", 2, func() {
		if err := st.Release(ctx, l2); err != nil {
			t.Errorf("Release, answer lost: got %v, want nil", err)
		}
	})
	state("after Release", key2, idem.StateReleased)
	// A failed condition is an answer: not sent again.
	sends("Complete after Release", "UpdateItem", 1, func() {
		if err := st.Complete(ctx, l2, resp, time.Hour); !errors.Is(err, idem.ErrLeaseLost) {
			t.Errorf("Complete after Release: got %v, want ErrLeaseLost", err)
		}
	})

	// The documented exception: a Release whose answer was lost, and the
	// key acquired by another caller before the store sent it again.
	key3 := idem.Key{3}
	l3 := acquire("Acquire of key 3", key3, idem.NewLeaseID()).Lease
	other := mustNew(t, client, dynamostore.Options{Table: table, Namespace: ns})
	api.hook = func() {
		api.hook = nil
		if acq, err := other.Acquire(ctx, idem.AcquireRequest{Key: key3, Fingerprint: fp, LeaseID: idem.NewLeaseID(), TTL: time.Minute}); err != nil || acq.Outcome != idem.Acquired {
			t.Errorf("Acquire by another caller after the lost Release: %v, %v", acq.Outcome, err)
		}
	}
	api.arm("UpdateItem", lost)
	if err := st.Release(ctx, l3); !errors.Is(err, idem.ErrLeaseLost) {
		t.Errorf("Release, answer lost, key taken by another caller: got %v, want ErrLeaseLost", err)
	}

	key4 := idem.Key{4}
	api.arm("UpdateItem", unsent)
	sends("Acquire, not sent", "UpdateItem", 2, func() {
		if acq := acquire("Acquire, not sent", key4, idem.NewLeaseID()); acq.Outcome != idem.Acquired {
			t.Errorf("Acquire, not sent: got %v, want acquired", acq.Outcome)
		}
	})

	// No answer to any attempt: the store gives up after SendAttempts.
	api.arm("GetItem", lost, lost, lost, lost)
	sends("Get, every answer lost", "GetItem", dynamostore.SendAttempts, func() {
		_, _, err := st.Get(ctx, key)
		var se *idem.StoreError
		var rse *smithyhttp.RequestSendError
		if !errors.As(err, &se) || !errors.As(err, &rse) {
			t.Errorf("Get, every answer lost: got %v, want a *idem.StoreError with the RequestSendError", err)
		}
	})
	api.arm("GetItem")

	// The context ends: not sent again.
	cctx, cancel := context.WithCancel(ctx)
	api.hook = cancel
	api.arm("GetItem", lost)
	sends("Get, answer lost, context cancelled", "GetItem", 1, func() {
		if _, _, err := st.Get(cctx, key); err == nil {
			t.Error("Get, answer lost, context cancelled: got nil, want an error")
		}
	})
	api.hook = nil

	// Delete: sent again only when it was never sent.
	api.arm("DeleteItem", unsent)
	sends("Delete, not sent", "DeleteItem", 2, func() {
		if ok, err := st.Delete(ctx, key4); !ok || err != nil {
			t.Errorf("Delete, not sent: got %t, %v; want true, nil", ok, err)
		}
	})
	api.arm("DeleteItem", lost)
	sends("Delete, answer lost", "DeleteItem", 1, func() {
		if _, err := st.Delete(ctx, key); err == nil {
			t.Error("Delete, answer lost: got nil, want the error (a repeat would report false)")
		}
	})
	if _, ok, err := st.Get(ctx, key); ok || err != nil {
		t.Errorf("after the Delete whose answer was lost: got %t, %v; want a miss", ok, err)
	}
}
