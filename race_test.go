//go:build race

package idem_test

// raceEnabled: the race detector adds one allocation to some calls.
const raceEnabled = true
