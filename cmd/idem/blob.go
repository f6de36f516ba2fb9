package main

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"net/url"
	"slices"
	"strings"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/blobstore"
)

func init() {
	commands["gc"] = command{
		summary: "delete the blobs of large responses that no record needs any more",
		run:     runGC,
	}
}

// blobURLHelp documents the forms of a blob store URL; blobFlagHelp is
// the proxy's and demo's --blob flag.
const (
	blobURLHelp = `s3://BUCKET?region=R (AWS; credentials from the environment as AWS tooling finds them), ` +
		`s3://[ACCESS_KEY:SECRET@]BUCKET?endpoint=http://HOST:PORT&region=R&use_path_style=true (S3-compatible), ` +
		`file:///DIR, or mem:// (this process's memory); any form may take prefix=P (optional)`
	blobFlagHelp = `blob store for response bodies larger than --max-response (off when empty): ` + blobURLHelp
)

// openBlobs opens the blob store a --blob value names. Errors never show
// the URL's password.
func openBlobs(ctx context.Context, spec string) (*blobstore.Bucket, error) {
	u, err := url.Parse(spec)
	if err != nil || u.Scheme == "" {
		return nil, usageError{"--blob: want a URL such as s3://bucket?region=…, file:///var/lib/idem/blobs or mem:// (the value is not shown: it may hold a password)"}
	}
	switch u.Scheme {
	case "s3", "file", "mem":
	default:
		return nil, usageError{fmt.Sprintf("--blob: unknown scheme %q; want s3://, file:// or mem://", u.Scheme)}
	}
	b, err := blobstore.Open(ctx, spec)
	if err != nil {
		return nil, usageError{"--blob: " + strings.TrimPrefix(err.Error(), "blobstore: ")}
	}
	return b, nil
}

const gcUsage = `usage: idem gc --store STORE --blob URL [--prefix P] [--min-age 15m] [--dry-run] [--json]

Deletes the blobs (response bodies too large for their record) that no
record of STORE will read again: those whose attempt crashed, was released
or lost its lease before completing, and those whose record expired or was
purged. A blob is kept while its record is completed and refers to it, or
is in flight with the blob's fencing token. Blobs younger than --min-age
are left alone, and so is a blob whose record cannot be read. Temporary
files of interrupted writes (file://) and incomplete multipart uploads
(s3://) older than --min-age go too.

Every blob name carries the namespace of the store that wrote it (its
kind, the Redis key prefix or SQL table and namespace, and the store id
kept in its database: the proxy's --store and --prefix): gc judges only the blobs of the namespace
of STORE and --prefix, and leaves the others alone, counted, with their
namespaces listed (idem proxy logs its blob_namespace at start). Blobs
written before names had a namespace (idem/<key>/…) are always left
alone: nothing in them says which store wrote them, and a flag cannot
make that safe; delete them by hand, or with an S3 lifecycle rule, once
every record that may refer to them has expired (--retention). Two
stores of the same namespace on different servers (two Redis servers
with the default prefix) do not share a namespace: a Redis store's
carries a store id kept in its database (idem:store-id), so gc on
another database (redis://host/0 against blobs of redis://host/1), another
server or a flushed database judges none of them; a PostgreSQL or MySQL
store's, one kept in the table idem_records_store_id, so gc on another
database with the same table judges none either. Blobs written by idem
v1.0, whose namespace was the prefix alone, are always left alone and
counted as legacy: their names cannot tell two databases apart. A
PostgreSQL or MySQL database without a store id (tables of v1.0, not
migrated since) judges nothing. gc creates no store id.

On S3 a bucket lifecycle rule can do the same work (see docs/proxy.md); idem
proxy --blob-sweep runs this sweep periodically.

flags:
`

func runGC(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("idem gc", flag.ContinueOnError)
	storeSpec := fs.String("store", "", "the record store the proxies use (required): "+storeFlagHelpRead)
	prefix := fs.String("prefix", "", "key prefix (Redis) or namespace (PostgreSQL) of the records")
	blobSpec := fs.String("blob", "", "the blob store to sweep (required): "+blobURLHelp)
	minAge := fs.Duration("min-age", blobstore.DefaultMinAge, "leave blobs younger than this (0: none)")
	dryRun := fs.Bool("dry-run", false, "count what would be deleted; delete nothing")
	asJSON := fs.Bool("json", false, "print JSON")
	fs.Usage = func() {
		fmt.Fprint(fs.Output(), gcUsage)
		fs.PrintDefaults()
	}
	if err := parseFlags(fs, args, stderr); err != nil {
		return err
	}
	if *blobSpec == "" {
		return usageError{"--blob is required: the blob store to sweep"}
	}
	if *minAge < 0 {
		return usageError{fmt.Sprintf("--min-age %v: must not be negative", *minAge)}
	}
	// A new, empty store would make every blob look like an orphan: the
	// sweep would delete the bodies of live records.
	const orphans = "every blob would look like an orphan and be deleted"
	if err := checkReadable(*storeSpec, orphans); err != nil {
		return err
	}
	blobs, err := openBlobs(ctx, *blobSpec)
	if err != nil {
		return err
	}
	defer blobs.Close()
	store, closeStore, err := openStoreReading(ctx, *storeSpec, *prefix, orphans)
	if err != nil {
		return err
	}
	defer closeStore()
	if err := blobs.Check(ctx); err != nil {
		return fmt.Errorf("--blob: %w", err)
	}
	age := *minAge
	if age == 0 {
		age = -1 // SweepOptions: 0 is the default, negative is none
	}
	res, err := blobstore.Sweep(ctx, blobs, store, blobstore.SweepOptions{MinAge: age, DryRun: *dryRun})
	if *asJSON {
		out := struct {
			Blob   string `json:"blob"`
			DryRun bool   `json:"dry_run"`
			blobstore.SweepResult
			Error string `json:"error,omitempty"`
		}{Blob: blobs.String(), DryRun: *dryRun, SweepResult: res}
		if err != nil {
			out.Error = err.Error()
		}
		enc := json.NewEncoder(stdout)
		enc.SetIndent("", "  ")
		if e := enc.Encode(out); e != nil {
			return e
		}
		return err
	}
	verb := "deleted"
	if *dryRun {
		verb = "would delete"
	}
	fmt.Fprintf(stdout, "%s, namespace %s (%s): %d blobs scanned, %d kept, %d too young; %s %d orphans, %d partial writes (%s); %d incomplete uploads aborted; %d foreign names left, %d errors\n",
		blobs, res.BlobNamespace, res.Namespace, res.Scanned, res.Kept, res.Young, verb, res.Orphans, res.Partial, sizeString(res.Reclaimed), res.Aborted, res.Foreign, res.Errors)
	if res.Other > 0 {
		fmt.Fprintf(stdout, "left alone: %d blobs of %d other namespaces (%s), written by stores with another --prefix or of another kind; "+
			"run idem gc with their --store and --prefix (idem proxy logs its blob_namespace at start)\n",
			res.Other, len(res.OtherNamespaces), namespaceCounts(res.OtherNamespaces))
	}
	if res.Unqualified > 0 {
		fmt.Fprintf(stdout, "left alone: %d blobs without a namespace (idem/<key>/…, written before blob names had one): "+
			"nothing says which store wrote them; delete them by hand or with an S3 lifecycle rule once every record that may refer to them has expired\n", res.Unqualified)
	}
	if res.NoStoreID {
		fmt.Fprintf(stdout, "judged nothing: the store has no store id (a PostgreSQL or MySQL database not migrated since idem v1.0: "+
			"run idem proxy on it once, or pgstore.Migrate / mysqlstore.Migrate), so its namespace is the same for every database and proves no blob its own\n")
	}
	if res.Legacy > 0 {
		fmt.Fprintf(stdout, "left alone: %d blobs of namespace %s (%s), written by idem v1.0 (or by a store whose database has no store id), whose blob names do not say which database wrote them: "+
			"they still replay; delete them by hand or with a lifecycle rule on idem/%s/ once every record written before the upgrade has expired (--retention)\n",
			res.Legacy, res.LegacyBlobNamespace, res.LegacyNamespace, res.LegacyBlobNamespace)
	}
	return err
}

// namespaceCounts lists blob namespaces and their counts, most blobs first.
func namespaceCounts(m map[string]int) string {
	names := slices.Collect(maps.Keys(m))
	slices.SortFunc(names, func(a, b string) int { return cmp.Or(cmp.Compare(m[b], m[a]), cmp.Compare(a, b)) })
	parts := make([]string, len(names))
	for i, n := range names {
		parts[i] = fmt.Sprintf("%s: %d", n, m[n])
	}
	return strings.Join(parts, ", ")
}

// sizeString writes a byte count for people.
func sizeString(n int64) string {
	switch {
	case n >= 1<<30:
		return fmt.Sprintf("%.1f GiB", float64(n)/(1<<30))
	case n >= 1<<20:
		return fmt.Sprintf("%.1f MiB", float64(n)/(1<<20))
	case n >= 1<<10:
		return fmt.Sprintf("%.1f KiB", float64(n)/(1<<10))
	}
	return fmt.Sprintf("%d bytes", n)
}

// sweepLoop runs blobstore.Sweep every interval until ctx ends, logging
// each pass and counting in metrics.
func sweepLoop(ctx context.Context, blobs idem.BlobStore, store idem.Store, interval, minAge time.Duration,
	metrics *proxyMetrics, logger *slog.Logger) {
	if minAge == 0 {
		minAge = -1 // SweepOptions: 0 is the default, negative is none
	}
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		start := time.Now()
		res, err := blobstore.Sweep(ctx, blobs, store, blobstore.SweepOptions{MinAge: minAge})
		if errors.Is(err, context.Canceled) && ctx.Err() != nil {
			return
		}
		metrics.sweep(res, err)
		level := slog.LevelInfo
		if err != nil || res.Errors > 0 {
			level = slog.LevelWarn
		}
		logger.LogAttrs(ctx, level, "blob sweep", slog.Int("scanned", res.Scanned), slog.Int("kept", res.Kept),
			slog.Int("young", res.Young), slog.Int("orphans_deleted", res.Orphans), slog.Int("partial_deleted", res.Partial),
			slog.Int("uploads_aborted", res.Aborted), slog.Int("errors", res.Errors), slog.Int64("bytes_reclaimed", res.Reclaimed),
			slog.Int("other_namespaces_left", res.Other), slog.Int("unqualified_left", res.Unqualified),
			durationMS(time.Since(start)), slog.Any("error", err))
	}
}
