package idemgrpc

import (
	"context"
	"fmt"

	"google.golang.org/grpc/metadata"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/engine"
)

// MetadataKey is the request metadata that carries the idempotency key.
const MetadataKey = "idempotency-key"

// MetadataReplayed is set to "true" in the response header metadata of a
// replay.
const MetadataReplayed = "idempotent-replayed"

// MetadataBodyOmitted is set to "true" in the response header metadata of a
// replay whose response was larger than Config.MaxResponseSize when it was
// first produced and was not stored.
const MetadataBodyOmitted = "idempotent-replay-body-omitted"

// errKeyMissing reports a call without a key: it wraps idem.ErrMissingKey,
// not idem.ErrInvalidKey.
var errKeyMissing error = &engine.KeyError{Pkg: "idemgrpc", Why: "no idempotency key", Err: idem.ErrMissingKey}

// ParseKey returns the client key of an incoming call: the single value of
// its idempotency-key metadata, valid by idem.ValidateKey (1 to 255
// printable ASCII characters, 0x20 to 0x7E: the rule of idemhttp's quoted
// form). A call without the metadata gives an error that wraps
// idem.ErrMissingKey; everything else wrong (two values, an empty value, a
// control or non-ASCII byte, the length) wraps idem.ErrInvalidKey.
func ParseKey(ctx context.Context) (string, error) {
	vs := metadata.ValueFromIncomingContext(ctx, MetadataKey)
	switch len(vs) {
	case 0:
		return "", errKeyMissing
	case 1:
	default:
		return "", invalidKey(fmt.Sprintf("%d idempotency-key values; send exactly one", len(vs)))
	}
	return vs[0], validate(vs[0])
}

// validate is idem.ValidateKey, its error wrapped in an *engine.KeyError
// (the package's prefix, then idem's message). It applies to keys from
// metadata and from Config.Key alike.
func validate(key string) error {
	if err := idem.ValidateKey(key); err != nil {
		return &engine.KeyError{Pkg: "idemgrpc", Err: err}
	}
	return nil
}

func invalidKey(why string) error {
	return &engine.KeyError{Pkg: "idemgrpc", Why: why, Err: idem.ErrInvalidKey}
}
