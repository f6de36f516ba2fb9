package tieredstore_test

import (
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/idemkit/idem/pgstore"
	"github.com/idemkit/idem/redisstore"
	"github.com/idemkit/idem/tieredstore"
)

// TestOpen checks that Open reads its PostgreSQL URL as pgstore.Open does:
// a URL of another form is refused before any connection, with an error
// wrapping pgstore.ErrBadURL without the password; a good one gets the
// 10s connect timeout, and Pool returns the pool Close closes.
func TestOpen(t *testing.T) {
	for _, pgURL := range []string{"postgres:u:s3cret@127.0.0.1/db", "mysql://u:s3cret@127.0.0.1/db"} {
		_, err := tieredstore.Open(t.Context(), "redis://127.0.0.1:1", pgURL, redisstore.Options{}, tieredstore.Options{})
		if !errors.Is(err, pgstore.ErrBadURL) || strings.Contains(err.Error(), "s3cret") {
			t.Errorf("Open with PostgreSQL URL %s: got %v, want an ErrBadURL without the password", pgURL, err)
		}
	}
	s, err := tieredstore.Open(t.Context(), "redis://"+shared.Addr(), database, redisstore.Options{}, tieredstore.Options{Migrate: true})
	if err != nil {
		t.Fatal(err)
	}
	if got := s.Pool().Config().ConnConfig.ConnectTimeout; got != 10*time.Second {
		t.Errorf("Open: pool's connect timeout %v, want the default 10s", got)
	}
	s.Close()
	if err := s.Pool().Ping(t.Context()); err == nil {
		t.Error("after Close: the pool Open made still answers, want it closed")
	}
}
