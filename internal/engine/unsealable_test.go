package engine

import (
	"bytes"
	"errors"
	"log/slog"
	"strings"
	"sync"
	"testing"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/sealtest"
	"github.com/idemkit/idem/memstore"
)

// logBuf is a concurrency-safe log sink.
type logBuf struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *logBuf) Write(p []byte) (int, error) { l.mu.Lock(); defer l.mu.Unlock(); return l.b.Write(p) }
func (l *logBuf) String() string              { l.mu.Lock(); defer l.mu.Unlock(); return l.b.String() }

func sealedEngine(t *testing.T, store idem.Store, cfg Config, logs *logBuf) *Engine {
	t.Helper()
	cfg.Name = "idemtest"
	cfg.Logger = slog.New(slog.NewTextHandler(logs, nil))
	e, err := New(store, cfg)
	if err != nil {
		t.Fatal(err)
	}
	return e
}

// A completed record whose sealed response does not open (under a key id
// not in the ring, altered by one byte, read without a Sealer) is
// OutcomeUnsealable: not a store error (FailOpen would run it again), not
// a replay of sealed bytes, never a run; logged at ERROR with the key and
// the key id. Fallback opens what it reads with Get.
func TestAcquireUnsealable(t *testing.T) {
	store := sharedStore{memstore.New(memstore.Options{})} // Fallback's look-up included
	ringA := sealtest.Ring(t, "a1")
	var logs logBuf
	a := sealedEngine(t, store, Config{Seal: ringA}, &logs)
	ctx := t.Context()
	fp := idem.Fingerprint{1}
	put := func(e *Engine, k idem.Key, fp idem.Fingerprint, body string) {
		t.Helper()
		d := e.Acquire(ctx, ctx, k, fp, "")
		if d.Outcome != OutcomeExecuted {
			t.Fatalf("store %s: %+v", body, d)
		}
		w := e.Start(d, nil)
		if err := w.Complete(&idem.Response{Status: 201, Body: []byte(body)}); err != nil {
			t.Fatal(err)
		}
		w.End()
	}
	k := key(t, "k")
	put(a, k, fp, "secret")
	if d := a.Acquire(ctx, ctx, k, fp, ""); d.Outcome != OutcomeReplayed || string(d.Response.Body) != "secret" {
		t.Fatalf("ring A: %+v, want the replay", d)
	}

	check := func(name string, d Decision, keyID string) {
		t.Helper()
		var se *idem.SealError
		if d.Outcome != OutcomeUnsealable || !errors.As(d.Err, &se) || se.KeyID != keyID || d.Attempt != nil || d.Response != nil {
			t.Errorf("%s: got %+v, want unsealable with a SealError naming %q", name, d, keyID)
		}
		line := ""
		for l := range strings.Lines(logs.String()) {
			if strings.Contains(l, "cannot be opened") {
				line = l
			}
		}
		if !strings.Contains(line, "level=ERROR") || !strings.Contains(line, "key_id="+keyID) || !strings.Contains(line, "key="+k.String()) ||
			strings.Contains(line, "secret") {
			t.Errorf("%s: log line %q; want an ERROR naming the key and key_id=%s, without content", name, line, keyID)
		}
		logs.mu.Lock()
		logs.b.Reset()
		logs.mu.Unlock()
	}
	// Ring B does not hold a1; FailOpen changes nothing; nor does a wait.
	b := sealedEngine(t, store, Config{Seal: sealtest.Ring(t, "b1"), FailOpen: true, Wait: DefaultWait}, &logs)
	check("unknown key id", b.Acquire(ctx, ctx, k, fp, "POST /pay"), "a1")
	none := sealedEngine(t, store, Config{}, &logs)
	check("no sealer", none.Acquire(ctx, ctx, k, fp, ""), "")
	sealtest.Flip(t, store, k)
	check("a flipped byte", a.Acquire(ctx, ctx, k, fp, ""), "a1")
	if rec, _, _ := store.Get(ctx, k); rec.State != idem.StateCompleted {
		t.Errorf("the record is %v after the refusals, want completed (nothing ran or released it)", rec.State)
	}

	// Fallback: v1.0's record is read with Get, and opened.
	old, now := key(t, "v1"), key(t, "now")
	oldFP := idem.Fingerprint{9}
	put(a, old, oldFP, "v1.0's")
	if d := a.Fallback(ctx, a.Acquire(ctx, ctx, now, fp, ""), now, fp, old, oldFP); d.Outcome != OutcomeReplayed ||
		d.Response.Sealed() || string(d.Response.Body) != "v1.0's" {
		t.Errorf("fallback, ring A: %+v, want the opened replay", d)
	}
	k = old
	check("fallback, unknown key id", b.Fallback(ctx, b.Acquire(ctx, ctx, now, fp, ""), now, fp, old, oldFP), "a1")
	if d := b.Acquire(ctx, ctx, now, fp, ""); d.Outcome != OutcomeExecuted {
		t.Errorf("today's key after the fallback: %+v, want it released (executed)", d)
	} else {
		b.Release(ctx, d.Attempt)
	}
}
