// Command quickstart runs idem's main job on the embedded in-memory store,
// with nothing else installed: a payments service receives every charge
// request several times at once (client retries, a resending proxy, an
// at-least-once queue), first unprotected, then through an idem.Guard.
//
//	go run ./examples/quickstart
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"strconv"
	"sync"
	"sync/atomic"
	"text/tabwriter"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/memstore"
)

func main() {
	payments := flag.Int("payments", 200, "distinct charge requests (idempotency keys)")
	copies := flag.Int("copies", 5, "concurrent deliveries of each request")
	flag.Parse()
	if *payments < 1 || *copies < 1 {
		fmt.Fprintln(os.Stderr, "quickstart: -payments and -copies must be at least 1")
		os.Exit(2)
	}
	w := tabwriter.NewWriter(os.Stdout, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(w, "mode\trequests\tcharges\tduplicate charges\treplays\tconflicts\ttime\t")
	for _, protected := range []bool{false, true} {
		r := run(*payments, *copies, protected)
		fmt.Fprintf(w, "%s\t%d\t%d\t%d\t%d\t%d\t%v\t\n", r.mode, r.requests, r.charges,
			r.charges-*payments, r.replays, r.conflicts, r.elapsed.Round(time.Millisecond))
	}
	w.Flush()
}

type report struct {
	mode                                  string
	requests, charges, replays, conflicts int
	elapsed                               time.Duration
}

// bank is the side effect: every call charges a card.
type bank struct {
	mu      sync.Mutex
	charges map[string]int
}

func (b *bank) charge(ctx context.Context, payment string) (*idem.Response, error) {
	select { // the card network takes a moment
	case <-time.After(2 * time.Millisecond):
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	b.charges[payment]++
	return &idem.Response{Status: 201, Body: []byte(`{"charge":"` + payment + `","amount":1000}`)}, nil
}

func run(payments, copies int, protected bool) report {
	ctx := context.Background()
	b := &bank{charges: map[string]int{}}
	g, err := idem.New(memstore.New(memstore.Options{}), idem.Config{Lease: 5 * time.Second})
	if err != nil {
		panic(err)
	}
	var replays, conflicts atomic.Int64
	var wg sync.WaitGroup
	start := time.Now()
	for p := range payments {
		payment := "pay_" + strconv.Itoa(p)
		key, err := idem.Scope{Tenant: "acct_1", Method: "POST", Route: "/charges"}.Key(payment)
		if err != nil {
			panic(err)
		}
		for range copies {
			wg.Go(func() {
				if !protected {
					b.charge(ctx, payment)
					return
				}
				for { // a client that retries while the first copy is in flight
					res, err := g.Do(ctx, key, idem.Fingerprint{}, func(ctx context.Context) (*idem.Response, error) {
						return b.charge(ctx, payment)
					})
					var inFlight *idem.InFlightError
					if errors.As(err, &inFlight) {
						conflicts.Add(1)
						time.Sleep(min(inFlight.RetryAfter, time.Millisecond))
						continue
					}
					if err != nil {
						panic(err)
					}
					if res.Replayed {
						replays.Add(1)
					}
					return
				}
			})
		}
	}
	wg.Wait()
	r := report{mode: "unprotected", requests: payments * copies, replays: int(replays.Load()),
		conflicts: int(conflicts.Load()), elapsed: time.Since(start)}
	if protected {
		r.mode = "idem (memstore)"
	}
	for _, n := range b.charges {
		r.charges += n
	}
	return r
}
