package main

// idem gc and the proxy's --blob-sweep judge only the blobs of their own
// store's namespace: a blob written through a store with another --prefix
// (or names from before namespaces) is never deleted by a sweep that cannot
// read its record.

import (
	"context"
	"crypto/sha256"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/blobstore"
	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/internal/proctest"
)

// openPrefixed opens the store at storeURL with prefix, for the test.
func openPrefixed(t *testing.T, storeURL, prefix string) idem.Store {
	t.Helper()
	s, closeStore, err := openStore(context.Background(), storeURL, prefix)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(closeStore)
	return s
}

// completedBlob waits (bounded) for the record of clientKey on POST
// /export in store to be completed with a blob, and returns the blob's name.
func completedBlob(t *testing.T, store idem.Store, clientKey string) string {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		rec, ok, err := store.Get(context.Background(), storedKey(clientKey))
		if err != nil {
			t.Fatal(err)
		}
		if ok && rec.State == idem.StateCompleted && rec.Response != nil && rec.Response.Blob != nil {
			return rec.Response.Blob.Name
		}
		if time.Now().After(deadline) {
			t.Fatalf("record of %s: %+v after 10s, want it completed with a blob", clientKey, rec)
		}
	}
}

// putBlob writes a small blob called name.
func putBlob(t *testing.T, bs idem.BlobStore, name string) idem.BlobRef {
	t.Helper()
	body := []byte("a body of " + name)
	w, err := bs.Create(context.Background(), name)
	if err != nil {
		t.Fatal(err)
	}
	w.Write(body)
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	return idem.BlobRef{Name: name, Size: int64(len(body)), SHA256: sha256.Sum256(body)}
}

// runGCJSON runs idem gc --json with args and returns its result.
func runGCJSON(t *testing.T, args ...string) blobstore.SweepResult {
	t.Helper()
	code, out := runIdemOut(t, append([]string{"gc", "--min-age", "0", "--json"}, args...)...)
	var res blobstore.SweepResult
	if code != 0 || json.Unmarshal([]byte(out), &res) != nil {
		t.Fatalf("idem gc %q: exit %d\n%s", args, code, out)
	}
	return res
}

// The reproduced case: a proxy with --prefix keeps a 5 MiB response in a
// blob. idem gc without --prefix, or with another one, dry run or not,
// leaves it (and every blob of that namespace) alone, and says where they
// came from; with the right --prefix it deletes the orphan of that
// namespace and keeps the live blob. Blobs named without a namespace (as
// before) are always left alone.
func TestGCPrefix(t *testing.T) {
	for _, kind := range []string{"file", "s3"} {
		t.Run(kind, func(t *testing.T) {
			ctx := context.Background()
			redis := proxyRedis(t)
			storeURL := "redis://" + redis.Addr()
			const prefix = "shop:"
			bb := newBlobBackend(t, kind)
			up := newBigUpstream(t)
			p := startBlobProxy(t, "--upstream", up.URL, "--store", storeURL, "--prefix", prefix, "--blob", bb.url)
			wantWhole(t, "first", fetch(t, p.base(), "live", 5*mib), "live", 5*mib)
			store := openPrefixed(t, storeURL, prefix)
			ns := store.(idem.Namespacer).Namespace()
			seg := idem.BlobNamespace(ns)
			if !strings.Contains(p.LogText(), `"blob_namespace":"`+seg) {
				t.Errorf("the proxy did not log its blob namespace %s:\n%s", seg, p.LogText())
			}
			live := completedBlob(t, store, "live")
			if n, ok := idem.ParseBlobName(live); !ok || n.Namespace != seg {
				t.Fatalf("the proxy's blob %s: want it in namespace %s (%s)", live, seg, ns)
			}
			// An orphan of the proxy's namespace: an attempt that never
			// completed.
			orphan := putBlob(t, bb.open, idem.NewBlobName(ns, idem.Lease{Key: storedKey("never"), Token: 7})).Name
			// Names without a namespace, of this store's records: one
			// live, one orphan.
			acq, err := store.Acquire(ctx, idem.AcquireRequest{Key: storedKey("old-live"), LeaseID: idem.NewLeaseID(), TTL: time.Minute})
			if err != nil {
				t.Fatal(err)
			}
			oldLive := putBlob(t, bb.open, idem.NewBlobName("", acq.Lease))
			if err := store.Complete(ctx, acq.Lease, &idem.Response{Status: 201, Blob: &oldLive}, time.Hour); err != nil {
				t.Fatal(err)
			}
			oldOrphan := putBlob(t, bb.open, idem.NewBlobName("", idem.Lease{Key: storedKey("old-never"), Token: 7})).Name
			all := []string{live, orphan, oldLive.Name, oldOrphan}
			slices.Sort(all)
			if got := bb.names(t); !slices.Equal(got, all) {
				t.Fatalf("before idem gc: %v, want %v", got, all)
			}

			for _, wrong := range [][]string{nil, {"--prefix", "other:"}, {"--prefix", "idem:"}} {
				for _, dry := range []bool{true, false} {
					args := append([]string{"--store", storeURL, "--blob", bb.url}, wrong...)
					if dry {
						args = append(args, "--dry-run")
					}
					res := runGCJSON(t, args...)
					if res.Orphans != 0 || res.Kept != 0 || res.Other != 2 || res.OtherNamespaces[seg] != 2 || res.Unqualified != 2 {
						t.Errorf("idem gc %q: %+v; want nothing deleted or kept, 2 blobs of namespace %s and 2 unqualified left alone", args, res, seg)
					}
					if got := bb.names(t); !slices.Equal(got, all) {
						t.Fatalf("after idem gc %q: %v, want every blob still there: %v", args, got, all)
					}
				}
			}
			code, out := runIdemOut(t, "gc", "--store", storeURL, "--blob", bb.url, "--min-age", "0")
			for _, want := range []string{"left alone: 2 blobs of 1 other namespaces (" + seg + ": 2)", "--prefix", "blob_namespace",
				"left alone: 2 blobs without a namespace", "delete them by hand"} {
				if code != 0 || !strings.Contains(out, want) {
					t.Errorf("idem gc without --prefix: exit %d, want %q in\n%s", code, want, out)
				}
			}

			// The right prefix: the orphan of the namespace goes, the live
			// blob stays, the names without a namespace are left.
			right := []string{"--store", storeURL, "--prefix", prefix, "--blob", bb.url}
			res := runGCJSON(t, append(right, "--dry-run")...)
			if res.Orphans != 1 || res.Kept != 1 || res.Unqualified != 2 || res.Other != 0 || res.Namespace != ns {
				t.Errorf("idem gc --prefix %s --dry-run: %+v; want 1 orphan, 1 kept, 2 unqualified", prefix, res)
			}
			if got := bb.names(t); !slices.Equal(got, all) {
				t.Fatalf("after the dry run: %v, want %v", got, all)
			}
			res = runGCJSON(t, right...)
			if res.Orphans != 1 || res.Kept != 1 || res.Unqualified != 2 {
				t.Errorf("idem gc --prefix %s: %+v; want 1 orphan deleted, 1 kept, 2 unqualified", prefix, res)
			}
			want := []string{live, oldLive.Name, oldOrphan}
			slices.Sort(want)
			if got := bb.names(t); !slices.Equal(got, want) {
				t.Errorf("after idem gc --prefix %s: %v, want %v", prefix, got, want)
			}
			// An unknown flag is refused: there is no way to make gc judge
			// the names without a namespace.
			if code, _ := runIdemOut(t, append([]string{"gc", "--unqualified"}, right...)...); code != 2 {
				t.Errorf("idem gc --unqualified: exit %d, want 2", code)
			}
			wantWhole(t, "the replay after idem gc", fetch(t, p.base(), "live", 5*mib), "live", 5*mib)
			if n := up.runsOf("live"); n != 1 {
				t.Errorf("the upstream ran %d times, want 1", n)
			}
		})
	}
}

// Two proxies with different --prefix values share one Redis and one
// blob store; the sweep (--blob-sweep) of one never deletes the other's
// blobs, and still deletes its own expired ones.
func TestProxyBlobSweepTwoPrefixes(t *testing.T) {
	redis := proxyRedis(t)
	storeURL := "redis://" + redis.Addr()
	bb := newBlobBackend(t, "file")
	up := newBigUpstream(t)
	sweeper := startBlobProxy(t, "--upstream", up.URL, "--store", storeURL, "--prefix", "a:", "--blob", bb.url,
		"--retention", "2s", "--blob-sweep", "200ms", "--blob-sweep-min-age", "0")
	other := startBlobProxy(t, "--upstream", up.URL, "--store", storeURL, "--prefix", "b:", "--blob", bb.url)
	wantWhole(t, "b", fetch(t, other.base(), "b", 2*mib), "b", 2*mib)
	bBlob := completedBlob(t, openPrefixed(t, storeURL, "b:"), "b")
	wantWhole(t, "a", fetch(t, sweeper.base(), "a", 2*mib), "a", 2*mib)
	aBlob := completedBlob(t, openPrefixed(t, storeURL, "a:"), "a")
	// a's record expires after 2s, and its sweep deletes its blob.
	for deadline := time.Now().Add(15 * time.Second); ; time.Sleep(100 * time.Millisecond) {
		names := bb.names(t)
		if !slices.Contains(names, aBlob) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("blobs after 15s: %v, want %s swept", names, aBlob)
		}
	}
	// More sweeps, then b's blob is still there and replays whole.
	for n := sweeper.metric(t, `idem_blob_sweeps_total{result="ok"}`); sweeper.metric(t, `idem_blob_sweeps_total{result="ok"}`) < n+3; {
		time.Sleep(100 * time.Millisecond)
	}
	if names := bb.names(t); !slices.Equal(names, []string{bBlob}) {
		t.Errorf("after the sweeps: %v, want only the other proxy's blob %s", names, bBlob)
	}
	wantWhole(t, "the other proxy's replay", fetch(t, other.base(), "b", 2*mib), "b", 2*mib)
	if n := up.runsOf("b"); n != 1 {
		t.Errorf("the upstream ran b %d times, want 1", n)
	}
	if got := sweeper.metric(t, `idem_blob_sweep_left{reason="other_namespace"}`); got != 1 {
		t.Errorf(`idem_blob_sweep_left{reason="other_namespace"}: %v, want 1`, got)
	}
	if !strings.Contains(sweeper.LogText(), `"other_namespaces_left":1`) {
		t.Errorf("the sweeper's log does not count the other proxy's blob:\n%s", sweeper.LogText())
	}
}

// A file blob URL that is not an absolute directory is a usage error
// (exit 2, one line), before anything is written: file://blobs parses
// with the host "blobs" and would write into the working directory.
func TestBlobFileURLUsage(t *testing.T) {
	bin, err := proctest.BuildIdem()
	if err != nil {
		t.Fatal(err)
	}
	redis := proxyRedis(t)
	storeURL := "redis://" + redis.Addr()
	for _, blob := range []string{"file://blobs", "file:blobs", "file://./blobs", "file://"} {
		for _, args := range [][]string{
			{"proxy", "--upstream", "http://127.0.0.1:1", "--listen", "127.0.0.1:0", "--blob", blob},
			{"gc", "--store", storeURL, "--blob", blob},
			{"inspect", "--store", storeURL, "--stored-key", storedKey("k").String(), "--blob", blob},
		} {
			dir := t.TempDir()
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			cmd := exec.CommandContext(ctx, bin, args...)
			cmd.Env, cmd.Dir = proxyEnv(nil), dir
			out, _ := cmd.CombinedOutput()
			cancel()
			if code := cmd.ProcessState.ExitCode(); code != 2 || !strings.Contains(string(out), "want file:///absolute/dir") ||
				strings.Count(strings.TrimSpace(string(out)), "\n") != 0 {
				t.Errorf("idem %q: exit %d, want 2 and one line naming file:///absolute/dir:\n%s", args, code, out)
			}
			if entries, _ := os.ReadDir(dir); len(entries) != 0 {
				t.Errorf("idem %q wrote into its working directory: %v", args, entries)
			}
		}
	}
}

// A replay whose blob is missing: the proxy's error line and idem
// inspect name the stored key and the idem purge that runs it again, and
// that purge does.
func TestProxyBlobMissingHint(t *testing.T) {
	redis := proxyRedis(t)
	storeURL := "redis://" + redis.Addr()
	bb := newBlobBackend(t, "file")
	up := newBigUpstream(t)
	p := startBlobProxy(t, "--upstream", up.URL, "--store", storeURL, "--blob", bb.url)
	wantWhole(t, "first", fetch(t, p.base(), "gone", 2*mib), "gone", 2*mib)
	rec := completedRecord(t, storeURL, "gone")
	if err := bb.open.Delete(context.Background(), rec.Response.Blob.Name); err != nil {
		t.Fatal(err)
	}
	wantProblem(t, "replay of a deleted blob", fetch(t, p.base(), "gone", 2*mib), http.StatusServiceUnavailable,
		idemhttp.ProblemStoredBodyUnavailable)
	key := storedKey("gone").String()
	purge := "idem purge --stored-key " + key + " --blob "
	found := false
	for deadline := time.Now().Add(10 * time.Second); !found && time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		for line := range strings.Lines(p.LogText()) {
			if strings.Contains(line, "missing from the blob store") {
				found = strings.Contains(line, `"key":"`+key+`"`) && strings.Contains(line, purge)
			}
		}
	}
	if !found {
		t.Errorf("no error line naming the key %s and %q:\n%s", key, purge, p.LogText())
	}
	code, out := runIdemOut(t, "inspect", "--store", storeURL, "--stored-key", key, "--blob", bb.url)
	if code != 0 || !strings.Contains(out, "MISSING") || !strings.Contains(out, purge) {
		t.Errorf("inspect: exit %d, want MISSING and %q:\n%s", code, purge, out)
	}
	code, out = runIdemOut(t, "purge", "--stored-key", key, "--blob", bb.url, "--yes", "--store", storeURL)
	if code != 0 {
		t.Fatalf("the suggested purge: exit %d\n%s", code, out)
	}
	// The proxy's replay cache learns of a purge by another process when
	// Redis's invalidation message reaches it, a moment after the purge's
	// reply (redisstore's documentation): until then it may answer as
	// just before the purge, never run the work again.
	after := fetch(t, p.base(), "gone", 2*mib)
	for deadline := time.Now().Add(5 * time.Second); after.status == http.StatusServiceUnavailable && time.Now().Before(deadline); {
		time.Sleep(20 * time.Millisecond)
		after = fetch(t, p.base(), "gone", 2*mib)
	}
	wantWhole(t, "after the purge", after, "gone", 2*mib)
	if n := up.runsOf("gone"); n != 2 {
		t.Errorf("the upstream ran %d times, want 2", n)
	}
}

// Each kind of store, prefix and namespace names its blobs differently,
// and the same store opened twice the same: a Redis store with the
// tiered store's prefix does not judge the tiered store's blobs (whose
// completions are in PostgreSQL). The proxy's timed store forwards it.
func TestStoreNamespaces(t *testing.T) {
	redis := proxyRedis(t)
	redisURL := "redis://" + redis.Addr()
	pg := pgURL(t)
	seen := map[string]string{}
	for _, tc := range []struct{ store, prefix string }{
		{"memory", ""}, {redisURL, ""}, {redisURL, "shop:"}, {pg, ""}, {pg, "shop:"},
		{redisURL + " " + pg, ""}, {redisURL + " " + pg, "shop:"},
	} {
		var nss []string
		for range 2 {
			s := openPrefixed(t, tc.store, tc.prefix)
			n, ok := s.(idem.Namespacer)
			if !ok || n.Namespace() == "" {
				t.Fatalf("store %q prefix %q: no namespace", tc.store, tc.prefix)
			}
			timed := newTimedStore(s, newProxyMetrics().store)
			if timed.Namespace() != n.Namespace() {
				t.Errorf("the timed store's namespace %q, want %q", timed.Namespace(), n.Namespace())
			}
			nss = append(nss, n.Namespace())
		}
		// A memory store's namespace is its own: no other may judge its
		// blobs. Any other store opened twice has one namespace.
		if mem := tc.store == "memory"; (nss[0] == nss[1]) == mem {
			t.Errorf("store %q prefix %q opened twice: namespaces %q and %q; want them the same, unless memory", tc.store, tc.prefix, nss[0], nss[1])
		}
		seg := idem.BlobNamespace(nss[0])
		if prev, dup := seen[seg]; dup {
			t.Errorf("store %q prefix %q: namespace %q (%s), the same as %s's", tc.store, tc.prefix, nss[0], seg, prev)
		}
		seen[seg] = fmt.Sprintf("%q prefix %q", tc.store, tc.prefix)
	}
}
