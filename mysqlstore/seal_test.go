package mysqlstore_test

import (
	"bytes"
	"context"
	"database/sql"
	"testing"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/sealtest"
	"github.com/idemkit/idem/mysqlstore"
)

// TestBeginFuncSealed: BeginFunc completes through the attempt, so a
// Guard with Config.Seal stores the response sealed (the row's bytes hold
// no card) and the retry replays it opened.
func TestBeginFuncSealed(t *testing.T) {
	const card = "4111 1111 1111 1111"
	db := srv.New(t)
	ctx := t.Context()
	s := newStore(t, db, mysqlstore.Options{Migrate: true})
	g, err := idem.New(s, idem.Config{Seal: sealtest.Ring(t, "k1")})
	if err != nil {
		t.Fatal(err)
	}
	key := idem.Key{0x5e}
	att, acq, err := g.Begin(ctx, key, fp)
	if err != nil || acq.Outcome != idem.Acquired {
		t.Fatalf("Begin: %v, %v", acq.Outcome, err)
	}
	if _, err := s.BeginFunc(ctx, db, att, func(context.Context, *sql.Tx) (*idem.Response, error) {
		return &idem.Response{Status: 201, Body: []byte(`{"card":"` + card + `"}`)}, nil
	}); err != nil {
		t.Fatal(err)
	}
	rec, ok, err := s.Get(ctx, key)
	if err != nil || !ok {
		t.Fatalf("Get: %v, %v", ok, err)
	}
	raw, _ := rec.Response.AppendBinary(nil)
	if !rec.Response.Sealed() || bytes.Contains(raw, []byte(card)) {
		t.Fatalf("BeginFunc stored the response in clear: %q", raw)
	}
	var row []byte
	if err := db.QueryRowContext(ctx, "SELECT response FROM idem_records").Scan(&row); err != nil {
		t.Fatalf("reading the row: %v", err)
	} else if bytes.Contains(row, []byte(card)) {
		t.Fatalf("the row holds the card")
	}
	_, again, err := g.Begin(ctx, key, fp)
	if err != nil || again.Outcome != idem.Replay || !bytes.Contains(again.Response.Body, []byte(card)) {
		t.Fatalf("retry: %v, %+v, %v; want the replay, opened", again.Outcome, again.Response, err)
	}
}
