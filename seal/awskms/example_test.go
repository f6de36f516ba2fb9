package awskms_test

import (
	"context"
	"log"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/memstore"
	"github.com/idemkit/idem/seal"
	"github.com/idemkit/idem/seal/awskms"
)

// A Guard that seals its records with data keys of a KMS key, reading
// AWS_REGION, AWS_ENDPOINT_URL (or AWS_ENDPOINT_URL_KMS) and the
// credentials as the AWS SDK does. (Not run: it needs a KMS.)
func ExampleOpen() {
	ctx := context.Background()
	s, err := awskms.Open(ctx, "arn:aws:kms:eu-west-1:111122223333:key/1234abcd-12ab-34cd-56ef-1234567890ab", awskms.Options{})
	if err != nil {
		log.Fatal(err) // one line: the key, and what KMS said
	}
	guard, err := idem.New(memstore.New(memstore.Options{}), idem.Config{Seal: s})
	if err != nil {
		log.Fatal(err)
	}
	_ = guard
}

// Moving from a key ring to KMS: new records are sealed with KMS data
// keys, and those the ring sealed still open.
func ExampleOpen_fromRing() {
	ctx := context.Background()
	ring, err := seal.RingFromFile("/etc/idem/seal.keys")
	if err != nil {
		log.Fatal(err)
	}
	kms, err := awskms.Open(ctx, "alias/idem", awskms.Options{})
	if err != nil {
		log.Fatal(err)
	}
	cfg := idem.Config{Seal: seal.Combine(kms, ring)}
	_ = cfg
}
