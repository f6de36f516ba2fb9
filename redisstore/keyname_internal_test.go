package redisstore

import (
	"strconv"
	"testing"

	"github.com/idemkit/idem"
)

// KeyName is the prefix, then the key's String in braces (its hash tag),
// built without a string for the key's own form (issue 36).
func TestKeyName(t *testing.T) {
	s := &Store{prefix: "idem:"}
	for i := range 50 {
		k, _ := idem.Scope{}.Key(strconv.Itoa(i))
		if got, want := s.KeyName(k), "idem:{"+k.String()+"}"; got != want {
			t.Fatalf("KeyName %q, want %q", got, want)
		}
	}
	if n := testing.AllocsPerRun(100, func() { _ = s.KeyName(idem.Key{1}) }); n > 1 {
		t.Errorf("KeyName: %v allocations, want 1", n)
	}
}
