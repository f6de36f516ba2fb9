package blobstore

import (
	"context"
	"errors"
	"fmt"
	"regexp"
	"time"

	"github.com/idemkit/idem"
)

// DefaultMinAge is SweepOptions.MinAge's default.
const DefaultMinAge = 15 * time.Minute

// SweepOptions tunes Sweep. The zero value means the defaults.
type SweepOptions struct {
	// MinAge spares blobs written (or, for a temporary file, last written
	// to) more recently than this. It is a margin, not what keeps a blob
	// that is still wanted: the record decides that (see Sweep). Default
	// DefaultMinAge; a negative value means none.
	MinAge time.Duration

	// DryRun counts what would be deleted and deletes nothing.
	DryRun bool

	// Unqualified makes the sweep judge, against its store, the blobs
	// whose names carry no namespace too: those written before blob names
	// had one, or through a store that does not implement
	// idem.Namespacer. Nothing in such a name says which store wrote it:
	// set it only when every writer to this blob store (and prefix) used
	// this very store (same servers, same prefix or namespace), else the
	// blobs of the others' live records are deleted. As a guard, the
	// sweep judges them only when it finds no blob of another namespace
	// (else SweepResult.UnqualifiedRefused), in a second listing. Default
	// false: they are left alone and counted in SweepResult.Unqualified.
	Unqualified bool

	// Now is the clock for MinAge. Default time.Now.
	Now func() time.Time
}

// SweepResult counts what a sweep saw and did.
type SweepResult struct {
	// Namespace is the store's idem.Namespacer namespace, as written
	// (redis prefix "idem:", ...), and BlobNamespace its segment in blob names
	// (idem.BlobNamespace): the blobs the sweep judged. Both are empty
	// for a store without one (see SweepOptions.Unqualified).
	Namespace     string `json:"namespace"`
	BlobNamespace string `json:"blob_namespace"`

	Scanned     int   `json:"scanned"`     // blobs listed under idem.BlobPrefix
	Kept        int   `json:"kept"`        // referenced by a completed record, or written by an attempt still in flight
	Young       int   `json:"young"`       // spared by MinAge
	Orphans     int   `json:"orphans"`     // deleted: their attempt crashed, was released or lost its lease, or their record expired or was purged
	Partial     int   `json:"partial"`     // deleted: temporary files of writes cut short
	Aborted     int   `json:"aborted"`     // incomplete S3 multipart uploads aborted
	Foreign     int   `json:"foreign"`     // names idem does not write: left alone
	Other       int   `json:"other"`       // blobs (and temporary files) of other namespaces, written by other stores: left alone
	Unqualified int   `json:"unqualified"` // names without a namespace, left alone (SweepOptions.Unqualified judges them)
	Legacy      int   `json:"legacy"`      // blobs of the store's legacy namespace (v1.0's, which did not tell databases apart): left alone
	Errors      int   `json:"errors"`      // blobs whose record could not be read, or that could not be deleted: left for the next sweep
	Reclaimed   int64 `json:"reclaimed"`   // bytes deleted

	// LegacyNamespace is the store's namespace in v1.0 (LegacyNamespacer),
	// and LegacyBlobNamespace its segment: the blobs counted in Legacy.
	// Empty when the store has none.
	LegacyNamespace     string `json:"legacy_namespace,omitempty"`
	LegacyBlobNamespace string `json:"legacy_blob_namespace,omitempty"`

	// NoStoreID reports that the store's namespace is its legacy one
	// (LegacyNamespacer): it has no store id, as a PostgreSQL or MySQL
	// database not migrated since v1.0 (or opened with NoStoreID). That
	// namespace is the same for every database, so nothing says that its
	// blobs are this database's: the sweep judged none, counting them in
	// Legacy, and judged no name without a namespace either.
	NoStoreID bool `json:"no_store_id,omitempty"`

	// OtherNamespaces counts the blobs of each other namespace (by its
	// idem.BlobNamespace segment) that the sweep left alone.
	OtherNamespaces map[string]int `json:"other_namespaces,omitempty"`

	// UnqualifiedRefused reports that SweepOptions.Unqualified was set,
	// but the sweep left the names without a namespace alone anyway:
	// blobs of other namespaces showed that another store writes here.
	UnqualifiedRefused bool `json:"unqualified_refused,omitempty"`
}

// Sweep deletes the blobs of blobs (under idem.BlobPrefix) that no record
// of store will ever read. It judges only the blobs whose name carries
// the store's namespace (idem.Namespacer, idem.NewBlobName): those that
// the store's own writers wrote. Blobs of other namespaces (another
// prefix, table or kind of store) are left alone and counted in Other
// and OtherNamespaces, and names without a namespace in Unqualified
// (unless SweepOptions.Unqualified), and those of the store's namespace
// before v1.1 in Legacy (LegacyNamespacer). A store whose namespace is
// still its legacy one (no store id: SweepResult.NoStoreID) judges
// nothing. A store without a namespace is an
// error unless SweepOptions.Unqualified is set: there is nothing it may
// judge.
//
// For each blob it judges, it reads the record of the name's key, and
// keeps the blob when the record is completed and refers to this very
// blob, or is in flight with the name's fencing token (the attempt
// writing it may still complete). Anything else is an orphan and is
// deleted: its attempt crashed, was released or lost its lease, or its
// record expired or was purged. Temporary files of interrupted writes
// (file://) and incomplete S3 multipart uploads of the namespace go too.
// Everything younger than MinAge is spared, and a blob whose record
// cannot be read is kept (counted in Errors).
//
// Deleting an orphan cannot break a replay: stores refuse Complete once
// the lease has ended (on the store's clock), so an attempt whose record
// the sweep found expired can no longer complete with a reference to the
// blob. Run one sweep at a time per blob prefix; several at once are safe
// but do the work twice. A namespace names the set of records that owns
// a blob: redisstore's, pgstore's and mysqlstore's carry a store id kept
// in their database (another database, schema, server, prefix or table
// has another).
func Sweep(ctx context.Context, blobs idem.BlobStore, store idem.Store, opts SweepOptions) (SweepResult, error) {
	var res SweepResult
	if n, ok := store.(idem.Namespacer); ok {
		res.Namespace = n.Namespace()
		res.BlobNamespace = idem.BlobNamespace(res.Namespace)
	}
	if n, ok := store.(LegacyNamespacer); ok && res.Namespace != "" {
		if old := n.LegacyNamespace(); old != "" {
			res.LegacyNamespace, res.LegacyBlobNamespace = old, idem.BlobNamespace(old)
			// A store still on its legacy namespace has no store id: its
			// namespace names no database, and so proves nothing.
			res.NoStoreID = old == res.Namespace
		}
	}
	if res.Namespace == "" && !opts.Unqualified {
		return res, fmt.Errorf("blobstore: sweep: the store (%T) has no namespace (idem.Namespacer), so no blob name says it wrote it; "+
			"SweepOptions.Unqualified judges the names without a namespace against it", store)
	}
	if opts.MinAge == 0 {
		opts.MinAge = DefaultMinAge
	}
	opts.MinAge = max(opts.MinAge, 0)
	if opts.Now == nil {
		opts.Now = time.Now
	}
	cutoff := opts.Now().Add(-opts.MinAge)
	// judging says whether the names without a namespace are judged: in
	// a second pass, once the first found no other namespace.
	judging := false
	// mine reports whether the sweep judges a blob of namespace ns.
	mine := func(ns string) bool {
		if ns == "" {
			return judging
		}
		return ns == res.BlobNamespace && !res.NoStoreID
	}
	// leave counts a blob of a namespace the sweep does not judge.
	leave := func(ns string) {
		if ns == "" {
			res.Unqualified++
			return
		}
		if ns == res.LegacyBlobNamespace {
			res.Legacy++
			return
		}
		res.Other++
		if res.OtherNamespaces == nil {
			res.OtherNamespaces = map[string]int{}
		}
		res.OtherNamespaces[ns]++
	}
	del := func(info idem.BlobInfo) error {
		if opts.DryRun {
			return nil
		}
		err := blobs.Delete(ctx, info.Name)
		if errors.Is(err, idem.ErrBlobNotFound) {
			return nil // deleted meanwhile: by another sweep, a purge
		}
		return err
	}
	visit := func(info idem.BlobInfo) error {
		if err := ctx.Err(); err != nil {
			return err
		}
		name, ok := idem.ParseBlobName(info.Name)
		temp := false
		if !ok {
			name, ok = parseTempName(info.Name)
			temp = true
		}
		if judging { // the second pass: only the names without a namespace
			if !ok || name.Namespace != "" {
				return nil
			}
			res.Unqualified = max(res.Unqualified-1, 0) // one that appeared since is not counted
		} else {
			res.Scanned++
			if !ok {
				res.Foreign++
				return nil
			}
			if !mine(name.Namespace) {
				leave(name.Namespace)
				return nil
			}
		}
		if info.ModTime.After(cutoff) {
			res.Young++
			return nil
		}
		if temp {
			if err := del(info); err != nil {
				res.Errors++
				return nil
			}
			res.Partial++
			res.Reclaimed += info.Size
			return nil
		}
		rec, found, err := store.Get(ctx, name.Key)
		if err != nil {
			if ctx.Err() != nil {
				return ctx.Err()
			}
			res.Errors++ // unreadable: keep it, a later sweep decides
			return nil
		}
		if found && keeps(rec, info.Name, name.Token) {
			res.Kept++
			return nil
		}
		if err := del(info); err != nil {
			res.Errors++
			return nil
		}
		res.Orphans++
		res.Reclaimed += info.Size
		return nil
	}
	if err := blobs.List(ctx, idem.BlobPrefix, visit); err != nil {
		return res, fmt.Errorf("blobstore: sweep: %w", err)
	}
	if opts.Unqualified && res.Unqualified > 0 {
		// Names without a namespace say nothing of the store that wrote
		// them: judge them only when no other store writes here.
		if res.Other > 0 || res.Legacy > 0 || res.NoStoreID {
			res.UnqualifiedRefused = true
		} else {
			judging = true
			if err := blobs.List(ctx, idem.BlobPrefix, visit); err != nil {
				return res, fmt.Errorf("blobstore: sweep: %w", err)
			}
		}
	}
	if ab, ok := underneath(blobs).(interface {
		abortUploads(context.Context, string, time.Time, func(string) bool) (int, error)
	}); ok && !opts.DryRun {
		n, err := ab.abortUploads(ctx, idem.BlobPrefix, cutoff, func(s string) bool {
			name, ok := idem.ParseBlobName(s)
			return ok && mine(name.Namespace)
		})
		res.Aborted = n
		if err != nil {
			return res, fmt.Errorf("blobstore: sweep: %w", err)
		}
	}
	return res, nil
}

// underneath returns the store bs wraps (idem.SealBlobs: Unwrap), all the
// way down: incomplete uploads are the S3 store's own.
func underneath(bs idem.BlobStore) idem.BlobStore {
	for {
		u, ok := bs.(interface{ Unwrap() idem.BlobStore })
		if !ok || u.Unwrap() == nil {
			return bs
		}
		bs = u.Unwrap()
	}
}

// LegacyNamespacer is implemented by a store whose namespace
// (idem.Namespacer) changed since v1.0: redisstore's, pgstore's,
// mysqlstore's and tieredstore's now carry a store id kept in their
// database. LegacyNamespace is the namespace that v1.0 wrote into blob
// names. A store that has no store id (a PostgreSQL or MySQL database not
// migrated since v1.0) still names its blobs with it: its Namespace is
// its LegacyNamespace, and Sweep then judges nothing
// (SweepResult.NoStoreID). It named a key prefix or a table, not a database: the
// same for two stores on two databases, so nothing in such a blob's name
// says which one wrote it. Sweep leaves those blobs alone and counts them
// in SweepResult.Legacy, whatever its options; their replays read them
// as before (a record holds its blob's whole name). They are unreferenced
// once every record written before the upgrade has expired (one
// retention period): delete them then, by hand or with a lifecycle rule
// on the prefix idem/<LegacyBlobNamespace>/.
type LegacyNamespacer interface {
	LegacyNamespace() string
}

// keeps reports whether rec still needs the blob called name, written by
// the attempt with the given token.
func keeps(rec idem.Record, name string, token uint64) bool {
	switch rec.State {
	case idem.StateCompleted:
		if rec.Response.Sealed() {
			// Its reference cannot be read without the key: keep the blob
			// of the attempt that completed it (its name holds the token).
			return rec.Token == token
		}
		return rec.Response != nil && rec.Response.Blob != nil && rec.Response.Blob.Name == name
	case idem.StateInFlight:
		return rec.Token == token
	}
	return false
}

// tempSuffix ends the temporary file of a write to a file:// store that
// did not finish: the blob's name, a dot, hex digits and ".tmp".
var tempSuffix = regexp.MustCompile(`\.[0-9a-f]+\.tmp$`)

// parseTempName reads the blob name in the name of a temporary file.
func parseTempName(s string) (idem.BlobName, bool) {
	loc := tempSuffix.FindStringIndex(s)
	if loc == nil {
		return idem.BlobName{}, false
	}
	return idem.ParseBlobName(s[:loc[0]])
}
