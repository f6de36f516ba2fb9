package main

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/sidecar"
)

// storeFlagHelp documents the --store flag.
const storeFlagHelp = `where records live: memory, redis://[user:pass@]host:port[/db], rediss://… (TLS), ` +
	`redis://host:port?addr=host2:port2 (Cluster), redis://host:port?master_set=NAME&addr=… (Sentinel: the addresses are sentinels), ` +
	`postgres://… (PostgreSQL; the table is created if missing), ` +
	`mysql://[user:pass@]host[:port]/db (MySQL or MariaDB; the tables are created if missing), ` +
	`or a Redis URL and a PostgreSQL URL separated by a space (the tiered store: leases and replays on Redis, ` +
	`completions in PostgreSQL, relayed to Redis; its table is created if missing)`

// storeFlagHelpRead documents the --store flag of inspect, purge and gc,
// which create nothing.
const storeFlagHelpRead = `redis://[user:pass@]host:port[/db], rediss://… (TLS), the Cluster and Sentinel forms (see idem proxy -h), ` +
	`postgres://…, mysql://…, or a Redis URL and a PostgreSQL URL separated by a space (the tiered store); ` +
	`nothing is created in it: a PostgreSQL or MySQL database without idem's table is an error`

// openStore opens the store a --store value names, with its key prefix
// (Redis) or namespace (PostgreSQL), for the proxy and the demo: the
// PostgreSQL table is created if missing. close releases its connections.
func openStore(ctx context.Context, spec, prefix string) (store idem.Store, close func(), err error) {
	return openStoreWith(ctx, spec, prefix, storeOptions{})
}

// storeOptions are the store's options (sidecar.StoreOptions).
type storeOptions = sidecar.StoreOptions

// openStoreWith is openStore with o (sidecar.OpenStore), after a check of
// the prefix; an error in the URL is a usage error.
func openStoreWith(ctx context.Context, spec, prefix string, o storeOptions) (idem.Store, func(), error) {
	if err := checkPrefix(prefix); err != nil {
		return nil, nil, err
	}
	s, closeStore, err := sidecar.OpenStore(ctx, spec, prefix, o)
	if bad := (sidecar.BadStore{}); errors.As(err, &bad) {
		return nil, nil, usageError{bad.Msg}
	}
	return s, closeStore, err
}

// openStoreReading opens the store of inspect, purge and gc: one that
// holds the proxies' records, so not memory (why names the harm), and
// opened without creating anything (storeOptions.readOnly). It reads
// once, so that a store that cannot be reached fails at once; errors
// other than usage errors start "--store NAME: " (NAME as storeForLog).
func openStoreReading(ctx context.Context, spec, prefix, why string) (idem.Store, func(), error) {
	if err := checkPrefix(prefix); err != nil {
		return nil, nil, err
	}
	if spec == "" || spec == "memory" {
		return nil, nil, usageError{"--store is required: the store the proxies use (redis://…, postgres://… or both, quoted); " +
			"a memory store is new and empty in this process, so " + why}
	}
	store, closeStore, err := openStoreWith(ctx, spec, prefix, storeOptions{ReadOnly: true})
	if err == nil {
		if _, _, err = store.Get(ctx, idem.Key{}); err != nil {
			closeStore()
		}
	}
	if errors.As(err, new(usageError)) {
		return nil, nil, err
	} else if err != nil {
		return nil, nil, fmt.Errorf("--store %s: %w", sidecar.StoreForLog(spec), err)
	}
	return store, closeStore, nil
}

// checkPrefix refuses a --prefix that Redis cannot use: braces delimit the
// key's hash tag. (The tiered store uses it in both.)
func checkPrefix(prefix string) error {
	if strings.ContainsAny(prefix, "{}") {
		return usageError{fmt.Sprintf("--prefix %q: must not contain '{' or '}' (Redis keys put the stored key in braces)", prefix)}
	}
	return nil
}
