package bench

import (
	"context"
	"io"
	"math/rand/v2"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/idemkit/idem/idemhttp"
)

const (
	// benchBody is every request's body: the same for every copy of a key,
	// so that idem's fingerprint matches.
	benchBody = `{"amount":1000,"currency":"EUR","customer":"cus_42"}`
	// requestTimeout bounds one HTTP attempt.
	requestTimeout = 10 * time.Second
	// maxTries bounds the attempts of one logical request (the first and
	// the retries after 409).
	maxTries = 500
	// maxInFlight caps the open-loop mode's outstanding requests. When it
	// is reached the schedule still runs on: late sends are charged to
	// their scheduled time.
	maxInFlight = 4096
)

// loadSpec says how to send a plan of requests.
type loadSpec struct {
	urls       []string       // the instances; every attempt goes to the next one, round-robin
	next       *atomic.Uint64 // the round-robin counter
	keys       []string       // the logical requests, in send order: one key each
	clients    int            // closed loop: this many concurrent clients
	rate       float64        // > 0: open loop at this many requests/s instead
	deadline   time.Time      // no request starts after this
	retryPause time.Duration  // pause before retrying a 409 (±25% jitter)
}

// sample is one logical request's outcome.
type sample struct {
	done   bool
	lat    time.Duration // first send (or, open loop, scheduled send) to the final answer
	status int           // the final status; 0 for a transport error
	tries  int           // HTTP attempts
}

// loadResult is what one plan produced.
type loadResult struct {
	samples []sample
	elapsed time.Duration
}

func newClient(conns int) *http.Client {
	return &http.Client{Transport: &http.Transport{
		MaxIdleConns:        conns,
		MaxIdleConnsPerHost: conns,
		IdleConnTimeout:     30 * time.Second,
		DisableCompression:  true,
	}}
}

// runLoad sends spec's plan and waits for every answer.
func runLoad(ctx context.Context, client *http.Client, spec loadSpec) loadResult {
	res := loadResult{samples: make([]sample, len(spec.keys))}
	start := time.Now()
	var last atomic.Int64 // nanoseconds after start of the last answer
	one := func(i int, from time.Time) {
		s := sendOne(ctx, client, spec, spec.keys[i])
		end := time.Now()
		s.lat = end.Sub(from)
		res.samples[i] = s
		for {
			cur := last.Load()
			d := int64(end.Sub(start))
			if d <= cur || last.CompareAndSwap(cur, d) {
				break
			}
		}
	}
	var wg sync.WaitGroup
	if spec.rate > 0 {
		interval := time.Duration(float64(time.Second) / spec.rate)
		sem := make(chan struct{}, maxInFlight)
		for i := range spec.keys {
			at := start.Add(time.Duration(i) * interval)
			if at.After(spec.deadline) || ctx.Err() != nil {
				break
			}
			if d := time.Until(at); d > 0 {
				sleepCtx(ctx, d)
			}
			sem <- struct{}{}
			wg.Go(func() {
				defer func() { <-sem }()
				one(i, at) // latency from the scheduled time: coordinated omission shows
			})
		}
	} else {
		var next atomic.Int64
		for range spec.clients {
			wg.Go(func() {
				for {
					i := int(next.Add(1) - 1)
					if i >= len(spec.keys) || time.Now().After(spec.deadline) || ctx.Err() != nil {
						return
					}
					one(i, time.Now())
				}
			})
		}
	}
	wg.Wait()
	res.elapsed = time.Duration(last.Load())
	return res
}

// url returns the instance for the next attempt.
func (s loadSpec) url() string {
	if len(s.urls) == 1 {
		return s.urls[0]
	}
	return s.urls[(s.next.Add(1)-1)%uint64(len(s.urls))]
}

// sendOne sends one logical request, retrying while the answer is 409.
func sendOne(ctx context.Context, client *http.Client, spec loadSpec, key string) sample {
	s := sample{done: true}
	for {
		s.tries++
		s.status = post(ctx, client, spec.url(), key)
		if s.status != http.StatusConflict || s.tries >= maxTries || time.Now().After(spec.deadline.Add(requestTimeout)) {
			return s
		}
		j := 0.75 + rand.Float64()/2
		sleepCtx(ctx, time.Duration(float64(spec.retryPause)*j))
	}
}

func post(ctx context.Context, client *http.Client, url, key string) int {
	ctx, cancel := context.WithTimeout(ctx, requestTimeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, strings.NewReader(benchBody))
	if err != nil {
		return 0
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set(idemhttp.HeaderKey, key)
	resp, err := client.Do(req)
	if err != nil {
		return 0
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	return resp.StatusCode
}

func sleepCtx(ctx context.Context, d time.Duration) {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
	case <-ctx.Done():
	}
}
