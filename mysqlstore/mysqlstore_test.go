package mysqlstore_test

import (
	"context"
	"database/sql"
	"fmt"
	"os"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/mysqltest"
	"github.com/idemkit/idem/mysqlstore"
	"github.com/idemkit/idem/storetest"
)

var srv *mysqltest.Server

func TestMain(m *testing.M) {
	srv = mysqltest.MustStart()
	code := m.Run()
	srv.Stop()
	os.Exit(code)
}

func newStore(t testing.TB, db *sql.DB, opts mysqlstore.Options) *mysqlstore.Store {
	t.Helper()
	s, err := mysqlstore.New(context.Background(), db, opts)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func TestConformance(t *testing.T) {
	db := srv.New(t)
	if err := mysqlstore.Migrate(t.Context(), db, ""); err != nil {
		t.Fatal(err)
	}
	storetest.Run(t, func(t *testing.T, prefix string) storetest.Fixture {
		s := newStore(t, db, mysqlstore.Options{Namespace: prefix})
		return storetest.Fixture{
			Store: s,
			Sleep: time.Sleep,
			Corrupt: func(key idem.Key) error {
				// 0xFF sets the version bits of the response encoding: no such version.
				_, err := db.Exec("UPDATE idem_records SET response = X'FF' WHERE namespace = ? AND `key` = ? AND state = 2", prefix, key[:])
				return err
			},
		}
	})
}

var (
	fp   = idem.Fingerprint{0: 'f'}
	resp = &idem.Response{Status: 201, Body: []byte(`{"id":1}`)}
)

func newKey(i int) idem.Key {
	k, err := idem.Scope{Method: "POST", Route: "/test"}.Key(fmt.Sprint("key-", i))
	if err != nil {
		panic(err)
	}
	return k
}

func acquire(t testing.TB, s *mysqlstore.Store, key idem.Key, ttl time.Duration) idem.Acquisition {
	t.Helper()
	acq, err := s.Acquire(context.Background(), idem.AcquireRequest{Key: key, Fingerprint: fp, LeaseID: idem.NewLeaseID(), TTL: ttl})
	if err != nil {
		t.Fatalf("Acquire: got error %v, want none", err)
	}
	return acq
}

func lease(t testing.TB, s *mysqlstore.Store, key idem.Key, ttl time.Duration) idem.Lease {
	t.Helper()
	acq := acquire(t, s, key, ttl)
	if acq.Outcome != idem.Acquired {
		t.Fatalf("Acquire: got outcome %v, want acquired", acq.Outcome)
	}
	return acq.Lease
}
