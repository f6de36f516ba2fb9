package idemhttp_test

import (
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"

	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/memstore"
)

// A web app whose browsers authenticate with a session cookie: the
// session cookie names the client, so one key from two sessions is two
// operations, and a retry whose other cookies changed still replays.
func ExampleTenantFromCookie() {
	orders := 0
	mux := http.NewServeMux()
	mux.HandleFunc("POST /orders", func(w http.ResponseWriter, r *http.Request) {
		orders++
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, "order %d", orders)
	})
	store := memstore.New(memstore.Options{})
	cfg := idemhttp.Config{Tenant: idemhttp.TenantFromCookie("session")}
	srv := httptest.NewServer(idemhttp.Middleware(store, cfg)(mux))
	defer srv.Close()

	for _, cookie := range []string{"session=alice; tracking=1", "session=mallory", "session=alice; tracking=2"} {
		req, _ := http.NewRequest("POST", srv.URL+"/orders", strings.NewReader(`{"sku":"tea"}`))
		req.Header.Set("Idempotency-Key", "order-1001")
		req.Header.Set("Cookie", cookie)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			panic(err)
		}
		resp.Body.Close()
		fmt.Println(cookie+":", resp.StatusCode, "replayed:", resp.Header.Get("Idempotent-Replayed") == "true")
	}
	// Output:
	// session=alice; tracking=1: 201 replayed: false
	// session=mallory: 201 replayed: false
	// session=alice; tracking=2: 201 replayed: true
}
