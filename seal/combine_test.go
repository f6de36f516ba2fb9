package seal_test

import (
	"bytes"
	"encoding/base64"
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/seal"
)

func ringOf(t *testing.T, lines ...string) *seal.Ring {
	t.Helper()
	var text []string
	for i, id := range lines {
		text = append(text, id+" "+base64.StdEncoding.EncodeToString(bytes.Repeat([]byte{byte(i + 10*len(id))}, seal.KeySize)))
	}
	r, err := seal.ParseRing(strings.Join(text, "\n"))
	if err != nil {
		t.Fatal(err)
	}
	return r
}

// xorSealer is a Sealer of another envelope (0xFF 'X'), which no Ring
// recognises: it stands for a Sealer of another kind (AWS KMS).
type xorSealer struct{ opens int }

func (x *xorSealer) Seal(dst, p, ad []byte) ([]byte, error) {
	dst = append(dst, 0xFF, 'X')
	for _, c := range p {
		dst = append(dst, c^0x5A)
	}
	return dst, nil
}

func (x *xorSealer) Open(dst, s, ad []byte) ([]byte, error) {
	x.opens++
	if !bytes.HasPrefix(s, []byte{0xFF, 'X'}) {
		return dst, errors.New("xor: not mine")
	}
	for _, c := range s[2:] {
		dst = append(dst, c^0x5A)
	}
	return dst, nil
}

func (x *xorSealer) KeyID(s []byte) (string, bool) {
	return "xor", bytes.HasPrefix(s, []byte{0xFF, 'X'})
}

func TestCombine(t *testing.T) {
	old := ringOf(t, "k1")
	x := &xorSealer{}
	c := seal.Combine(x, old)
	ad := []byte("ad")
	byOld, _ := old.Seal(nil, []byte("old"), ad)
	byNew, err := c.Seal(nil, []byte("new"), ad)
	if err != nil || !bytes.HasPrefix(byNew, []byte{0xFF, 'X'}) {
		t.Fatalf("Combine(x, ring).Seal = %x, %v; want the writer's envelope", byNew, err)
	}
	for want, v := range map[string][]byte{"old": byOld, "new": byNew} {
		if got, err := c.Open(nil, v, ad); err != nil || string(got) != want {
			t.Errorf("Open(%s value) = %q, %v", want, got, err)
		}
	}
	// The ring's value never went to the xor Sealer, which does not
	// recognise it.
	x.opens = 0
	c.Open(nil, byOld, ad)
	if x.opens != 0 {
		t.Errorf("the writer was asked to open a value it does not recognise")
	}
	if id, ok := c.KeyID(byOld); !ok || id != "k1" {
		t.Errorf("KeyID(ring value) = %q, %t; want k1", id, ok)
	}
	if id, ok := c.KeyID(byNew); !ok || id != "xor" {
		t.Errorf("KeyID(writer's value) = %q, %t; want xor", id, ok)
	}
	if id, ok := c.KeyID([]byte{0x04}); ok {
		t.Errorf("KeyID(clear record) = %q, true", id)
	}
	// Altered: the ring's error, not a later Sealer's.
	bad := bytes.Clone(byOld)
	bad[len(bad)-1] ^= 1
	if _, err := c.Open(nil, bad, ad); !errors.Is(err, seal.ErrTampered) || !strings.Contains(err.Error(), "k1") {
		t.Errorf("Open(altered ring value): %v; want ErrTampered under k1", err)
	}
	// Recognised by none.
	if _, err := c.Open(nil, []byte{0xFF, 'Q', 1}, ad); !errors.Is(err, seal.ErrTampered) {
		t.Errorf("Open(unknown envelope): %v; want ErrTampered", err)
	}

	// Two rings: the first recognises every ring envelope but holds only
	// its keys; ErrUnknownKey moves on to the next.
	a, b := ringOf(t, "ka"), ringOf(t, "kbb")
	ab := seal.Combine(a, b)
	byB, _ := b.Seal(nil, []byte("b"), ad)
	if got, err := ab.Open(nil, byB, ad); err != nil || string(got) != "b" {
		t.Errorf("Combine(ring a, ring b).Open(b's value) = %q, %v", got, err)
	}
	byC, _ := ringOf(t, "kc").Seal(nil, []byte("c"), ad)
	if _, err := ab.Open(nil, byC, ad); !errors.Is(err, seal.ErrUnknownKey) || !strings.Contains(err.Error(), "kc") {
		t.Errorf("Open of a key neither ring holds: %v; want ErrUnknownKey naming kc", err)
	}

	if s := fmt.Sprintf("%v %#v", ab, ab); !strings.Contains(s, "primary ka") || !strings.Contains(s, "primary kbb") {
		t.Errorf("Combine prints as %q; want both rings named", s)
	}
	if s := fmt.Sprint(c); !strings.Contains(s, "*seal_test.xorSealer") {
		t.Errorf("Combine of a Sealer without String prints as %q; want its type", s)
	}
	for _, f := range []func(){func() { seal.Combine(nil) }, func() { seal.Combine(a, nil) }} {
		func() {
			defer func() {
				if recover() == nil {
					t.Error("Combine with a nil Sealer did not panic")
				}
			}()
			f()
		}()
	}
	var _ idem.Sealer = c
}
