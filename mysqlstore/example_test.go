package mysqlstore_test

import (
	"context"
	"database/sql"
	"fmt"
	"log"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/mysqlstore"
)

// ExampleStore_BeginFunc charges an order once per idempotency key: the
// charge row and the completion commit in one transaction. The store
// opens from a URL, owns its *sql.DB (DB, for BeginFunc) and its reaper,
// and Close ends both.
func ExampleStore_BeginFunc() {
	ctx := context.Background()
	name, err := srv.CreateDatabase()
	if err != nil {
		log.Fatal(err)
	}
	defer srv.DropDatabase(name)
	url := srv.URL(name) // mysql://user:pass@host:3306/db
	store, err := mysqlstore.Open(ctx, url, mysqlstore.Options{
		Migrate:      true,
		ReapInterval: time.Minute, // the store's reaper; 0: none
	})
	if err != nil {
		log.Fatal(err)
	}
	defer store.Close() // stops the reaper, closes the *sql.DB
	db := store.DB()
	if _, err := db.Exec("CREATE TABLE charges (order_id VARCHAR(64) NOT NULL, cents BIGINT NOT NULL)"); err != nil {
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
