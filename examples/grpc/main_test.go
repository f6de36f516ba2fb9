package main

import (
	"regexp"
	"strings"
	"testing"
)

// TestRun runs the example: the first attempt times out, the next is told
// the charge is in flight, the last gets the stored reply; one charge.
func TestRun(t *testing.T) {
	var out strings.Builder
	if err := run(t.Context(), &out); err != nil {
		t.Fatal(err)
	}
	want := regexp.MustCompile(`^attempt 1: DeadlineExceeded after \d+ms; the charge goes on on the server
attempt 2: Aborted \(IDEMPOTENCY_KEY_IN_FLIGHT\), retry in 1s
attempt 3: OK, replayed from the store: ch_1: 4200 cents for acct_42 \(token \d+\)
charges made: 1, for one call
$`)
	if !want.MatchString(out.String()) {
		t.Fatalf("got:\n%s\nwant it to match:\n%s", out.String(), want)
	}
}
