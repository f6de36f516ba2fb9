package idem_test

import (
	"context"
	"errors"
	"fmt"
	"log"

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

// The README's first example: Guard.Do with every error handled.
func Example() {
	ctx := context.Background()
	account, clientKey := "acct_1", "order-42"
	fingerprint := idem.SumFingerprint([]byte(`{"amount":1000}`), "POST", "/charges")
	charge := func(ctx context.Context, token uint64) (*idem.Response, error) {
		return &idem.Response{Status: 201, Body: []byte(`{"charge":"ch_1"}`)}, nil
	}

	store := memstore.New(memstore.Options{}) // or redisstore.Open("redis://localhost:6379", redisstore.Options{})
	g, err := idem.New(store, idem.Config{})  // lease 30s, retention 24h
	if err != nil {
		log.Fatal(err)
	}
	key, err := idem.Scope{Tenant: account, Method: "POST", Route: "/charges"}.Key(clientKey)
	if err != nil {
		log.Fatal(err) // idem.ErrInvalidKey: empty, too long, not printable ASCII
	}
	res, err := g.Do(ctx, key, fingerprint, func(ctx context.Context) (*idem.Response, error) {
		lease, _ := idem.LeaseFromContext(ctx) // lease.Token: the fencing token
		return charge(ctx, lease.Token)
	})
	var inFlight *idem.InFlightError
	switch {
	case err == nil: // res.Replayed: the stored result; the work did not run again
		fmt.Println(res.Response.Status, string(res.Response.Body), "replayed:", res.Replayed)
	case errors.As(err, &inFlight): // another caller holds the key
		fmt.Println("in flight; retry after", inFlight.RetryAfter)
	case errors.Is(err, idem.ErrMismatch): // the key was used with another request
		fmt.Println("mismatch")
	default: // fn's own error (the key was released), a *idem.StoreError before fn ran,
		// or an error beside res.Response after fn ran: see Guard.Do
		log.Fatal(err)
	}

	// The same request again: the stored result.
	res, err = g.Do(ctx, key, fingerprint, func(ctx context.Context) (*idem.Response, error) {
		return nil, errors.New("not run")
	})
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println(res.Response.Status, string(res.Response.Body), "replayed:", res.Replayed)
	// Output:
	// 201 {"charge":"ch_1"} replayed: false
	// 201 {"charge":"ch_1"} replayed: true
}
