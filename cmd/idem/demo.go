package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"text/tabwriter"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemhttp"
)

func init() {
	commands["demo"] = command{
		summary: "duplicate charges on a payments API, without and with idem",
		run:     runDemo,
	}
}

const (
	// demoChargeTime is how long the payments API takes to charge a card:
	// long enough that the copies of a request overlap.
	demoChargeTime = 10 * time.Millisecond
	// demoMaxRequests bounds the requests in flight at once (whole
	// payments, each with all its copies), so that sockets stay well
	// under the usual ulimit -n.
	demoMaxRequests = 320
	// demoMaxCopies bounds --copies.
	demoMaxCopies = 100
	// demoRetention is how long a store keeps the demo's records.
	demoRetention = 10 * time.Minute
)

const demoUsage = `usage: idem demo [--store STORE] [--blob URL] [--payments N] [--copies N] [--json]

Starts a payments API on 127.0.0.1, sends every charge request to it
--copies times at once (what client retries, a resending proxy or an
at-least-once queue do), first unprotected, then through idem's
middleware (idemhttp) on the store, and prints what each run charged.
The clients are idemhttp.Transport: one Idempotency-Key per payment, and
409 (still in flight) is retried.

Unprotected, every copy charges the card; through idem, each payment is
charged exactly once and the other copies get the stored response. The
exit status is 1 if the run through idem charged a payment more than once
or not at all.

The default store is the embedded in-memory one: nothing to install.
With another --store (any of those below) the records (keys unique to
each run) expire after 10 minutes.

With --blob URL (mem:// for this process's memory, file:///DIR, or
s3://…), it then asks for reports of 8 MiB, too large for the record,
each --copies times at once: first through idem without a blob store
(each replay comes without its body), then with the blob store (every
copy gets the whole report, byte for byte, and each is generated once).

flags:
`

// demoResult is one run of the demo.
type demoResult struct {
	Mode       string  `json:"mode"`
	Requests   int     `json:"requests"`          // requests sent, copies included
	Charges    int     `json:"charges"`           // cards charged
	Duplicates int     `json:"duplicate_charges"` // charges beyond one per payment charged
	Uncharged  int     `json:"uncharged"`         // payments never charged
	Replays    int     `json:"replays"`           // responses with Idempotent-Replayed: true
	Conflicts  int     `json:"conflicts"`         // 409 answers (in flight), each retried
	Failed     int     `json:"failed"`            // requests that did not end in 201
	TimeMS     float64 `json:"time_ms"`
	elapsed    time.Duration
}

func runDemo(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("idem demo", flag.ContinueOnError)
	storeSpec := fs.String("store", "memory", storeFlagHelp)
	payments := fs.Int("payments", 200, "distinct payments, each with its own idempotency key")
	copies := fs.Int("copies", 5, "copies of each payment request sent at once")
	asJSON := fs.Bool("json", false, "print the results as JSON")
	blobSpec := fs.String("blob", "", "blob store for the large-response part: mem://, file:///DIR or s3://… (off when empty)")
	fs.Usage = func() {
		fmt.Fprint(fs.Output(), demoUsage)
		fs.PrintDefaults()
	}
	if err := parseFlags(fs, args, stderr); err != nil {
		return err
	}
	if *payments < 1 || *copies < 1 {
		return usageError{"--payments and --copies must be at least 1"}
	}
	if *copies > demoMaxCopies {
		return usageError{fmt.Sprintf("--copies %d: at most %d", *copies, demoMaxCopies)}
	}
	if *payments > 1_000_000 {
		return usageError{fmt.Sprintf("--payments %d: at most 1000000", *payments)}
	}

	store, closeStore, err := openStoreChecked(ctx, *storeSpec, "")
	if err != nil {
		return err
	}
	defer closeStore()
	var id [4]byte
	rand.Read(id[:])
	keyPrefix := "demo-" + hex.EncodeToString(id[:]) + "-" // fresh keys on a store that outlives the run

	results := make([]demoResult, 0, 2)
	for _, s := range []idem.Store{nil, store} {
		mode := "unprotected"
		if s != nil {
			mode = "idem (" + demoStoreName(*storeSpec) + ")"
		}
		r, err := demoRun(ctx, s, mode, keyPrefix, *payments, *copies)
		if err != nil {
			return err
		}
		results = append(results, r)
	}
	unprotected, protected := results[0], results[1]
	ok := protected.Duplicates == 0 && protected.Uncharged == 0

	var large []demoLargeResult
	if *blobSpec != "" {
		blobs, err := openBlobs(ctx, *blobSpec)
		if err != nil {
			return err
		}
		defer blobs.Close()
		if err := blobs.Check(ctx); err != nil {
			return fmt.Errorf("--blob: %w", err)
		}
		for _, bs := range []idem.BlobStore{nil, blobs} {
			mode := "idem, no blob store"
			if bs != nil {
				mode = "idem, blob store " + blobs.String()
			}
			r, err := demoLarge(ctx, store, bs, mode, keyPrefix+strconv.Itoa(len(large))+"-", *copies)
			if err != nil {
				return err
			}
			large = append(large, r)
		}
		withBlobs := large[1]
		ok = ok && withBlobs.Generated == demoReports && withBlobs.Whole == withBlobs.Requests
	}

	if *asJSON {
		enc := json.NewEncoder(stdout)
		enc.SetIndent("", "  ")
		err := enc.Encode(struct {
			Store    string            `json:"store"`
			Payments int               `json:"payments"`
			Copies   int               `json:"copies"`
			Runs     []demoResult      `json:"runs"`
			Large    []demoLargeResult `json:"large_responses,omitempty"`
			OK       bool              `json:"ok"`
		}{demoStoreName(*storeSpec), *payments, *copies, results, large, ok})
		if err != nil {
			return err
		}
	} else {
		// Numbers right-aligned, two spaces apart; the mode padded to
		// the left.
		width := len("mode")
		for _, r := range results {
			width = max(width, len(r.Mode))
		}
		w := tabwriter.NewWriter(stdout, 0, 0, 0, ' ', tabwriter.AlignRight)
		fmt.Fprintf(w, "%-*s\t  requests\t  charges\t  duplicate charges\t  replays\t  conflicts\t  time\t\n", width, "mode")
		for _, r := range results {
			fmt.Fprintf(w, "%-*s\t  %d\t  %d\t  %d\t  %d\t  %d\t  %v\t\n", width, r.Mode, r.Requests, r.Charges,
				r.Duplicates, r.Replays, r.Conflicts, r.elapsed.Round(time.Millisecond))
		}
		if err := w.Flush(); err != nil {
			return err
		}
		fmt.Fprintln(stdout, "(conflicts: 409 answers, key in flight, each retried; one request may get several)")
		fmt.Fprintln(stdout)
		fmt.Fprintln(stdout, demoVerdict(unprotected, protected, *payments))
		if large != nil {
			if err := printDemoLarge(stdout, large, *copies); err != nil {
				return err
			}
		}
	}
	if !ok {
		if large != nil && (large[1].Generated != demoReports || large[1].Whole != large[1].Requests) {
			return fmt.Errorf("self-check failed: with the blob store, %d reports generated (want %d) and %d whole bodies (want %d)",
				large[1].Generated, demoReports, large[1].Whole, large[1].Requests)
		}
		return fmt.Errorf("self-check failed: through idem, %d duplicate charges and %d payments not charged (want 0 and 0)",
			protected.Duplicates, protected.Uncharged)
	}
	return nil
}

// demoVerdict sums the two runs up in a sentence or two.
func demoVerdict(unprotected, protected demoResult, payments int) string {
	var b strings.Builder
	fmt.Fprintf(&b, "unprotected: %d charges for %d payments, %d of them duplicates.\n",
		unprotected.Charges, payments, unprotected.Duplicates)
	if protected.Duplicates == 0 && protected.Uncharged == 0 {
		fmt.Fprintf(&b, "%s: every payment charged exactly once; the %d other copies got the stored response.",
			protected.Mode, protected.Replays)
	} else {
		fmt.Fprintf(&b, "%s: %d duplicate charges, %d payments not charged: SELF-CHECK FAILED.",
			protected.Mode, protected.Duplicates, protected.Uncharged)
	}
	for _, r := range []demoResult{unprotected, protected} {
		if r.Failed > 0 {
			fmt.Fprintf(&b, "\n%s: %d requests did not end in 201 Created.", r.Mode, r.Failed)
		}
	}
	return b.String()
}

// demoStoreName names the store for the table, without the URL's
// credentials.
func demoStoreName(spec string) string {
	if spec == "" || spec == "memory" {
		return "memstore"
	}
	if f := strings.Fields(spec); len(f) > 1 {
		return "tiered: " + demoStoreName(f[0]) + " + " + demoStoreName(f[1])
	}
	u, err := url.Parse(spec)
	if err != nil {
		return "store"
	}
	switch u.Scheme {
	case "postgres", "postgresql":
		return "postgres"
	case "rediss", "valkeys":
		return "redis, TLS"
	}
	return u.Scheme
}

// demoRun starts the payments API on a loopback port, behind idem's
// middleware when store is not nil, and sends it every payment copies
// times at once.
func demoRun(ctx context.Context, store idem.Store, mode, keyPrefix string, payments, copies int) (demoResult, error) {
	ledger := &demoLedger{charges: map[string]int{}}
	mux := http.NewServeMux()
	mux.Handle("POST /charges", ledger)
	var handler http.Handler = mux
	if store != nil {
		mw, err := idemhttp.NewMiddleware(store, idemhttp.Config{Retention: demoRetention})
		if err != nil {
			return demoResult{}, err
		}
		handler = mw(mux)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return demoResult{}, err
	}
	srv := &http.Server{Handler: handler, ReadHeaderTimeout: 10 * time.Second}
	go srv.Serve(ln)
	defer srv.Close()

	inFlight := max(1, demoMaxRequests/copies) // payments at once
	// No proxy from the environment: this is loopback.
	base := &http.Transport{
		MaxIdleConns:        inFlight * copies,
		MaxIdleConnsPerHost: inFlight * copies,
		IdleConnTimeout:     10 * time.Second,
	}
	defer base.CloseIdleConnections()
	counter := &demoCounter{base: base}
	client := &http.Client{
		Transport: &idemhttp.Transport{
			Base:        counter,
			MaxAttempts: 100,
			MinBackoff:  5 * time.Millisecond,
			MaxBackoff:  50 * time.Millisecond,
			// The middleware answers 409 with Retry-After: 1, which
			// DefaultBackoff honours; the demo's clients come back
			// sooner (jittered, from 5ms) so that it takes well under
			// a second.
			Backoff: func(minWait, maxWait time.Duration, attempt int, _ *http.Response) time.Duration {
				return idemhttp.DefaultBackoff(minWait, maxWait, attempt, nil)
			},
		},
		Timeout: time.Minute,
	}
	target := "http://" + ln.Addr().String() + "/charges"

	var replays, failed atomic.Int64
	var wg sync.WaitGroup
	slots := make(chan struct{}, inFlight)
	start := time.Now()
	for p := range payments {
		payment := "pay_" + strconv.Itoa(p)
		key := keyPrefix + payment
		body := `{"payment":"` + payment + `","amount":1000}`
		select {
		case slots <- struct{}{}:
		case <-ctx.Done():
		}
		if ctx.Err() != nil {
			break
		}
		wg.Go(func() {
			defer func() { <-slots }()
			var sent sync.WaitGroup
			for range copies {
				sent.Go(func() {
					created, replayed := demoSend(ctx, client, target, key, body)
					if !created {
						failed.Add(1)
					}
					if replayed {
						replays.Add(1)
					}
				})
			}
			sent.Wait()
		})
	}
	wg.Wait()
	elapsed := time.Since(start)
	if err := ctx.Err(); err != nil {
		return demoResult{}, err
	}

	r := demoResult{Mode: mode, Requests: payments * copies, Replays: int(replays.Load()),
		Conflicts: int(counter.conflicts.Load()), Failed: int(failed.Load()),
		TimeMS: float64(elapsed.Microseconds()) / 1000, elapsed: elapsed}
	ledger.mu.Lock()
	defer ledger.mu.Unlock()
	for _, n := range ledger.charges {
		r.Charges += n
	}
	r.Duplicates = r.Charges - len(ledger.charges)
	r.Uncharged = payments - len(ledger.charges)
	return r, nil
}

// demoSend sends one copy of a charge request and reports whether it got
// 201 Created and whether that was a replay.
func demoSend(ctx context.Context, client *http.Client, target, key, body string) (created, replayed bool) {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, target, strings.NewReader(body))
	if err != nil {
		return false, false
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set(idemhttp.HeaderKey, key) // the same key on every copy of a payment
	req.Header.Set("Authorization", "Bearer demo-shop")
	resp, err := client.Do(req)
	if err != nil {
		return false, false
	}
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	return resp.StatusCode == http.StatusCreated, resp.Header.Get(idemhttp.HeaderReplayed) == "true"
}

// demoLedger is the payments API: POST /charges charges a card, which
// takes demoChargeTime, and records the charge.
type demoLedger struct {
	mu      sync.Mutex
	charges map[string]int // per payment id
	n       int
}

func (l *demoLedger) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	var req struct {
		Payment string `json:"payment"`
		Amount  int    `json:"amount"`
	}
	if err := json.NewDecoder(r.Body).Decode(&req); err != nil || req.Payment == "" {
		http.Error(w, "want a JSON body with a payment id", http.StatusBadRequest)
		return
	}
	t := time.NewTimer(demoChargeTime) // the card network takes a moment
	defer t.Stop()
	select {
	case <-t.C:
	case <-r.Context().Done():
		return
	}
	l.mu.Lock()
	l.charges[req.Payment]++
	l.n++
	id := l.n
	l.mu.Unlock()
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(http.StatusCreated)
	fmt.Fprintf(w, `{"id":"ch_%d","payment":%q,"amount":%d}`+"\n", id, req.Payment, req.Amount)
}

// demoCounter counts the 409 answers the Transport sees (and retries).
type demoCounter struct {
	base      http.RoundTripper
	conflicts atomic.Int64
}

func (c *demoCounter) RoundTrip(req *http.Request) (*http.Response, error) {
	resp, err := c.base.RoundTrip(req)
	if err == nil && resp.StatusCode == http.StatusConflict {
		c.conflicts.Add(1)
	}
	return resp, err
}

// openStoreChecked is openStore followed by one read, so that a store
// that cannot be reached fails the command at once (and not with a 503
// per request). Errors other than usage errors are prefixed "--store: ".
func openStoreChecked(ctx context.Context, spec, prefix string) (idem.Store, func(), error) {
	store, closeStore, err := openStore(ctx, spec, prefix)
	if err != nil {
		if errors.As(err, new(usageError)) {
			return nil, nil, err
		}
		return nil, nil, fmt.Errorf("--store: %w", err)
	}
	if _, _, err := store.Get(ctx, idem.Key{}); err != nil {
		closeStore()
		return nil, nil, fmt.Errorf("--store: %w", err)
	}
	return store, closeStore, nil
}
