// Command echo serves a tiny payments API on labstack/echo with idemhttp
// making POST /charges idempotent. From examples/frameworks:
//
//	go run ./echo
//	curl -i localhost:8080/charges -H 'Idempotency-Key: order-1' -H 'Content-Type: application/json' -d '{"amount":1000,"currency":"usd"}'
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

	"github.com/labstack/echo/v4"

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
	log.Printf("echo: listening on http://%s", *addr)
	log.Fatal(srv.ListenAndServe())
}

// newHandler builds the API. charges counts the charges made (and numbers
// their ids); the tests use it to see how often the handler ran.
func newHandler(store idem.Store, charges *atomic.Int64) http.Handler {
	e := echo.New()
	// echo.WrapMiddleware adapts net/http middleware; idemhttp covers POST
	// and PATCH only, GET passes through. echo runs e.Use middleware after
	// routing, but idemhttp only sees the *http.Request, not c.Path():
	// records are scoped by the URL path, the default.
	e.Use(echo.WrapMiddleware(idemhttp.Middleware(store, idemhttp.Config{})))
	// An echo handler may return an error (c.Bind's 400, echo.HTTPError)
	// instead of writing a response. echo writes it with its
	// HTTPErrorHandler once the whole chain has returned, that is after
	// idemhttp has stored what it saw: an empty 200. This middleware,
	// inside idemhttp, writes the error there, so it is stored and
	// replayed like any other answer.
	e.Use(func(next echo.HandlerFunc) echo.HandlerFunc {
		return func(c echo.Context) error {
			if err := next(c); err != nil {
				c.Error(err)
			}
			return nil
		}
	})

	e.POST("/charges", func(c echo.Context) error {
		var req chargeRequest
		if err := c.Bind(&req); err != nil {
			return err // a 400 echo.HTTPError, written by the middleware above
		}
		if req.Amount <= 0 || req.Currency == "" {
			return echo.NewHTTPError(http.StatusBadRequest, "amount must be positive and currency set")
		}
		// The lease is in the request's context when it carried a key:
		// pass its fencing token to the system of record, which rejects
		// writes with a token older than the last one it saw.
		var token uint64
		if lease, ok := idem.LeaseFromContext(c.Request().Context()); ok {
			token = lease.Token
		}
		id := fmt.Sprintf("ch_%06d", charges.Add(1))
		return c.JSON(http.StatusCreated, charge{ID: id, Amount: req.Amount, Currency: req.Currency, FencingToken: token})
	})

	e.GET("/charges/:id", func(c echo.Context) error {
		return c.JSON(http.StatusOK, chargeStatus{ID: c.Param("id"), Status: "succeeded"})
	})
	return e
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
