package blobstore

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/s3"
	s3types "github.com/aws/aws-sdk-go-v2/service/s3/types"
)

// s3Writer uploads one blob to S3 with bounded memory: two part buffers,
// one filling while the other uploads. A body that fits in one part is one
// PutObject; a larger one a multipart upload, completed on Close and
// aborted on failure. (gocloud.dev's writer uses the SDK's transfer
// manager, which reads the first 16 MiB of every upload into memory before
// it starts; this one holds 2 parts, 10 MiB by default, whatever the size.)
type s3Writer struct {
	b      *Bucket
	ctx    context.Context
	cancel context.CancelFunc
	key    string // with the bucket's prefix
	name   string // for errors

	buf      *[]byte // the part being filled
	uploadID *string
	parts    []s3types.CompletedPart
	partNum  int32
	inflight chan error // the part upload in progress, if any
	err      error      // the first failure: nothing more is sent
	done     bool
}

// partBufs holds part buffers of partSize between uploads.
var partBufs = sync.Pool{New: func() any { b := make([]byte, 0, partSize); return &b }}

func (b *Bucket) newS3Writer(ctx context.Context, name string) *s3Writer {
	ctx, cancel := context.WithCancel(ctx)
	return &s3Writer{b: b, ctx: ctx, cancel: cancel, key: b.s3Prefix + name, name: name, buf: getPart()}
}

func getPart() *[]byte { return partBufs.Get().(*[]byte) }

func putPart(b *[]byte) {
	if cap(*b) == partSize {
		*b = (*b)[:0]
		partBufs.Put(b)
	}
}

func (w *s3Writer) Write(p []byte) (int, error) {
	if w.err != nil {
		return 0, w.err
	}
	if w.done {
		return 0, errors.New("blobstore: write after Close or Abort")
	}
	n := 0
	for len(p) > 0 {
		buf := *w.buf
		k := copy(buf[len(buf):cap(buf)], p)
		*w.buf = buf[:len(buf)+k]
		n += k
		p = p[k:]
		if len(*w.buf) == cap(*w.buf) {
			if err := w.flush(); err != nil {
				return n, err
			}
		}
	}
	return n, nil
}

// flush sends the full buffer as the next part, after the part before it
// has gone; the upload runs while the next buffer fills.
func (w *s3Writer) flush() error {
	if w.uploadID == nil {
		out, err := w.b.s3.CreateMultipartUpload(w.ctx, &s3.CreateMultipartUploadInput{
			Bucket: aws.String(w.b.s3Bucket), Key: aws.String(w.key), ContentType: aws.String("application/octet-stream"),
			ChecksumAlgorithm: w.b.s3Checksum, ServerSideEncryption: w.b.s3SSE, SSEKMSKeyId: w.b.s3KMS,
		})
		if err != nil {
			return w.fail(err)
		}
		w.uploadID = out.UploadId
	}
	if err := w.wait(); err != nil {
		return err
	}
	w.partNum++
	part, num := w.buf, w.partNum
	w.buf = getPart()
	w.inflight = make(chan error, 1)
	go func(ch chan error) {
		out, err := w.b.s3.UploadPart(w.ctx, &s3.UploadPartInput{
			Bucket: aws.String(w.b.s3Bucket), Key: aws.String(w.key), UploadId: w.uploadID,
			PartNumber: aws.Int32(num), Body: bytes.NewReader(*part), ChecksumAlgorithm: w.b.s3Checksum,
		})
		putPart(part)
		if err == nil {
			w.parts = append(w.parts, s3types.CompletedPart{ // only this goroutine appends while it runs
				PartNumber: aws.Int32(num), ETag: out.ETag, ChecksumCRC32: out.ChecksumCRC32, ChecksumCRC32C: out.ChecksumCRC32C,
				ChecksumSHA1: out.ChecksumSHA1, ChecksumSHA256: out.ChecksumSHA256,
			})
		}
		ch <- err
	}(w.inflight)
	return nil
}

// wait waits for the part upload in progress, if any.
func (w *s3Writer) wait() error {
	if w.inflight == nil {
		return nil
	}
	err := <-w.inflight
	w.inflight = nil
	if err != nil {
		return w.fail(err)
	}
	return nil
}

// fail records the first failure and aborts the multipart upload, if one
// was started.
func (w *s3Writer) fail(err error) error {
	if w.err == nil {
		w.err = fmt.Errorf("blobstore: write %s: %w", w.name, err)
		w.abortUpload()
	}
	return w.err
}

// abortUpload aborts the multipart upload, on a context of its own (the
// writer's may be the one that ended). A failure leaves an incomplete
// upload that Sweep (or a lifecycle rule) removes.
func (w *s3Writer) abortUpload() {
	w.cancel()
	if w.inflight != nil {
		<-w.inflight
		w.inflight = nil
	}
	if w.uploadID != nil {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		w.b.s3.AbortMultipartUpload(ctx, &s3.AbortMultipartUploadInput{Bucket: aws.String(w.b.s3Bucket), Key: aws.String(w.key),
			UploadId: w.uploadID})
		cancel()
	}
}

// Close uploads what is left and commits the blob.
func (w *s3Writer) Close() error {
	if w.done {
		return errors.New("blobstore: writer already closed or aborted")
	}
	w.done = true
	defer func() {
		putPart(w.buf)
		w.cancel()
	}()
	if w.err != nil {
		return w.err
	}
	if err := w.ctx.Err(); err != nil {
		return w.fail(err)
	}
	if w.uploadID == nil { // one part: a plain PutObject
		_, err := w.b.s3.PutObject(w.ctx, &s3.PutObjectInput{
			Bucket: aws.String(w.b.s3Bucket), Key: aws.String(w.key), Body: bytes.NewReader(*w.buf),
			ContentType: aws.String("application/octet-stream"), ChecksumAlgorithm: w.b.s3Checksum,
			ServerSideEncryption: w.b.s3SSE, SSEKMSKeyId: w.b.s3KMS,
		})
		if err != nil {
			w.err = fmt.Errorf("blobstore: commit %s: %w", w.name, err)
		}
		return w.err
	}
	if len(*w.buf) > 0 {
		if err := w.flush(); err != nil {
			return err
		}
	}
	if err := w.wait(); err != nil {
		return err
	}
	if _, err := w.b.s3.CompleteMultipartUpload(w.ctx, &s3.CompleteMultipartUploadInput{
		Bucket: aws.String(w.b.s3Bucket), Key: aws.String(w.key), UploadId: w.uploadID,
		MultipartUpload: &s3types.CompletedMultipartUpload{Parts: w.parts},
	}); err != nil {
		return w.fail(fmt.Errorf("commit: %w", err))
	}
	return nil
}

// Abort discards the blob.
func (w *s3Writer) Abort() error {
	if w.done {
		return nil
	}
	w.done = true
	if w.err == nil {
		w.err = errors.New("blobstore: aborted")
		w.abortUpload()
	}
	putPart(w.buf)
	return nil
}
