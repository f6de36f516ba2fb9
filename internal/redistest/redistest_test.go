package redistest

import (
	"os"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/redisserver"
	"github.com/idemkit/idem/redisstore"
)

var srv *redisserver.Server

func TestMain(m *testing.M) { os.Exit(Run(m, &srv)) }

func TestRunStartsTheServer(t *testing.T) {
	if srv == nil {
		t.Fatal("Run did not set srv")
	}
	if pong, err := srv.Do("PING"); err != nil || pong != "PONG" {
		t.Fatalf("PING: %q, %v", pong, err)
	}
}

func TestPrefix(t *testing.T) {
	a, b := Prefix("x"), Prefix("x")
	if a == b {
		t.Fatalf("Prefix returned %q twice", a)
	}
	re := regexp.MustCompile(`^idem:x:[A-Za-z0-9]{8}:[0-9]+:$`)
	for _, p := range []string{a, b} {
		if !re.MatchString(p) {
			t.Errorf("Prefix(%q) = %q, want idem:x:RUN:N:", "x", p)
		}
	}
}

func TestStore(t *testing.T) {
	key, err := idem.Scope{Route: t.Name()}.Key("k1")
	if err != nil {
		t.Fatal(err)
	}
	ctx := t.Context()

	// Two stores with the default prefix: what one claims, the other does
	// not see.
	first, second := Store(t, srv, redisstore.Options{}), Store(t, srv, redisstore.Options{})
	for name, s := range map[string]*redisstore.Store{"first": first, "second": second} {
		acq, err := s.Acquire(ctx, idem.AcquireRequest{Key: key, Fingerprint: idem.Fingerprint{1}, LeaseID: idem.NewLeaseID(), TTL: time.Minute})
		if err != nil {
			t.Fatal(err)
		}
		if acq.Outcome != idem.Acquired {
			t.Errorf("%s store: Acquire of a key only it knows: %v, want %v", name, acq.Outcome, idem.Acquired)
		}
	}

	// A prefix given is kept.
	p := Prefix("given")
	s := Store(t, srv, redisstore.Options{Prefix: p})
	if name := s.KeyName(key); !strings.HasPrefix(name, p) {
		t.Errorf("KeyName = %q, want it under the given prefix %q", name, p)
	}
}
