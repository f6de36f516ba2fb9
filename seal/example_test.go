package seal_test

import (
	"crypto/rand"
	"encoding/base64"
	"fmt"
	"log"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"

	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/memstore"
	"github.com/idemkit/idem/seal"
)

// ExampleRingFromFile seals every response an idemhttp middleware stores
// with the key ring of a file (one "ID BASE64" line per key, the first the
// primary), as docs/security.md shows.
func ExampleRingFromFile() {
	dir, err := os.MkdirTemp("", "ring")
	if err != nil {
		log.Fatal(err)
	}
	defer os.RemoveAll(dir)
	key := make([]byte, seal.KeySize)
	rand.Read(key)
	path := filepath.Join(dir, "seal.keys")
	if err := os.WriteFile(path, []byte("k1 "+base64.StdEncoding.EncodeToString(key)+"\n"), 0o600); err != nil {
		log.Fatal(err)
	}
	store := memstore.New(memstore.Options{})

	ring, err := seal.RingFromFile(path) // or seal.RingFromEnv
	if err != nil {
		log.Fatal(err) // one line, naming the file and the line; never a key
	}
	mw := idemhttp.Middleware(store, idemhttp.Config{Seal: ring})

	h := mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusCreated)
		fmt.Fprint(w, `{"card":"4111 1111 1111 1111"}`)
	}))
	for range 2 {
		req := httptest.NewRequest("POST", "/payments", strings.NewReader(`{}`))
		req.Header.Set("Idempotency-Key", "order-1")
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, req)
		fmt.Println(rec.Code, rec.Header().Get("Idempotent-Replayed"), rec.Body.String())
	}
	fmt.Println(ring.Primary(), ring.Len())
	// Output:
	// 201  {"card":"4111 1111 1111 1111"}
	// 201 true {"card":"4111 1111 1111 1111"}
	// k1 1
}
