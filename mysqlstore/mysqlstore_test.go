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
				// 0xC0 sets the version bits of the response encoding to version 7: no such version (0xFF would start a sealed value).
				_, err := db.Exec("UPDATE idem_records SET response = X'C0' WHERE namespace = ? AND `key` = ? AND state = 2", prefix, key[:])
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

// TestReap checks that Reap deletes the records expired for the grace, of
// every namespace, in batches, and passes over live records and a record
// locked by a transaction in progress; and that the store's reaper
// (ReapInterval) reports its passes and stops at Close.
func TestReap(t *testing.T) {
	db := srv.New(t)
	ctx := t.Context()
	s := newStore(t, db, mysqlstore.Options{Migrate: true, Namespace: "a", ReapGrace: time.Millisecond})
	other := newStore(t, db, mysqlstore.Options{Namespace: "b", ReapGrace: time.Millisecond})
	const expiring, live = 25, 10
	for i := range expiring {
		st := s
		if i%2 == 1 {
			st = other
		}
		switch l := lease(t, st, newKey(i), 50*time.Millisecond); i % 3 {
		case 1:
			if err := st.Complete(ctx, l, resp, 50*time.Millisecond); err != nil {
				t.Fatal(err)
			}
		case 2:
			if err := st.Release(ctx, l); err != nil {
				t.Fatal(err)
			}
		}
	}
	for i := range live {
		l := lease(t, s, newKey(1000+i), time.Minute)
		if i%2 == 0 {
			if err := s.Complete(ctx, l, resp, time.Hour); err != nil {
				t.Fatal(err)
			}
		}
	}
	// One more expiring record, locked by a transaction in progress.
	locked := lease(t, s, newKey(2000), 50*time.Millisecond)
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback()
	if err := s.CompleteTx(ctx, tx, locked, resp, time.Hour); err != nil {
		t.Fatal(err)
	}
	time.Sleep(100 * time.Millisecond)
	countRows := func() int {
		var n int
		if err := db.QueryRow("SELECT count(*) FROM idem_records").Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	if n := countRows(); n != expiring+live+1 {
		t.Fatalf("rows before Reap: got %d, want %d", n, expiring+live+1)
	}
	if deleted, err := newStore(t, db, mysqlstore.Options{}).Reap(ctx, 4); deleted != 0 || err != nil {
		t.Errorf("Reap within the default grace: got %d deleted, %v; want 0", deleted, err)
	}
	deleted, err := s.Reap(ctx, 4)
	if err != nil || deleted != expiring {
		t.Fatalf("Reap: got %d deleted, %v; want %d (the locked record left)", deleted, err, expiring)
	}
	if n := countRows(); n != live+1 {
		t.Errorf("rows after Reap: got %d, want %d", n, live+1)
	}
	if err := tx.Commit(); err != nil {
		t.Fatal(err)
	}
	if acq := acquire(t, s, newKey(2000), time.Minute); acq.Outcome != idem.Replay {
		t.Errorf("the locked record after its commit: got %v, want replay", acq.Outcome)
	}
	if _, err := s.Reap(ctx, 0); err == nil {
		t.Error("Reap with batch 0: got nil, want an error")
	}

	// The store's reaper (ReapInterval): one more expired record,
	// reported by a pass; Close stops it.
	lease(t, s, newKey(3000), time.Millisecond)
	passes := make(chan int, 100)
	s2 := newStore(t, db, mysqlstore.Options{ReapGrace: time.Millisecond, ReapInterval: 10 * time.Millisecond, OnReap: func(n int, _ time.Duration, err error) {
		if err != nil {
			t.Errorf("reaper pass: %v", err)
		}
		passes <- n
	}})
	total := 0
	for total < 1 {
		total += <-passes
	}
	s2.Close()
	if total != 1 {
		t.Errorf("the reaper deleted %d records, want 1", total)
	}
	n := len(passes)
	time.Sleep(50 * time.Millisecond)
	if len(passes) != n {
		t.Errorf("after Close: %d more passes, want none", len(passes)-n)
	}
	if err := db.PingContext(ctx); err != nil {
		t.Errorf("after Close of a store from New: the caller's db: %v, want it open", err)
	}
}
