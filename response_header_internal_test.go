package idem

import (
	"encoding/binary"
	"net/http"
	"reflect"
	"testing"
)

// readHeaderWas is readHeader as it was before issue 36's cuts: a string
// and a value slice per line. The header it decodes is the reference.
func readHeaderWas(p []byte) (http.Header, []byte, error) {
	lines, n := binary.Uvarint(p)
	if n <= 0 || lines > uint64(len(p)-n)/2 {
		return nil, nil, corrupt("bad header count")
	}
	p = p[n:]
	h := make(http.Header, min(lines, 16))
	for range lines {
		var name, value string
		var err error
		if name, p, err = readStringWas(p); err != nil {
			return nil, nil, err
		}
		if value, p, err = readStringWas(p); err != nil {
			return nil, nil, err
		}
		h[name] = append(h[name], value)
	}
	return h, p, nil
}

func readStringWas(p []byte) (string, []byte, error) {
	code, n := binary.Uvarint(p)
	if n <= 0 {
		return "", nil, corrupt("truncated header")
	}
	p = p[n:]
	if code > 0 {
		if code > uint64(len(headerTable)) {
			return "", nil, corrupt("unknown header code %d", code)
		}
		return headerTable[code-1], p, nil
	}
	l, n := binary.Uvarint(p)
	if n <= 0 || l > uint64(len(p)-n) {
		return "", nil, corrupt("truncated header string")
	}
	p = p[n:]
	return string(p[:l]), p[l:], nil
}

// lines encodes header lines in order, as AppendBinary never does when a
// name comes back after another (it sorts them).
func lines(kv ...string) []byte {
	b := binary.AppendUvarint(nil, uint64(len(kv)/2))
	for _, s := range kv {
		b = appendString(b, s)
	}
	return append(b, "body"...)
}

func checkReadHeader(t *testing.T, p []byte) {
	t.Helper()
	got, grest, gerr := readHeader(p)
	want, wrest, werr := readHeaderWas(p)
	if (gerr == nil) != (werr == nil) || (gerr != nil && gerr.Error() != werr.Error()) {
		t.Fatalf("error %v, want %v", gerr, werr)
	}
	if !reflect.DeepEqual(got, want) || string(grest) != string(wrest) {
		t.Fatalf("got %q, rest %q; want %q, rest %q", got, grest, want, wrest)
	}
	// A value slice is its name's alone: appending to it, or writing it,
	// leaves the others as they are.
	for name := range got {
		got[name] = append(got[name], "appended")
		got[name][0] = "written"
	}
	for name, vs := range got {
		if w := append(append([]string{"written"}, want[name][1:]...), "appended"); !reflect.DeepEqual(vs, w) {
			t.Fatalf("%s: %q after the writes, want %q", name, vs, w)
		}
	}
}

// readHeader decodes what it did before its allocations were cut (issue
// 36), runs of a name, names met again, table codes and literal strings
// alike, and refuses the same corrupt input with the same error.
func TestReadHeaderAsBefore(t *testing.T) {
	for _, p := range [][]byte{
		lines(),
		lines("Content-Type", "application/json"),
		lines("Content-Type", "application/json", "X-A", "1", "X-A", "2", "Set-Cookie", "a=b", "Set-Cookie", "c=d", "X-Z", "z"),
		lines("X-A", "1", "X-B", "2", "X-A", "3", "X-A", "4", "X-B", "5", "Vary", "Origin", "X-A", "6"),
		lines("X-A", "1", "X-A", "2", "X-B", "2", "X-A", "3"),
		lines("", "", "X", ""),
		{},
		{5, 0},
		{1, 0, 9},
		{1, 200, 1},
		{2, 1, 1, 0, 3, 'a', 'b'},
	} {
		checkReadHeader(t, p)
	}
}

func FuzzReadHeader(f *testing.F) {
	f.Add(lines("X-A", "1", "X-B", "2", "X-A", "3", "Content-Type", "text/plain"))
	f.Add([]byte{1, 0, 1, 'a', 1})
	f.Fuzz(func(t *testing.T, p []byte) { checkReadHeader(t, p) })
}
