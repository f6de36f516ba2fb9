package sidecar

import (
	"context"
	"log/slog"
	"os"
	"os/signal"
	"syscall"
)

// Reload is one part of a sidecar's configuration that SIGHUP re-reads:
// What names it in the log ("config", "certificates"), Do re-reads it and
// puts it in place, or returns an error that says what is wrong with the
// new files in one line and leaves the running configuration as it was.
type Reload struct {
	What string
	Do   func() error
}

// CatchHangups catches SIGHUP from now on, for ReloadOnHangup: called
// first thing, a SIGHUP sent while the sidecar starts (it may wait seconds
// for its store) waits for the reloads instead of ending the process,
// SIGHUP's default action. stop gives the signal back.
func CatchHangups() (hup <-chan os.Signal, stop func()) {
	c := make(chan os.Signal, 1)
	signal.Notify(c, syscall.SIGHUP)
	return c, func() { signal.Stop(c) }
}

// ReloadOnHangup runs every reload in turn on each SIGHUP from hup
// (CatchHangups) until ctx is done, and logs each: INFO "reloaded" when it
// took, ERROR "reload refused; the running configuration is kept" with
// the error when not. A failed part does not stop the others. Without
// reloads a SIGHUP is logged as having nothing to reload: it never ends
// the process, so that one sent to every sidecar by habit, or by a closed
// terminal, does not cut off the keyed requests in flight.
func ReloadOnHangup(ctx context.Context, hup <-chan os.Signal, logger *slog.Logger, reloads ...Reload) {
	go func() {
		for {
			select {
			case <-ctx.Done():
				return
			case <-hup:
				if len(reloads) == 0 {
					logger.Info("SIGHUP: nothing to reload")
				}
				for _, r := range reloads {
					if err := r.Do(); err != nil {
						logger.Error("reload refused; the running configuration is kept", "what", r.What, "error", err)
						continue
					}
					logger.Info("reloaded", "what", r.What)
				}
			}
		}
	}()
}
