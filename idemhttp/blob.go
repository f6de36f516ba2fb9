package idemhttp

import (
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"hash"
	"io"
	"log/slog"
	"net/http"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/telemetry"
)

// Blob store operations, as OnBlobError names them.
const (
	BlobOpWrite = "write" // streaming a large body to the blob store, or committing it
	BlobOpRead  = "read"  // replaying a body from the blob store
	BlobOpCheck = "check" // the probe before a new request runs
)

// DefaultBlobTimeout is Config.BlobTimeout's default.
const DefaultBlobTimeout = 30 * time.Second

// blobCheckEvery is how long a probe of the blob store is trusted: a new
// request probes again once the last probe (or blob operation) is older.
// blobCheckTimeout bounds the probe.
const (
	blobCheckEvery   = time.Second
	blobCheckTimeout = 2 * time.Second
)

// errNoBlobStore is the error of a replay whose body is in a blob store
// when the middleware has none (Config.Blobs unset).
var errNoBlobStore = errors.New("idemhttp: the stored body is in a blob store, and Config.Blobs is not set")

// errBlobStalled is the cause that ends a blob operation that made no
// progress for Config.BlobTimeout.
var errBlobStalled = errors.New("idemhttp: the blob store made no progress within Config.BlobTimeout")

// blobGate says whether the blob store can take a new request's body: a
// probe (BlobStore.Check) at most every blobCheckEvery, its answer also
// refreshed by the blob operations themselves.
type blobGate struct {
	bs      idem.BlobStore
	mu      sync.Mutex
	checked time.Time // the last probe or operation
	err     error     // its verdict: nil when the store answered
	probing bool
}

// check returns the gate's verdict, probing first when it is stale. Only
// one request probes at a time; the others meanwhile take the last verdict.
func (g *blobGate) check(ctx context.Context) error {
	g.mu.Lock()
	if g.probing || time.Since(g.checked) < blobCheckEvery {
		err := g.err
		g.mu.Unlock()
		return err
	}
	g.probing = true
	g.mu.Unlock()
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), blobCheckTimeout)
	err := g.bs.Check(ctx)
	cancel()
	g.mu.Lock()
	g.probing = false
	g.checked, g.err = time.Now(), err
	g.mu.Unlock()
	return err
}

// report records the outcome of a blob operation: a success says the store
// answers, an error other than a missing or corrupt blob says it does not.
func (g *blobGate) report(err error) {
	if errors.Is(err, idem.ErrBlobNotFound) || errors.Is(err, idem.ErrBlobCorrupt) {
		return
	}
	g.mu.Lock()
	g.checked, g.err = time.Now(), err
	g.mu.Unlock()
}

// watchdog cancels a blob operation that makes no progress: while a call
// is in progress (enter, leave) for longer than stall, it cancels ctx with
// errBlobStalled. One goroutine per watchdog, until stop.
type watchdog struct {
	ctx    context.Context
	cancel context.CancelCauseFunc
	stall  time.Duration
	since  atomic.Int64 // unix nanos at which the call in progress started; 0: none
	done   chan struct{}
	once   sync.Once
}

func newWatchdog(parent context.Context, stall time.Duration) (context.Context, *watchdog) {
	ctx, cancel := context.WithCancelCause(parent)
	w := &watchdog{ctx: ctx, cancel: cancel, stall: stall, done: make(chan struct{})}
	go w.run()
	return ctx, w
}

func (w *watchdog) run() {
	t := time.NewTicker(max(w.stall/4, time.Millisecond))
	defer t.Stop()
	for {
		select {
		case <-w.done:
			return
		case <-t.C:
			if s := w.since.Load(); s != 0 && time.Since(time.Unix(0, s)) > w.stall {
				w.cancel(errBlobStalled)
				return
			}
		}
	}
}

func (w *watchdog) enter() { w.since.Store(time.Now().UnixNano()) }
func (w *watchdog) leave() { w.since.Store(0) }

// stop ends the watchdog and cancels its context.
func (w *watchdog) stop() {
	w.once.Do(func() {
		close(w.done)
		w.cancel(nil)
	})
}

// spill is a body on its way to the blob store: capture writes to it what
// goes past Config.MaxResponseSize, and it hashes what it writes. A failed
// write abandons the blob; the response is then stored without its body.
type spill struct {
	m    *middleware
	r    *http.Request
	name string
	w    idem.BlobWriter
	dog  *watchdog
	h    hash.Hash
	n    int64
	err  error // the first failure: the blob is abandoned
	// committed: the blob is written whole; abort leaves it (a sweep
	// removes it if no record points to it)
	committed bool
}

// newSpill starts the blob of the attempt holding lease. ctx is the
// attempt's: losing the lease cancels the write.
func (m *middleware) newSpill(ctx context.Context, r *http.Request, lease idem.Lease) *spill {
	ns := ""
	if m.blobNS != nil {
		ns = m.blobNS.Namespace()
	}
	s := &spill{m: m, r: r, name: idem.NewBlobName(ns, lease), h: sha256.New()}
	ctx, s.dog = newWatchdog(ctx, m.cfg.BlobTimeout)
	s.dog.enter()
	s.w, s.err = m.cfg.Blobs.Create(ctx, s.name)
	s.dog.leave()
	if s.err != nil {
		s.fail(s.err)
	}
	return s
}

func (s *spill) write(p []byte) {
	if s.err != nil || len(p) == 0 {
		return
	}
	s.h.Write(p)
	s.n += int64(len(p))
	s.dog.enter()
	_, err := s.w.Write(p)
	s.dog.leave()
	if err != nil {
		s.w.Abort()
		s.fail(err)
	}
}

// fail records the spill's first failure, with the watchdog's cause when
// it stopped the write.
func (s *spill) fail(err error) {
	s.err = stalled(s.dog.ctx, err)
	s.dog.stop()
	s.m.blobError(s.r, BlobOpWrite, err)
}

// commit closes the blob and returns its reference; after an error the
// blob is abandoned (nothing to delete).
func (s *spill) commit() (*idem.BlobRef, error) {
	if s.err != nil {
		return nil, s.err
	}
	s.dog.enter()
	err := s.w.Close()
	s.dog.leave()
	if err != nil {
		s.fail(err)
		return nil, s.err
	}
	s.dog.stop()
	s.committed = true
	s.m.gate.report(nil)
	ref := &idem.BlobRef{Name: s.name, Size: s.n}
	s.h.Sum(ref.SHA256[:0])
	return ref, nil
}

// abort discards the blob, unless it failed or was committed. A nil spill
// is none.
func (s *spill) abort() {
	if s == nil || s.err != nil || s.committed {
		return
	}
	s.err = errors.New("aborted")
	s.w.Abort()
	s.dog.stop()
}

// blobError reports a failed blob operation to the gate, the log and
// OnBlobError.
func (m *middleware) blobError(r *http.Request, op string, err error) {
	m.gate.report(err)
	if m.cfg.OnBlobError != nil {
		m.cfg.OnBlobError(r, op, err)
	}
}

// deleteBlob removes the blob of a response that was not stored (its lease
// was lost before Complete), best effort; a sweep removes it otherwise.
func (m *middleware) deleteBlob(ctx context.Context, name string) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), m.cfg.BlobTimeout)
	defer cancel()
	if err := m.cfg.Blobs.Delete(ctx, name); err != nil && !errors.Is(err, idem.ErrBlobNotFound) {
		m.cfg.Logger.LogAttrs(ctx, slog.LevelDebug, "idem: could not delete the blob of a response that was not stored; a sweep will",
			slog.String("blob", name), slog.Any("error", err))
	}
}

// replayChunk is the unit of a blob replay: a chunk is sent to the client
// only once the next one (or the verified end) has been read, so a blob
// found corrupt at its end never reaches the client whole. replayAhead
// chunks are read (and hashed) ahead of the one being sent, in a goroutine
// of their own, so hashing and sending overlap.
const (
	replayChunk = 64 << 10
	replayAhead = 4
)

var replayBufs = sync.Pool{New: func() any { return new([replayChunk]byte) }}

// replayRead is a chunk the reading goroutine of a replay read: n bytes
// of buf, then err (io.EOF or io.ErrUnexpectedEOF at the verified end).
type replayRead struct {
	buf *[replayChunk]byte
	n   int
	err error
}

// replayBlob replays a response whose body is in the blob store. It opens
// the blob before anything is written: a missing blob, a blob of the wrong
// size or a store that does not answer gets 503 (ProblemStoredBodyUnavailable),
// and the work is not run again. The status and headers go out with the
// first chunk, or at the verified end for a body of at most two chunks;
// a blob found corrupt or unreadable after that aborts the response
// (http.ErrAbortHandler), so the client sees a broken response, never a
// short or wrong one that looks whole.
func (m *middleware) replayBlob(w http.ResponseWriter, r *http.Request, key idem.Key, resp *idem.Response, cw clientWrites) {
	if m.cfg.Blobs == nil {
		m.replayFailed(w, r, key, resp.Blob, errNoBlobStore)
		return
	}
	ctx, dog := newWatchdog(r.Context(), m.cfg.BlobTimeout)
	defer dog.stop()
	dog.enter()
	rd, err := idem.OpenBlob(ctx, m.cfg.Blobs, *resp.Blob)
	dog.leave()
	if err != nil {
		if r.Context().Err() != nil {
			m.outcome(r, OutcomeGone)
			return
		}
		m.replayFailed(w, r, key, resp.Blob, stalled(ctx, err))
		return
	}
	reads := make(chan replayRead, replayAhead)
	stop := make(chan struct{})
	var wg sync.WaitGroup
	wg.Go(func() {
		defer close(reads)
		for {
			buf := replayBufs.Get().(*[replayChunk]byte)
			dog.enter()
			n, err := io.ReadFull(rd, buf[:])
			dog.leave()
			select {
			case reads <- replayRead{buf, n, err}:
			case <-stop:
				replayBufs.Put(buf)
				return
			}
			if err != nil {
				return
			}
		}
	})
	defer func() {
		close(stop)
		dog.stop() // ends a read in progress
		wg.Wait()
		for c := range reads {
			replayBufs.Put(c.buf)
		}
		rd.Close()
	}()

	sent := false // the header went out
	rc := http.NewResponseController(w)
	send := func(p []byte) bool {
		if !sent {
			sent = true
			m.replayHeader(w, resp)
			if !hasTrailers(resp.Header) {
				// With trailers, HTTP/1.1 must send the body chunked.
				w.Header().Set("Content-Length", strconv.FormatInt(resp.Blob.Size, 10))
			}
			w.WriteHeader(resp.Status)
		}
		if len(p) == 0 {
			return true
		}
		_, err := cw.write(w, rc, p)
		return err == nil
	}
	var pending *replayRead
	for c := range reads {
		switch {
		case c.err == nil:
			if pending != nil {
				ok := send(pending.buf[:pending.n])
				replayBufs.Put(pending.buf)
				if !ok {
					replayBufs.Put(c.buf)
					m.replayed(r, nil) // the client left: nothing more to do
					return
				}
			}
			pending = &c
			continue
		case errors.Is(c.err, io.EOF) || errors.Is(c.err, io.ErrUnexpectedEOF):
			// The end, verified by OpenBlob's reader: send the rest.
			if pending == nil || send(pending.buf[:pending.n]) {
				send(c.buf[:c.n])
			}
			if pending != nil {
				replayBufs.Put(pending.buf)
			}
			replayBufs.Put(c.buf)
			m.gate.report(nil)
			m.replayed(r, nil)
			return
		}
		replayBufs.Put(c.buf)
		if pending != nil {
			replayBufs.Put(pending.buf)
		}
		err := stalled(ctx, c.err)
		if r.Context().Err() != nil {
			m.replayed(r, nil) // the client left while we read
			return
		}
		if !sent {
			m.replayFailed(w, r, key, resp.Blob, err)
			return
		}
		// The header went out: the response cannot be taken back. Abort
		// the connection (HTTP/1.1) or the stream (HTTP/2) so the client
		// sees it broken.
		m.replayed(r, err)
		panic(http.ErrAbortHandler)
	}
	// The reader stopped without a verdict: only when stop was closed,
	// which happens after this loop. Unreachable.
	m.replayed(r, errors.New("idemhttp: blob replay ended without its end"))
	panic(http.ErrAbortHandler)
}

// stalled returns err, or errBlobStalled when the watchdog of ctx ended it.
func stalled(ctx context.Context, err error) error {
	if c := context.Cause(ctx); errors.Is(c, errBlobStalled) {
		return fmt.Errorf("%w (%v)", errBlobStalled, err)
	}
	return err
}

// replayed reports the end of a blob replay: err nil for a body sent whole
// (or a client that left), else the failure that cut it short after the
// header was sent.
func (m *middleware) replayed(r *http.Request, err error) {
	if err == nil {
		m.outcome(r, OutcomeReplayed)
		telemetry.Event(r.Context(), telemetry.EventReplay)
		return
	}
	m.outcome(r, OutcomeReplayFailed)
	m.blobError(r, BlobOpRead, err)
	m.cfg.Logger.LogAttrs(r.Context(), slog.LevelError, "idem: the stored body broke off during its replay; the response was aborted",
		slog.Any("error", err))
}

// replayFailed answers 503 for a completed key whose body cannot be read
// from the blob store. Nothing runs again. A missing or corrupt blob is
// logged with the stored key and how to run it again (idem purge).
func (m *middleware) replayFailed(w http.ResponseWriter, r *http.Request, key idem.Key, ref *idem.BlobRef, err error) {
	m.outcome(r, OutcomeReplayFailed)
	if !errors.Is(err, errNoBlobStore) {
		m.blobError(r, BlobOpRead, err)
	}
	p := problemStoredBody
	switch {
	case errors.Is(err, idem.ErrBlobNotFound) || errors.Is(err, idem.ErrBlobCorrupt):
		p.RetryAfter = 0 // retrying will not help
		msg := "idem: the stored body is missing from the blob store; answered 503, nothing ran, and so will every replay of the key until its record expires or is purged"
		attrs := []slog.Attr{slog.String("key", key.String()), slog.String("blob", ref.Name)}
		var se *idem.BlobSealError
		switch {
		case errors.As(err, &se):
			msg = "idem: the stored body is sealed and does not open (altered, or under a key id not in the ring); answered 503, nothing ran, and so will every replay of the key until its record expires or is purged"
			id := se.KeyID
			if id == "" {
				id = "unknown"
			}
			attrs = append(attrs, slog.String("key_id", id))
		case errors.Is(err, idem.ErrBlobCorrupt):
			msg = "idem: the stored body is corrupt in the blob store; answered 503, nothing ran, and so will every replay of the key until its record expires or is purged"
		}
		attrs = append(attrs, slog.Any("error", err),
			slog.String("fix", "to run the key again on its next request: idem purge --stored-key "+key.String()+
				" --blob BLOB_URL --yes, with the --store and --prefix of this store"))
		m.cfg.Logger.LogAttrs(r.Context(), slog.LevelError, msg, attrs...)
	case errors.Is(err, errNoBlobStore):
		p.RetryAfter = 0
		m.cfg.Logger.LogAttrs(r.Context(), slog.LevelError, "idem: the stored body is in a blob store, and this middleware has none (Config.Blobs); answered 503, nothing ran",
			slog.String("key", key.String()), slog.String("blob", ref.Name), slog.Any("error", err))
	default:
		m.cfg.Logger.LogAttrs(r.Context(), slog.LevelWarn, "idem: the stored body cannot be read from the blob store; answered 503, nothing ran",
			slog.String("key", key.String()), slog.String("blob", ref.Name), slog.Any("error", err))
	}
	m.problem(w, r, p)
}
