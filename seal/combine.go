package seal

import (
	"errors"
	"fmt"
	"strings"
)

// Sealer is Sealer's method set, written out so that package seal
// does not import package idem (whose tests use seal): every Sealer
// is a Sealer, and the other way round.
type Sealer interface {
	Seal(dst, plaintext, ad []byte) ([]byte, error)
	Open(dst, sealed, ad []byte) ([]byte, error)
	KeyID(sealed []byte) (string, bool)
}

// Combine returns a Sealer that seals with writer and opens a value with
// the first of writer, then readers in order, whose KeyID recognises it
// (its envelope): moving from a key ring to AWS KMS (or back) is
// Combine(kmsSealer, ring), and records the ring sealed still open until
// retention has removed them. Where a Sealer that recognises the value
// answers ErrUnknownKey (a ring without that key id), the next one that
// recognises it is tried; a value none recognises is an error wrapping
// ErrTampered. KeyID is that of the first Sealer that recognises the
// value. It panics when writer or a reader is nil.
func Combine(writer Sealer, readers ...Sealer) Sealer {
	all := append([]Sealer{writer}, readers...)
	for i, s := range all {
		if s == nil {
			if i == 0 {
				panic("seal: Combine with a nil writer")
			}
			panic(fmt.Sprintf("seal: Combine with reader %d nil", i))
		}
	}
	return &combined{all: all}
}

type combined struct {
	all []Sealer // the writer first
}

func (c *combined) Seal(dst, plaintext, ad []byte) ([]byte, error) {
	return c.all[0].Seal(dst, plaintext, ad)
}

func (c *combined) Open(dst, sealed, ad []byte) ([]byte, error) {
	var unknown error
	for _, s := range c.all {
		if _, ok := s.KeyID(sealed); !ok {
			continue
		}
		out, err := s.Open(dst, sealed, ad)
		if err == nil {
			return out, nil
		}
		if !errors.Is(err, ErrUnknownKey) {
			return dst, err
		}
		if unknown == nil {
			unknown = err
		}
	}
	if unknown != nil {
		return dst, unknown
	}
	return dst, fmt.Errorf("%w: not a sealed value of any of the combined Sealers (%s)", ErrTampered, c)
}

func (c *combined) KeyID(sealed []byte) (string, bool) {
	for _, s := range c.all {
		if id, ok := s.KeyID(sealed); ok {
			return id, true
		}
	}
	return "", false
}

// String names the Sealers (by their String, or else their type: never
// their fields, which may hold keys).
func (c *combined) String() string {
	names := make([]string, len(c.all))
	for i, s := range c.all {
		if st, ok := s.(fmt.Stringer); ok {
			names[i] = st.String()
		} else {
			names[i] = fmt.Sprintf("%T", s)
		}
	}
	if len(names) == 1 {
		return "sealing and opening with " + names[0]
	}
	return "sealing with " + names[0] + "; opening also with " + strings.Join(names[1:], ", ")
}

// GoString is String.
func (c *combined) GoString() string { return c.String() }
