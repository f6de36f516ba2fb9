package idemhttp_test

import (
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"

	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/memstore"
)

// A sender that names each event in its body ("id") and redelivers it on
// a timeout with a new attempt count: the key comes from the body, and the
// fingerprint ignores the attempt, so the redelivery is answered from the
// store and the event is handled once. The same id with another amount is
// refused.
func ExampleKeyFromJSON() {
	handled := 0
	hook := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		handled++
		fmt.Fprintf(w, "handled %d", handled)
	})
	mw := idemhttp.Middleware(memstore.New(memstore.Options{}), idemhttp.Config{
		KeySource:   idemhttp.KeyFromJSON("/id"),
		Fingerprint: idemhttp.FingerprintJSON("/attempt"),
		Tenant:      func(*http.Request) string { return "the-sender" }, // who signs the events, say
	})
	srv := httptest.NewServer(mw(hook))
	defer srv.Close()

	for _, event := range []string{
		`{"id":"evt_1","amount":500,"attempt":1}`,
		`{"attempt":2, "amount":500, "id":"evt_1"}`,
		`{"id":"evt_1","amount":900,"attempt":3}`,
	} {
		resp, err := http.Post(srv.URL+"/hooks", "application/json", strings.NewReader(event))
		if err != nil {
			panic(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			body = []byte(resp.Header.Get("Content-Type"))
		}
		fmt.Println(resp.StatusCode, "replayed:", resp.Header.Get("Idempotent-Replayed") == "true", string(body))
	}
	fmt.Println("handled:", handled)
	// Output:
	// 200 replayed: false handled 1
	// 200 replayed: true handled 1
	// 422 replayed: false application/problem+json
	// handled: 1
}
