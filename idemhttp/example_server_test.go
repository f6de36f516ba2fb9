package idemhttp_test

import (
	"context"
	"errors"
	"fmt"
	"log"
	"net/http"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/redisstore"
)

func createCharge(w http.ResponseWriter, r *http.Request) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(http.StatusCreated)
	fmt.Fprint(w, `{"charge":"ch_1"}`)
}

// A production server: Redis, server timeouts, and a shutdown that lets
// running handlers finish and store their responses before it cancels
// them. (Compiled, not run: it listens on :8080 until SIGTERM.)
func ExampleMiddleware_server() {
	store, err := redisstore.Open("redis://localhost:6379", redisstore.Options{}) // or memstore.New(memstore.Options{})
	if err != nil {
		log.Fatal(err) // a malformed URL, or Redis unreachable: Open dials at once
	}
	defer store.Close()
	mux := http.NewServeMux()
	mux.HandleFunc("POST /charges", createCharge)
	stop, stopWork := context.WithCancel(context.Background())
	srv := &http.Server{
		Addr:              ":8080",
		Handler:           idemhttp.Middleware(store, idemhttp.Config{StopContext: stop})(mux),
		ReadHeaderTimeout: 10 * time.Second, // slowloris: see RELIABILITY.md
		ReadTimeout:       time.Minute,
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		sig, _ := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
		<-sig.Done()
		grace, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if err := srv.Shutdown(grace); err != nil { // handlers still running after 30s:
			stopWork() // cancel their work (idem.ErrStopped); a handler that then answers 5xx releases its key
			srv.Close()
		}
	}()
	if err := srv.ListenAndServe(); !errors.Is(err, http.ErrServerClosed) {
		log.Fatal(err)
	}
	<-done
}
