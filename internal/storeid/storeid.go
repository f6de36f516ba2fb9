// Package storeid keeps the store id of the SQL stores (pgstore,
// mysqlstore): a random id kept in a one-row table beside the records
// table, which their Namespace carries, so that the blob names of two
// databases (or schemas, or servers) with the same table never agree.
//
// The id lives in the database itself, so a failover to a replica, a
// second address of the same server and a restore of a backup keep it,
// and another database has another. A store reads it when it opens; a
// database that did not answer then is asked again when the namespace is
// next wanted (Holder.Get), so that opening a store does not need the
// server, as in v1.0.
package storeid

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"log/slog"
	"sync"
	"time"
)

// New returns a new store id: 32 random hex digits.
func New() string {
	var b [16]byte
	rand.Read(b[:]) // never fails (crypto/rand)
	return hex.EncodeToString(b[:])
}

// Read reads a store's id. Its error is None(why) when the database
// answered and has no id for the store (no table, no row, no right to read
// it): that answer is final. Any other error is tried again.
type Read func(ctx context.Context) (string, error)

// None marks why as Read's final answer: the database has no id.
func None(why error) error { return noneError{why} }

type noneError struct{ why error }

func (e noneError) Error() string { return e.why.Error() }
func (e noneError) Unwrap() error { return e.why }

// Holder is a store id read once: at Open, or on the first Get after a
// read that failed.
type Holder struct {
	read    Read
	timeout time.Duration
	onNone  func(why error) // called once when the database turns out to have no id

	mu    sync.Mutex
	known bool // an answer was had: id, or none
	id    string
}

// LegacyWarning is the onNone of a SQL store (pkg, "pgstore") whose id
// table is table: a WARN that its blobs are named with v1.0's namespace,
// which no sweep judges, and how to give it an id.
func LegacyWarning(log *slog.Logger, pkg, table string) func(why error) {
	return func(why error) {
		log.Warn(pkg+": the database has no store id, so this store's blobs are named with v1.0's namespace, which does not tell databases apart: "+
			"no sweep (idem gc, --blob-sweep) deletes them; run Migrate (Options.Migrate) to create the id's table",
			slog.String("table", table), slog.Any("error", why))
	}
}

// Open reads the id with read (bounded by timeout) and returns a Holder
// for it. A read that fails is tried again by Get. onNone, if not nil, is
// called once if the database has no id, with why.
func Open(ctx context.Context, read Read, timeout time.Duration, onNone func(why error)) *Holder {
	h := &Holder{read: read, timeout: timeout, onNone: onNone}
	h.try(ctx)
	return h
}

// try reads the id unless it is known; h.mu is held or h is new.
func (h *Holder) try(ctx context.Context) {
	if h.known {
		return
	}
	ctx, cancel := context.WithTimeout(ctx, h.timeout)
	defer cancel()
	id, err := h.read(ctx)
	var none noneError
	switch {
	case errors.As(err, &none):
		h.known = true
		if h.onNone != nil {
			h.onNone(none.why)
		}
	case err == nil && id != "":
		h.known, h.id = true, id
	}
}

// Get returns the id: "" when the database has none, or has not answered
// yet (it is asked again).
func (h *Holder) Get() string {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.try(context.Background())
	return h.id
}
