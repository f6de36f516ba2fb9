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

	// Now is the clock for MinAge. Default time.Now.
	Now func() time.Time
}

// SweepResult counts what a sweep saw and did.
type SweepResult struct {
	Scanned   int   `json:"scanned"`   // blobs listed under idem.BlobPrefix
	Kept      int   `json:"kept"`      // referenced by a completed record, or written by an attempt still in flight
	Young     int   `json:"young"`     // spared by MinAge
	Orphans   int   `json:"orphans"`   // deleted: their attempt crashed, was released or lost its lease, or their record expired or was purged
	Partial   int   `json:"partial"`   // deleted: temporary files of writes cut short
	Aborted   int   `json:"aborted"`   // incomplete S3 multipart uploads aborted
	Foreign   int   `json:"foreign"`   // names idem does not write: left alone
	Errors    int   `json:"errors"`    // blobs whose record could not be read, or that could not be deleted: left for the next sweep
	Reclaimed int64 `json:"reclaimed"` // bytes deleted
}

// Sweep deletes the blobs of blobs (under idem.BlobPrefix) that no record
// of store will ever read: for each blob named by idem.NewBlobName it
// reads the record of the name's key, and keeps the blob when the record
// is completed and refers to this very blob, or is in flight with the
// name's fencing token (the attempt writing it may still complete).
// Anything else is an orphan and is deleted: its attempt crashed, was
// released or lost its lease, or its record expired or was purged.
// Temporary files of interrupted writes (file://) and incomplete S3
// multipart uploads go too. Everything younger than MinAge is spared, and
// a blob whose record cannot be read is kept (counted in Errors).
//
// Deleting an orphan cannot break a replay: stores refuse Complete once
// the lease has ended (on the store's clock), so an attempt whose record
// the sweep found expired can no longer complete with a reference to the
// blob. Run one sweep at a time per blob prefix; several at once are safe
// but do the work twice. The store must be the one whose middleware
// writes under this prefix: a sweep reads a blob of another store's
// records as an orphan.
func Sweep(ctx context.Context, blobs idem.BlobStore, store idem.Store, opts SweepOptions) (SweepResult, error) {
	var res SweepResult
	if opts.MinAge == 0 {
		opts.MinAge = DefaultMinAge
	}
	opts.MinAge = max(opts.MinAge, 0)
	if opts.Now == nil {
		opts.Now = time.Now
	}
	cutoff := opts.Now().Add(-opts.MinAge)
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
	err := blobs.List(ctx, idem.BlobPrefix, func(info idem.BlobInfo) error {
		if err := ctx.Err(); err != nil {
			return err
		}
		res.Scanned++
		key, token, ok := idem.ParseBlobName(info.Name)
		if !ok {
			if !tempName.MatchString(info.Name) {
				res.Foreign++
				return nil
			}
			if info.ModTime.After(cutoff) {
				res.Young++
				return nil
			}
			if err := del(info); err != nil {
				res.Errors++
				return nil
			}
			res.Partial++
			res.Reclaimed += info.Size
			return nil
		}
		if info.ModTime.After(cutoff) {
			res.Young++
			return nil
		}
		rec, found, err := store.Get(ctx, key)
		if err != nil {
			if ctx.Err() != nil {
				return ctx.Err()
			}
			res.Errors++ // unreadable: keep it, a later sweep decides
			return nil
		}
		if found && keeps(rec, info.Name, token) {
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
	})
	if err != nil {
		return res, fmt.Errorf("blobstore: sweep: %w", err)
	}
	if ab, ok := blobs.(interface {
		abortUploads(context.Context, string, time.Time) (int, error)
	}); ok && !opts.DryRun {
		n, err := ab.abortUploads(ctx, idem.BlobPrefix, cutoff)
		res.Aborted = n
		if err != nil {
			return res, fmt.Errorf("blobstore: sweep: %w", err)
		}
	}
	return res, nil
}

// keeps reports whether rec still needs the blob called name, written by
// the attempt with the given token.
func keeps(rec idem.Record, name string, token uint64) bool {
	switch rec.State {
	case idem.StateCompleted:
		return rec.Response != nil && rec.Response.Blob != nil && rec.Response.Blob.Name == name
	case idem.StateInFlight:
		return rec.Token == token
	}
	return false
}

// tempName matches the temporary file of a write to a file:// store that
// did not finish: the blob's name, a dot, hex digits and ".tmp".
var tempName = regexp.MustCompile(`^idem/[A-Za-z0-9_-]{22}/[0-9]+-[0-9a-f]{16}\.[0-9a-f]+\.tmp$`)
