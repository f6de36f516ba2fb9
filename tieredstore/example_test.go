package tieredstore_test

import (
	"context"
	"fmt"
	"log"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/redisstore"
	"github.com/idemkit/idem/tieredstore"
)

// A charge and its completion commit in one PostgreSQL transaction;
// repeats are answered from Redis. When Redis loses the key, the next run
// is rolled back at its completion and answered with the first commit.
func ExampleStore_BeginFunc() {
	ctx := context.Background()
	redisURL, pgURL := "redis://"+shared.Addr(), database // redis://host:6379/0, postgres://user:pass@host:5432/db
	store, err := tieredstore.Open(ctx, redisURL, pgURL,
		redisstore.Options{}, tieredstore.Options{Migrate: true}) // table idem_completions
	if err != nil {
		log.Fatal(err)
	}
	defer store.Close() // stops the relay and the reaper, closes both clients
	pool := store.Pool()
	g, err := idem.New(store, idem.Config{})
	if err != nil {
		log.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `CREATE TABLE IF NOT EXISTS charges (order_id text, cents int)`); err != nil {
		log.Fatal(err)
	}
	rs := store.Redis()

	charge := func(orderID string, cents int) {
		key, err := idem.Scope{Method: "POST", Route: "/charges"}.Key(orderID)
		if err != nil {
			log.Fatal(err)
		}
		att, acq, err := g.Begin(ctx, key, idem.SumFingerprint(fmt.Append(nil, cents)))
		if err != nil {
			log.Fatal(err)
		}
		switch acq.Outcome {
		case idem.Replay:
			fmt.Printf("%s: replayed from Redis %d %s\n", orderID, acq.Response.Status, acq.Response.Body)
			return
		case idem.Acquired:
		default:
			fmt.Printf("%s: %v\n", orderID, acq.Outcome) // InFlight or Mismatch
			return
		}
		res, err := store.BeginFunc(ctx, pool, att, func(ctx context.Context, tx pgx.Tx) (*idem.Response, error) {
			if _, err := tx.Exec(ctx, `INSERT INTO charges VALUES ($1, $2)`, orderID, cents); err != nil {
				return nil, err // rolled back, and the key released
			}
			return &idem.Response{Status: 201, Body: fmt.Appendf(nil, `{"charged":%d}`, cents)}, nil
		})
		if err != nil {
			log.Fatal(err) // idem.ErrMismatch if the key was used for another request
		}
		if res.Replayed { // Redis had lost the key: this run was rolled back
			fmt.Printf("%s: ran again, rolled back, replayed the first commit %d %s\n", orderID, res.Response.Status, res.Response.Body)
			return
		}
		fmt.Printf("%s: charged %d %s\n", orderID, res.Response.Status, res.Response.Body)
	}
	charge("order-7", 4200)
	charge("order-7", 4200)

	// Redis loses the record (a failover, a restart, FLUSHALL).
	key, _ := idem.Scope{Method: "POST", Route: "/charges"}.Key("order-7")
	rs.Delete(ctx, key)
	charge("order-7", 4200)
	charge("order-7", 4200)

	var n int
	pool.QueryRow(ctx, `SELECT count(*) FROM charges WHERE order_id = 'order-7'`).Scan(&n)
	fmt.Println("charges:", n)
	// Output:
	// order-7: charged 201 {"charged":4200}
	// order-7: replayed from Redis 201 {"charged":4200}
	// order-7: ran again, rolled back, replayed the first commit 201 {"charged":4200}
	// order-7: replayed from Redis 201 {"charged":4200}
	// charges: 1
}
