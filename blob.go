package idem

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"hash"
	"io"
	"strconv"
	"strings"
	"time"
)

// Blob errors. They arrive wrapped; branch on them with errors.Is.
var (
	// ErrBlobNotFound reports a blob that is not in the BlobStore: never
	// written, deleted, or removed by the store's own lifecycle rules.
	ErrBlobNotFound = errors.New("idem: blob not found")

	// ErrBlobCorrupt reports a blob whose size or SHA-256 digest is not the
	// one its BlobRef recorded, or a sealed blob that does not open
	// (SealBlobs: a *BlobSealError, also ErrUnsealable).
	ErrBlobCorrupt = errors.New("idem: blob corrupt")
)

// BlobRef is where a response body too large for the record lives: a
// blob in a BlobStore, with the body's size and SHA-256 digest, which a
// replay checks as it reads. A Response with a BlobRef has an empty Body.
// Stores keep the reference inside the encoded response, as opaque bytes:
// no Store reads or writes blobs.
type BlobRef struct {
	// Name is the blob's name in the BlobStore (NewBlobName).
	Name string
	// Size is the body's length in bytes.
	Size int64
	// SHA256 is the digest of the body.
	SHA256 [sha256.Size]byte
}

// MaxBlobNameLen is the longest BlobRef.Name the encoding accepts.
const MaxBlobNameLen = 512

func (b *BlobRef) validate() error {
	switch {
	case b.Name == "" || len(b.Name) > MaxBlobNameLen:
		return fmt.Errorf("idem: blob name of %d bytes: want 1 to %d", len(b.Name), MaxBlobNameLen)
	case b.Size < 0:
		return fmt.Errorf("idem: blob size %d is negative", b.Size)
	}
	return nil
}

// BlobStore keeps the bodies of responses too large for their record
// (package blobstore implements it over S3, the file system and memory).
// Implementations are safe for concurrent use.
type BlobStore interface {
	// Create starts a blob called name. Its bytes become readable, whole,
	// only when the writer's Close returns nil: no reader or listing ever
	// sees a partial blob. Abort, or the end of ctx before Close, discards
	// it. Names are unique (NewBlobName): a name is never written twice.
	Create(ctx context.Context, name string) (BlobWriter, error)

	// Open returns a reader of the blob and its size. A missing blob is an
	// error wrapping ErrBlobNotFound; ctx bounds the reads too.
	Open(ctx context.Context, name string) (io.ReadCloser, int64, error)

	// Delete removes the blob. A missing blob is an error wrapping
	// ErrBlobNotFound.
	Delete(ctx context.Context, name string) error

	// List calls fn with every blob whose name starts with prefix, in no
	// particular order, and stops at fn's first error, which it returns.
	List(ctx context.Context, prefix string, fn func(BlobInfo) error) error

	// Check reports whether the store answers: nil when it can be used.
	Check(ctx context.Context) error
}

// BlobWriter writes one blob: Close commits it, Abort discards it. After
// either, the writer is done.
type BlobWriter interface {
	io.Writer
	Close() error
	Abort() error
}

// BlobInfo describes a listed blob.
type BlobInfo struct {
	Name    string
	Size    int64
	ModTime time.Time
}

// BlobPrefix starts the name of every blob idem writes: a sweep lists
// only the names under it and never touches other objects of a bucket.
const BlobPrefix = "idem/"

// Namespacer is implemented by a Store that can name the key space its
// records live in. Every store of this module does (each one's
// Namespace doc says from what: where its records live and, for the
// stores that keep one in their database, a store id). Two stores with
// the same Namespace read each other's records; two with different ones
// never do. (A database without its store id, as v1.0 left it, has
// v1.0's namespace, the same for every database: sweeps judge none of
// its blobs.) Callers type-assert:
//
//	ns := ""
//	if n, ok := store.(idem.Namespacer); ok {
//		ns = n.Namespace()
//	}
//
// The namespace goes into the names of blobs (NewBlobName), so that a
// sweep (blobstore.Sweep) judges only the blobs of its own store's
// records and leaves every other store's alone. A store that wraps
// another should forward Namespace; the empty string means that the
// store cannot say.
type Namespacer interface {
	Namespace() string
}

// BlobNamespace returns the segment that names namespace ns in blob
// names: 16 lower-case hex digits of its SHA-256. It is "" for "" (no
// namespace known).
func BlobNamespace(ns string) string {
	if ns == "" {
		return ""
	}
	sum := sha256.Sum256([]byte(ns))
	return hex.EncodeToString(sum[:8])
}

// NewBlobName returns a fresh blob name for the response of lease l,
// written through a store whose Namespacer.Namespace is ns:
//
//	idem/<space>/<key>/<token>-<random>
//
// where space is BlobNamespace(ns), key is l.Key.String() (the record key's
// digest, never client bytes), token the lease's fencing token, and random
// 16 hex digits, so that two attempts never share a name, even for two
// stores (whose tokens may repeat) writing to one bucket. With ns empty
// (a store that does not implement Namespacer) the name has no namespace,
// idem/<key>/<token>-<random>, as every name had before namespaces: a
// sweep leaves those alone unless told which store wrote them
// (blobstore.SweepOptions.Unqualified). ParseBlobName reads names back.
func NewBlobName(ns string, l Lease) string {
	var r [8]byte
	rand.Read(r[:]) // never fails (crypto/rand)
	name := BlobPrefix
	if ns != "" {
		name += BlobNamespace(ns) + "/"
	}
	return name + l.Key.String() + "/" + strconv.FormatUint(l.Token, 10) + "-" + hex.EncodeToString(r[:])
}

// BlobName is what a name from NewBlobName says.
type BlobName struct {
	// Namespace is the BlobNamespace of the namespace of the store that
	// wrote the blob; "" for a name without one.
	Namespace string
	// Key is the record key.
	Key Key
	// Token is the fencing token of the attempt that wrote the blob.
	Token uint64
}

// ParseBlobName reads a name from NewBlobName, with or without a
// namespace; ok is false for any other name.
func ParseBlobName(name string) (n BlobName, ok bool) {
	rest, found := strings.CutPrefix(name, BlobPrefix)
	if !found {
		return BlobName{}, false
	}
	seg, rest, found := strings.Cut(rest, "/")
	if !found {
		return BlobName{}, false
	}
	if len(seg) == 16 && isLowerHex(seg) { // a namespace: keys are 22 characters
		n.Namespace = seg
		if seg, rest, found = strings.Cut(rest, "/"); !found {
			return BlobName{}, false
		}
	}
	k, err := ParseKey(seg)
	if err != nil {
		return BlobName{}, false
	}
	ts, rs, found := strings.Cut(rest, "-")
	if !found || len(rs) != 16 || ts == "" || (ts[0] == '0' && ts != "0") || !isLowerHex(rs) {
		return BlobName{}, false
	}
	t, err := strconv.ParseUint(ts, 10, 64)
	if err != nil {
		return BlobName{}, false
	}
	n.Key, n.Token = k, t
	return n, true
}

// isLowerHex reports whether s is lower-case hex digits only.
func isLowerHex(s string) bool {
	for i := 0; i < len(s); i++ {
		if c := s[i]; (c < '0' || c > '9') && (c < 'a' || c > 'f') {
			return false
		}
	}
	return true
}

// OpenBlob opens the blob ref names and returns a reader that checks it
// against ref as it reads: it fails at once, with ErrBlobCorrupt, if the
// blob's size is not ref.Size, and at the end, with ErrBlobCorrupt instead
// of io.EOF, if the bytes read do not have ref's digest. So io.EOF means
// that every byte read so far is the body that was stored. A missing blob
// is an error wrapping ErrBlobNotFound.
//
// A blob read sealed, from a store SealBlobs returned, is not hashed: its
// AEAD authenticates every byte and their order, bound to the blob's
// unique name, and refuses the blob (an error wrapping ErrBlobCorrupt and
// ErrUnsealable) as soon as a chunk does not open; its size is checked
// as any other's. A clear blob is hashed, sealing on or not.
func OpenBlob(ctx context.Context, bs BlobStore, ref BlobRef) (io.ReadCloser, error) {
	rc, size, err := bs.Open(ctx, ref.Name)
	if err != nil {
		return nil, err
	}
	if size != ref.Size {
		rc.Close()
		return nil, fmt.Errorf("%w: blob %s has %d bytes, want %d", ErrBlobCorrupt, ref.Name, size, ref.Size)
	}
	r := &blobReader{rc: rc, ref: ref}
	if _, sealed := rc.(*sealedBlobReader); !sealed {
		r.h = sha256.New()
	}
	return r, nil
}

// blobReader verifies a blob as it is read (see OpenBlob).
type blobReader struct {
	rc  io.ReadCloser
	ref BlobRef
	h   hash.Hash // nil for a sealed blob
	n   int64
	err error // sticky: the verdict once the end was seen, or a read error
}

func (r *blobReader) Read(p []byte) (int, error) {
	if r.err != nil {
		return 0, r.err
	}
	n, err := r.rc.Read(p)
	if r.h != nil {
		r.h.Write(p[:n])
	}
	r.n += int64(n)
	switch {
	case r.n > r.ref.Size:
		r.err = fmt.Errorf("%w: blob %s is longer than %d bytes", ErrBlobCorrupt, r.ref.Name, r.ref.Size)
		return 0, r.err
	case errors.Is(err, io.EOF):
		var sum [sha256.Size]byte
		if r.h != nil {
			r.h.Sum(sum[:0])
		}
		switch {
		case r.n != r.ref.Size:
			r.err = fmt.Errorf("%w: blob %s ended after %d bytes, want %d", ErrBlobCorrupt, r.ref.Name, r.n, r.ref.Size)
		case r.h != nil && sum != r.ref.SHA256:
			r.err = fmt.Errorf("%w: blob %s: SHA-256 %x, want %x", ErrBlobCorrupt, r.ref.Name, sum, r.ref.SHA256)
		default:
			r.err = io.EOF
		}
		if r.err != io.EOF {
			return 0, r.err // none of this read's bytes can be trusted either
		}
		return n, io.EOF
	case err != nil:
		r.err = err
	}
	return n, err
}

func (r *blobReader) Close() error { return r.rc.Close() }
