package hostile

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/internal/redisserver"
	"github.com/idemkit/idem/internal/reltest"
	"github.com/idemkit/idem/redisstore"
)

// idemCommands is the smallest command set the store needs: the scripts
// run as EVALSHA, falling back to EVAL on NOSCRIPT, and call GET, SET,
// TIME, PTTL and PEXPIREAT inside; Delete (idem purge) is DEL.
var idemCommands = []string{"+evalsha", "+eval", "+get", "+set", "+time", "+pttl", "+pexpireat", "+del"}

// lockedBuffer is a log sink for the middleware's logger.
type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// TestRedisACL runs the store as a Redis user limited to idem's prefix
// and to the commands the scripts need, on both clients (rueidis through
// Open and a URL, go-redis through New), and as users that lack the key
// pattern, a command, or scripting: those get 503 from the middleware, a
// store error naming NOPERM, and nothing runs or is written.
func TestRedisACL(t *testing.T) {
	t.Parallel()
	srv, err := redisserver.StartServer()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv.Stop)
	setUser := func(name string, rules ...string) {
		t.Helper()
		args := append([]string{"ACL", "SETUSER", name, "reset", "on", ">pw-" + name, "resetchannels", "-@all"}, rules...)
		if _, err := srv.Do(args...); err != nil {
			t.Fatalf("ACL SETUSER %s: %v", name, err)
		}
	}
	setUser("idemuser", append([]string{"~idem:*"}, idemCommands...)...)
	setUser("otherkeys", append([]string{"~other:*"}, idemCommands...)...)
	setUser("noset", append([]string{"~idem:*"}, without(idemCommands, "+set")...)...)
	setUser("noscripts", append([]string{"~idem:*"}, without(idemCommands, "+evalsha", "+eval")...)...)

	tryOpen := func(client, user string) (*redisstore.Store, error) {
		t.Helper()
		var s *redisstore.Store
		var err error
		switch client {
		case "rueidis":
			s, err = redisstore.Open(fmt.Sprintf("redis://%s:pw-%s@%s", user, user, srv.Addr()), redisstore.Options{})
		case "go-redis":
			c := redis.NewClient(&redis.Options{Addr: srv.Addr(), Username: user, Password: "pw-" + user, MaxRetries: -1})
			t.Cleanup(func() { c.Close() })
			s, err = redisstore.New(c, redisstore.Options{Timeout: 2 * time.Second})
		}
		if err == nil {
			t.Cleanup(func() { s.Close() })
		}
		return s, err
	}
	open := func(client, user string) *redisstore.Store {
		t.Helper()
		s, err := tryOpen(client, user)
		if err != nil {
			t.Fatalf("%s as %s: %v", client, user, err)
		}
		return s
	}

	for _, client := range []string{"rueidis", "go-redis"} {
		// The limited user: everything works.
		s := open(client, "idemuser")
		a := &app{}
		ts, _ := startServer(t, idemhttp.Middleware(s, idemhttp.Config{Logger: quietLogger()})(a.handler()), nil)
		c := newClient(10 * time.Second)
		key := "acl-" + client
		first := mustPost(t, c, ts.URL+"/charges", key, `{"amount":1}`, nil)
		again := mustPost(t, c, ts.URL+"/charges", key, `{"amount":1}`, nil)
		other := mustPost(t, c, ts.URL+"/charges", key, `{"amount":2}`, nil)
		if first.status != http.StatusCreated || again.header.Get(idemhttp.HeaderReplayed) != "true" || other.status != http.StatusUnprocessableEntity || a.runs.Load() != 1 {
			t.Errorf("%s as idemuser: %d, %d (replayed %q), %d; handler ran %d times; want 201, replay, 422, once",
				client, first.status, again.status, again.header.Get(idemhttp.HeaderReplayed), other.status, a.runs.Load())
		}
		k, _ := idem.Scope{Method: http.MethodPost, Route: "POST /charges"}.Key(key)
		if rec, ok, err := s.Get(context.Background(), k); err != nil || !ok || rec.State != idem.StateCompleted {
			t.Errorf("%s as idemuser: Get: %v %v %v", client, rec.State, ok, err)
		}
		if ok, err := s.Delete(context.Background(), k); err != nil || !ok {
			t.Errorf("%s as idemuser: Delete: %v %v", client, ok, err)
		}
		// After SCRIPT FLUSH the scripts are reloaded with EVAL: still
		// within the user's rights.
		if _, err := srv.Do("SCRIPT", "FLUSH"); err != nil {
			t.Fatal(err)
		}
		if got := mustPost(t, c, ts.URL+"/charges", key+"-after-flush", `{}`, nil); got.status != http.StatusCreated {
			t.Errorf("%s as idemuser after SCRIPT FLUSH: %d %s", client, got.status, got.body)
		}
		reltest.Report(t, reltest.Row{
			Scenario: "hostile: Redis ACL user limited to idem's prefix", Store: "redis (single), " + client,
			Fault:    "user ~idem:* " + strings.Join(idemCommands, " ") + " (nothing else)",
			Requests: 4, Keys: 2,
			Notes: "execute, replay, 422, Get, Delete and EVAL after SCRIPT FLUSH all work",
		})

		// Users without the rights: 503, NOPERM, nothing runs or is written.
		for _, user := range []string{"otherkeys", "noset", "noscripts"} {
			// Redis 7.0 reports a command refused inside a script without
			// the NOPERM code: "The user executing the script can't run
			// this command or subcommand script: <sha>, on
			// @user_script:<line>."
			want := "NOPERM"
			if user == "noset" {
				want = "can't run this command"
			}
			keysBefore := dbsizeAll(t, srv)
			s, err := tryOpen(client, user)
			if err != nil {
				// Refused at open (Open reads the store id there): the
				// same error an Acquire would give, before any request.
				if !strings.Contains(err.Error(), "NOPERM") || !strings.Contains(err.Error(), "the Redis user needs the keys ~idem:*") {
					t.Errorf("%s as %s: open error %v, want one saying NOPERM and what the store needs", client, user, err)
				}
				if n := dbsizeAll(t, srv) - keysBefore; n != 0 {
					t.Errorf("%s as %s: %d keys written", client, user, n)
				}
				reltest.Report(t, reltest.Row{
					Scenario: "hostile: Redis ACL user without the rights", Store: "redis (single), " + client,
					Fault: "user " + user, Requests: 0, Keys: 0,
					Notes: fmt.Sprintf("refused when the store opens, 0 keys written: %.160s", firstLine(err)),
				})
				continue
			}
			logs := &lockedBuffer{}
			a := &app{}
			ts, _ := startServer(t, idemhttp.Middleware(s, idemhttp.Config{Logger: slog.New(slog.NewTextHandler(logs, nil))})(a.handler()), nil)
			got := mustPost(t, c, ts.URL+"/charges", "acl-denied", `{"amount":1}`, nil)
			_, aerr := s.Acquire(context.Background(), idem.AcquireRequest{Key: k, LeaseID: idem.NewLeaseID(), TTL: time.Second})
			var se *idem.StoreError
			switch {
			case got.status != http.StatusServiceUnavailable || got.problemType() != idemhttp.ProblemStoreUnavailable:
				t.Errorf("%s as %s: %d %s, want 503 %s", client, user, got.status, got.body, idemhttp.ProblemStoreUnavailable)
			case a.runs.Load() != 0:
				t.Errorf("%s as %s: the handler ran", client, user)
			case aerr == nil || !strings.Contains(aerr.Error(), want):
				t.Errorf("%s as %s: Acquire error %v, want one saying %q", client, user, aerr, want)
			case !errors.As(aerr, &se):
				t.Errorf("%s as %s: Acquire error %T, want *idem.StoreError", client, user, aerr)
			case !strings.Contains(logs.String(), want):
				t.Errorf("%s as %s: the middleware's log does not say %q:\n%s", client, user, want, logs)
			case !strings.Contains(aerr.Error(), "the Redis user needs the keys ~idem:* and the commands +evalsha"):
				t.Errorf("%s as %s: Acquire error %v does not say what the store needs", client, user, aerr)
			}
			if n := dbsizeAll(t, srv) - keysBefore; n != 0 {
				t.Errorf("%s as %s: %d keys written", client, user, n)
			}
			reltest.Report(t, reltest.Row{
				Scenario: "hostile: Redis ACL user without the rights", Store: "redis (single), " + client,
				Fault: "user " + user, Requests: 1, Keys: 1, ClientErrors: map[string]int{fmt.Sprint(got.status): 1},
				Notes: fmt.Sprintf("handler ran %d times, 0 keys written; store error: %.160s", a.runs.Load(), firstLine(aerr)),
			})
		}
	}
}

func without(list []string, drop ...string) []string {
	return slices.DeleteFunc(slices.Clone(list), func(x string) bool { return slices.Contains(drop, x) })
}

func dbsizeAll(t *testing.T, srv *redisserver.Server) int {
	t.Helper()
	keys, err := srv.Do("KEYS", "*")
	if err != nil {
		t.Fatal(err)
	}
	if keys == "" {
		return 0
	}
	return len(strings.Split(keys, "\n"))
}

func firstLine(err error) string {
	if err == nil {
		return "none"
	}
	s, _, _ := strings.Cut(err.Error(), "\n")
	return s
}
