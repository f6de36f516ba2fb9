package idemhttp

import (
	"errors"
	"fmt"
	"net/http"
	"reflect"
	"strings"
	"testing"
)

// takingWriter takes up to room bytes, then fails with err (a short
// write), and records what it took.
type takingWriter struct {
	h    http.Header
	room int
	err  error
	got  []byte
	code int
}

func (w *takingWriter) Header() http.Header { return w.h }
func (w *takingWriter) WriteHeader(code int) {
	if w.code == 0 {
		w.code = code
	}
}
func (w *takingWriter) Write(p []byte) (int, error) {
	n := min(len(p), w.room)
	w.room -= n
	w.got = append(w.got, p[:n]...)
	if n < len(p) {
		return n, w.err
	}
	return n, nil
}

// WriteString answers as Write does, and leaves the capture and the
// client with what Write leaves them: whatever the writer takes, its
// errors (the client's or the handler's), the status, the limit.
func TestCaptureWriteStringAsWrite(t *testing.T) {
	gone := errors.New("client gone")
	for _, status := range []int{0, http.StatusOK, http.StatusNoContent} {
		for _, err := range []error{gone, http.ErrBodyNotAllowed, http.ErrContentLength} {
			for _, room := range []int{0, 1, 5, 9, 100} {
				for _, max := range []int{0, 4, 8, 100} {
					name := fmt.Sprintf("status %d, %v after %d, max %d", status, err, room, max)
					writes := []string{"abc", "", "defg", "h", strings.Repeat("i", 10)}
					type result struct {
						N    []int
						Errs []error
						Body []byte
						Gone error
						Over bool
						Code int
						Got  []byte
					}
					run := func(str bool) result {
						w := &takingWriter{h: http.Header{}, room: room, err: err}
						c := newCapture(w, max)
						if status != 0 {
							c.WriteHeader(status)
						}
						var res result
						for _, s := range writes {
							var n int
							var e error
							if str {
								n, e = c.WriteString(s)
							} else {
								n, e = c.Write([]byte(s))
							}
							res.N, res.Errs = append(res.N, n), append(res.Errs, e)
						}
						res.Body, res.Gone, res.Over, res.Code, res.Got = c.body, c.gone, c.overflow, c.status, w.got
						if len(res.Body) == 0 {
							res.Body = nil
						}
						return res
					}
					if a, b := run(false), run(true); !reflect.DeepEqual(a, b) {
						t.Errorf("%s:\nWrite:       %+v\nWriteString: %+v", name, a, b)
					}
				}
			}
		}
	}
}

// snapshot is Header.Clone: equal, nil values nil, empty ones empty, each
// value slice clipped (an append never writes into another's), and none
// shared with h.
func TestCaptureSnapshotAsClone(t *testing.T) {
	many := make([]string, 9)
	for i := range many {
		many[i] = fmt.Sprint(i)
	}
	for _, h := range []http.Header{
		nil,
		{},
		{"Content-Type": {"application/json"}},
		{"A": nil, "B": {}, "C": {"1", "2"}, "D": {"3"}},
		{"Many": many},
		{"A": {"1", "2", "3", "4"}, "B": {"5", "6", "7", "8"}},
		{"A": {"1", "2", "3", "4"}, "B": {"5", "6", "7", "8"}, "C": {"9"}},
	} {
		c := &capture{}
		got, want := c.snapshot(h), h.Clone()
		if !reflect.DeepEqual(got, want) || (got == nil) != (want == nil) {
			t.Errorf("snapshot(%v) = %#v, want %#v", h, got, want)
		}
		for k, vs := range got {
			if (vs == nil) != (h[k] == nil) || cap(vs) != len(vs) {
				t.Errorf("snapshot(%v)[%s] = %#v (cap %d), want a clipped copy of %#v", h, k, vs, cap(vs), h[k])
			}
			if len(vs) > 0 {
				vs[0] = "changed"
				if h[k][0] == "changed" {
					t.Errorf("snapshot(%v)[%s] shares its values with h", h, k)
				}
			}
		}
	}
}
