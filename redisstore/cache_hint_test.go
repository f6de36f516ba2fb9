package redisstore_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/rueidis"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/redistest"
	"github.com/idemkit/idem/redisstore"
)

// TestCacheLateHintAfterChange: an acquire whose script answered replay
// before this store deleted (or filled over) the record, but whose reply
// is handled after, must not leave a hint behind: the tracked copy of
// the old record may not be invalidated yet (the change went out on
// another connection), and the next Acquire would replay it. The client
// runs over a leakyCache, which never drops a copy, so a hint left
// behind shows as a stale replay.
func TestCacheLateHintAfterChange(t *testing.T) {
	for _, tc := range cacheChanges {
		t.Run(tc.name, func(t *testing.T) {
			_, s2, key := leakyStores(t, "latehint")

			// s2 has no hint: its Acquire runs the script, which answers
			// replay; the hook holds the reply until the change is done.
			var once atomic.Bool
			reached, release := make(chan struct{}), make(chan struct{})
			redisstore.OnHint(s2, func() {
				if once.CompareAndSwap(false, true) {
					close(reached)
					<-release
				}
			})
			got := make(chan idem.Acquisition, 1)
			go func() {
				a, err := s2.Acquire(context.Background(), idem.AcquireRequest{Key: key, Fingerprint: cacheFP, LeaseID: idem.NewLeaseID(), TTL: 10 * time.Second})
				if err != nil {
					t.Error(err)
				}
				got <- a
			}()
			<-reached
			tc.change(t, s2, key)
			close(release)
			if a := <-got; a.Outcome != idem.Replay || string(a.Response.Body) != "r1" {
				t.Fatalf("acquire in flight during the change: got %v, want the replay of r1 its script answered", a.Outcome)
			}
			if left := redisstore.HintLeft(s2, key); left != 0 {
				t.Errorf("after the change returned: a hint for %v is left; want none", left)
			}
			a := acquireRetry(t, s2, key, cacheFP)
			if a.Outcome != tc.want || a.Outcome == idem.Replay && string(a.Response.Body) != "r2" {
				body := ""
				if a.Response != nil {
					body = string(a.Response.Body)
				}
				t.Fatalf("acquire after the change: got %v %q, want %v (not the stale r1)", a.Outcome, body, tc.want)
			}
		})
	}
}

// cacheChanges are the changes by which this store deletes or overwrites
// a completed record (r1), and what Acquire answers after each.
var cacheChanges = []struct {
	name   string
	change func(t *testing.T, s *redisstore.Store, key idem.Key)
	want   idem.Outcome // what Acquire answers after the change
}{
	{"delete", func(t *testing.T, s *redisstore.Store, key idem.Key) {
		if ok, err := s.Delete(context.Background(), key); err != nil || !ok {
			t.Fatalf("Delete: %v, %v", ok, err)
		}
	}, idem.Acquired},
	{"fill", func(t *testing.T, s *redisstore.Store, key idem.Key) {
		blob, _ := (&idem.Response{Status: 201, Body: []byte("r2")}).AppendBinary(nil)
		r, err := s.Fill(context.Background(), redisstore.Fill{Key: key, Token: 1 << 47, Fingerprint: cacheFP, TTL: time.Minute, Response: blob})
		if err != nil || r != redisstore.Filled {
			t.Fatalf("Fill: %v, %v", r, err)
		}
	}, idem.Replay},
}

// leakyStores returns two stores on one client over a leakyCache, and a
// key s1 completed with r1 and replayed (the client holds a copy of r1).
func leakyStores(t *testing.T, name string) (s1, s2 *redisstore.Store, key idem.Key) {
	t.Helper()
	lc := newLeakyCache()
	c, err := rueidis.NewClient(rueidis.ClientOption{InitAddress: []string{single.Addr()},
		NewCacheStoreFn: func(rueidis.CacheStoreOption) rueidis.CacheStore { return lc }})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(c.Close)
	prefix := redistest.Prefix(name)
	s1, err1 := redisstore.NewRueidis(c, redisstore.Options{Prefix: prefix})
	s2, err2 := redisstore.NewRueidis(c, redisstore.Options{Prefix: prefix})
	if err := errors.Join(err1, err2); err != nil {
		t.Fatal(err)
	}
	key = cacheKey(t)
	completeWith(t, s1, key, "r1", time.Minute)
	if body, _ := replayed(t, s1, key); body != "r1" {
		t.Fatalf("replay by s1: got %q, want r1", body)
	}
	return s1, s2, key
}

// TestCacheHintDuringChange: an acquire sent after this store's Delete
// (or Fill) began but answered replay before the change reached Redis
// (its mark already counts the change's first forget) sets a hint, which
// the change's second forget, after the change, must drop: the tracked
// copy of the old record may not be invalidated yet, and the next Acquire
// would replay it. The change waits at its first forget until that
// acquire returned.
func TestCacheHintDuringChange(t *testing.T) {
	for _, tc := range cacheChanges {
		t.Run(tc.name, func(t *testing.T) {
			_, s2, key := leakyStores(t, "hintduring")
			var once atomic.Bool
			redisstore.OnForget(s2, func() {
				if !once.CompareAndSwap(false, true) {
					return
				}
				// Between the first forget and the change: an acquire
				// that finds r1 and notes its hint.
				a, err := s2.Acquire(context.Background(), idem.AcquireRequest{Key: key, Fingerprint: cacheFP, LeaseID: idem.NewLeaseID(), TTL: 10 * time.Second})
				if err != nil || a.Outcome != idem.Replay {
					t.Errorf("acquire before the change reached Redis: got %v, %v, want the replay of r1", a.Outcome, err)
				}
				if redisstore.HintLeft(s2, key) == 0 {
					t.Errorf("acquire before the change reached Redis: no hint noted, want one (the case this test is about)")
				}
			})
			tc.change(t, s2, key)
			if !once.Load() {
				t.Fatal("the change did not forget the record")
			}
			if left := redisstore.HintLeft(s2, key); left != 0 {
				t.Errorf("after the change returned: a hint for %v is left; want none", left)
			}
			a := acquireRetry(t, s2, key, cacheFP)
			if a.Outcome != tc.want || a.Outcome == idem.Replay && string(a.Response.Body) != "r2" {
				body := ""
				if a.Response != nil {
					body = string(a.Response.Body)
				}
				t.Fatalf("acquire after the change: got %v %q, want %v (not the stale r1)", a.Outcome, body, tc.want)
			}
		})
	}
}
