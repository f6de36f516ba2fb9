// Package reliability holds no code: its subpackages are test suites that
// attack idem the way production will (crashes, zombie holders, Redis
// faults, failover, hostile input) and report what they saw in the rows of
// RELIABILITY.md. A short version of every scenario runs in the normal test
// command; `make reliability` runs the long versions and rebuilds the table.
package reliability
