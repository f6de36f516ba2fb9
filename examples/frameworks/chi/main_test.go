package main

import (
	"testing"

	"github.com/idemkit/idem/examples/frameworks/internal/routertest"
)

// TestIdempotency runs the shared checks (see internal/routertest) against
// this example's handler, served by httptest on memstore.
func TestIdempotency(t *testing.T) {
	routertest.Run(t, newHandler)
}
