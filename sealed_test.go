package idem_test

import (
	"bytes"
	"context"
	"encoding/base64"
	"errors"
	"net/http"
	"strings"
	"testing"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/memstore"
	"github.com/idemkit/idem/seal"
)

const canary = "4111 1111 1111 1111"

func testRing(t testing.TB, ids ...string) *seal.Ring {
	t.Helper()
	var lines []string
	for i, id := range ids {
		k := bytes.Repeat([]byte{byte(i + 1)}, seal.KeySize)
		lines = append(lines, id+" "+base64.StdEncoding.EncodeToString(k))
	}
	r, err := seal.ParseRing(strings.Join(lines, "\n"))
	if err != nil {
		t.Fatal(err)
	}
	return r
}

func canaryResponse() *idem.Response {
	return &idem.Response{Status: 201,
		Header: http.Header{"Content-Type": {"application/json"}, "X-Session-Token": {"tok-" + canary}},
		Body:   bytes.Repeat([]byte(`{"card":"`+canary+`"}`), 100)} // compressed
}

func mustGuard(t testing.TB, s idem.Store, cfg idem.Config) *idem.Guard {
	t.Helper()
	g, err := idem.New(s, cfg)
	if err != nil {
		t.Fatal(err)
	}
	return g
}

// storedBytes is what the store holds for key, read through Get.
func storedBytes(t *testing.T, s idem.Store, key idem.Key) (*idem.Response, []byte) {
	t.Helper()
	rec, ok, err := s.Get(context.Background(), key)
	if err != nil || !ok || rec.Response == nil {
		t.Fatalf("Get: %v, %t", err, ok)
	}
	b, err := rec.Response.AppendBinary(nil)
	if err != nil {
		t.Fatal(err)
	}
	return rec.Response, b
}

func TestSealedRoundTrip(t *testing.T) {
	ctx := context.Background()
	s := memstore.New(memstore.Options{})
	ring := testRing(t, "k1")
	g := mustGuard(t, s, idem.Config{Seal: ring})
	key, fp := idem.Key{1}, idem.Fingerprint{1}
	want := canaryResponse()
	runs := 0
	fn := func(context.Context) (*idem.Response, error) { runs++; return want, nil }
	if _, err := g.Do(ctx, key, fp, fn); err != nil {
		t.Fatal(err)
	}
	res, err := g.Do(ctx, key, fp, fn)
	if err != nil || !res.Replayed || runs != 1 {
		t.Fatalf("replay: %+v, %v, runs %d", res, err, runs)
	}
	if r := res.Response; r.Status != 201 || r.Header.Get("X-Session-Token") != "tok-"+canary || !bytes.Equal(r.Body, want.Body) || r.Sealed() {
		t.Errorf("replayed %+v; want the response stored", r)
	}
	carrier, b := storedBytes(t, s, key)
	if !carrier.Sealed() || bytes.Contains(b, []byte(canary)) || bytes.Contains(b, []byte("4111")) {
		t.Errorf("the store holds Sealed %t, canary present %t", carrier.Sealed(), bytes.Contains(b, []byte("4111")))
	}
	if id, ok := ring.KeyID(b); !ok || id != "k1" {
		t.Errorf("KeyID = %q, %t", id, ok)
	}
	if opened, err := idem.OpenResponse(ring, key, fp, carrier); err != nil || opened.Status != 201 {
		t.Errorf("OpenResponse: %v", err)
	}

	// Copied under another key: refused, the work not run.
	key2 := idem.Key{2}
	att, acq, err := g.Begin(ctx, key2, fp)
	if err != nil || acq.Outcome != idem.Acquired {
		t.Fatal(err)
	}
	if err := att.Complete(ctx, carrier); err != nil {
		t.Fatal(err)
	}
	_, err = g.Do(ctx, key2, fp, fn)
	var se *idem.SealError
	if !errors.As(err, &se) || !errors.Is(err, idem.ErrUnsealable) || se.Key != key2 || se.KeyID != "k1" || runs != 1 {
		t.Errorf("copied record: %v (runs %d); want a SealError naming k1", err, runs)
	}

	// Rotated away: the id named.
	g2 := mustGuard(t, s, idem.Config{Seal: testRing(t, "k9")})
	if _, err := g2.Do(ctx, key, fp, fn); !errors.As(err, &se) || se.KeyID != "k1" || !errors.Is(err, seal.ErrUnknownKey) || !strings.Contains(err.Error(), "k1") || runs != 1 {
		t.Errorf("unknown key: %v", err)
	}
	// No Sealer.
	g3 := mustGuard(t, s, idem.Config{})
	if _, err := g3.Do(ctx, key, fp, fn); !errors.Is(err, idem.ErrUnsealable) || !strings.Contains(err.Error(), "Config.Seal") || runs != 1 {
		t.Errorf("no sealer: %v", err)
	}
}

func TestSealedTampered(t *testing.T) {
	ctx := context.Background()
	s := memstore.New(memstore.Options{})
	g := mustGuard(t, s, idem.Config{Seal: testRing(t, "k1")})
	key, fp := idem.Key{1}, idem.Fingerprint{1}
	if _, err := g.Do(ctx, key, fp, func(context.Context) (*idem.Response, error) { return canaryResponse(), nil }); err != nil {
		t.Fatal(err)
	}
	_, b := storedBytes(t, s, key)
	b[len(b)-20] ^= 1
	var flipped idem.Response
	if err := flipped.UnmarshalBinary(b); err != nil {
		t.Fatal(err)
	}
	key2 := idem.Key{2}
	att, _, err := g.Begin(ctx, key2, fp)
	if err != nil {
		t.Fatal(err)
	}
	// Stored under key2 as is; it would not open there anyway, so open it
	// under key with OpenResponse.
	att.Complete(ctx, &flipped)
	if _, err := idem.OpenResponse(testRing(t, "k1"), key, fp, &flipped); !errors.Is(err, seal.ErrTampered) {
		t.Errorf("flipped byte: %v", err)
	}
	// Another fingerprint on the same key: mismatch, as before.
	if _, err := g.Do(ctx, key, idem.Fingerprint{9}, nil); !errors.Is(err, idem.ErrMismatch) {
		t.Errorf("other fingerprint: %v", err)
	}
	if _, err := idem.OpenResponse(testRing(t, "k1"), key, idem.Fingerprint{9}, mustCarrier(t, s, key)); !errors.Is(err, idem.ErrUnsealable) {
		t.Errorf("other fingerprint: %v", err)
	}
}

func mustCarrier(t *testing.T, s idem.Store, key idem.Key) *idem.Response {
	r, _ := storedBytes(t, s, key)
	return r
}

func TestSealingOverClearAndOpenOnly(t *testing.T) {
	ctx := context.Background()
	s := memstore.New(memstore.Options{})
	ring := testRing(t, "k1")
	fn := func(context.Context) (*idem.Response, error) { return canaryResponse(), nil }
	fp := idem.Fingerprint{1}
	if _, err := mustGuard(t, s, idem.Config{}).Do(ctx, idem.Key{1}, fp, fn); err != nil {
		t.Fatal(err)
	}
	g := mustGuard(t, s, idem.Config{Seal: ring})
	if res, err := g.Do(ctx, idem.Key{1}, fp, nil); err != nil || !res.Replayed || res.Response.Status != 201 {
		t.Errorf("clear record under sealing: %+v, %v", res, err)
	}
	if _, err := g.Do(ctx, idem.Key{2}, fp, fn); err != nil {
		t.Fatal(err)
	}
	oo := mustGuard(t, s, idem.Config{Seal: ring, SealOpenOnly: true})
	if _, err := oo.Do(ctx, idem.Key{3}, fp, fn); err != nil {
		t.Fatal(err)
	}
	if r, b := storedBytes(t, s, idem.Key{3}); r.Sealed() || !bytes.Contains(b, []byte("X-Session-Token")) {
		t.Errorf("OpenOnly stored a sealed record")
	}
	if res, err := oo.Do(ctx, idem.Key{2}, fp, nil); err != nil || res.Response.Status != 201 {
		t.Errorf("OpenOnly replay of a sealed record: %v", err)
	}
}

func TestStoredSealsTheSameBytes(t *testing.T) {
	ctx := context.Background()
	s := memstore.New(memstore.Options{})
	g := mustGuard(t, s, idem.Config{Seal: testRing(t, "k1")})
	att, _, err := g.Begin(ctx, idem.Key{1}, idem.Fingerprint{1})
	if err != nil {
		t.Fatal(err)
	}
	defer att.Release(ctx)
	a, _ := att.Stored(canaryResponse()).AppendBinary(nil)
	b, _ := att.Stored(canaryResponse()).AppendBinary(nil)
	if !bytes.Equal(a, b) || a[0] != idem.SealedMark {
		t.Errorf("two Stored of one content encode differently")
	}
	cut := *att.Stored(canaryResponse())
	cut.Body, cut.BodyOmitted = nil, true
	c, _ := cut.AppendBinary(nil)
	if bytes.Equal(c, a) || len(c) >= len(a) {
		t.Errorf("a copy with its body cut sealed the original content")
	}
	// The same response encoded again is not encoded anew; a copy of it
	// encoded after it (a store cutting the body of what it was given)
	// still is.
	orig := att.Stored(canaryResponse())
	o1, _ := orig.AppendBinary(nil)
	cut2 := *orig
	cut2.Body, cut2.BodyOmitted = nil, true
	c2, _ := cut2.AppendBinary(nil)
	o2, _ := orig.AppendBinary(nil)
	if !bytes.Equal(o1, a) || !bytes.Equal(o2, a) || !bytes.Equal(c2, c) {
		t.Errorf("encoding the same response, then a cut copy, then it again gave other bytes")
	}
}

func TestSealedFinishMany(t *testing.T) {
	ctx := context.Background()
	s := memstore.New(memstore.Options{})
	g := mustGuard(t, s, idem.Config{Seal: testRing(t, "k1")})
	begun := g.BeginMany(ctx, []idem.BeginRequest{{Key: idem.Key{1}, Fingerprint: idem.Fingerprint{1}}, {Key: idem.Key{2}, Fingerprint: idem.Fingerprint{2}}})
	var fs []idem.Finish
	for _, b := range begun {
		fs = append(fs, idem.Finish{Attempt: b.Attempt, Response: canaryResponse()})
	}
	for _, err := range g.FinishMany(ctx, fs) {
		if err != nil {
			t.Fatal(err)
		}
	}
	for _, k := range []idem.Key{{1}, {2}} {
		if r, b := storedBytes(t, s, k); !r.Sealed() || bytes.Contains(b, []byte("4111")) {
			t.Errorf("FinishMany stored %x in clear", k)
		}
	}
	again := g.BeginMany(ctx, []idem.BeginRequest{{Key: idem.Key{1}, Fingerprint: idem.Fingerprint{1}}, {Key: idem.Key{2}, Fingerprint: idem.Fingerprint{1}}})
	if again[0].Err != nil || again[0].Acquisition.Response.Status != 201 {
		t.Errorf("BeginMany replay: %v", again[0].Err)
	}
}
