package idemhttp_test

import (
	"crypto/rand"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/memstore"
)

// noise is an incompressible body of n bytes (the store compresses what
// it can).
func noise(n int) string {
	b := make([]byte, n/2)
	rand.Read(b)
	return fmt.Sprintf("%x", b)
}

// echo answers 201 with the request's body.
func echo(w http.ResponseWriter, r *http.Request) {
	b, _ := io.ReadAll(r.Body)
	w.WriteHeader(http.StatusCreated)
	w.Write(b)
}

// The reproduced defect: one client's flood of new keys with large bodies
// filled a bounded memstore, and every other client's new keys got 503
// store-full for the retention. With the default quota (DefaultQuota of
// the store's MaxBytes), the flood is refused 429 with Retry-After once the
// attacker holds an eighth of the store, claiming nothing; another tenant
// then stores new keys and its retries replay; the attacker's own stored
// keys still replay over its quota.
func TestQuotaFloodLeavesRoom(t *testing.T) {
	const storeBytes = 4 << 20
	store := memstore.New(memstore.Options{MaxBytes: storeBytes})
	var mu sync.Mutex
	outcomes := map[idemhttp.Outcome]int{}
	limits := map[string]int{}
	s := newServer(t, store, idemhttp.Config{Logger: quietLogger(),
		OnOutcome: func(_ *http.Request, o idemhttp.Outcome) {
			mu.Lock()
			outcomes[o]++
			mu.Unlock()
		},
		OnQuotaExceeded: func(_ *http.Request, limit string) {
			mu.Lock()
			limits[limit]++
			mu.Unlock()
		}}, echo)
	body := noise(128 << 10)

	var refused answer
	stored := 0
	for i := range 2 * storeBytes / len(body) {
		a := s.do(t, "POST", "/echo", fmt.Sprint("flood-", i), body, "Authorization", "Bearer mallory")
		if a.status != http.StatusCreated {
			refused = a
			break
		}
		stored++
	}
	if refused.status != http.StatusTooManyRequests {
		t.Fatalf("after %d stored keys: got %d %.200s, want 429 before the store fills", stored, refused.status, refused.body)
	}
	var p idemhttp.Problem
	json.Unmarshal([]byte(refused.body), &p)
	ra, _ := strconv.Atoi(refused.header.Get("Retry-After"))
	if p.Type != idemhttp.ProblemQuotaExceeded || ra < 1 || refused.header.Get("Content-Type") != "application/problem+json" {
		t.Errorf("429: got type %q, Retry-After %q, Content-Type %q; want %s, a positive Retry-After, problem+json",
			p.Type, refused.header.Get("Retry-After"), refused.header.Get("Content-Type"), idemhttp.ProblemQuotaExceeded)
	}
	if max := storeBytes / idemhttp.DefaultQuotaShare / len(body); stored > max+1 {
		t.Errorf("the attacker stored %d keys of %d bytes, want at most %d (an eighth of the store)", stored, len(body), max+1)
	}
	// Nothing claimed for refused keys: the store holds the stored ones only.
	before := store.Stats()
	runs := s.runs.Load()
	for i := range 20 {
		if a := s.do(t, "POST", "/echo", fmt.Sprint("more-", i), body, "Authorization", "Bearer mallory"); a.status != http.StatusTooManyRequests {
			t.Fatalf("flood key %d: got %d, want 429", i, a.status)
		}
	}
	if after := store.Stats(); after.Records != before.Records || s.runs.Load() != runs {
		t.Errorf("refused keys: records %d -> %d, handler runs %d -> %d; want nothing claimed, nothing run",
			before.Records, after.Records, runs, s.runs.Load())
	}
	// The attacker's own stored key replays over its quota.
	if a := s.do(t, "POST", "/echo", "flood-0", body, "Authorization", "Bearer mallory"); a.status != 201 || a.header.Get(idemhttp.HeaderReplayed) != "true" {
		t.Errorf("a stored key over quota: got %d %v, want its replay", a.status, a.header)
	}

	// The victim stores new keys of its own; each retry replays.
	for i := range 5 {
		key := fmt.Sprint("victim-", i)
		vb := noise(64 << 10)
		first := s.do(t, "POST", "/echo", key, vb, "Authorization", "Bearer alice")
		if first.status != http.StatusCreated || first.header.Get(idemhttp.HeaderReplayed) != "" {
			t.Fatalf("victim's %s: got %d %.200s, want 201 executed", key, first.status, first.body)
		}
		runs := s.runs.Load()
		for range 3 {
			a := s.do(t, "POST", "/echo", key, vb, "Authorization", "Bearer alice")
			if a.status != 201 || a.header.Get(idemhttp.HeaderReplayed) != "true" || a.body != first.body {
				t.Fatalf("victim's retry of %s: got %d %v, want the replay", key, a.status, a.header)
			}
		}
		if s.runs.Load() != runs {
			t.Fatalf("victim's retries of %s ran the handler again", key)
		}
	}
	mu.Lock()
	defer mu.Unlock()
	if outcomes[idemhttp.OutcomeQuotaExceeded] != 21 || limits[idemhttp.QuotaBytes] != 21 {
		t.Errorf("outcomes %v, limits %v: want 21 quota_exceeded, all bytes", outcomes, limits)
	}
	if store.Stats().Refused != 0 {
		t.Errorf("the store refused %d keys: it filled", store.Stats().Refused)
	}
}

// InFlight bounds a tenant's new keys in flight: past it, a new key gets
// 429 at once, another tenant is not affected, and a copy of a key in
// flight is not refused (it waits, as without a quota). Released keys
// (a 5xx) give their place and record back; stored records give theirs
// back once their retention has passed.
func TestQuotaInFlightAndGivenBack(t *testing.T) {
	release := make(chan struct{})
	started := make(chan string, 10)
	h := func(w http.ResponseWriter, r *http.Request) {
		switch r.URL.Path {
		case "/slow":
			started <- r.Header.Get(idemhttp.HeaderKey)
			<-release
		case "/fail":
			w.WriteHeader(http.StatusInternalServerError)
			return
		}
		w.WriteHeader(http.StatusCreated)
	}
	q := &idemhttp.Quota{InFlight: 2, Records: 3}
	s := newServer(t, memstore.New(memstore.Options{}), idemhttp.Config{Quota: q, Retention: 400 * time.Millisecond, Logger: quietLogger()}, h)

	var wg sync.WaitGroup
	slow := make([]answer, 3)
	for i, key := range []string{"a", "b"} {
		wg.Go(func() { slow[i] = s.do(t, "POST", "/slow", key, "{}") })
		<-started
	}
	third := make(chan answer, 1)
	go func() { third <- s.do(t, "POST", "/slow", "c", "{}") }()
	select {
	case a := <-third:
		if a.status != http.StatusTooManyRequests || a.header.Get("Retry-After") != "1" {
			t.Errorf("third key in flight: got %d %v, want 429 Retry-After: 1", a.status, a.header)
		}
	case <-started:
		close(release)
		t.Fatal("third key in flight: the handler ran, want 429")
	}
	wg.Go(func() { slow[2] = s.do(t, "POST", "/slow", "a", "{}") }) // a copy of a: waits
	if a := s.do(t, "POST", "/other", "x", "{}", "Authorization", "Bearer bob"); a.status != http.StatusCreated {
		t.Errorf("another tenant: got %d, want 201", a.status)
	}
	close(release)
	wg.Wait()
	if slow[0].status != 201 || slow[1].status != 201 {
		t.Fatalf("keys in flight: got %d %d, want 201", slow[0].status, slow[1].status)
	}
	if slow[2].status != 201 && slow[2].status != http.StatusConflict {
		t.Errorf("copy of a key in flight: got %d %s, want its replay or 409, never 429", slow[2].status, slow[2].body)
	}
	// a and b are stored (2 records of 3): 5xx answers release their keys.
	for i := range 10 {
		if a := s.do(t, "POST", "/fail", fmt.Sprint("f", i), "{}"); a.status != http.StatusInternalServerError {
			t.Fatalf("released key %d: got %d, want 500 (released keys give their record back)", i, a.status)
		}
	}
	s.do(t, "POST", "/ok", "c", "{}")
	if a := s.do(t, "POST", "/ok", "d", "{}"); a.status != http.StatusTooManyRequests {
		t.Fatalf("fourth record: got %d, want 429", a.status)
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		a := s.do(t, "POST", "/ok", "d", "{}")
		if a.status == http.StatusCreated {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("after the retention: still %d", a.status)
		}
		time.Sleep(50 * time.Millisecond)
	}
}
