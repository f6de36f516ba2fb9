package idemgrpc

import (
	"context"
	"errors"
	"fmt"

	"google.golang.org/grpc/metadata"

	"github.com/idemkit/idem"
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

// errKeyMissing reports a call without a key; it does not match
// idem.ErrInvalidKey.
var errKeyMissing = errors.New("idemgrpc: no idempotency key")

// ParseKey returns the client key of an incoming call: the single value of
// its idempotency-key metadata, 1 to 255 visible ASCII characters (0x21 to
// 0x7E; no spaces). A call without the metadata gives an error for which
// errors.Is(err, idem.ErrInvalidKey) is false; everything else wrong (two
// values, an empty value, a space, a control or non-ASCII byte, the length)
// wraps idem.ErrInvalidKey.
func ParseKey(ctx context.Context) (string, error) {
	vs := metadata.ValueFromIncomingContext(ctx, MetadataKey)
	switch len(vs) {
	case 0:
		return "", errKeyMissing
	case 1:
	default:
		return "", invalidKey(fmt.Sprintf("%d idempotency-key values; send exactly one", len(vs)))
	}
	return vs[0], ValidateKey(vs[0])
}

// ValidateKey reports whether key is acceptable as an idempotency key: 1 to
// 255 bytes, each visible ASCII (0x21 to 0x7E). It applies to keys from
// metadata and from Config.Key alike. The error wraps idem.ErrInvalidKey.
func ValidateKey(key string) error {
	switch {
	case key == "":
		return invalidKey("empty idempotency key")
	case len(key) > idem.MaxKeyLen:
		return invalidKey(fmt.Sprintf("idempotency key of %d bytes; at most %d are allowed", len(key), idem.MaxKeyLen))
	}
	for i := 0; i < len(key); i++ {
		if c := key[i]; c < 0x21 || c > 0x7E {
			return invalidKey(fmt.Sprintf("idempotency key holds byte 0x%02x at offset %d; only visible ASCII (0x21 to 0x7E) is allowed", c, i))
		}
	}
	return nil
}

func invalidKey(why string) error { return &keyError{why} }

type keyError struct{ why string }

func (e *keyError) Error() string        { return "idemgrpc: " + e.why }
func (e *keyError) Is(target error) bool { return target == idem.ErrInvalidKey }
