// Package blobstore keeps the bodies of responses too large for their
// idempotency record, behind idem.BlobStore, in S3 or an S3-compatible
// server, the local file system, or memory. It is gocloud.dev's blob
// package underneath, so a program can also hand it any bucket that
// package opens (GCS, Azure: New).
//
// A store is chosen by URL (Open):
//
//	s3://BUCKET?region=R                        AWS S3; credentials as AWS tooling finds them
//	s3://BUCKET?endpoint=http://HOST:PORT&region=R&use_path_style=true
//	                                            an S3-compatible server (MinIO, versitygw, Ceph, ...)
//	s3://ACCESS_KEY:SECRET@BUCKET?...           credentials in the URL instead of the environment
//	file:///var/lib/idem/blobs                  a directory (created if missing); the path must be absolute
//	mem://                                      this process's memory (tests, demos)
//
// Every form takes prefix=P, which puts every name under P. Blob names
// carry the namespace of the record store that wrote them (idem.Namespacer:
// its kind and Redis prefix, or PostgreSQL table and namespace), and a
// sweep judges only its own store's, so stores of different namespaces
// can share a bucket and prefix. Stores of the same namespace on different
// servers (two Redis servers with the default prefix) cannot: each sweep
// would take the other's blobs for orphans; give each its own prefix=P.
//
// For s3, credentials come from the URL's user and password when there
// are some, else from the environment and the shared files as the AWS SDK
// finds them (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_PROFILE,
// instance roles, ...); the region from region= or AWS_REGION; the other
// parameters are gocloud.dev's (profile, endpoint, use_path_style,
// disable_https, ssetype, kmskeyid, ...). For file, the path must be an
// absolute directory (file:///var/lib/idem/blobs; file://blobs is an
// error, not ./blobs); temporary files are written next to their final
// name (no_tmp_dir: a rename across file systems would fail) and no
// metadata files are kept.
//
// Blobs are written whole or not at all: an S3 object appears when its
// upload completes, a file when it is renamed into place, a memory blob on
// Close. An upload cut short leaves an incomplete multipart upload on S3
// (Sweep aborts those older than its MinAge, as does the lifecycle rule
// in the README) or a temporary file named NAME.<hex>.tmp (Sweep removes
// those too).
package blobstore

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/url"
	"os"
	"strings"

	"github.com/aws/aws-sdk-go-v2/service/s3"
	s3types "github.com/aws/aws-sdk-go-v2/service/s3/types"
	"gocloud.dev/blob"
	"gocloud.dev/blob/fileblob"
	"gocloud.dev/blob/memblob"
	"gocloud.dev/blob/s3blob"
	"gocloud.dev/gcerrors"

	"github.com/idemkit/idem"
)

// Upload sizes. An s3:// store uploads in parts of partSize bytes, one
// filling while the one before it uploads (s3Writer), so one upload holds
// about 2*partSize bytes (10 MiB) of memory whatever the body's size;
// 5 MiB is S3's smallest part. Other buckets (New, gs://, azblob://) are
// written with gocloud.dev's writer, a buffer of partSize bytes and at most
// writerConcurrency uploads at once, as the driver does them.
const (
	partSize          = 5 << 20
	writerConcurrency = 2
)

// Bucket is an idem.BlobStore over a gocloud.dev blob bucket. It is safe
// for concurrent use.
type Bucket struct {
	b    *blob.Bucket
	name string // for logs: scheme and bucket or path, no credentials
	// For an s3:// store: the client, the bucket, the prefix and the
	// write options of s3Writer and abortUploads; s3 is nil otherwise.
	s3                 *s3.Client
	s3Bucket, s3Prefix string
	s3Checksum         s3types.ChecksumAlgorithm
	s3SSE              s3types.ServerSideEncryption
	s3KMS              *string
}

var _ idem.BlobStore = (*Bucket)(nil)

// Open opens the store rawURL names (see the package documentation).
// Errors never repeat the URL's password.
func Open(ctx context.Context, rawURL string) (*Bucket, error) {
	u, err := url.Parse(rawURL)
	if err != nil {
		return nil, errors.New("blobstore: not a URL (the value is not shown: it may hold a password)")
	}
	q := u.Query()
	prefix := q.Get("prefix")
	q.Del("prefix")
	var b *blob.Bucket
	var s3client *s3.Client
	var s3opts *s3blob.Options
	switch u.Scheme {
	case "s3":
		if u.Host == "" {
			return nil, fmt.Errorf("blobstore: %s: no bucket (want s3://BUCKET?region=...)", Redact(rawURL))
		}
		if !safeS3Prefix(prefix) {
			return nil, fmt.Errorf("blobstore: %s: prefix %q: want letters, digits and / _ - . only", Redact(rawURL), prefix)
		}
		b, s3client, s3opts, err = openS3(ctx, u, q)
	case "file":
		// file://blobs has the host "blobs" and no path: gocloud.dev would
		// write into the working directory.
		if u.Opaque != "" || (u.Host != "" && u.Host != "localhost") || !strings.HasPrefix(u.Path, "/") {
			shown := Redact(rawURL)
			if u.Opaque != "" {
				shown = "file:" + u.Opaque
			}
			return nil, fmt.Errorf("blobstore: %s: not an absolute directory: want file:///absolute/dir (three slashes)", shown)
		}
		// Response bodies are the clients' data: directories 0700 (unless
		// dir_file_mode says otherwise), files 0600 (Create).
		for name, v := range map[string]string{"no_tmp_dir": "1", "metadata": "skip", "create_dir": "1", "dir_file_mode": "0700"} {
			if !q.Has(name) {
				q.Set(name, v)
			}
		}
		v := *u
		v.RawQuery = q.Encode()
		b, err = blob.OpenBucket(ctx, v.String())
	case "mem":
		if len(q) > 0 {
			return nil, fmt.Errorf("blobstore: %s: mem:// takes no parameters but prefix", Redact(rawURL))
		}
		b = memblob.OpenBucket(nil)
	case "":
		return nil, errors.New("blobstore: want a URL such as s3://bucket?region=…, file:///path or mem://")
	default:
		// Another scheme a driver registered with gocloud.dev (gs://,
		// azblob://) when the program imports it.
		v := *u
		v.RawQuery = q.Encode()
		b, err = blob.OpenBucket(ctx, v.String())
	}
	if err != nil {
		return nil, fmt.Errorf("blobstore: open %s: %s", Redact(rawURL), redactErr(err, u))
	}
	if prefix != "" {
		b = blob.PrefixedBucket(b, prefix)
	}
	bk := New(b)
	bk.name = Redact(rawURL)
	if s3client != nil {
		bk.setS3(s3client, s3opts, u.Host, prefix)
	}
	return bk, nil
}

// New returns a Bucket over b, which it closes on Close.
func New(b *blob.Bucket) *Bucket {
	return &Bucket{b: b, name: "bucket"}
}

// Redact names a blob store URL for logs: its scheme, bucket or path, and
// prefix, without credentials or other parameters.
func Redact(rawURL string) string {
	u, err := url.Parse(rawURL)
	if err != nil {
		return "(unparsable blob URL)"
	}
	s := u.Scheme + "://" + u.Host + u.Path
	if p := u.Query().Get("prefix"); p != "" {
		s += "?prefix=" + url.QueryEscape(p)
	}
	return s
}

// redactErr is err's message without u's password, which some errors
// repeat with the URL.
func redactErr(err error, u *url.URL) string {
	msg := err.Error()
	if u.User != nil {
		if pw, ok := u.User.Password(); ok && pw != "" {
			msg = strings.ReplaceAll(msg, pw, "xxxxx")
			msg = strings.ReplaceAll(msg, url.QueryEscape(pw), "xxxxx")
		}
	}
	return msg
}

// String names the store for logs (see Redact).
func (b *Bucket) String() string { return b.name }

// Bucket returns the gocloud.dev bucket underneath.
func (b *Bucket) Bucket() *blob.Bucket { return b.b }

// Close releases the bucket's resources.
func (b *Bucket) Close() error { return b.b.Close() }

// Create implements idem.BlobStore.
func (b *Bucket) Create(ctx context.Context, name string) (idem.BlobWriter, error) {
	if b.s3 != nil {
		return b.newS3Writer(ctx, name), nil
	}
	ctx, cancel := context.WithCancel(ctx)
	w, err := b.b.NewWriter(ctx, name, &blob.WriterOptions{
		ContentType:    "application/octet-stream",
		BufferSize:     partSize,
		MaxConcurrency: writerConcurrency,
		BeforeWrite:    privateFile,
	})
	if err != nil {
		cancel()
		return nil, fmt.Errorf("blobstore: create %s: %w", name, err)
	}
	return &writer{w: w, cancel: cancel, name: name}, nil
}

// privateFile makes a file:// blob readable by its owner only (0600),
// before its first byte: fileblob creates its temporary file 0666 (less
// the umask, so world-readable as a rule), and renames it into place.
func privateFile(as func(any) bool) error {
	var f *os.File
	if as(&f) && f != nil {
		return f.Chmod(0o600)
	}
	return nil
}

// writer is a blob being written; cancelling its context discards it.
type writer struct {
	w      *blob.Writer
	cancel context.CancelFunc
	name   string
	done   bool
}

func (w *writer) Write(p []byte) (int, error) {
	n, err := w.w.Write(p)
	if err != nil {
		err = fmt.Errorf("blobstore: write %s: %w", w.name, err)
	}
	return n, err
}

func (w *writer) Close() error {
	if w.done {
		return errors.New("blobstore: writer already closed or aborted")
	}
	w.done = true
	defer w.cancel()
	if err := w.w.Close(); err != nil {
		return fmt.Errorf("blobstore: commit %s: %w", w.name, err)
	}
	return nil
}

func (w *writer) Abort() error {
	if w.done {
		return nil
	}
	w.done = true
	w.cancel() // gocloud.dev discards a write whose context ended before Close
	w.w.Close()
	return nil
}

// Open implements idem.BlobStore.
func (b *Bucket) Open(ctx context.Context, name string) (io.ReadCloser, int64, error) {
	r, err := b.b.NewReader(ctx, name, nil)
	if err != nil {
		return nil, 0, b.wrap("open", name, err)
	}
	return r, r.Size(), nil
}

// Delete implements idem.BlobStore.
func (b *Bucket) Delete(ctx context.Context, name string) error {
	if err := b.b.Delete(ctx, name); err != nil {
		return b.wrap("delete", name, err)
	}
	return nil
}

// List implements idem.BlobStore.
func (b *Bucket) List(ctx context.Context, prefix string, fn func(idem.BlobInfo) error) error {
	it := b.b.List(&blob.ListOptions{Prefix: prefix})
	for {
		obj, err := it.Next(ctx)
		if errors.Is(err, io.EOF) {
			return nil
		}
		if err != nil {
			return fmt.Errorf("blobstore: list %s: %w", prefix, err)
		}
		if obj.IsDir {
			continue
		}
		if err := fn(idem.BlobInfo{Name: obj.Key, Size: obj.Size, ModTime: obj.ModTime}); err != nil {
			return err
		}
	}
}

// Check implements idem.BlobStore: the bucket (or directory) must exist
// and answer.
func (b *Bucket) Check(ctx context.Context) error {
	ok, err := b.b.IsAccessible(ctx)
	switch {
	case err != nil:
		return fmt.Errorf("blobstore: %s: %w", b.name, err)
	case !ok:
		return fmt.Errorf("blobstore: %s: the bucket does not exist", b.name)
	}
	return nil
}

// wrap turns gocloud.dev's not-found error into idem.ErrBlobNotFound.
func (b *Bucket) wrap(op, name string, err error) error {
	if gcerrors.Code(err) == gcerrors.NotFound {
		return fmt.Errorf("blobstore: %s %s: %w", op, name, idem.ErrBlobNotFound)
	}
	return fmt.Errorf("blobstore: %s %s: %w", op, name, err)
}

// fileblob registers file://; the import keeps it linked.
var _ = fileblob.Scheme
