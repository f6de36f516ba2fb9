package clients

import (
	"context"
	"io"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/idemkit/idem/idemhttp"
)

// goTransportClient is idemhttp.Transport, the repository's retrying
// RoundTripper, with a timeout per attempt until the response headers: a
// slow attempt is retried with the same key, as urllib3's read timeout
// does.
var goTransportClient = client{name: "idemhttp.Transport", run: runTransport}

func runTransport(ctx context.Context, c call) result {
	ctx, cancel := context.WithTimeout(ctx, clientDeadline)
	defer cancel()
	base := &http.Transport{}
	defer base.CloseIdleConnections()
	rec := &recorder{base: base}
	hc := &http.Client{Transport: &idemhttp.Transport{
		Base:           rec,
		AttemptTimeout: c.timeout,
		MaxAttempts:    c.attempts,
		MinBackoff:     20 * time.Millisecond,
		MaxBackoff:     200 * time.Millisecond,
		MaxElapsed:     20 * time.Second,
	}}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, c.url, strings.NewReader(c.body))
	if err != nil {
		return result{Error: err.Error()}
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set(idemhttp.HeaderKey, c.key)
	res := func() result {
		resp, err := hc.Do(req)
		if err != nil {
			return result{Error: failure(err)}
		}
		defer resp.Body.Close()
		b, err := io.ReadAll(resp.Body)
		if err != nil {
			return result{Error: "body " + failure(err)}
		}
		return result{Status: resp.StatusCode, Body: string(b), Replayed: resp.Header.Get(idemhttp.HeaderReplayed),
			RetryAfter: resp.Header.Get("Retry-After")}
	}()
	res.Seen = rec.attempts()
	return res
}

// recorder is the Transport's Base: it notes what each attempt saw.
type recorder struct {
	base http.RoundTripper
	mu   sync.Mutex
	seen []string
}

func (r *recorder) RoundTrip(req *http.Request) (*http.Response, error) {
	resp, err := r.base.RoundTrip(req)
	saw := ""
	switch {
	case err != nil && req.Context().Err() != nil:
		saw = "timeout" // the attempt's context ended: AttemptTimeout
	case err != nil:
		saw = failure(err)
	default:
		saw = strconv.Itoa(resp.StatusCode)
	}
	r.mu.Lock()
	r.seen = append(r.seen, saw)
	r.mu.Unlock()
	return resp, err
}

func (r *recorder) attempts() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]string(nil), r.seen...)
}
