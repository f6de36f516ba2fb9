package idem_test

import (
	"fmt"
	"strings"
	"testing"

	"github.com/idemkit/idem"
)

// TestEnumStrings checks that every value of the public enums, the zero
// value included, prints as a name, not as its number.
func TestEnumStrings(t *testing.T) {
	for _, c := range []struct {
		v    fmt.Stringer
		want string
	}{
		{idem.State(0), "none"},
		{idem.StateInFlight, "in_flight"},
		{idem.StateCompleted, "completed"},
		{idem.StateReleased, "released"},
		{idem.Outcome(0), "none"},
		{idem.NoOutcome, "none"},
		{idem.Acquired, "acquired"},
		{idem.Replay, "replay"},
		{idem.InFlight, "in_flight"},
		{idem.Mismatch, "mismatch"},
	} {
		if got := c.v.String(); got != c.want {
			t.Errorf("%T(%d).String() = %q, want %q", c.v, c.v, got, c.want)
		}
	}
	// The first value past the named ones has no name: it prints its number.
	for _, v := range []fmt.Stringer{idem.StateReleased + 1, idem.Mismatch + 1} {
		if got := v.String(); !strings.Contains(got, "(") {
			t.Errorf("%T(%d).String() = %q, want type(number) for a value with no name", v, v, got)
		}
	}
}
