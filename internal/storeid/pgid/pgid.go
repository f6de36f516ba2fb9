// Package pgid reads the store id of a PostgreSQL database (internal/storeid)
// for pgstore and tieredstore, which keep it alike: a one-row table
// beside the records.
package pgid

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/internal/storeid"
)

// Read reads the store id from table with the statement sel, storing a
// new one first with insert (which takes the id as $1 and leaves an id
// already there alone) when create is set. A missing table, a table
// without its row, or one this role may not read is final (storeid.None):
// the store then keeps v1.0's namespace.
func Read(pool *pgxpool.Pool, insert, sel, table string, create bool) storeid.Read {
	return func(ctx context.Context) (string, error) {
		if create {
			_, err := pool.Exec(ctx, insert, storeid.New())
			// Without the right to insert, read what is there.
			if err != nil && !Denied(err) {
				return "", noID(err, table)
			}
		}
		var id string
		err := pool.QueryRow(ctx, sel).Scan(&id)
		if errors.Is(err, pgx.ErrNoRows) {
			return "", storeid.None(fmt.Errorf("%s has no row", table))
		}
		if err != nil {
			return "", noID(err, table)
		}
		return id, nil
	}
}

// noID is Read's error for err: final (storeid.None) when the table is
// missing or may not be read.
func noID(err error, table string) error {
	switch {
	case isCode(err, "42P01"):
		return storeid.None(fmt.Errorf("no table %s", table))
	case Denied(err):
		return storeid.None(err)
	}
	return err
}

// Denied reports whether err is PostgreSQL's insufficient_privilege
// (SQLSTATE 42501).
func Denied(err error) bool { return isCode(err, "42501") }

// isCode reports whether err is PostgreSQL's error with SQLSTATE code.
func isCode(err error, code string) bool {
	var pe *pgconn.PgError
	return errors.As(err, &pe) && pe.Code == code
}
