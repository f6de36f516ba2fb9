package main

import (
	"context"
	"crypto/sha256"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"text/tabwriter"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemhttp"
)

// The large-response part of idem demo (--blob): reports too large for
// the record, generated once and replayed whole from the blob store.
const (
	demoReports    = 4
	demoReportSize = 8 << 20
)

// demoLargeResult is one run of the large-response part.
type demoLargeResult struct {
	Mode      string  `json:"mode"`
	Requests  int     `json:"requests"`  // requests sent, copies included
	Generated int     `json:"generated"` // reports the API generated
	Replays   int     `json:"replays"`   // responses with Idempotent-Replayed: true
	Whole     int     `json:"whole"`     // responses with the whole report, byte for byte
	Omitted   int     `json:"omitted"`   // replays whose body was not kept (500 response-not-kept, Idempotent-Replay-Body-Omitted)
	Failed    int     `json:"failed"`    // other requests that did not end in 200
	TimeMS    float64 `json:"time_ms"`
	elapsed   time.Duration
}

// demoReport is the body of report id: size bytes of a stream seeded by
// the id, so the demo checks every copy against it without keeping it.
func demoReport(id string, size int64) io.Reader {
	seed := sha256.Sum256([]byte(id))
	return io.LimitReader(rand.NewChaCha8(seed), size)
}

func demoDigest(r io.Reader) ([32]byte, int64) {
	h := sha256.New()
	n, _ := io.Copy(h, r)
	var sum [32]byte
	h.Sum(sum[:0])
	return sum, n
}

// demoLarge runs the reports API behind the middleware on store (with
// blobs, or without a blob store when blobs is nil) and asks for every
// report copies times at once.
func demoLarge(ctx context.Context, store idem.Store, blobs idem.BlobStore, mode, keyPrefix string, copies int) (demoLargeResult, error) {
	var generated atomic.Int64
	api := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		id := r.URL.Query().Get("id")
		generated.Add(1)
		time.Sleep(demoChargeTime) // the report takes a moment
		w.Header().Set("Content-Type", "text/csv")
		w.Header().Set("Content-Length", strconv.Itoa(demoReportSize))
		io.Copy(w, demoReport(id, demoReportSize))
	})
	mw, err := idemhttp.NewMiddleware(store, idemhttp.Config{Retention: demoRetention, Blobs: blobs, Wait: 10 * time.Second,
		Route: func(*http.Request) string { return "/reports" }})
	if err != nil {
		return demoLargeResult{}, err
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return demoLargeResult{}, err
	}
	srv := &http.Server{Handler: mw(api), ReadHeaderTimeout: 10 * time.Second}
	go srv.Serve(ln)
	defer srv.Close()
	base := &http.Transport{MaxIdleConnsPerHost: demoReports * copies}
	defer base.CloseIdleConnections()
	client := &http.Client{Transport: &idemhttp.Transport{Base: base, MaxAttempts: 20,
		MinBackoff: 5 * time.Millisecond, MaxBackoff: 50 * time.Millisecond}, Timeout: time.Minute}

	var replays, whole, omitted, failed atomic.Int64
	var wg sync.WaitGroup
	start := time.Now()
	for i := range demoReports {
		id := keyPrefix + "report-" + strconv.Itoa(i)
		want, _ := demoDigest(demoReport(id, demoReportSize))
		for range copies {
			wg.Go(func() {
				req, err := http.NewRequestWithContext(ctx, http.MethodPost, "http://"+ln.Addr().String()+"/reports?id="+id,
					strings.NewReader(`{"report":"`+id+`"}`))
				if err != nil {
					failed.Add(1)
					return
				}
				req.Header.Set(idemhttp.HeaderKey, id)
				req.Header.Set("Authorization", "Bearer demo-shop")
				resp, err := client.Do(req)
				if err != nil {
					failed.Add(1)
					return
				}
				sum, n := demoDigest(resp.Body)
				resp.Body.Close()
				if resp.Header.Get(idemhttp.HeaderBodyOmitted) == "true" {
					// A 500 response-not-kept replay: the report was
					// generated once, its body was not kept.
					replays.Add(1)
					omitted.Add(1)
					return
				}
				if resp.StatusCode != http.StatusOK {
					failed.Add(1)
					return
				}
				if resp.Header.Get(idemhttp.HeaderReplayed) == "true" {
					replays.Add(1)
				}
				if sum == want && n == demoReportSize {
					whole.Add(1)
				}
			})
		}
	}
	wg.Wait()
	elapsed := time.Since(start)
	if err := ctx.Err(); err != nil {
		return demoLargeResult{}, err
	}
	return demoLargeResult{Mode: mode, Requests: demoReports * copies, Generated: int(generated.Load()),
		Replays: int(replays.Load()), Whole: int(whole.Load()), Omitted: int(omitted.Load()), Failed: int(failed.Load()),
		TimeMS: float64(elapsed.Microseconds()) / 1000, elapsed: elapsed}, nil
}

// printDemoLarge prints the large-response runs as a table and a verdict.
func printDemoLarge(w io.Writer, results []demoLargeResult, copies int) error {
	fmt.Fprintf(w, "\nlarge responses: %d reports of %d MiB, each asked for %d times at once\n", demoReports, demoReportSize>>20, copies)
	width := len("mode")
	for _, r := range results {
		width = max(width, len(r.Mode))
	}
	tw := tabwriter.NewWriter(w, 0, 0, 0, ' ', tabwriter.AlignRight)
	fmt.Fprintf(tw, "%-*s\t  requests\t  generated\t  replays\t  whole bodies\t  omitted bodies\t  time\t\n", width, "mode")
	for _, r := range results {
		fmt.Fprintf(tw, "%-*s\t  %d\t  %d\t  %d\t  %d\t  %d\t  %v\t\n", width, r.Mode, r.Requests, r.Generated, r.Replays,
			r.Whole, r.Omitted, r.elapsed.Round(time.Millisecond))
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	fmt.Fprintln(w, "(whole bodies: responses carrying the whole report, byte for byte; omitted: replays that said the report ran but was too large to keep, a 500)")
	fmt.Fprintln(w)
	for _, r := range results {
		switch {
		case r.Omitted > 0:
			fmt.Fprintf(w, "%s: each report generated once; its %d replays answered 500 response-not-kept (too large for the record, no blob store).\n", r.Mode, r.Omitted)
		case r.Whole == r.Requests && r.Generated == demoReports:
			fmt.Fprintf(w, "%s: each report generated once; all %d copies got it whole, %d of them replayed from the blob store.\n",
				r.Mode, r.Requests, r.Replays)
		default:
			fmt.Fprintf(w, "%s: %d reports generated for %d, %d whole bodies of %d: SELF-CHECK FAILED.\n", r.Mode, r.Generated,
				demoReports, r.Whole, r.Requests)
		}
	}
	return nil
}
