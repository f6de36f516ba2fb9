package kafka

import "github.com/twmb/franz-go/pkg/kgo"

// crashBeforeCommit sets c's crash hook: f is called when a record is
// done, before any offset past it is committed, and false simulates a
// crash there: nothing more is committed (on any partition) and Run
// returns errCrashed. Production code only checks the hook for nil; it is
// a field rather than a package variable because the tests run a crashing
// consumer beside healthy ones.
func (c *Consumer) crashBeforeCommit(f func(rec *kgo.Record) bool) { c.beforeCommit = f }
