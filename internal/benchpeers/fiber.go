package main

import (
	"context"
	"fmt"
	"net"
	"strings"
	"time"

	"github.com/gofiber/fiber/v3"
	"github.com/gofiber/fiber/v3/middleware/adaptor"
	"github.com/gofiber/fiber/v3/middleware/idempotency"
	fiberredis "github.com/gofiber/storage/redis/v3"

	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/internal/bench"
	"github.com/idemkit/idem/redisstore"
)

// The fiber peers: gofiber/fiber v3's idempotency middleware with its
// Redis storage (gofiber/storage/redis/v3), wired as its documentation
// shows, and fiber with no layer, the baseline for its HTTP stack
// (fasthttp) in scenario b.
var fiberImpls = []bench.Impl{
	{Name: "fiber-none", Color: "#c7c7c7", OnlyB: true, Build: buildFiberNone},
	{Name: "fiber", Color: "#e377c2", Peer: true, Build: buildFiber},
	{Name: "idem-fiber", Color: "#98df8a", Build: buildIdemFiber},
}

// fiberServer is one fiber app; Close shuts it down and closes the
// storage.
type fiberServer struct {
	app     *fiber.App
	closeFn func() error
}

func (s *fiberServer) Serve(ln net.Listener) error {
	return s.app.Listener(ln, fiber.ListenConfig{DisableStartupMessage: true})
}

func (s *fiberServer) Close() error {
	err := s.app.ShutdownWithTimeout(5 * time.Second)
	if s.closeFn != nil {
		if e := s.closeFn(); err == nil {
			err = e
		}
	}
	return err
}

// fiberHandler is bench.App as a fiber handler: count the execution,
// sleep, answer 201 with the same JSON body.
func fiberHandler(app *bench.App) fiber.Handler {
	return func(c fiber.Ctx) error {
		// Copied: fiber's strings point into fasthttp's buffers, reused
		// after the handler returns (fiber's documentation, "Zero
		// Allocation").
		key := strings.Clone(c.Get("Idempotency-Key"))
		n := app.Exec(key)
		if d := app.Sleep(); d > 0 {
			time.Sleep(d)
		}
		c.Set(fiber.HeaderContentType, fiber.MIMEApplicationJSON)
		return c.Status(fiber.StatusCreated).SendString(bench.Body(key, n))
	}
}

func buildFiberNone(_ context.Context, env bench.Env) (bench.Server, error) {
	app := fiber.New()
	app.Post("/payments", fiberHandler(env.App))
	return &fiberServer{app: app}, nil
}

// buildFiber wires the middleware as fiber's documentation does, with the
// storage on the bench's Redis. Three settings differ from the defaults,
// and say so: the header is the IETF draft's Idempotency-Key (the
// default is X-Idempotency-Key), the key check accepts the bench's keys
// (the default wants 36 characters, a UUID), and the lifetime and the
// storage's pool are the bench's (10 minutes, as every implementation
// keeps its records; 64 connections, as every go-redis client here). The
// lock stays the default: fiber's in-memory lock, per process.
func buildFiber(_ context.Context, env bench.Env) (srv bench.Server, err error) {
	defer func() {
		if p := recover(); p != nil { // fiberredis.New panics when Redis does not answer
			err = fmt.Errorf("gofiber/storage/redis: %v", p)
		}
	}()
	storage := fiberredis.New(fiberredis.Config{URL: env.RedisURL, PoolSize: bench.PoolSize})
	app := fiber.New()
	app.Use(idempotency.New(idempotency.Config{
		Storage:   storage,
		KeyHeader: "Idempotency-Key",
		KeyHeaderValidate: func(k string) error {
			if len(k) == 0 || len(k) > 255 {
				return fmt.Errorf("%w: length %d", idempotency.ErrInvalidIdempotencyKey, len(k))
			}
			return nil
		},
		Lifetime: bench.Retention,
	}))
	app.Post("/payments", fiberHandler(env.App))
	return &fiberServer{app: app, closeFn: storage.Close}, nil
}

// buildIdemFiber mounts idemhttp.Middleware (on redisstore.Open, as
// idem-rueidis) around the net/http handler in a fiber app, with
// adaptor.HTTPHandler. (adaptor.HTTPMiddleware does not fit: it does not
// pass the fiber handler's response back through the net/http
// middleware, so nothing could be recorded.)
func buildIdemFiber(_ context.Context, env bench.Env) (bench.Server, error) {
	st, err := redisstore.Open(env.RedisURL, redisstore.Options{})
	if err != nil {
		return nil, err
	}
	mw := idemhttp.Middleware(st, idemhttp.Config{Retention: bench.Retention, Logger: env.Logger})
	app := fiber.New()
	app.Post("/payments", adaptor.HTTPHandler(mw(env.App)))
	return &fiberServer{app: app, closeFn: func() error { st.Close(); return nil }}, nil
}
