package engine

import "github.com/idemkit/idem"

// KeyError is a ParseKey error of idemhttp or idemgrpc: a missing key
// (errors.Is idem.ErrMissingKey) or an invalid one (idem.ErrInvalidKey),
// never both.
type KeyError struct {
	Pkg     string // "idemhttp" or "idemgrpc": the message's prefix
	Why     string // the message without it
	Missing bool
}

func (e *KeyError) Error() string { return e.Pkg + ": " + e.Why }

func (e *KeyError) Is(target error) bool {
	if e.Missing {
		return target == idem.ErrMissingKey
	}
	return target == idem.ErrInvalidKey
}
