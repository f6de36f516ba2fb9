package clients

import (
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"os"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/idemkit/idem/internal/proctest"
	"github.com/idemkit/idem/internal/redisserver"
	"github.com/idemkit/idem/internal/redistest"
)

// rdb is the private redis-server of the Redis targets; every store gets
// its own prefix.
var rdb *redisserver.Server

// runID makes the keys of this run unique, so that a key never meets a
// record or an upstream count of another test.
var runID = rand.Text()[:8]

func TestMain(m *testing.M) {
	code := redistest.Run(m, &rdb)
	proctest.RemoveIdem()
	proctest.RemoveCaddy()
	os.Exit(code)
}

// bodySeq makes every request body of the run unique.
var bodySeq atomic.Int64

// outcomes returns "outcome→status" for every request line of an idem
// proxy's log for the stored key digest, in order.
func outcomes(log, digest string) []string {
	var out []string
	for line := range strings.Lines(log) {
		var rec struct {
			Msg, Key, Outcome string
			Status            int
		}
		if json.Unmarshal([]byte(line), &rec) == nil && rec.Msg == "request" && rec.Key == digest {
			out = append(out, fmt.Sprintf("%s→%d", rec.Outcome, rec.Status))
		}
	}
	return out
}

// randomHex is n random bytes in hex.
func randomHex(n int) string {
	b := make([]byte, n)
	rand.Read(b)
	return hex.EncodeToString(b)
}

// caddyOutcomes returns "outcome→status" for every access log line of a
// Caddy's log (idem-caddy) whose idempotency_key is the stored key digest,
// in order.
func caddyOutcomes(log, digest string) []string {
	var out []string
	for line := range strings.Lines(log) {
		var rec struct {
			Msg     string
			Key     string `json:"idempotency_key"`
			Outcome string `json:"idempotency_outcome"`
			Status  int
		}
		if json.Unmarshal([]byte(line), &rec) == nil && rec.Msg == "handled request" && rec.Key == digest {
			out = append(out, fmt.Sprintf("%s→%d", rec.Outcome, rec.Status))
		}
	}
	return out
}
