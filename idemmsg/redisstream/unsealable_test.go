package redisstream

import (
	"context"
	"errors"
	"log/slog"
	"strings"
	"sync"
	"testing"

	"github.com/redis/go-redis/v9"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemmsg"
	"github.com/idemkit/idem/internal/sealtest"
	"github.com/idemkit/idem/memstore"
)

// An entry whose key completed with a sealed result the consumer's ring
// cannot open is not handled again and not left pending: it is
// dead-lettered (permanent, as a mismatch), with the error naming the key
// id, and reported to OnError.
func TestUnsealableDeadLettered(t *testing.T) {
	forEachLib(t, func(t *testing.T, lib string) {
		store := memstore.New(memstore.Options{})
		e := newEnvWith(t, lib, envOptions{store: store})
		ns := e.stream + "/" + e.group
		a, err := idemmsg.New(store, idemmsg.Config{Namespace: ns, Seal: sealtest.Ring(t, "a1")})
		if err != nil {
			t.Fatal(err)
		}
		if res, err := a.Handle(context.Background(), idemmsg.Delivery{Key: "paid", Attempt: 1}, func(context.Context) error { return nil }); err != nil || res.Outcome != idemmsg.Executed {
			t.Fatal(res, err)
		}
		e.dedup, err = idemmsg.New(store, idemmsg.Config{Namespace: ns, Seal: sealtest.Ring(t, "b1"), Logger: slog.New(slog.DiscardHandler)})
		if err != nil {
			t.Fatal(err)
		}
		e.publish("paid", "fresh")
		c := e.consumer("c1")
		c.DeadLetterStream = e.stream + ":dead"
		var mu sync.Mutex
		var reported []error
		c.OnError = func(err error) { mu.Lock(); reported = append(reported, err); mu.Unlock() }
		var handled []string
		c.Handler = func(ctx context.Context, msg redis.XMessage) error {
			mu.Lock()
			handled = append(handled, msg.Values["k"].(string))
			mu.Unlock()
			return e.ledger.Apply(ctx, msg.Values["k"].(string))
		}
		e.start(c)
		waitFor(t, "both entries acknowledged", e.settled)
		e.checkLedger([]string{"fresh"})
		mu.Lock()
		defer mu.Unlock()
		if len(handled) != 1 || handled[0] != "fresh" {
			t.Errorf("handled %v, want only fresh", handled)
		}
		if len(reported) != 1 || !errors.Is(reported[0], idem.ErrUnsealable) {
			t.Errorf("OnError got %v, want one ErrUnsealable", reported)
		}
		dead, err := e.client.XRange(context.Background(), c.DeadLetterStream, "-", "+").Result()
		if err != nil || len(dead) != 1 || dead[0].Values["k"] != "paid" || !strings.Contains(dead[0].Values[FieldError].(string), "key id a1") {
			t.Fatalf("dead-letter stream: got %v (%v), want paid's entry with an error naming key id a1", dead, err)
		}
	})
}
