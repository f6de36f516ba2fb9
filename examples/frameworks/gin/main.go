// Command gin serves a tiny payments API on gin with idemhttp making
// POST /charges idempotent. From examples/frameworks:
//
//	go run ./gin
//	curl -i localhost:8080/charges -H 'Idempotency-Key: order-1' -d '{"amount":1000,"currency":"usd"}'
//
// Repeat the curl: the same charge comes back with Idempotent-Replayed: true.
package main

import (
	"flag"
	"fmt"
	"log"
	"net/http"
	"sync/atomic"
	"time"

	"github.com/gin-gonic/gin"

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
	log.Printf("gin: listening on http://%s", *addr)
	log.Fatal(srv.ListenAndServe())
}

// newHandler builds the API. charges counts the charges made (and numbers
// their ids); the tests use it to see how often the handler ran.
func newHandler(store idem.Store, charges *atomic.Int64) http.Handler {
	engine := gin.New()
	engine.Use(gin.Recovery()) // a panic becomes a 500, which idemhttp does not store: a retry runs again

	engine.POST("/charges", func(c *gin.Context) {
		var req chargeRequest
		if err := c.ShouldBindJSON(&req); err != nil {
			c.JSON(http.StatusBadRequest, errorBody{"malformed JSON body"})
			return
		}
		if req.Amount <= 0 || req.Currency == "" {
			c.JSON(http.StatusBadRequest, errorBody{"amount must be positive and currency set"})
			return
		}
		// The lease is in the request's context when it carried a key:
		// pass its fencing token to the system of record, which rejects
		// writes with a token older than the last one it saw.
		var token uint64
		if lease, ok := idem.LeaseFromContext(c.Request.Context()); ok {
			token = lease.Token
		}
		id := fmt.Sprintf("ch_%06d", charges.Add(1))
		c.JSON(http.StatusCreated, charge{ID: id, Amount: req.Amount, Currency: req.Currency, FencingToken: token})
	})

	engine.GET("/charges/:id", func(c *gin.Context) {
		c.JSON(http.StatusOK, chargeStatus{ID: c.Param("id"), Status: "succeeded"})
	})

	// gin middleware is a gin.HandlerFunc over *gin.Context, not
	// func(http.Handler) http.Handler, and gin has no adapter for the
	// latter. So idemhttp wraps the whole engine as an http.Handler. That
	// keeps it in front of everything gin does: it sees the exact bytes
	// gin writes (replays are byte for byte), and a replay, 409 or 422 is
	// answered without entering gin at all. It covers POST and PATCH only;
	// GET passes through.
	//
	// Records are scoped by the URL path, the default (gin does not set
	// Request.Pattern). gin's c.FullPath() ("/charges/:id") would be a
	// tidier route name, but it is only known once gin has routed, which
	// is after idemhttp scoped the key. Keep the path (it is at least as
	// specific as the route), or set Config.Route to a func that names the
	// operation from the request itself.
	return http.Handler(idemhttp.Middleware(store, idemhttp.Config{})(engine))
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
