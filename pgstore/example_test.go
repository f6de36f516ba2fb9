package pgstore_test

import (
	"context"
	"fmt"
	"log"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/pgstore"
)

// A charge and its idempotency record commit in one transaction:
// BeginFunc takes the steps in order (begin, the work, StopRenewal,
// CompleteTx, commit). The second call with the same key is a replay.
// The store opens from a URL, owns its pool (Pool, for BeginFunc) and
// its reaper, and Close ends both.
func ExampleStore_BeginFunc() {
	ctx := context.Background()
	url := exampleDatabase // postgres://user:pass@host:5432/db
	store, err := pgstore.Open(ctx, url, pgstore.Options{
		Migrate:      true,        // table idem_records
		ReapInterval: time.Minute, // the store's reaper; 0: none
	})
	if err != nil {
		log.Fatal(err)
	}
	defer store.Close() // stops the reaper, closes the pool
	pool := store.Pool()
	g, err := idem.New(store, idem.Config{})
	if err != nil {
		log.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `CREATE TABLE IF NOT EXISTS payments (order_id text PRIMARY KEY, cents int)`); err != nil {
		log.Fatal(err)
	}

	pay := func(orderID string, cents int) {
		key, err := idem.Scope{Method: "POST", Route: "/payments"}.Key(orderID)
		if err != nil {
			log.Fatal(err)
		}
		att, acq, err := g.Begin(ctx, key, idem.SumFingerprint(fmt.Append(nil, cents)))
		if err != nil {
			log.Fatal(err)
		}
		switch acq.Outcome {
		case idem.Replay:
			fmt.Printf("%s: replayed %d %s\n", orderID, acq.Response.Status, acq.Response.Body)
			return
		case idem.Acquired:
		default:
			fmt.Printf("%s: %v\n", orderID, acq.Outcome) // InFlight or Mismatch
			return
		}
		res, err := store.BeginFunc(ctx, pool, att, func(ctx context.Context, tx pgx.Tx) (*idem.Response, error) {
			if _, err := tx.Exec(ctx, `INSERT INTO payments VALUES ($1, $2)`, orderID, cents); err != nil {
				return nil, err // rolled back, and the key released
			}
			return &idem.Response{Status: 201, Body: fmt.Appendf(nil, `{"paid":%d}`, cents)}, nil
		})
		if err != nil {
			log.Fatal(err)
		}
		fmt.Printf("%s: charged %d %s\n", orderID, res.Response.Status, res.Response.Body)
	}
	pay("order-1042", 4200)
	pay("order-1042", 4200)

	var n int
	pool.QueryRow(ctx, `SELECT count(*) FROM payments`).Scan(&n)
	fmt.Println("payments:", n)
	// Output:
	// order-1042: charged 201 {"paid":4200}
	// order-1042: replayed 201 {"paid":4200}
	// payments: 1
}
