package main

import (
	"context"
	"io"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/idemkit/idem"
)

// The case: a proxy on redis://host/1 writes a blob; idem gc
// --store redis://host/0 (the wrong database, same prefix) must judge none
// of it, with or without --dry-run, and say why. A blob written by v1.0
// (named with the prefix alone, which cannot tell databases apart) is left
// alone by gc on either database, and still replays.
func TestGCWrongDatabase(t *testing.T) {
	ctx := context.Background()
	redis := proxyRedis(t)
	db1 := "redis://" + redis.Addr() + "/1"
	db0 := "redis://" + redis.Addr() + "/0"
	bb := newBlobBackend(t, "file")
	up := newBigUpstream(t)
	p := startBlobProxy(t, "--upstream", up.URL, "--store", db1, "--blob", bb.url)
	wantWhole(t, "first", fetch(t, p.base(), "live", 5*mib), "live", 5*mib)
	store1 := openPrefixed(t, db1, "")
	live := completedBlob(t, store1, "live")
	ns1 := store1.(idem.Namespacer).Namespace()
	if !strings.Contains(p.LogText(), `"store":"`+db1+`"`) {
		t.Errorf("the start-up log does not name the database:\n%s", p.LogText())
	}

	// A record of v1.0: its blob named with v1.0's namespace, the prefix
	// alone. Made from the proxy's own record of "old" (same fingerprint).
	wantWhole(t, "old, first", fetch(t, p.base(), "old", 2*mib), "old", 2*mib)
	oldName := completedBlob(t, store1, "old")
	rec, _, err := store1.Get(ctx, storedKey("old"))
	if err != nil {
		t.Fatal(err)
	}
	legacyNS := store1.(interface{ LegacyNamespace() string }).LegacyNamespace()
	if legacyNS != `redis prefix "idem:"` {
		t.Fatalf("LegacyNamespace %q, want v1.0's namespace", legacyNS)
	}
	if _, err := store1.Delete(ctx, storedKey("old")); err != nil {
		t.Fatal(err)
	}
	acq, err := store1.Acquire(ctx, idem.AcquireRequest{Key: storedKey("old"), Fingerprint: rec.Fingerprint, LeaseID: idem.NewLeaseID(), TTL: time.Minute})
	if err != nil || acq.Outcome != idem.Acquired {
		t.Fatalf("acquire old: %v %v", acq.Outcome, err)
	}
	legacy := *rec.Response.Blob
	legacy.Name = idem.NewBlobName(legacyNS, acq.Lease)
	copyBlob(t, bb, oldName, legacy.Name)
	resp := *rec.Response
	resp.Blob = &legacy
	if err := store1.Complete(ctx, acq.Lease, &resp, time.Hour); err != nil {
		t.Fatal(err)
	}
	if err := bb.open.Delete(ctx, oldName); err != nil {
		t.Fatal(err)
	}
	all := []string{live, legacy.Name}
	slices.Sort(all)

	for _, dry := range []bool{true, false} {
		args := []string{"--store", db0, "--blob", bb.url}
		if dry {
			args = append(args, "--dry-run")
		}
		res := runGCJSON(t, args...)
		if res.Orphans != 0 || res.Kept != 0 || res.Other != 1 || res.OtherNamespaces[idem.BlobNamespace(ns1)] != 1 || res.Legacy != 1 {
			t.Errorf("idem gc %q: %+v; want nothing deleted or kept, db1's blob left as another namespace and the v1.0 blob as legacy", args, res)
		}
		if got := bb.names(t); !slices.Equal(got, all) {
			t.Fatalf("after idem gc %q: %v, want every blob still there: %v", args, got, all)
		}
	}
	code, out := runIdemOut(t, "gc", "--store", db0, "--blob", bb.url, "--min-age", "0")
	for _, want := range []string{"deleted 0 orphans", "left alone: 1 blobs of 1 other namespaces", "left alone: 1 blobs of namespace", "written by idem v1.0"} {
		if code != 0 || !strings.Contains(out, want) {
			t.Errorf("idem gc on db0: exit %d, want %q in\n%s", code, want, out)
		}
	}
	// The right database keeps its live blob, and leaves the v1.0 one.
	res := runGCJSON(t, "--store", db1, "--blob", bb.url)
	if res.Orphans != 0 || res.Kept != 1 || res.Legacy != 1 || res.Namespace != ns1 {
		t.Errorf("idem gc on db1: %+v; want 1 kept, 1 legacy, nothing deleted", res)
	}
	if got := bb.names(t); !slices.Equal(got, all) {
		t.Fatalf("after idem gc on db1: %v, want %v", got, all)
	}
	wantWhole(t, "the replay after idem gc", fetch(t, p.base(), "live", 5*mib), "live", 5*mib)
	wantWhole(t, "the replay of v1.0's blob", fetch(t, p.base(), "old", 2*mib), "old", 2*mib)
	if up.runsOf("live") != 1 || up.runsOf("old") != 1 {
		t.Errorf("the upstream ran live %d times, old %d; want once each", up.runsOf("live"), up.runsOf("old"))
	}
	// Databases have their own store ids: their namespaces differ.
	if ns0 := openPrefixed(t, db0, "").(idem.Namespacer).Namespace(); ns0 == ns1 {
		t.Errorf("db0 and db1 have one namespace %q", ns0)
	}
}

// copyBlob copies the blob from to a new blob to.
func copyBlob(t *testing.T, bb *blobBackend, from, to string) {
	t.Helper()
	ctx := context.Background()
	r, _, err := bb.open.Open(ctx, from)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	w, err := bb.open.Create(ctx, to)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := io.Copy(w, r); err != nil {
		t.Fatal(err)
	}
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
}
