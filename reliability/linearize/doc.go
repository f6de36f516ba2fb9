// Package linearize checks that idem's stores are linearizable: many
// clients run Acquire, Renew, Complete, Release and Get against a real
// Store on a few keys, every call's invocation and return are recorded,
// and porcupine checks the history, partitioned by key, against a
// sequential model of the per-key state machine of package idem (see
// model_test.go). Calls that fail with a timeout or a connection error are
// indeterminate: they may or may not have taken effect, at any moment after
// their invocation, so they are recorded with an "unknown" output and a
// return at the end of the history.
//
// The package holds only tests; its rows go to RELIABILITY.md through
// internal/reltest.
package linearize
