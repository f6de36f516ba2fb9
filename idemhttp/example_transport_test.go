package idemhttp_test

import (
	"fmt"
	"log"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"time"

	"github.com/idemkit/idem/idemhttp"
)

// A client whose POSTs carry an Idempotency-Key and are retried with that
// same key when the server is briefly unavailable.
func ExampleTransport() {
	var (
		mu   sync.Mutex
		keys []string
	)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		keys = append(keys, r.Header.Get("Idempotency-Key"))
		attempt := len(keys)
		mu.Unlock()
		if attempt == 1 {
			w.Header().Set("Retry-After", "0")
			w.WriteHeader(http.StatusServiceUnavailable)
			return
		}
		w.WriteHeader(http.StatusCreated)
	}))
	defer srv.Close()

	client := &http.Client{Transport: &idemhttp.Transport{
		MinBackoff: 10 * time.Millisecond, // the zero value means defaults; this only shortens the example
	}}
	resp, err := client.Post(srv.URL+"/payments", "application/json", strings.NewReader(`{"amount":1000}`))
	if err != nil {
		fmt.Println(err)
		return
	}
	resp.Body.Close()

	mu.Lock()
	defer mu.Unlock()
	fmt.Println(resp.Status)
	fmt.Println("attempts:", len(keys))
	fmt.Println("same key:", keys[0] != "" && keys[0] == keys[1])
	fmt.Println("key sent:", idemhttp.KeyFromResponse(resp) == keys[1])
	// Output:
	// 201 Created
	// attempts: 2
	// same key: true
	// key sent: true
}

// A client whose attempts give up after 2s each and are retried with the
// same key. (Compiled, not run.)
func ExampleTransport_attemptTimeout() {
	client := &http.Client{Transport: &idemhttp.Transport{AttemptTimeout: 2 * time.Second}} // other fields: defaults
	resp, err := client.Post("https://api.example.com/charges", "application/json", strings.NewReader(`{"amount":1000}`))
	if err != nil {
		log.Fatal(err) // every attempt failed: the network, or a timeout each time
	}
	defer resp.Body.Close()
	fmt.Println(resp.StatusCode, resp.Header.Get("Idempotent-Replayed"), idemhttp.KeyFromResponse(resp))
}
