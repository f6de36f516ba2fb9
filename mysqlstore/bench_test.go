package mysqlstore_test

import (
	"testing"

	"github.com/idemkit/idem/mysqlstore"
	"github.com/idemkit/idem/storetest"
)

// BenchmarkAcquireComplete measures full acquire+complete pairs on unique
// keys from 64 goroutines sharing a pool of 8 connections, against the
// private MariaDB server, as pgstore's benchmark of the same name does
// against PostgreSQL. It reports pairs/s and the p50/p99 of one pair.
//
// A pair on a new key is four statements (the read, the token draw, the
// insert, the completion), three of which commit. The "durable" run keeps
// innodb_flush_log_at_trx_commit = 1 (each commit waits for the redo log
// to reach the disk); "flush-per-second" sets it to 2 (the server's, not a
// session's, setting: a crash of the machine may lose the last second of
// commits), closer to pgstore's async-commit run.
//
//	go test -run '^$' -bench AcquireComplete -benchtime 5s ./mysqlstore/
func BenchmarkAcquireComplete(b *testing.B) {
	db := srv.New(b)
	db.SetMaxOpenConns(8)
	db.SetMaxIdleConns(8)
	for _, flush := range []string{"1", "2"} {
		name := map[string]string{"1": "durable", "2": "flush-per-second"}[flush]
		b.Run(name, func(b *testing.B) {
			if _, err := db.Exec("SET GLOBAL innodb_flush_log_at_trx_commit = " + flush); err != nil {
				b.Fatal(err)
			}
			defer db.Exec("SET GLOBAL innodb_flush_log_at_trx_commit = 1")
			storetest.BenchmarkPairs(b, newStore(b, db, mysqlstore.Options{Migrate: true, Namespace: name}), 64)
		})
	}
}
