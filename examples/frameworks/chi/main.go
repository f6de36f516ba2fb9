// Command chi serves a tiny payments API on go-chi/chi with idemhttp making
// POST /charges idempotent. From examples/frameworks:
//
//	go run ./chi
//	curl -i localhost:8080/charges -H 'Idempotency-Key: order-1' -d '{"amount":1000,"currency":"usd"}'
//
// Repeat the curl: the same charge comes back with Idempotent-Replayed: true.
package main

import (
	"encoding/json"
	"flag"
	"fmt"
	"log"
	"net/http"
	"sync/atomic"
	"time"

	"github.com/go-chi/chi/v5"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/memstore"
)

func main() {
	addr := flag.String("addr", "127.0.0.1:8080", "listen address")
	flag.Parse()
	var charges atomic.Int64
	srv := &http.Server{
		Addr:              *addr,
		Handler:           newHandler(memstore.New(memstore.Options{}), &charges),
		ReadHeaderTimeout: 10 * time.Second,
	}
	log.Printf("chi: listening on http://%s", *addr)
	log.Fatal(srv.ListenAndServe())
}

// newHandler builds the API. charges counts the charges made (and numbers
// their ids); the tests use it to see how often the handler ran.
func newHandler(store idem.Store, charges *atomic.Int64) http.Handler {
	r := chi.NewRouter()
	// chi middleware is plain func(http.Handler) http.Handler: idemhttp
	// plugs in as is. It covers POST and PATCH only; GET passes through.
	//
	// chi runs r.Use middleware before it routes, so the route pattern
	// ("/charges/{id}") is not known yet: records are scoped by the URL
	// path, the default. Set Config.Route to name operations otherwise.
	r.Use(idemhttp.Middleware(store, idemhttp.Config{}))

	r.Post("/charges", func(w http.ResponseWriter, r *http.Request) {
		var req chargeRequest
		if err := json.NewDecoder(r.Body).Decode(&req); err != nil {
			writeJSON(w, http.StatusBadRequest, errorBody{"malformed JSON body"})
			return
		}
		if req.Amount <= 0 || req.Currency == "" {
			writeJSON(w, http.StatusBadRequest, errorBody{"amount must be positive and currency set"})
			return
		}
		// The lease is in the context when the request carried a key: pass
		// its fencing token to the system of record, which rejects writes
		// with a token older than the last one it saw.
		var token uint64
		if lease, ok := idem.LeaseFromContext(r.Context()); ok {
			token = lease.Token
		}
		id := fmt.Sprintf("ch_%06d", charges.Add(1))
		writeJSON(w, http.StatusCreated, charge{ID: id, Amount: req.Amount, Currency: req.Currency, FencingToken: token})
	})

	r.Get("/charges/{id}", func(w http.ResponseWriter, r *http.Request) {
		writeJSON(w, http.StatusOK, chargeStatus{ID: chi.URLParam(r, "id"), Status: "succeeded"})
	})
	return r
}

type chargeRequest struct {
	Amount   int64  `json:"amount"`
	Currency string `json:"currency"`
}

type charge struct {
	ID           string `json:"id"`
	Amount       int64  `json:"amount"`
	Currency     string `json:"currency"`
	FencingToken uint64 `json:"fencing_token,omitempty"`
}

type chargeStatus struct {
	ID     string `json:"id"`
	Status string `json:"status"`
}

type errorBody struct {
	Error string `json:"error"`
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	json.NewEncoder(w).Encode(v)
}
