// Package pgurl parses the PostgreSQL URL of pgstore.Open and
// tieredstore.Open (and so of idem proxy's --store and Caddy's store):
// postgres://[user[:pass]@]host[:port]/db[?params], with a connect
// timeout when the URL sets none. Its errors never show the password.
package pgurl

import (
	"errors"
	"fmt"
	"net/url"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
)

// Form is the form of the URL, for errors.
const Form = "postgres://[user[:pass]@]host[:port]/db[?params], postgresql://…"

// ConnectTimeout bounds connecting when the URL does not say
// (connect_timeout=SECONDS): pgx alone waits for ever on a server that
// accepts the connection and never answers.
const ConnectTimeout = 10 * time.Second

// Parse returns the pool configuration of a PostgreSQL URL. Its errors
// say what is wrong, not which form is right (Form), and never repeat
// the URL, which may hold a password; they start with no package name.
func Parse(raw string) (*pgxpool.Config, error) {
	u, err := url.Parse(raw)
	if err != nil {
		return nil, errors.New("it does not parse as a URL (not shown: it may hold a password)")
	}
	switch {
	case u.Scheme != "postgres" && u.Scheme != "postgresql":
		return nil, fmt.Errorf("scheme %q, not postgres or postgresql", u.Scheme)
	case u.Opaque != "":
		return nil, fmt.Errorf("no host (is the // after %s: missing?)", u.Scheme)
	}
	cfg, err := pgxpool.ParseConfig(raw)
	if err != nil {
		// pgconn's parse errors show the URL with its password masked.
		return nil, err
	}
	if cfg.ConnConfig.ConnectTimeout == 0 {
		cfg.ConnConfig.ConnectTimeout = ConnectTimeout
	}
	return cfg, nil
}
