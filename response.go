package idem

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"net/http"
	"slices"
	"sync"

	"github.com/klauspost/compress/zstd"
)

// Response is the stored result of an operation: for HTTP, the status,
// headers and body; for a message consumer, whatever the handler chose to
// keep (often only a status).
type Response struct {
	Status int
	Header http.Header
	Body   []byte
	// BodyOmitted reports that the body was larger than the guard's
	// MaxResponseSize and was not stored. The operation is still completed
	// and is never executed again; replays carry the status and headers
	// with an empty body.
	BodyOmitted bool
	// Blob, when not nil, says that the body is in a BlobStore, not in the
	// record: Body is empty and BodyOmitted false. It is written before
	// Complete (idemhttp streams large bodies there), and replays read it
	// with OpenBlob, which checks its size and digest.
	Blob *BlobRef

	// sealed is a store's value that starts with SealedMark, kept as it is
	// (a "sealed carrier": see Sealed); the fields above are then zero.
	sealed []byte
	// sealing, set by the Guard on the response it stores, makes
	// AppendBinary seal the clear encoding (see sealState).
	sealing *sealState
}

// Sealed reports whether r is a sealed response not opened: a store's
// value that UnmarshalBinary kept as it is because it starts with
// SealedMark. Its Status, Header and body are zero; AppendBinary writes it
// back unchanged (a store relaying or caching it), and OpenResponse, or
// the Guard that reads it, opens it.
func (r *Response) Sealed() bool { return r != nil && r.sealed != nil }

// Limits of the record encoding.
const (
	// CompressMinSize is the smallest body that is compressed (zstd). A
	// compressed body is kept only when it saves at least an eighth.
	CompressMinSize = 1 << 10
	// MaxEncodedBody is the largest body the encoding accepts, before
	// compression. Decoding refuses to inflate past it.
	MaxEncodedBody = 64 << 20
)

// Encoding, version 1. Byte 0 holds flags:
//
//	bits 0-1  status form: 0 = 200, 1 = 201, 2 = one byte (status-100),
//	          3 = uvarint
//	bit  2    the header set is exactly {Content-Type: application/json}
//	bits 3-4  body form: 0 = the rest, 1 (bit 3) = zstd-compressed,
//	          2 (bit 4) = omitted, 3 = in a blob store (a BlobRef)
//	bits 5-7  version - 1 (0); 7 (a first byte of 0xE0 or more, "version
//	          8") is reserved: package seal's envelopes start with 0xFF, so
//	          that no clear record is taken for a sealed one
//
// Then the status when its form asks for it, then (unless bit 2) a uvarint
// count of header lines, each a name and a value written as a uvarint table
// code (1..len(table)) or 0 followed by a uvarint length and the bytes.
// The body is the rest; a compressed body is its uvarint length, then the
// zstd frame; a blob reference is the uvarint size, the 32-byte SHA-256
// and the name (uvarint length, bytes). The table is append-only: codes
// never change. Body form 3 came after the first release: an idem built
// before it finds such a record corrupt (an omitted body with bytes) and
// answers as for a store failure, never with an empty body.
const (
	flagStatusMask = 0x03
	flagJSONOnly   = 1 << 2
	flagZstd       = 1 << 3
	flagOmitted    = 1 << 4
	flagBlob       = flagZstd | flagOmitted // both: the body is in a blob store
	flagVersion    = 0xE0
)

var headerTable = [...]string{
	"Content-Type", "Content-Length", "Content-Encoding", "Content-Language",
	"Content-Disposition", "Location", "Cache-Control", "Etag", "Last-Modified",
	"Vary", "Link", "Retry-After", "Expires", "Pragma", "X-Request-Id",
	"X-Content-Type-Options", "Content-Location",
	"application/json", "application/json; charset=utf-8",
	"text/plain; charset=utf-8", "text/html; charset=utf-8",
	"application/problem+json", "application/xml", "text/xml; charset=utf-8",
	"application/octet-stream", "text/plain", "no-store", "no-cache",
	"private", "nosniff", "Accept-Encoding", "Origin", "gzip", "br", "zstd",
}

var headerCodes = func() map[string]uint64 {
	m := make(map[string]uint64, len(headerTable))
	for i, s := range headerTable {
		m[s] = uint64(i + 1)
	}
	return m
}()

var (
	zstdEnc = sync.OnceValue(func() *zstd.Encoder {
		e, err := zstd.NewWriter(nil, zstd.WithEncoderLevel(zstd.SpeedFastest))
		if err != nil {
			panic(err) // only for invalid options
		}
		return e
	})
	zstdDec = sync.OnceValue(func() *zstd.Decoder {
		d, err := zstd.NewReader(nil, zstd.WithDecoderConcurrency(0), zstd.WithDecoderMaxMemory(MaxEncodedBody),
			zstd.WithDecodeAllCapLimit(true)) // never inflate past the recorded length

		if err != nil {
			panic(err)
		}
		return d
	})
)

// AppendBinary appends the compact encoding of r to b. Bodies of at least
// CompressMinSize bytes are compressed when that saves at least an eighth
// and the response does not already carry a Content-Encoding. A sealed
// response (Sealed) is appended as it was read. A response the Guard
// stores with Config.Seal set (Attempt.Stored) is encoded, then sealed:
// the same content gives the same bytes every time (a store may recognise
// a repeated completion by its bytes), a copy with other content (a store
// cutting the body) is sealed on its own.
func (r *Response) AppendBinary(b []byte) ([]byte, error) {
	if err := r.validate(); err != nil {
		return b, err
	}
	if r.sealed != nil {
		return append(b, r.sealed...), nil
	}
	if r.sealing != nil {
		if sealed := r.sealing.sealedAgain(r); sealed != nil {
			return append(b, sealed...), nil
		}
		clear, err := r.appendClear(nil)
		if err != nil {
			return b, err
		}
		sealed, err := r.sealing.seal(r, clear)
		if err != nil {
			return b, err
		}
		return append(b, sealed...), nil
	}
	return r.appendClear(b)
}

// appendClear is AppendBinary without sealing; r is valid.
func (r *Response) appendClear(b []byte) ([]byte, error) {
	flagAt := len(b)
	b = append(b, 0)
	var flags byte
	switch {
	case r.Status == 200:
	case r.Status == 201:
		flags |= 1
	case r.Status >= 100 && r.Status <= 355:
		flags |= 2
		b = append(b, byte(r.Status-100))
	default:
		flags |= 3
		b = binary.AppendUvarint(b, uint64(r.Status))
	}
	if isJSONOnly(r.Header) {
		flags |= flagJSONOnly
	} else {
		b = appendHeader(b, r.Header)
	}
	switch {
	case r.Blob != nil:
		flags |= flagBlob
		b = binary.AppendUvarint(b, uint64(r.Blob.Size))
		b = append(b, r.Blob.SHA256[:]...)
		b = binary.AppendUvarint(b, uint64(len(r.Blob.Name)))
		b = append(b, r.Blob.Name...)
	case r.BodyOmitted:
		flags |= flagOmitted
	case len(r.Body) >= CompressMinSize && r.Header.Get("Content-Encoding") == "":
		start := len(b)
		b = binary.AppendUvarint(b, uint64(len(r.Body)))
		b = zstdEnc().EncodeAll(r.Body, b)
		if n := len(b) - start; n <= len(r.Body)-len(r.Body)/8 {
			flags |= flagZstd
		} else {
			b = append(b[:start], r.Body...)
		}
	default:
		b = append(b, r.Body...)
	}
	b[flagAt] = flags
	return b, nil
}

// validate reports a response the encoding cannot hold.
func (r *Response) validate() error {
	switch {
	case r == nil:
		return errors.New("idem: nil *Response")
	case r.sealed != nil:
		return nil // written as it was read
	case r.Status < 0 || r.Status > 999:
		return fmt.Errorf("idem: response status %d out of range 0..999", r.Status)
	case len(r.Body) > MaxEncodedBody:
		return fmt.Errorf("idem: response body of %d bytes exceeds the %d-byte maximum", len(r.Body), MaxEncodedBody)
	case r.Blob != nil && (len(r.Body) > 0 || r.BodyOmitted):
		return errors.New("idem: a response with a Blob has no Body and is not BodyOmitted")
	case r.Blob != nil:
		return r.Blob.validate()
	}
	return nil
}

// UnmarshalBinary decodes data written by AppendBinary. It copies what it
// keeps. Malformed input gives an error wrapping ErrCorrupt. A sealed value
// (one that starts with SealedMark) is kept as it is, unopened: r is then
// Sealed, with its other fields zero.
func (r *Response) UnmarshalBinary(data []byte) error {
	*r = Response{}
	if len(data) > 0 && data[0] == SealedMark {
		r.sealed = slices.Clone(data)
		return nil
	}
	return r.decodeClear(data, false)
}

// decodeClear decodes a clear encoding into r, which is zero. With own,
// data is r's to keep: the body may alias it.
func (r *Response) decodeClear(data []byte, own bool) error {
	if len(data) == 0 {
		return corrupt("empty response")
	}
	flags, p := data[0], data[1:]
	if flags&flagVersion != 0 {
		return corrupt("unknown response encoding version %d", flags>>5+1)
	}
	switch flags & flagStatusMask {
	case 0:
		r.Status = 200
	case 1:
		r.Status = 201
	case 2:
		if len(p) < 1 {
			return corrupt("truncated status")
		}
		r.Status, p = int(p[0])+100, p[1:]
	case 3:
		v, n := binary.Uvarint(p)
		if n <= 0 || v > 999 {
			return corrupt("bad status")
		}
		r.Status, p = int(v), p[n:]
	}
	if flags&flagJSONOnly != 0 {
		r.Header = http.Header{"Content-Type": {"application/json"}}
	} else {
		var err error
		if r.Header, p, err = readHeader(p); err != nil {
			return err
		}
	}
	switch {
	case flags&flagBlob == flagBlob:
		ref, err := readBlobRef(p)
		if err != nil {
			return err
		}
		r.Blob = ref
	case flags&flagOmitted != 0:
		r.BodyOmitted = true
		if len(p) != 0 {
			return corrupt("omitted body has %d bytes", len(p))
		}
	case flags&flagZstd != 0:
		n, k := binary.Uvarint(p)
		if k <= 0 || n > MaxEncodedBody {
			return corrupt("bad compressed body length")
		}
		body, err := zstdDec().DecodeAll(p[k:], make([]byte, 0, n))
		if err != nil || uint64(len(body)) != n {
			return corrupt("compressed body: got %d bytes, want %d (%v)", len(body), n, err)
		}
		r.Body = body
	case len(p) > 0 && own:
		r.Body = p
	case len(p) > 0:
		r.Body = slices.Clone(p)
	}
	return nil
}

// readBlobRef decodes a blob reference that must fill p.
func readBlobRef(p []byte) (*BlobRef, error) {
	size, n := binary.Uvarint(p)
	if n <= 0 || size > math.MaxInt64 {
		return nil, corrupt("bad blob size")
	}
	p = p[n:]
	ref := &BlobRef{Size: int64(size)}
	if len(p) < len(ref.SHA256) {
		return nil, corrupt("truncated blob digest")
	}
	p = p[copy(ref.SHA256[:], p):]
	l, n := binary.Uvarint(p)
	if n <= 0 || l == 0 || l > MaxBlobNameLen || l != uint64(len(p)-n) {
		return nil, corrupt("bad blob name")
	}
	ref.Name = string(p[n:])
	return ref, nil
}

func isJSONOnly(h http.Header) bool {
	if len(h) != 1 {
		return false
	}
	v, ok := h["Content-Type"]
	return ok && len(v) == 1 && v[0] == "application/json"
}

func appendHeader(b []byte, h http.Header) []byte {
	names := make([]string, 0, len(h))
	lines := 0
	for name, vs := range h {
		names = append(names, name)
		lines += len(vs)
	}
	slices.Sort(names) // deterministic encoding
	b = binary.AppendUvarint(b, uint64(lines))
	for _, name := range names {
		for _, v := range h[name] {
			b = appendString(b, name)
			b = appendString(b, v)
		}
	}
	return b
}

func appendString(b []byte, s string) []byte {
	if code, ok := headerCodes[s]; ok {
		return binary.AppendUvarint(b, code)
	}
	b = append(b, 0)
	b = binary.AppendUvarint(b, uint64(len(s)))
	return append(b, s...)
}

// readHeader decodes a header set. Its allocations do not grow with the
// lines: the values are one backing array (each name's run of lines a
// slice of it, capped, so that appending to one never writes another's),
// and the strings that are not table codes are substrings of one string,
// the header's bytes; the first pass only checks the lines and finds where
// they end.
func readHeader(p []byte) (http.Header, []byte, error) {
	lines, n := binary.Uvarint(p)
	if n <= 0 || lines > uint64(len(p)-n)/2 { // every line takes at least two bytes
		return nil, nil, corrupt("bad header count")
	}
	p = p[n:]
	rest, literal := p, false
	for range 2 * lines {
		code, _, r, err := nextString(rest)
		if err != nil {
			return nil, nil, err
		}
		rest, literal = r, literal || code == 0
	}
	var text string // the header's bytes, when a string is not a code
	if literal {
		text = string(p[:len(p)-len(rest)])
	}
	at := func(q []byte) int { return len(p) - len(q) } // q's offset in text
	h := make(http.Header, min(lines, 16))
	vals := make([]string, lines)
	var prev string // the name of the run of lines vals[start:i] holds
	start, run := 0, false
	q := p
	for i := range int(lines) {
		var name, value string
		name, q = readString(q, text, at(q))
		value, q = readString(q, text, at(q))
		switch old, ok := h[name]; {
		case ok && run && name == prev:
			vals[i] = value
			h[name] = vals[start : i+1 : i+1]
		case ok: // a name met again after others: as append did
			h[name], run = append(old, value), false
		default:
			vals[i] = value
			h[name] = vals[i : i+1 : i+1]
			start, run = i, true
		}
		prev = name
	}
	return h, rest, nil
}

// nextString reads the code of a header string, 0 followed by its bytes
// (lit) when it is not in the table, and returns what follows it.
func nextString(p []byte) (code uint64, lit, rest []byte, err error) {
	code, n := binary.Uvarint(p)
	if n <= 0 {
		return 0, nil, nil, corrupt("truncated header")
	}
	p = p[n:]
	if code > 0 {
		if code > uint64(len(headerTable)) {
			return 0, nil, nil, corrupt("unknown header code %d", code)
		}
		return code, nil, p, nil
	}
	l, n := binary.Uvarint(p)
	if n <= 0 || l > uint64(len(p)-n) {
		return 0, nil, nil, corrupt("truncated header string")
	}
	p = p[n:]
	return 0, p[:l], p[l:], nil
}

// readString reads a header string that nextString checked: a table entry,
// or a substring of text, whose bytes p begins at offset off of.
func readString(p []byte, text string, off int) (string, []byte) {
	code, lit, rest, _ := nextString(p)
	if code > 0 {
		return headerTable[code-1], rest
	}
	litAt := off + (len(p) - len(rest) - len(lit))
	return text[litAt : litAt+len(lit)], rest
}

func corrupt(format string, args ...any) error {
	return fmt.Errorf("%w: %s", ErrCorrupt, fmt.Sprintf(format, args...))
}
