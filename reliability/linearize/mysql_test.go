package linearize

import (
	"context"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/mysqltest"
	"github.com/idemkit/idem/internal/reltest"
	"github.com/idemkit/idem/mysqlstore"
)

// TestLinearizableMySQL checks mysqlstore on a private MariaDB against
// the model: its Acquire is up to three statements (a read, a token draw,
// an insert or takeover, and a read again when the key turned out live),
// and each call must still take effect at one moment between its
// invocation and its return.
func TestLinearizableMySQL(t *testing.T) {
	ms, err := mysqltest.Start()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(ms.Stop)
	db := ms.New(t)
	db.SetMaxOpenConns(24)
	store, err := mysqlstore.New(context.Background(), db, mysqlstore.Options{Migrate: true})
	if err != nil {
		t.Fatal(err)
	}
	w := newWorkload(t, store, 12, reltest.Scale(150, 1500))
	w.callTTL = 5 * time.Second
	w.run(4)
	result(t, w, "mysql (MariaDB 10.11)", "none", newModel(stepper{}))
}
