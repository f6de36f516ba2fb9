package idem

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
)

// The sealed blob format, version 1. A 12-byte header, in clear:
//
//	magic     3 bytes  0xFF 'S' 'B'
//	version   1 byte   1
//	chunk     uint32   plaintext bytes per chunk (64 KiB), big-endian
//	overhead  uint32   bytes the Sealer adds to each chunk, big-endian
//
// then the chunks: the plaintext cut in chunks of chunk bytes, the last
// one shorter (0 to chunk-1 bytes, so there is always one), each sealed
// with Sealer.Seal on its own, with the associated data
//
//	"idem/blob/v1\x00" ‖ blob name ‖ uint64 chunk index ‖ final flag (1 byte) ‖ header
//
// (big-endian index; the flag 1 for the last chunk, else 0). The index
// refuses chunks reordered or dropped, the flag a blob truncated at a
// chunk's end, the name a blob copied or moved under another name, and the
// header any change to the header. A stored blob of S bytes holds
// (S-12) / (chunk+overhead) full chunks and one last chunk of
// (S-12) % (chunk+overhead) bytes, at least overhead: the plaintext size
// follows from the stored size.
var blobSealMagic = [3]byte{0xFF, 'S', 'B'}

const (
	blobSealVersion   = 1
	blobSealHeaderLen = 12
	// BlobSealChunk is the plaintext size of a sealed blob's chunks.
	blobSealChunk = 64 << 10
	// Bounds a header must keep to before anything is allocated for it
	// (the header is authenticated only with the first chunk).
	blobSealMaxChunk    = 16 << 20
	blobSealMaxOverhead = 64 << 10
	blobADTag           = "idem/blob/v1\x00"
)

// SealBlobs returns bs with every blob sealed at rest by s: what Create
// writes is encrypted and authenticated, in chunks of 64 KiB, under s's
// key, and bound to the blob's name, so that whoever reads the blob store
// (the S3 bucket, the directory, a backup) sees none of a response's body,
// and a blob altered by one byte, truncated, with chunks reordered or
// dropped, or copied under another name is refused as its bytes are read:
// an error that wraps ErrUnsealable and ErrBlobCorrupt, a *BlobSealError
// naming the blob and the key id (never key material). Open returns the
// plaintext's size (computed from the stored size); List, Delete and
// Check are bs's own (List's sizes are the stored ones, a little larger).
//
// A blob that does not start with the sealed header (0xFF 'S' 'B': one
// written before sealing was turned on, or with openOnly) is read as it
// is, in clear; OpenBlob checks its SHA-256 digest as always. With
// openOnly, Create writes clear blobs, and sealed ones still open: the way
// to turn sealing off while blobs sealed before are still referenced. A
// clear blob whose body itself starts with those three bytes cannot be
// read through SealBlobs (it is taken for a sealed one and refused).
//
// OpenBlob does not hash a blob read sealed: its AEAD already
// authenticates every byte, in order, bound to the blob's name, which is
// unique (NewBlobName) and held in the record; the size is checked all
// the same. A nil s returns bs; so does a nil bs. SealBlobs of a store
// SealBlobs returned wraps the store underneath it (Unwrap) instead, so
// blobs are never sealed twice. idemhttp does it itself (Config.Seal and
// Config.Blobs). The returned store has Unwrap() BlobStore, for what
// needs the store underneath (blobstore.Sweep aborting S3 uploads).
//
// A Sealer's overhead (what Seal adds to a plaintext) must be the same
// for all the chunks of one blob; one whose overhead changes between them
// fails the write (the response is then stored without its body).
func SealBlobs(bs BlobStore, s Sealer, openOnly bool) BlobStore {
	if s == nil || bs == nil {
		return bs
	}
	if sb, ok := bs.(*sealedBlobs); ok {
		bs = sb.bs
	}
	return &sealedBlobs{bs: bs, s: s, openOnly: openOnly}
}

// BlobSealError is the error of a sealed blob that cannot be opened:
// altered, truncated, moved under another name, or sealed under a key id
// the Sealer does not hold. It matches ErrUnsealable and ErrBlobCorrupt
// (errors.Is).
type BlobSealError struct {
	// Name is the blob's name.
	Name string
	// KeyID is the id of the key the chunk says sealed it ("" when it says
	// none).
	KeyID string
	// Err is the reason: the Sealer's error, or what is wrong with the
	// blob's layout.
	Err error
}

func (e *BlobSealError) Error() string {
	id := e.KeyID
	if id == "" {
		id = "unknown"
	}
	return fmt.Sprintf("idem: sealed blob %s (key id %s) cannot be opened: %v", e.Name, id, e.Err)
}

func (e *BlobSealError) Unwrap() error { return e.Err }

// Is makes errors.Is(err, ErrUnsealable) and errors.Is(err,
// ErrBlobCorrupt) true.
func (e *BlobSealError) Is(target error) bool {
	return target == ErrUnsealable || target == ErrBlobCorrupt
}

// sealedBlobs is SealBlobs's store.
type sealedBlobs struct {
	bs       BlobStore
	s        Sealer
	openOnly bool
}

// Unwrap returns the store underneath.
func (b *sealedBlobs) Unwrap() BlobStore { return b.bs }

// String names the store underneath, for logs.
func (b *sealedBlobs) String() string {
	if s, ok := b.bs.(fmt.Stringer); ok {
		return s.String()
	}
	return fmt.Sprintf("%T", b.bs)
}

func (b *sealedBlobs) Delete(ctx context.Context, name string) error { return b.bs.Delete(ctx, name) }
func (b *sealedBlobs) Check(ctx context.Context) error               { return b.bs.Check(ctx) }
func (b *sealedBlobs) List(ctx context.Context, prefix string, fn func(BlobInfo) error) error {
	return b.bs.List(ctx, prefix, fn)
}

// blobAD returns the associated data of the chunks of blob name with
// header hdr; chunkAD sets a chunk's index and flag in it.
func blobAD(name string, hdr []byte) []byte {
	ad := make([]byte, 0, len(blobADTag)+len(name)+9+len(hdr))
	ad = append(ad, blobADTag...)
	ad = append(ad, name...)
	ad = append(ad, make([]byte, 9)...)
	return append(ad, hdr...)
}

func chunkAD(ad []byte, index uint64, final bool) []byte {
	at := len(ad) - blobSealHeaderLen - 9
	binary.BigEndian.PutUint64(ad[at:], index)
	ad[at+8] = 0
	if final {
		ad[at+8] = 1
	}
	return ad
}

// overheader is implemented by Sealers that say what Seal adds (seal.Ring).
type overheader interface{ Overhead() int }

// Create implements BlobStore.
func (b *sealedBlobs) Create(ctx context.Context, name string) (BlobWriter, error) {
	if b.openOnly {
		return b.bs.Create(ctx, name)
	}
	var ov int
	if o, ok := b.s.(overheader); ok {
		ov = o.Overhead()
	} else {
		probe, err := b.s.Seal(nil, nil, []byte(blobADTag+name+"\x00probe"))
		if err != nil {
			return nil, fmt.Errorf("idem: sealing blob %s: %w", name, err)
		}
		ov = len(probe)
	}
	if ov < 1 || ov > blobSealMaxOverhead {
		return nil, fmt.Errorf("idem: sealing blob %s: the Sealer (%T) adds %d bytes to a value: want 1 to %d", name, b.s, ov, blobSealMaxOverhead)
	}
	w, err := b.bs.Create(ctx, name)
	if err != nil {
		return nil, err
	}
	sw := &sealedBlobWriter{s: b.s, w: w, name: name, ov: ov,
		buf: make([]byte, 0, blobSealChunk), out: make([]byte, 0, blobSealHeaderLen+blobSealChunk+ov)}
	copy(sw.hdr[:], blobSealMagic[:])
	sw.hdr[3] = blobSealVersion
	binary.BigEndian.PutUint32(sw.hdr[4:], blobSealChunk)
	binary.BigEndian.PutUint32(sw.hdr[8:], uint32(ov))
	sw.ad = blobAD(name, sw.hdr[:])
	return sw, nil
}

// sealedBlobWriter seals a blob as it is written: a chunk is sealed and
// written to the store underneath when it is full, the last one on Close.
type sealedBlobWriter struct {
	s     Sealer
	w     BlobWriter
	name  string
	ov    int
	hdr   [blobSealHeaderLen]byte
	ad    []byte
	buf   []byte // the chunk being filled
	out   []byte // scratch for a sealed chunk (and the header before the first)
	index uint64
	err   error // sticky
	done  bool
}

func (w *sealedBlobWriter) Write(p []byte) (int, error) {
	if w.err != nil {
		return 0, w.err
	}
	if w.done {
		return 0, errors.New("idem: sealed blob writer already closed or aborted")
	}
	n := len(p)
	for len(p) > 0 {
		k := copy(w.buf[len(w.buf):cap(w.buf)], p)
		w.buf = w.buf[:len(w.buf)+k]
		p = p[k:]
		if len(w.buf) == cap(w.buf) {
			if err := w.flush(false); err != nil {
				return n - len(p), err
			}
		}
	}
	return n, nil
}

// flush seals the chunk in buf and writes it (after the header, for the
// first).
func (w *sealedBlobWriter) flush(final bool) error {
	out := w.out[:0]
	if w.index == 0 {
		out = append(out, w.hdr[:]...)
	}
	start := len(out)
	out, err := w.s.Seal(out, w.buf, chunkAD(w.ad, w.index, final))
	if err == nil && len(out)-start != len(w.buf)+w.ov {
		err = fmt.Errorf("the Sealer (%T) added %d bytes to chunk %d, and %d to the blob's first: want the same for every chunk", w.s, len(out)-start-len(w.buf), w.index, w.ov)
	}
	if err != nil {
		w.err = fmt.Errorf("idem: sealing blob %s: %w", w.name, err)
		w.w.Abort()
		return w.err
	}
	w.out = out
	if _, err := w.w.Write(out); err != nil {
		w.err = err
		w.w.Abort()
		return err
	}
	w.index++
	w.buf = w.buf[:0]
	return nil
}

func (w *sealedBlobWriter) Close() error {
	if w.done {
		return errors.New("idem: sealed blob writer already closed or aborted")
	}
	if w.err != nil {
		w.done = true
		return w.err
	}
	if err := w.flush(true); err != nil {
		w.done = true
		return err
	}
	w.done = true
	return w.w.Close()
}

func (w *sealedBlobWriter) Abort() error {
	if w.done {
		return nil
	}
	w.done = true
	if w.err != nil {
		return nil // aborted already
	}
	return w.w.Abort()
}

// Open implements BlobStore.
func (b *sealedBlobs) Open(ctx context.Context, name string) (io.ReadCloser, int64, error) {
	rc, size, err := b.bs.Open(ctx, name)
	if err != nil {
		return nil, 0, err
	}
	var hdr [blobSealHeaderLen]byte
	n, err := io.ReadFull(rc, hdr[:min(size, blobSealHeaderLen)])
	if err != nil {
		rc.Close()
		if errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, io.EOF) {
			return nil, 0, fmt.Errorf("%w: blob %s ended after %d bytes, its store says %d", ErrBlobCorrupt, name, n, size)
		}
		return nil, 0, fmt.Errorf("idem: reading blob %s: %w", name, err)
	}
	if n < len(blobSealMagic) || !bytes.Equal(hdr[:len(blobSealMagic)], blobSealMagic[:]) {
		// A clear blob: written before sealing, or with openOnly.
		return &clearBlobReader{head: hdr[:n], rc: rc}, size, nil
	}
	fail := func(format string, args ...any) (io.ReadCloser, int64, error) {
		rc.Close()
		return nil, 0, &BlobSealError{Name: name, Err: fmt.Errorf(format, args...)}
	}
	if n < blobSealHeaderLen {
		return fail("%d bytes, shorter than the %d-byte header", size, blobSealHeaderLen)
	}
	if v := hdr[3]; v != blobSealVersion {
		return fail("unknown sealed blob version %d (want %d)", v, blobSealVersion)
	}
	chunk := int64(binary.BigEndian.Uint32(hdr[4:]))
	ov := int64(binary.BigEndian.Uint32(hdr[8:]))
	if chunk < 1 || chunk > blobSealMaxChunk || ov < 1 || ov > blobSealMaxOverhead {
		return fail("malformed header (chunk size %d, overhead %d)", chunk, ov)
	}
	rest := size - blobSealHeaderLen
	full, last := rest/(chunk+ov), rest%(chunk+ov)
	if last < ov {
		return fail("%d bytes: truncated (the last chunk has %d bytes, fewer than the %d every chunk adds)", size, last, ov)
	}
	r := &sealedBlobReader{s: b.s, rc: rc, name: name, ad: blobAD(name, hdr[:]),
		chunk: int(chunk), ov: int(ov), chunks: uint64(full) + 1, lastLen: int(last)}
	// The first chunk now: it authenticates the header, and with it the
	// size, before anyone relies on it.
	if !r.next(nil) {
		rc.Close()
		return nil, 0, r.err
	}
	return r, full*chunk + last - ov, nil
}

// clearBlobReader reads a clear blob: the bytes Open read to look for the
// header, then the rest.
type clearBlobReader struct {
	head []byte
	rc   io.ReadCloser
}

func (r *clearBlobReader) Read(p []byte) (int, error) {
	if len(r.head) > 0 {
		n := copy(p, r.head)
		r.head = r.head[n:]
		return n, nil
	}
	return r.rc.Read(p)
}

func (r *clearBlobReader) Close() error { return r.rc.Close() }

// sealedBlobReader opens a sealed blob chunk by chunk as it is read: no
// byte of a chunk is returned before the whole chunk authenticates, and
// io.EOF only after the final one did.
type sealedBlobReader struct {
	s       Sealer
	rc      io.ReadCloser
	name    string
	ad      []byte
	chunk   int
	ov      int
	chunks  uint64 // how many, the last one final
	lastLen int    // the stored size of the last one
	index   uint64 // the next chunk to open
	in      []byte // a sealed chunk
	buf     []byte // an opened chunk, for reads shorter than a chunk
	plain   []byte // what is left of the opened chunk
	err     error  // sticky
}

func (r *sealedBlobReader) Read(p []byte) (int, error) {
	for {
		if len(r.plain) > 0 {
			n := copy(p, r.plain)
			r.plain = r.plain[n:]
			return n, nil
		}
		if r.err != nil {
			return 0, r.err
		}
		if len(p) == 0 {
			return 0, nil
		}
		if r.index == r.chunks {
			r.err = r.end()
			continue
		}
		// A read of a chunk or more gets the chunk opened into it, with no
		// copy; a shorter one, through buf.
		if want := r.plainLen(r.index); len(p) >= want {
			if r.next(p[:0]) && want > 0 {
				return want, nil
			}
			continue
		}
		r.next(nil)
	}
}

// plainLen is the plaintext size of chunk i.
func (r *sealedBlobReader) plainLen(i uint64) int {
	if i == r.chunks-1 {
		return r.lastLen - r.ov
	}
	return r.chunk
}

// next reads and opens the next chunk into dst, which has room for it,
// or, with dst nil, into buf, and then sets plain to it. It reports
// whether it did; else r.err says why.
func (r *sealedBlobReader) next(dst []byte) bool {
	final := r.index == r.chunks-1
	want := r.plainLen(r.index)
	size := want + r.ov
	if cap(r.in) < size {
		r.in = make([]byte, r.chunk+r.ov)
	}
	in := r.in[:size]
	if n, err := io.ReadFull(r.rc, in); err != nil {
		if errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, io.EOF) {
			r.err = fmt.Errorf("%w: sealed blob %s ended in chunk %d, after %d of its %d bytes, shorter than its store says", ErrBlobCorrupt, r.name, r.index, n, size)
		} else {
			r.err = fmt.Errorf("idem: reading blob %s: %w", r.name, err)
		}
		return false
	}
	toBuf := dst == nil
	if toBuf {
		if r.buf == nil {
			r.buf = make([]byte, 0, r.chunk)
		}
		dst = r.buf[:0]
	}
	out, err := r.s.Open(dst, in, chunkAD(r.ad, r.index, final))
	if err == nil && len(out) != want {
		err = fmt.Errorf("chunk %d opened to %d bytes, want %d", r.index, len(out), want)
	}
	if err != nil {
		id, _ := r.s.KeyID(in)
		r.err = &BlobSealError{Name: r.name, KeyID: id, Err: fmt.Errorf("chunk %d of %d: %w", r.index, r.chunks, err)}
		return false
	}
	r.index++
	switch {
	case toBuf:
		r.plain = out
	case want > 0 && &out[0] != &dst[:1][0]: // a Sealer that did not open in place
		copy(dst[:want], out)
	}
	return true
}

// end is the verdict after the final chunk opened: io.EOF, unless the
// store has more bytes than it said.
func (r *sealedBlobReader) end() error {
	var b [1]byte
	n, err := io.ReadFull(r.rc, b[:])
	switch {
	case n > 0:
		return &BlobSealError{Name: r.name, Err: errors.New("bytes after the final chunk")}
	case errors.Is(err, io.EOF):
		return io.EOF
	default:
		return fmt.Errorf("idem: reading blob %s: %w", r.name, err)
	}
}

func (r *sealedBlobReader) Close() error { return r.rc.Close() }
