package main

// The steps of runProxy: the logger, the store and blob store with their
// metrics, the servers, the start-up line and the shutdown.

import (
	"cmp"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/url"
	"sync/atomic"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/blobstore"
	"github.com/idemkit/idem/internal/sidecar"
)

// startLogger makes the proxy's logger and the process's default one.
func startLogger(w io.Writer, format, level string) (*slog.Logger, error) {
	logger, err := newLogger(w, format, level)
	if err != nil {
		return nil, err
	}
	// What net/http writes with the log package (its Transport's
	// "Unsolicited response received on idle HTTP channel", for one) goes
	// to the structured log too, at WARN, never as raw text beside it.
	slog.SetDefault(logger)
	slog.SetLogLoggerLevel(slog.LevelWarn)
	return logger, nil
}

// proxyTLS is the TLS of the listener (certs, nil without --tls-cert) and
// of an https:// upstream (upstream, nil for the Transport's default; its
// client certificate from upstreamCerts, nil without --upstream-cert).
type proxyTLS struct {
	certs, upstreamCerts *sidecar.CertSource
	upstream             *tls.Config
}

// loadTLS reads the TLS files before anything opens: one that does not
// load is a usage error, as a bad flag is.
func (o *proxyOptions) loadTLS(target *url.URL, logger *slog.Logger) (proxyTLS, error) {
	var t proxyTLS
	var err error
	if o.tls.Cert != "" {
		if t.certs, err = sidecar.NewCertSource(o.tls, tlsFlags, logger); err != nil {
			return t, usageError{err.Error()}
		}
	}
	if t.upstream, t.upstreamCerts, err = sidecar.UpstreamTLS(target.Hostname(), o.upstreamTLS, upstreamTLSFlags, logger); err != nil {
		return t, usageError{err.Error()}
	}
	return t, nil
}

// backends are the proxy's store (rawStore as opened, store timed by the
// metrics) and blob store (nil without --blob), and its metrics.
type backends struct {
	rawStore idem.Store
	store    *timedStore
	blobs    *blobstore.Bucket
	metrics  *proxyMetrics
	closers  []func() // in the order they run
}

// close stops what the backends run and closes them, the last opened
// first.
func (b *backends) close() {
	for i := len(b.closers) - 1; i >= 0; i-- {
		b.closers[i]()
	}
}

// openBackends opens the store and the blob store, and makes the metrics
// of both. A blob store that does not answer yet is not fatal: it may
// come up later, and meanwhile new keyed requests get 503 (or run, with
// --fail-open).
func (o *proxyOptions) openBackends(ctx context.Context, logger *slog.Logger) (*backends, error) {
	b := &backends{metrics: newProxyMetrics()}
	storeStats := newStoreMetrics(logger)
	rawStore, closeStore, err := openStoreWith(ctx, o.store, o.prefix, storeOptions{MaxBytes: int64(o.memoryLimit),
		ReapEvery: cmp.Or(o.reapInterval, -1), OnReap: storeStats.onReap, Logger: logger})
	if errors.As(err, new(usageError)) {
		return nil, err
	} else if err != nil {
		return nil, fmt.Errorf("--store %s: %w", storeForLog(o.store), err)
	}
	b.closers = append(b.closers, closeStore) // stops the reaper, then closes the connections
	storeStats.register(b.metrics.reg, rawStore)
	b.rawStore, b.store = rawStore, newTimedStore(rawStore, b.metrics.store)
	if o.blob == "" {
		return b, nil
	}
	if b.blobs, err = openBlobs(ctx, o.blob); err != nil {
		b.close()
		return nil, err
	}
	b.closers = append(b.closers, func() { b.blobs.Close() })
	b.metrics.initBlobSeries()
	cctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	if err := b.blobs.Check(cctx); err != nil {
		logger.Warn("the blob store does not answer", "blob", b.blobs.String(), "error", err)
	}
	return b, nil
}

// startSweep runs the blob sweep (--blob-sweep) until the backends close.
func (b *backends) startSweep(o *proxyOptions, logger *slog.Logger) {
	if b.blobs == nil || o.blobSweep <= 0 {
		return
	}
	sweepCtx, stopSweep := context.WithCancel(context.Background())
	b.closers = append(b.closers, stopSweep)
	go sweepLoop(sweepCtx, b.blobs, b.rawStore, o.blobSweep, o.blobSweepMinAge, b.metrics, logger)
}

// servers are the proxy's server and its admin server (nil without
// --admin-listen); errs receives what their Serve returns.
type servers struct {
	srv, admin            *http.Server
	listenAddr, adminAddr string
	draining              atomic.Bool // /readyz answers 503 once set
	errs                  chan error
}

// serve starts serving the proxied traffic on --listen's listener (over
// TLS with certs) and, with --admin-listen, /metrics, /healthz and
// /readyz on the admin listener (both bound by bindListeners).
func (o *proxyOptions) serve(lns *proxyListeners, p *proxy, b *backends, certs *sidecar.CertSource, logger *slog.Logger) *servers {
	s := &servers{errs: make(chan error, 2)}
	s.srv = &http.Server{
		Handler:           p,
		ReadHeaderTimeout: readHeaderTimeout,
		ReadTimeout:       o.readTimeout,
		IdleTimeout:       o.idleTimeout,
		MaxHeaderBytes:    maxHeaderBytes,
		ErrorLog:          slog.NewLogLogger(logger.Handler(), slog.LevelWarn),
	}
	// HTTP/1.1 and, on the same listener, HTTP/2: by ALPN over TLS, else
	// cleartext by prior knowledge (h2c: a connection that opens with
	// HTTP/2's preface).
	s.srv.Protocols = new(http.Protocols)
	s.srv.Protocols.SetHTTP1(true)
	s.srv.Protocols.SetHTTP2(certs != nil)
	s.srv.Protocols.SetUnencryptedHTTP2(certs == nil)
	ln := lns.main
	s.listenAddr = lns.mainAddr
	if certs != nil {
		s.srv.TLSConfig = certs.Config()
		go func() { s.errs <- s.srv.ServeTLS(ln, "", "") }()
	} else {
		go func() { s.errs <- s.srv.Serve(ln) }()
	}
	aln := lns.admin
	if aln == nil {
		return s
	}
	s.admin = &http.Server{
		Handler:           adminHandler(b.metrics, b.rawStore, blobStoreOrNil(b.blobs), &s.draining),
		ReadHeaderTimeout: readHeaderTimeout,
		ReadTimeout:       10 * time.Second,
		WriteTimeout:      30 * time.Second,
		IdleTimeout:       o.idleTimeout,
		MaxHeaderBytes:    maxHeaderBytes,
		ErrorLog:          slog.NewLogLogger(logger.Handler(), slog.LevelWarn),
	}
	s.adminAddr = aln.Addr().String()
	go func() { s.errs <- s.admin.Serve(aln) }()
	return s
}

// close closes both servers at once.
func (s *servers) close() {
	s.srv.Close()
	if s.admin != nil {
		s.admin.Close()
	}
}

// logStart logs the start-up line (and the memory store's warning), once
// every setting was found good.
func (o *proxyOptions) logStart(logger *slog.Logger, target *url.URL, s *servers, b *backends, p *proxy, sealer *sidecar.Sealer) {
	blobName, blobNS := "", ""
	if b.blobs != nil {
		blobName = b.blobs.String()
		// The namespace in the names of its blobs, for idem gc's report.
		ns := b.store.Namespace()
		blobNS = idem.BlobNamespace(ns) + " (" + ns + ")"
	}
	if o.store == "" || o.store == "memory" {
		logger.Warn(memoryStoreWarning, "memory_limit", o.memoryLimit.String())
	}
	logger.Info("idem proxy listening", "listen", s.listenAddr, "tls", tlsMode(o.tls), "admin", s.adminAddr,
		"upstream", target.Redacted(), "store", storeForLog(o.store), "blob", blobName, "blob_namespace", blobNS, "routes", p.routes.Load().n,
		"methods", o.settings.Methods, "key", o.settings.KeyName(), "require_key", o.settings.RequireKey, "lease", o.settings.Lease.String(), "quota", p.quota.String(),
		"seal", sealer.String())
}

// shutdown stops accepting, lets in-flight requests finish (their
// handlers complete or release their keys) within timeout, then cuts
// the rest off; the caller closes the store after.
func (s *servers) shutdown(p *proxy, timeout time.Duration, logger *slog.Logger) error {
	s.draining.Store(true)
	logger.Info("shutting down: finishing in-flight requests", "timeout", timeout.String(), "in_flight", p.inFlight.Load())
	sctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	shutdownErr := s.srv.Shutdown(sctx)
	if shutdownErr != nil {
		logger.Warn("in-flight requests did not finish in time; cancelling their upstream requests and closing their connections",
			"in_flight", p.inFlight.Load())
		p.stopWork()
		s.srv.Close()
	}
	// Handlers outlive Shutdown when it times out, and hijacked
	// connections are not waited for: give them a moment to release
	// their leases before the store goes.
	if !p.wait(drainGrace) {
		logger.Warn("handlers still running at exit (upgraded connections, or keyed requests whose keys stay blocked until their leases end)",
			"in_flight", p.inFlight.Load())
	}
	if s.admin != nil {
		actx, acancel := context.WithTimeout(context.Background(), time.Second)
		s.admin.Shutdown(actx)
		acancel()
	}
	if shutdownErr != nil {
		return fmt.Errorf("shutdown: in-flight requests cut off after %v", timeout)
	}
	logger.Info("idem proxy stopped")
	return nil
}
