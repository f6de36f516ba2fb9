// Package crash holds no code: its tests are the "Crash" and "Zombie
// holder" scenarios of the reliability suite. Several server processes
// (the test binary re-executed as a child) serve the same keys through
// idemhttp.Middleware over a shared Redis, or through pgstore with the
// effect committed in the same transaction as CompleteTx; the tests kill
// them with SIGKILL at chosen points of the handler and at random moments,
// pause them with SIGSTOP past their lease, and count the effects that a
// fencing ledger in the test process accepted and refused.
package crash
