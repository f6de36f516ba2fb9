// Package logwriter writes log lines to a file (the proxy's stderr) with
// fewer system calls: the lines written while a write is under way go
// together in the next one.
//
// A line is never held back waiting for others: when no write is under
// way, the writer goroutine writes it at once. Under load, lines pile up
// while a write runs and leave in one write(2) after it, so a busy proxy
// makes a fraction of a system call per request for its log instead of
// one. Lines keep their order, each line's bytes stay together, and Close
// writes what is left. A crash loses the lines handed over but not yet
// written: those logged in the moment before it.
package logwriter

import (
	"io"
	"sync"
)

// maxPending is how many bytes may wait for the writer goroutine; a
// Write that finds that many waiting writes them itself (in order), so a
// slow destination slows the callers down as a direct write would,
// instead of growing memory.
const maxPending = 256 << 10

// Writer batches the writes made to it into writes to its destination.
// Its methods are safe for concurrent use.
type Writer struct {
	dst io.Writer

	out sync.Mutex // held while writing to dst: one write at a time, in order

	mu      sync.Mutex
	pending []byte // written to the Writer, not yet to dst
	spare   []byte // the buffer the last write to dst used, for reuse
	closed  bool
	err     error // the last error dst returned, not yet returned to a caller

	kick chan struct{} // a token: there is something pending
	done chan struct{} // closed when the goroutine has stopped
}

// New returns a Writer to dst and starts its goroutine; Close stops it.
func New(dst io.Writer) *Writer {
	w := &Writer{dst: dst, kick: make(chan struct{}, 1), done: make(chan struct{})}
	go w.run()
	return w
}

// Write queues p, whole, to be written to the destination; after Close it
// writes p itself. It returns an error the destination gave since the
// last one returned (the lines of that write were lost; p is queued all
// the same).
func (w *Writer) Write(p []byte) (int, error) {
	w.mu.Lock()
	err := w.err
	w.err = nil
	w.pending = append(w.pending, p...)
	direct := len(w.pending) >= maxPending || w.closed
	if !direct {
		select { // under mu: Close closes kick under it
		case w.kick <- struct{}{}:
		default: // the goroutine has a token already: it will see p
		}
	}
	w.mu.Unlock()
	if direct {
		w.flush()
		if ferr := w.takeErr(); ferr != nil {
			err = ferr
		}
	}
	return len(p), err
}

func (w *Writer) run() {
	defer close(w.done)
	for range w.kick {
		w.flush()
	}
}

// flush writes what is pending to the destination in one write, and
// returns (and keeps, for the next Write to return) its error.
func (w *Writer) flush() error {
	w.out.Lock()
	defer w.out.Unlock()
	w.mu.Lock()
	b := w.pending
	w.pending = w.spare[:0]
	w.spare = nil
	w.mu.Unlock()
	var err error
	if len(b) > 0 {
		_, err = w.dst.Write(b)
	}
	w.mu.Lock()
	if cap(b) <= maxPending { // keep a buffer of a usual size for the next write
		w.spare = b[:0]
	}
	if err != nil {
		w.err = err
	}
	w.mu.Unlock()
	return err
}

// takeErr returns the error not yet returned to a caller, and forgets it.
func (w *Writer) takeErr() error {
	w.mu.Lock()
	defer w.mu.Unlock()
	err := w.err
	w.err = nil
	return err
}

// Close writes what is pending and stops the goroutine; later writes go
// to the destination directly. It returns an error the destination gave
// that no Write returned. It does not close the destination.
func (w *Writer) Close() error {
	w.mu.Lock()
	if !w.closed {
		w.closed = true
		close(w.kick)
		w.mu.Unlock()
		<-w.done
	} else {
		w.mu.Unlock()
	}
	w.flush()
	return w.takeErr()
}
