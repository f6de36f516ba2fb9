// Package tiered attacks the tiered store (tieredstore: leases and replays
// on Redis, completions in PostgreSQL) with the faults it exists for, under
// load, with a ledger table in the same PostgreSQL database as the
// completions: one ledger row per committed effect, written in the same
// transaction as the completion (BeginFunc). The faults: a Redis FLUSHALL,
// a Redis restart without persistence, Redis paused, a Sentinel failover
// without WAIT, and the relay to Redis down while commits go on. For each it reports a row with
// reltest.Report, and the same load on the plain Redis store (the effect
// committed to PostgreSQL, then Complete on Redis) under the same fault,
// for comparison.
//
// What is counted: a duplicate is a ledger row beyond the first for a
// key; a lost completion is a key for which a client got an answer and a
// later client another one; a stuck key is one still in flight a lease and
// a grace after the load. The tiered store must show 0 of each under every
// fault, and every committed effect must be what clients got and what the
// completion row holds.
package tiered
