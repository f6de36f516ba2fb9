package pgstore_test

import (
	"context"
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/pgtest"
	"github.com/idemkit/idem/pgstore"
)

// TestOpenBadURL checks that Open refuses a URL of another form before
// connecting, with an error that wraps ErrBadURL, names the form wanted
// and never shows the password.
func TestOpenBadURL(t *testing.T) {
	for raw, want := range map[string]string{
		"postgres:u:s3cret@127.0.0.1/db":                   "no host",
		"mysql://u:s3cret@127.0.0.1/db":                    `scheme "mysql"`,
		"postgres://u:s3cret@127.0.0.1:1/db?sslmode=bogus": "sslmode",
		"postgres://u:s3cret@[::1/db":                      "does not parse",
	} {
		s, err := pgstore.Open(t.Context(), raw, pgstore.Options{})
		if s != nil || !errors.Is(err, pgstore.ErrBadURL) || !strings.Contains(err.Error(), want) ||
			!strings.Contains(err.Error(), "postgres://[user[:pass]@]host[:port]/db") || strings.Contains(err.Error(), "s3cret") {
			t.Errorf("Open(%s): got %v, want an ErrBadURL saying %q and the form, without the password", raw, err, want)
		}
	}
}

// TestOpenReapClose checks the store Open returns: it owns its pool
// (Pool; Close closes it), runs its reaper every Options.ReapInterval,
// reports each pass to OnReap, and Close stops it. A store from New with
// a ReapInterval reaps too, and its Close leaves the caller's pool open.
func TestOpenReapClose(t *testing.T) {
	admin := pgtest.New(t)
	url := admin.Config().ConnString()
	ctx := t.Context()
	var passes, reaped atomic.Int64
	s, err := pgstore.Open(ctx, url, pgstore.Options{Migrate: true, ReapGrace: time.Millisecond, ReapInterval: 10 * time.Millisecond,
		OnReap: func(deleted int, took time.Duration, err error) {
			if err != nil {
				t.Errorf("OnReap: pass failed: %v", err)
			}
			passes.Add(1)
			reaped.Add(int64(deleted))
		}})
	if err != nil {
		t.Fatal(err)
	}
	if got := s.Pool().Config().ConnConfig.ConnectTimeout; got != 10*time.Second {
		t.Errorf("Open: pool's connect timeout %v, want the default 10s", got)
	}
	lease(t, s, newKey(1), time.Millisecond)
	lease(t, s, newKey(2), time.Millisecond)
	lease(t, s, newKey(3), time.Hour)
	count := func() (n int) {
		if err := admin.QueryRow(ctx, "SELECT count(*) FROM idem_records").Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	deadline := time.Now().Add(5 * time.Second)
	for (count() != 1 || reaped.Load() < 2) && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	if n := count(); n != 1 || reaped.Load() != 2 {
		t.Fatalf("with ReapInterval 10ms: %d rows left and %d reaped, want the live one left and the 2 expired reaped", n, reaped.Load())
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	stopped := passes.Load()
	time.Sleep(50 * time.Millisecond)
	if p := passes.Load(); p != stopped {
		t.Errorf("after Close: %d more passes, want none (the reaper stopped)", p-stopped)
	}
	if err := s.Pool().Ping(ctx); err == nil {
		t.Error("after Close: the pool Open made still answers, want it closed")
	}
	if err := s.Close(); err != nil {
		t.Errorf("second Close: %v", err)
	}

	// New: the reaper runs as well; Close stops it and leaves the pool.
	passes.Store(0)
	s2 := newStore(t, admin, pgstore.Options{ReapGrace: time.Millisecond, ReapInterval: 10 * time.Millisecond,
		OnReap: func(int, time.Duration, error) { passes.Add(1) }})
	lease(t, s2, newKey(4), time.Millisecond)
	for (count() != 1 || passes.Load() == 0) && time.Now().Before(deadline.Add(5*time.Second)) {
		time.Sleep(10 * time.Millisecond)
	}
	if n := count(); n != 1 {
		t.Errorf("New with ReapInterval: %d rows left, want 1", n)
	}
	s2.Close()
	if s2.Pool() != admin {
		t.Error("New: Pool is not the pool New was given")
	}
	if err := admin.Ping(ctx); err != nil {
		t.Errorf("after Close of a store from New: the caller's pool: %v, want it open", err)
	}

	// No ReapInterval: no reaper.
	passes.Store(0)
	s3 := newStore(t, admin, pgstore.Options{ReapGrace: time.Millisecond, OnReap: func(int, time.Duration, error) { passes.Add(1) }})
	lease(t, s3, newKey(5), time.Millisecond)
	time.Sleep(50 * time.Millisecond)
	if n, p := count(), passes.Load(); n != 2 || p != 0 {
		t.Errorf("ReapInterval 0: %d rows and %d passes, want the expired row kept and no pass", n, p)
	}
	s3.Close()
}

// TestOpenUnreachable checks that Open's pool connects with the URL's
// connect_timeout, and that an error that is not the URL's does not wrap
// ErrBadURL.
func TestOpenUnreachable(t *testing.T) {
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	_, err := pgstore.Open(ctx, "postgres://u:s3cret@127.0.0.1:1/db?connect_timeout=2", pgstore.Options{Migrate: true})
	if err == nil || errors.Is(err, pgstore.ErrBadURL) || strings.Contains(err.Error(), "s3cret") {
		t.Errorf("Open on a closed port with Migrate: got %v, want a connection error, not ErrBadURL, without the password", err)
	}
}
