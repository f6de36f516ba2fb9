package idemhttp_test

// A small idem.BlobStore for these tests, on a directory or in memory.
// The real backends (package blobstore: S3, files, memory) are tested by
// their conformance suite and, behind the middleware, by idem proxy's
// tests; idemhttp's tests do not import them, so that a module using
// idemhttp does not need their modules (go mod tidy records the modules
// of its dependencies' tests too).

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/idemkit/idem"
)

// dirBlobs keeps each blob in a file under dir, written to a temporary
// file next to it and renamed into place on Close.
type dirBlobs struct{ dir string }

func newDirBlobs(dir string) *dirBlobs {
	os.MkdirAll(dir, 0o755)
	return &dirBlobs{dir: dir}
}

func (d *dirBlobs) path(name string) string { return filepath.Join(d.dir, filepath.FromSlash(name)) }

func (d *dirBlobs) Create(ctx context.Context, name string) (idem.BlobWriter, error) {
	p := d.path(name)
	if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
		return nil, err
	}
	var r [6]byte
	rand.Read(r[:])
	f, err := os.Create(p + "." + hex.EncodeToString(r[:]) + ".tmp")
	if err != nil {
		return nil, err
	}
	return &dirWriter{ctx: ctx, f: f, path: p}, nil
}

type dirWriter struct {
	ctx  context.Context
	f    *os.File
	path string
}

func (w *dirWriter) Write(p []byte) (int, error) {
	if err := w.ctx.Err(); err != nil {
		return 0, err
	}
	return w.f.Write(p)
}

func (w *dirWriter) Close() error {
	if err := w.ctx.Err(); err != nil {
		w.Abort()
		return err
	}
	if err := w.f.Close(); err != nil {
		os.Remove(w.f.Name())
		return err
	}
	return os.Rename(w.f.Name(), w.path)
}

func (w *dirWriter) Abort() error {
	w.f.Close()
	return os.Remove(w.f.Name())
}

func (d *dirBlobs) Open(_ context.Context, name string) (io.ReadCloser, int64, error) {
	f, err := os.Open(d.path(name))
	if os.IsNotExist(err) {
		return nil, 0, fmt.Errorf("%s: %w", name, idem.ErrBlobNotFound)
	}
	if err != nil {
		return nil, 0, err
	}
	fi, err := f.Stat()
	if err != nil {
		f.Close()
		return nil, 0, err
	}
	return f, fi.Size(), nil
}

func (d *dirBlobs) Delete(_ context.Context, name string) error {
	err := os.Remove(d.path(name))
	if os.IsNotExist(err) {
		return fmt.Errorf("%s: %w", name, idem.ErrBlobNotFound)
	}
	return err
}

func (d *dirBlobs) List(_ context.Context, prefix string, fn func(idem.BlobInfo) error) error {
	return filepath.WalkDir(d.dir, func(p string, e fs.DirEntry, err error) error {
		if err != nil || e.IsDir() {
			return nil
		}
		rel, _ := filepath.Rel(d.dir, p)
		name := filepath.ToSlash(rel)
		if !strings.HasPrefix(name, prefix) {
			return nil
		}
		fi, err := e.Info()
		if err != nil {
			return nil
		}
		return fn(idem.BlobInfo{Name: name, Size: fi.Size(), ModTime: fi.ModTime()})
	})
}

func (d *dirBlobs) Check(context.Context) error {
	_, err := os.Stat(d.dir)
	return err
}

// memBlobs keeps blobs in memory.
type memBlobs struct {
	mu sync.Mutex
	m  map[string][]byte
	t  map[string]time.Time
}

func newMemBlobs() *memBlobs { return &memBlobs{m: map[string][]byte{}, t: map[string]time.Time{}} }

type memWriter struct {
	ctx  context.Context
	s    *memBlobs
	name string
	buf  bytes.Buffer
	done bool
}

func (s *memBlobs) Create(ctx context.Context, name string) (idem.BlobWriter, error) {
	return &memWriter{ctx: ctx, s: s, name: name}, nil
}

func (w *memWriter) Write(p []byte) (int, error) {
	if err := w.ctx.Err(); err != nil {
		return 0, err
	}
	return w.buf.Write(p)
}

func (w *memWriter) Close() error {
	if err := w.ctx.Err(); err != nil {
		return err
	}
	w.s.mu.Lock()
	defer w.s.mu.Unlock()
	w.s.m[w.name], w.s.t[w.name] = bytes.Clone(w.buf.Bytes()), time.Now()
	return nil
}

func (w *memWriter) Abort() error { return nil }

func (s *memBlobs) Open(_ context.Context, name string) (io.ReadCloser, int64, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	b, ok := s.m[name]
	if !ok {
		return nil, 0, fmt.Errorf("%s: %w", name, idem.ErrBlobNotFound)
	}
	return io.NopCloser(bytes.NewReader(b)), int64(len(b)), nil
}

func (s *memBlobs) Delete(_ context.Context, name string) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, ok := s.m[name]; !ok {
		return fmt.Errorf("%s: %w", name, idem.ErrBlobNotFound)
	}
	delete(s.m, name)
	return nil
}

func (s *memBlobs) List(_ context.Context, prefix string, fn func(idem.BlobInfo) error) error {
	s.mu.Lock()
	var infos []idem.BlobInfo
	for n, b := range s.m {
		if strings.HasPrefix(n, prefix) {
			infos = append(infos, idem.BlobInfo{Name: n, Size: int64(len(b)), ModTime: s.t[n]})
		}
	}
	s.mu.Unlock()
	for _, i := range infos {
		if err := fn(i); err != nil {
			return err
		}
	}
	return nil
}

func (s *memBlobs) Check(context.Context) error { return nil }
