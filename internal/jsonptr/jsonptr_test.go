package jsonptr

import (
	"encoding/json"
	"errors"
	"slices"
	"testing"
)

func TestParse(t *testing.T) {
	for _, c := range []struct {
		in   string
		want []string
	}{
		{"", nil},
		{"/", []string{""}},
		{"/a~1b/~0c", []string{"a/b", "~c"}},
		{"/~01", []string{"~1"}}, // RFC 6901 §4: ~0 last, not "/"
		{"/0/-", []string{"0", "-"}},
	} {
		p, err := Parse(c.in)
		if err != nil || !slices.Equal(p.Tokens(), c.want) || p.String() != c.in {
			t.Errorf("%q: got %q, %v; want %q", c.in, p.Tokens(), err, c.want)
		}
	}
	for _, in := range []string{"a", "/~", "/~2", "/a~/b"} {
		if _, err := Parse(in); err == nil {
			t.Errorf("%q: got no error", in)
		}
	}
}

// The examples of RFC 6901 §5.
func TestFindRFCExamples(t *testing.T) {
	doc := []byte(`{"foo": ["bar", "baz"], "": 0, "a/b": 1, "c%d": 2, "e^f": 3, "g|h": 4, "i\\j": 5, "k\"l": 6, " ": 7, "m~n": 8}`)
	for in, want := range map[string]string{
		"/foo/0": `"bar"`, "/": `0`, "/a~1b": `1`, "/c%d": `2`, "/e^f": `3`, "/g|h": `4`,
		`/i\j`: `5`, `/k"l`: `6`, "/ ": `7`, "/m~0n": `8`,
	} {
		p, _ := Parse(in)
		got, err := Find(doc, p)
		if err != nil || string(got) != want {
			t.Errorf("%q: got %s, %v; want %s", in, got, err, want)
		}
	}
	p, _ := Parse("/foo/2")
	if _, err := Find(doc, p); !errors.Is(err, ErrNotFound) {
		t.Errorf("/foo/2: got %v, want ErrNotFound", err)
	}
	if _, err := Find([]byte(`{"foo":1} {}`), Pointer{}); !errors.Is(err, ErrNotJSON) {
		t.Errorf("two values: got %v, want ErrNotJSON", err)
	}
}

func TestRemove(t *testing.T) {
	v, _ := Decode([]byte(`{"a":{"b":[1,2,3]},"c":1}`))
	var ps []Pointer
	for _, s := range []string{"/a/b/1", "/c", "/nope/x", "/a/b/9", "/a/b/2", "/a/b/1"} {
		p, _ := Parse(s)
		ps = append(ps, p)
	}
	v, _ = RemoveAll(v, ps...)
	// /a/b/2 is the 3 of the document as given, not what is left at 2.
	if got, _ := json.Marshal(v); string(got) != `{"a":{"b":[1]}}` {
		t.Errorf("got %s, want {\"a\":{\"b\":[1]}}", got)
	}
	if v, ok := RemoveAll(v, Pointer{}); v != nil || ok {
		t.Errorf(`"": got %v, %v; want nil, false`, v, ok)
	}
}
