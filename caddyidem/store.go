package caddyidem

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/caddyserver/caddy/v2"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/blobstore"
	"github.com/idemkit/idem/internal/sidecar"
)

// pool holds the open stores and blob stores of the process, each shared
// by the handlers that name it and closed when the last one is cleaned up.
// A config reload provisions the new handlers before it cleans up the old
// ones, so a store lives on across reloads: the memory store keeps its
// records, and no connection is reopened.
var pool = caddy.NewUsagePool()

// storeSpec is what identifies a store in the pool.
type storeSpec struct {
	url, prefix string
	memLimit    int64         // memory only
	reapEvery   time.Duration // PostgreSQL and MySQL only; 0: no reaper
}

// key is the pool's key of the store; it holds the URL, and so maybe a
// password, and is never shown.
func (s storeSpec) key() string {
	return fmt.Sprintf("store\x00%s\x00%s\x00%d\x00%d", s.url, s.prefix, s.memLimit, s.reapEvery)
}

// openStore is a store in the pool, with the function that closes it.
type openStore struct {
	idem.Store
	close func()
}

func (s openStore) Destruct() error {
	s.close()
	return nil
}

// takeStore returns the store spec names, opening it when no handler has
// it open; the handler gives it back with pool.Delete(key).
func takeStore(ctx caddy.Context, spec storeSpec, logger *slog.Logger) (idem.Store, string, error) {
	key := spec.key()
	v, _, err := pool.LoadOrNew(key, func() (caddy.Destructor, error) {
		s, closeStore, err := open(ctx, spec, logger)
		if err != nil {
			return nil, err
		}
		return openStore{s, closeStore}, nil
	})
	if err != nil {
		return nil, "", err
	}
	return v.(openStore).Store, key, nil
}

// open opens the store spec names (sidecar.OpenStore, as idem proxy
// does). The stores outlive the config that opened them (the pool), so
// their connections and background work do not take ctx's cancellation.
// Errors never repeat the URL: it may hold a password.
func open(ctx caddy.Context, spec storeSpec, logger *slog.Logger) (idem.Store, func(), error) {
	s, closeStore, err := sidecar.OpenStore(context.WithoutCancel(ctx), spec.url, spec.prefix, sidecar.StoreOptions{Name: "store",
		MaxBytes: spec.memLimit, ReapEvery: cmp.Or(spec.reapEvery, -1), Logger: logger})
	if err != nil && !errors.As(err, new(sidecar.BadStore)) {
		err = fmt.Errorf("store %s: %w", sidecar.StoreForLog(spec.url), err)
	}
	return s, closeStore, err
}

// openBlobs is a blob store in the pool.
type openBlobs struct{ *blobstore.Bucket }

func (b openBlobs) Destruct() error { return b.Close() }

// takeBlobs returns the blob store rawURL names, opening it when no
// handler has it open; the handler gives it back with pool.Delete(key).
func takeBlobs(ctx caddy.Context, rawURL string) (idem.BlobStore, string, error) {
	key := "blob\x00" + rawURL
	v, _, err := pool.LoadOrNew(key, func() (caddy.Destructor, error) {
		b, err := blobstore.Open(context.WithoutCancel(ctx), rawURL)
		if err != nil {
			return nil, fmt.Errorf("blob: %w", err)
		}
		return openBlobs{b}, nil
	})
	if err != nil {
		return nil, "", err
	}
	return v.(openBlobs).Bucket, key, nil
}
