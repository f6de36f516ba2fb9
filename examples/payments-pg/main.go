// Command payments-pg is a payments service on PostgreSQL whose charge row
// and idempotency completion commit in one transaction, so that a charge is
// made exactly once per idempotency key, whatever fails and however often
// the client retries.
//
//	go run ./examples/payments-pg -db 'postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable'
//	curl -i -X POST localhost:8080/charges -H 'Idempotency-Key: order-1' -d '{"amount":1999,"currency":"eur"}'
//
// Per request: Acquire the key (a replay, in flight or mismatch answers at
// once); then, in one transaction, insert the charge and CompleteTx the
// key with the response naming it; commit. A failure before the commit
// rolls both back: after an error the key is released and the next retry
// charges; after a crash it stays in flight until its lease ends, then the
// next retry charges. After the commit, every
// retry gets the stored response. If the answer to the commit is lost, the
// release that follows finds the key completed and changes nothing.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log"
	"net/http"
	"os"
	"os/signal"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/pgstore"
)

func main() {
	addr := flag.String("addr", "localhost:8080", "listen address")
	db := flag.String("db", "postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable", "PostgreSQL connection string")
	flag.Parse()

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	// The store owns its pool and its reaper, which deletes the expired
	// records every minute; Close stops the one and closes the other.
	store, err := pgstore.Open(ctx, *db, pgstore.Options{Namespace: "payments", Migrate: true, ReapInterval: time.Minute})
	if err != nil {
		log.Fatal(err)
	}
	defer store.Close()
	svc, err := newService(ctx, store, time.Minute)
	if err != nil {
		log.Fatal(err)
	}

	srv := &http.Server{Addr: *addr, Handler: svc}
	go func() {
		<-ctx.Done()
		srv.Shutdown(context.Background())
	}()
	log.Printf("payments-pg: listening on http://%s", *addr)
	if err := srv.ListenAndServe(); !errors.Is(err, http.ErrServerClosed) {
		log.Fatal(err)
	}
}

// schema is the business table. idem_key is deliberately not UNIQUE: the
// idempotency store alone must keep a key from being charged twice.
const schema = `
CREATE TABLE IF NOT EXISTS charges (
	id         bigserial   PRIMARY KEY,
	idem_key   text        NOT NULL,
	amount     bigint      NOT NULL,
	currency   text        NOT NULL,
	token      bigint      NOT NULL,
	created_at timestamptz NOT NULL DEFAULT now()
)`

// chargeRequest is the body of POST /charges.
type chargeRequest struct {
	Amount   int64  `json:"amount"`
	Currency string `json:"currency"`
}

// charge is the body of the answer: the charge row.
type charge struct {
	ID       int64  `json:"id"`
	Key      string `json:"idempotency_key"`
	Amount   int64  `json:"amount"`
	Currency string `json:"currency"`
}

// scope keys every client key to this one operation.
var scope = idem.Scope{Method: http.MethodPost, Route: "/charges"}

type service struct {
	pool  *pgxpool.Pool
	store *pgstore.Store
	lease time.Duration
}

// newService creates the charges table if needed, in the store's
// database (the store creates its own with Options.Migrate). lease bounds
// how long a crashed request blocks its key.
func newService(ctx context.Context, store *pgstore.Store, lease time.Duration) (*service, error) {
	pool := store.Pool()
	if _, err := pool.Exec(ctx, schema); err != nil {
		return nil, fmt.Errorf("create charges: %w", err)
	}
	return &service{pool: pool, store: store, lease: lease}, nil
}

// retention is how long an answer is replayed.
const retention = 24 * time.Hour

// Charge charges req once for clientKey. It returns the response (stored
// and replayed when replayed is true), an *idem.InFlightError while
// another request holds the key, idem.ErrMismatch for a key used with
// another request, or another error when nothing was charged, or nothing
// is known to have been: retrying is then safe.
func (s *service) Charge(ctx context.Context, clientKey string, req chargeRequest) (resp *idem.Response, replayed bool, err error) {
	key, err := scope.Key(clientKey)
	if err != nil {
		return nil, false, err
	}
	body, err := json.Marshal(req)
	if err != nil {
		return nil, false, err
	}
	l := idem.Lease{Key: key, ID: idem.NewLeaseID(), TTL: s.lease}
	acq, err := s.store.Acquire(ctx, idem.AcquireRequest{Key: key, Fingerprint: idem.SumFingerprint(body), LeaseID: l.ID, TTL: l.TTL})
	if err == nil && acq.Outcome == idem.Acquired {
		l = acq.Lease
		resp, err = s.chargeTx(ctx, clientKey, req, l)
	}
	if err != nil {
		// The key may be ours (an Acquire whose answer was lost, a charge
		// rolled back): free it for the retry. If the commit happened with
		// its answer lost, the key is completed and this changes nothing.
		s.store.Release(context.WithoutCancel(ctx), l)
		return nil, false, err
	}
	switch acq.Outcome {
	case idem.Replay:
		return acq.Response, true, nil
	case idem.InFlight:
		return nil, false, &idem.InFlightError{RetryAfter: acq.RetryAfter}
	case idem.Mismatch:
		return nil, false, idem.ErrMismatch
	}
	return resp, false, nil
}

// chargeTx inserts the charge and completes the key in one transaction.
func (s *service) chargeTx(ctx context.Context, clientKey string, req chargeRequest, l idem.Lease) (*idem.Response, error) {
	tx, err := s.pool.Begin(ctx)
	if err != nil {
		return nil, err
	}
	defer tx.Rollback(context.WithoutCancel(ctx)) // a no-op after Commit
	c := charge{Key: clientKey, Amount: req.Amount, Currency: req.Currency}
	err = tx.QueryRow(ctx, `INSERT INTO charges (idem_key, amount, currency, token) VALUES ($1, $2, $3, $4) RETURNING id`,
		clientKey, req.Amount, req.Currency, int64(l.Token)).Scan(&c.ID)
	if err != nil {
		return nil, err
	}
	body, err := json.Marshal(c)
	if err != nil {
		return nil, err
	}
	resp := &idem.Response{Status: http.StatusCreated, Header: http.Header{"Content-Type": {"application/json"}}, Body: body}
	if err := s.store.CompleteTx(ctx, tx, l, resp, retention); err != nil {
		return nil, err
	}
	return resp, tx.Commit(ctx)
}

// ServeHTTP serves POST /charges.
func (s *service) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.Method != http.MethodPost || r.URL.Path != "/charges" {
		http.NotFound(w, r)
		return
	}
	var req chargeRequest
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, 1<<10))
	if err == nil {
		err = json.Unmarshal(body, &req)
	}
	if err != nil || req.Amount <= 0 || req.Currency == "" {
		http.Error(w, "want a JSON body with a positive amount and a currency", http.StatusBadRequest)
		return
	}
	resp, replayed, err := s.Charge(r.Context(), r.Header.Get("Idempotency-Key"), req)
	var inFlight *idem.InFlightError
	switch {
	case errors.Is(err, idem.ErrInvalidKey):
		http.Error(w, err.Error(), http.StatusBadRequest)
	case errors.As(err, &inFlight):
		w.Header().Set("Retry-After", strconv.Itoa(int(inFlight.RetryAfter.Seconds())+1))
		http.Error(w, "a request with this key is in progress", http.StatusConflict)
	case errors.Is(err, idem.ErrMismatch):
		http.Error(w, err.Error(), http.StatusUnprocessableEntity)
	case err != nil:
		// Nothing was charged, or the charge committed with its answer
		// lost: either way a retry with the same key gets the right answer.
		http.Error(w, "charge failed or its outcome is unknown: retry with the same key", http.StatusServiceUnavailable)
	default:
		for name, values := range resp.Header {
			w.Header()[name] = values
		}
		if replayed {
			w.Header().Set("Idempotent-Replayed", "true")
		}
		w.WriteHeader(resp.Status)
		w.Write(resp.Body)
	}
}
