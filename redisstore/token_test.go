package redisstore_test

import (
	"context"
	"encoding/binary"
	"errors"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/redisstore"
)

// Two leases with one token: after a failover that lost the key's record,
// two servers can issue the same token to two holders in the same
// millisecond, and both complete on the new primary. The second Complete
// must not be taken for a repeat of the first: its result is not in the
// record. (Staged on one server: the first lease's record is replaced by
// the second's with the same token, as the promoted replica would hold.)
func TestCompleteSameTokenOtherLease(t *testing.T) {
	ctx := context.Background()
	c := redis.NewClient(&redis.Options{Addr: single.Addr()})
	defer c.Close()
	s, err := redisstore.New(c, redisstore.Options{Prefix: "sametoken:"})
	if err != nil {
		t.Fatal(err)
	}
	key := scope(1)
	fp := idem.Fingerprint{7}
	acq, err := s.Acquire(ctx, idem.AcquireRequest{Key: key, Fingerprint: fp, LeaseID: idem.NewLeaseID(), TTL: time.Minute})
	if err != nil || acq.Outcome != idem.Acquired {
		t.Fatalf("Acquire: %v %v", acq.Outcome, err)
	}
	first := acq.Lease
	second := idem.Lease{Key: key, ID: idem.NewLeaseID(), Token: first.Token, TTL: time.Minute}
	var token [8]byte
	binary.BigEndian.PutUint64(token[:], first.Token)
	rec := "F" + string(token[2:]) + string(fp[:]) + string(second.ID[:])
	if err := c.Set(ctx, s.KeyName(key), rec, time.Minute).Err(); err != nil {
		t.Fatal(err)
	}
	stored := &idem.Response{Status: 201, Body: []byte("second run")}
	if err := s.Complete(ctx, second, stored, time.Hour); err != nil {
		t.Fatalf("Complete by the second lease: %v", err)
	}
	if err := s.Complete(ctx, first, &idem.Response{Status: 201, Body: []byte("first run")}, time.Hour); !errors.Is(err, idem.ErrLeaseLost) {
		t.Fatalf("Complete by the first lease, same token, another result: got %v, want ErrLeaseLost (its result is not stored)", err)
	}
	// The same bytes are stored: then success is true.
	if err := s.Complete(ctx, first, stored, time.Hour); err != nil {
		t.Fatalf("Complete by the first lease with the stored result: got %v, want nil", err)
	}
	got, ok, err := s.Get(ctx, key)
	if err != nil || !ok || string(got.Response.Body) != "second run" {
		t.Fatalf("record: %+v %v %v, want the second run's", got, ok, err)
	}
}
