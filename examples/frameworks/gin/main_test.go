package main

import (
	"testing"

	"github.com/gin-gonic/gin"

	"github.com/idemkit/idem/examples/frameworks/internal/routertest"
)

// TestIdempotency runs the shared checks (see internal/routertest) against
// this example's handler, served by httptest on memstore.
func TestIdempotency(t *testing.T) {
	gin.SetMode(gin.TestMode) // no debug route listing
	routertest.Run(t, newHandler)
}
