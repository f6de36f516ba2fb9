package main

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/sidecar"
)

// sharedStores names the stores that keep records outside the process,
// with their URL schemes. It is the one list of them in idem's help
// texts, usage errors and log lines (TestHelpNamesEveryStore checks it,
// and each text that uses it, against the schemes --store opens).
const sharedStores = "Redis or Valkey (redis://, valkey://; rediss://, valkeys:// for TLS), " +
	"PostgreSQL (postgres://, postgresql://), MySQL or MariaDB (mysql://, mariadb://), " +
	"or a Redis URL and a PostgreSQL URL in one quoted value (the tiered store)"

// storeFlagHelp documents the --store flag of proxy and demo.
const storeFlagHelp = "where records live: memory (in this process only), or " + sharedStores + ". " +
	"Forms: redis://[user:pass@]host:port[/db] (valkey:// alike), " +
	"redis://host:port?addr=host2:port2 (Cluster), redis://host:port?master_set=NAME&addr=… (Sentinel: the addresses are sentinels), " +
	"postgres://[user:pass@]host[:port]/db, mysql://[user:pass@]host[:port]/db, " +
	"'redis://host:port postgres://host/db' (the tiered store: leases and replays on Redis, completions in PostgreSQL, relayed to Redis). " +
	"The SQL stores' tables are created if missing"

// storeFlagHelpRead documents the --store flag of inspect, purge and gc,
// which create nothing.
const storeFlagHelpRead = sharedStores + ", in the forms of idem proxy -h; " +
	"nothing is created in it: a PostgreSQL or MySQL database without idem's table is an error"

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
// holds the proxies' records, so not memory (checkReadable), opened
// without creating anything (storeOptions.ReadOnly). It reads once, so that a store that cannot be reached fails at once; errors
// other than usage errors start "--store NAME: " (NAME as storeForLog).
func openStoreReading(ctx context.Context, spec, prefix, why string) (idem.Store, func(), error) {
	if err := checkPrefix(prefix); err != nil {
		return nil, nil, err
	}
	if err := checkReadable(spec, why); err != nil {
		return nil, nil, err
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

// checkReadable refuses a --store that the commands which read the
// proxies' records (inspect, purge, gc) cannot read: none, or memory,
// which lives inside each proxy's process. why says what reading
// a new, empty store would do.
func checkReadable(spec, why string) error {
	switch spec {
	case "":
		return usageError{"--store is required: the store the proxies use, " + sharedStores +
			" (not memory: in this process it would be new and empty, so " + why + ")"}
	case "memory":
		return usageError{"--store memory: a memory store lives inside one process, and this command cannot read another's " +
			"(its own would be new and empty, so " + why + "); give the store the proxies use: " + sharedStores}
	}
	return nil
}

// checkPrefix refuses a --prefix that Redis cannot use: braces delimit the
// key's hash tag. (The tiered store uses it in both.)
func checkPrefix(prefix string) error {
	if strings.ContainsAny(prefix, "{}") {
		return usageError{fmt.Sprintf("--prefix %q: must not contain '{' or '}' (Redis keys put the stored key in braces)", prefix)}
	}
	return nil
}
