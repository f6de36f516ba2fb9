//go:build unix

package blobstore_test

import (
	"context"
	"io/fs"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/idemkit/idem"
)

// TestFilePermissions: a file:// blob store keeps response bodies private
// to its user: files 0600 (the temporary file of a write in progress too)
// and directories 0700, under the usual umask 022 that leaves gocloud's
// defaults (0666, 0777) world-readable.
func TestFilePermissions(t *testing.T) {
	old := syscall.Umask(0o022)
	defer syscall.Umask(old)
	root := filepath.Join(t.TempDir(), "blobs")
	b := open(t, "file://"+root)
	ctx := context.Background()
	name := idem.NewBlobName("redis prefix \"idem:\" store x", idem.Lease{Token: 1})
	w, err := b.Create(ctx, name)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := w.Write([]byte("a private body")); err != nil {
		t.Fatal(err)
	}
	check := func(when string) (files int) {
		t.Helper()
		filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
			if err != nil {
				t.Fatal(err)
			}
			info, _ := d.Info()
			want := fs.FileMode(0o600)
			if d.IsDir() {
				want = 0o700
			} else {
				files++
			}
			if got := info.Mode().Perm(); got != want {
				t.Errorf("%s: %s has mode %#o, want %#o", when, strings.TrimPrefix(path, root), got, want)
			}
			return nil
		})
		return files
	}
	if n := check("while written"); n != 1 {
		t.Errorf("while written: %d files, want the temporary file", n)
	}
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	if n := check("once written"); n != 1 {
		t.Errorf("once written: %d files, want the blob", n)
	}
}
