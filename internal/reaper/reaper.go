// Package reaper is the loop that runs a SQL store's reaper: the one of
// pgstore, mysqlstore and tieredstore. It calls the store's Reap at every
// tick, logs a failed pass, reports each pass, and stops when told.
package reaper

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"
)

// Config is what the loop runs.
type Config struct {
	// Every is the time between passes; it must be positive.
	Every time.Duration
	// Batch is the most rows one statement of a pass deletes; at least 1.
	Batch int
	// Reap is the store's Reap.
	Reap func(ctx context.Context, batch int) (int, error)
	// Name starts the warning logged for a failed pass ("pgstore": the
	// log says "pgstore: reap failed").
	Name string
	// Attrs are added to that warning (the table, say).
	Attrs []slog.Attr
	// Logger receives that warning; nil: slog.Default().
	Logger *slog.Logger
	// OnReap, when set, receives each pass that ran to its end (not one
	// cut short because the loop was stopped): the rows it deleted, how
	// long it took, and its error. It runs on the loop's goroutine.
	OnReap func(deleted int, took time.Duration, err error)
}

// check reports a Config the loop cannot run.
func (c *Config) check() error {
	if c.Every <= 0 || c.Batch < 1 {
		return fmt.Errorf("interval %v and batch %d must be positive", c.Every, c.Batch)
	}
	if c.Reap == nil {
		return errors.New("no Reap function")
	}
	return nil
}

// Run runs the loop until ctx ends, then returns nil; it returns an error
// at once if c.Every or c.Batch is not positive.
func Run(ctx context.Context, c Config) error {
	if err := c.check(); err != nil {
		return err
	}
	log := c.Logger
	if log == nil {
		log = slog.Default()
	}
	t := time.NewTicker(c.Every)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
		start := time.Now()
		n, err := c.Reap(ctx, c.Batch)
		if ctx.Err() != nil {
			return nil // stopped during the pass: not reported
		}
		if err != nil {
			log.LogAttrs(ctx, slog.LevelWarn, c.Name+": reap failed", append(c.Attrs, slog.Any("error", err))...)
		}
		if c.OnReap != nil {
			c.OnReap(n, time.Since(start), err)
		}
	}
}

// Reaper is a loop started by Start. The nil *Reaper is a reaper that was
// never started: Stop does nothing.
type Reaper struct {
	stop context.CancelFunc
	done chan struct{}
}

// Start runs the loop on a goroutine of its own until Stop. It takes
// nothing from ctx but its values: the store's reaper outlives the
// context it was opened with.
func Start(ctx context.Context, c Config) (*Reaper, error) {
	if err := c.check(); err != nil {
		return nil, err
	}
	ctx, stop := context.WithCancel(context.WithoutCancel(ctx))
	r := &Reaper{stop: stop, done: make(chan struct{})}
	go func() {
		defer close(r.done)
		Run(ctx, c)
	}()
	return r, nil
}

// Stop ends the loop and waits for it: a pass in progress is cut short
// (its statement cancelled) and not reported. Stop may be called more
// than once, and on a nil *Reaper.
func (r *Reaper) Stop() {
	if r == nil {
		return
	}
	r.stop()
	<-r.done
}
