package idem_test

import (
	"context"
	"errors"
	"fmt"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/memstore"
)

// A payment request arrives three times with the same idempotency key: the
// charge runs once, and the repeats get the stored response.
func ExampleGuard_Do() {
	g, err := idem.New(memstore.New(memstore.Options{}), idem.Config{})
	if err != nil {
		panic(err)
	}
	key, err := idem.Scope{Tenant: "acct_1", Method: "POST", Route: "/charges"}.Key("order-42")
	if err != nil {
		panic(err) // idem.ErrInvalidKey: empty, too long, not printable ASCII
	}
	charges := 0
	charge := func(ctx context.Context) (*idem.Response, error) {
		lease, _ := idem.LeaseFromContext(ctx) // lease.Token fences the system of record
		charges++
		_ = lease.Token
		return &idem.Response{Status: 201, Body: []byte(`{"charge":"ch_1"}`)}, nil
	}
	for range 3 {
		res, err := g.Do(context.Background(), key, idem.Fingerprint{}, charge)
		if err != nil {
			panic(err)
		}
		fmt.Println(res.Response.Status, string(res.Response.Body), "replayed:", res.Replayed)
	}
	fmt.Println("charges:", charges)
	// Output:
	// 201 {"charge":"ch_1"} replayed: false
	// 201 {"charge":"ch_1"} replayed: true
	// 201 {"charge":"ch_1"} replayed: true
	// charges: 1
}

// The same key with a different request is refused: the caller reused a key
// by mistake.
func ExampleGuard_Do_mismatch() {
	g, _ := idem.New(memstore.New(memstore.Options{}), idem.Config{})
	key, _ := idem.Scope{Method: "POST", Route: "/charges"}.Key("order-42")
	fingerprint := func(body string) idem.Fingerprint { return idem.SumFingerprint([]byte(body), "POST", "/charges") }
	ok := func(context.Context) (*idem.Response, error) { return &idem.Response{Status: 201}, nil }
	g.Do(context.Background(), key, fingerprint(`{"amount":1000}`), ok)
	_, err := g.Do(context.Background(), key, fingerprint(`{"amount":9999}`), ok)
	fmt.Println(errors.Is(err, idem.ErrMismatch))
	// Output: true
}

// Begin is the lower-level form: the caller decides whether to store the
// result. Here a failure is released, so a retry runs the work again.
func ExampleGuard_Begin() {
	g, _ := idem.New(memstore.New(memstore.Options{}), idem.Config{})
	ctx := context.Background()
	key, _ := idem.Scope{Method: "POST", Route: "/emails"}.Key("welcome-7")
	for attempt := 1; attempt <= 2; attempt++ {
		att, acq, err := g.Begin(ctx, key, idem.Fingerprint{})
		if err != nil {
			panic(err) // *idem.StoreError: the store failed and nothing ran
		}
		if acq.Outcome != idem.Acquired {
			fmt.Println("attempt", attempt, acq.Outcome)
			continue
		}
		if attempt == 1 { // the mail server said 503: let a retry run it
			att.Release(ctx)
			fmt.Println("attempt", attempt, "released")
			continue
		}
		att.Complete(ctx, &idem.Response{Status: 202})
		fmt.Println("attempt", attempt, "completed")
	}
	// Output:
	// attempt 1 released
	// attempt 2 completed
}
