package mysqlstore_test

import (
	"context"
	"database/sql"
	"fmt"
	"log"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/mysqlstore"
)

// ExampleStore_BeginFunc charges an order once per idempotency key: the
// charge row and the completion commit in one transaction.
func ExampleStore_BeginFunc() {
	ctx := context.Background()
	name, err := srv.CreateDatabase() // in a program: sql.Open("mysql", "user:pass@tcp(host:3306)/shop")
	if err != nil {
		log.Fatal(err)
	}
	defer srv.DropDatabase(name)
	db, err := sql.Open("mysql", srv.DSN(name))
	if err != nil {
		log.Fatal(err)
	}
	defer db.Close()
	if _, err := db.Exec("CREATE TABLE charges (order_id VARCHAR(64) NOT NULL, cents BIGINT NOT NULL)"); err != nil {
		log.Fatal(err)
	}
	store, err := mysqlstore.New(ctx, db, mysqlstore.Options{Migrate: true})
	if err != nil {
		log.Fatal(err)
	}
	g, err := idem.New(store, idem.Config{})
	if err != nil {
		log.Fatal(err)
	}
	key, err := idem.Scope{Method: "POST", Route: "/charges"}.Key("order-1")
	if err != nil {
		log.Fatal(err)
	}
	charge := func() {
		att, acq, err := g.Begin(ctx, key, idem.SumFingerprint([]byte(`{"cents":1999}`)))
		if err != nil {
			log.Fatal(err)
		}
		if acq.Outcome != idem.Acquired {
			fmt.Println(acq.Outcome, acq.Response.Status, string(acq.Response.Body))
			return
		}
		res, err := store.BeginFunc(ctx, db, att, func(ctx context.Context, tx *sql.Tx) (*idem.Response, error) {
			if _, err := tx.ExecContext(ctx, "INSERT INTO charges VALUES (?, ?)", "order-1", 1999); err != nil {
				return nil, err // rolled back, and the key released
			}
			return &idem.Response{Status: 201, Body: []byte(`{"paid":1999}`)}, nil
		})
		if err != nil {
			log.Fatal(err)
		}
		fmt.Println("charged", res.Response.Status, string(res.Response.Body))
	}
	charge()
	charge() // a retry
	var n int
	if err := db.QueryRow("SELECT count(*) FROM charges").Scan(&n); err != nil {
		log.Fatal(err)
	}
	fmt.Println(n, "charge")
	// Output:
	// charged 201 {"paid":1999}
	// replay 201 {"paid":1999}
	// 1 charge
}
