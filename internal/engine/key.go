package engine

import "github.com/idemkit/idem"

// KeyError is a ParseKey error of idemhttp or idemgrpc. Err is
// idem.ErrMissingKey for a missing key, else idem.ErrInvalidKey or an error
// that wraps it (idem.ValidateKey's): errors.Is tells them apart.
type KeyError struct {
	Pkg string // "idemhttp" or "idemgrpc": the message's prefix
	Why string // what is wrong; "" when Err says it
	Err error
}

func (e *KeyError) Error() string { return e.Pkg + ": " + e.Text() }

// Text is the message without the package's prefix: Why, followed by Err
// in parentheses when Err says more than the sentinel; Err alone without
// a Why.
func (e *KeyError) Text() string {
	switch {
	case e.Why == "":
		return e.Err.Error()
	case e.Err == idem.ErrMissingKey || e.Err == idem.ErrInvalidKey:
		return e.Why
	}
	return e.Why + " (" + e.Err.Error() + ")"
}

func (e *KeyError) Unwrap() error { return e.Err }
