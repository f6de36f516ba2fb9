// Package redisstore is an idem.Store on Redis: one string key per record,
// time from the server's TIME. It runs on a single node, with Sentinel and
// on Redis Cluster, over go-redis v9 (New) or rueidis (NewRueidis, Open).
//
// # Replays without a round trip: the replay cache
//
// A completed record does not change until it is purged or expires. With
// rueidis (Open, NewRueidis), Acquire reads a completed record through
// rueidis's server-assisted client-side cache: a GET of the record key
// under RESP3 CLIENT TRACKING (opt-in mode), kept in process memory, which
// Redis invalidates when the key is written, deleted, expires or the
// database is flushed, and which rueidis drops with the connection it was
// read on (a lost connection, a restart, a failover). A replay it holds
// costs no round trip.
//
// Only a completed record whose fingerprint is the request's is answered
// from memory; no record, in flight, released, another fingerprint
// (mismatch) or a value that is not a record go to the acquire script,
// which decides as it always has. The cache is read only for keys this
// process has seen completed (its Complete, or the script answering
// replay) until the record's expiry as then known, so that first requests
// stay at one round trip; a cached copy never outlives that expiry, nor
// the PTTL rueidis reads with it. Get, Renew, Complete, Release, Delete and
// the batch methods always go to Redis.
//
// What it does not guarantee: a change reaches the cache when Redis's
// invalidation message does. Redis sends it with the change's reply only
// to the connection the change went out on; rueidis reads the cache on
// one connection per node and sends other commands on any of several, so
// the invalidation of a change, this process's included, may arrive a
// moment after the change's reply. For its own Delete and Fill the store
// makes up for it: it drops the key's hint before and after the change,
// and ignores the hints of calls that were in flight meanwhile, so it
// does not read the cache for that key again until it learns anew that
// the key is completed (at least one more round trip, by when the
// invalidation has long been sent, though nothing orders the two). A
// connection that delivers nothing without closing (a partition) keeps
// its copies until rueidis declares it dead (3s with Open). With
// NewRueidis and a client that sends reads to replicas (SendToReplicas,
// ReplicaOnly), a replica may lag a purge by its replication delay: set
// Options.CacheSize negative there.
//
// On by default with Open: Options.CacheSize bytes per connection
// (DefaultCacheSize, 16 MiB; Open uses up to four connections per node,
// one per Cluster node), negative for off; Open runs without it where the
// server refuses CLIENT TRACKING (before Redis 6, or an ACL without
// +client|tracking). NewRueidis reads through the client's own cache
// (bounded by its CacheSizeEachConn) unless CacheSize is negative. New
// (go-redis) has no cache: go-redis v9's client-side caching is marked
// experimental and lives in the caller's client; every replay runs the
// script there. Store.CacheStats counts hits and misses.
//
// # Paths: Lua or native commands
//
// A store carries out its transitions on one of two paths (Options.Path):
//
//   - Lua: every transition is one embedded Lua script (scripts/*.lua) and
//     one round trip. Any Redis ≥ 6.2 with scripting.
//   - Native: plain commands around a compare-and-set, SET … IFEQ (Valkey ≥
//     8.1, Redis ≥ 8.4), with no script: it works where scripting is off
//     or absent (Valkey 9 with its Lua module unloaded, managed services).
//
// PathAuto, the default, asks the server on the store's first call whether
// SET has the IFEQ argument (COMMAND DOCS SET; never a version string) and
// takes the native path when it does. Both paths write the same records
// (record.go) and give the same answers, so a store can switch paths with
// its records in place, and stores on both paths can share a server.
//
// How the native path keeps each transition atomic (native.go):
//
//   - Acquire claims the key: SET key F… NX GET PX ttl, then TIME,
//     pipelined (inside MULTI/EXEC on Cluster). An absent key is taken in
//     that one round trip, and a mismatch with a completed record is
//     answered in it. A record in flight (a mismatch with one included)
//     or a replay (one the replay cache did not answer) also needs the
//     record's TTL: GET and PTTL in a transaction, a second round trip
//     (when the record is no longer the one the claim found, the claim
//     starts over, so that the TTL is that record's). The claim's token is the client's lower-bound
//     estimate of the server's clock plus 50ms; it stands only when TIME,
//     read after the claim, is not later than it (an absent key has had
//     every earlier token passed by the clock, as records expire only
//     after their token) and it is at most 250ms ahead. Otherwise a
//     second step (SET IFEQ the claim) sets the token to the server's
//     TIME. A lease of 500ms or less always takes that second step, which
//     also sets its expiry. A released record is taken by SET IFEQ with
//     max(last+1, server time), as the script does.
//   - Complete and Release of a lease the same Store granted are one SET
//     … IFEQ <the lease's in-flight record> PX … (the Store remembers the
//     fingerprint of the leases it grants, at most 65,536). Otherwise, and
//     for Renew and the layered transitions (Hold, Fill, RaiseToken), the
//     store reads the record and TIME (and the TTL, for RaiseToken),
//     pipelined, decides as the script would, and writes with SET … IFEQ
//     <the value read> and the expiry the script would set (PXAT, or
//     KEEPTTL): never a write that drops the TTL. When the record changed
//     in between, nothing is written and the transition starts over (at
//     most 16 times, then an error wrapping ErrContention). Record values
//     never repeat on a key (each holds its token), so an equal value is
//     the record that was read.
//   - Get reads the value and its TTL in one MULTI/EXEC.
//   - Batches (AcquireMany, CompleteMany, ReleaseMany) on a single node
//     (or Sentinel's primary) send the first appearance of each key in one
//     pipeline: the claims (SET … NX GET PX for each key, then one TIME,
//     which runs after every claim and so proves each claim's token as
//     the single acquire's does), or the one SET … IFEQ of each lease the
//     Store granted. A key that needs more (a record was there, a lease of
//     500ms or less, a token that does not stand, a lease the Store did
//     not grant) goes on from there as its single transition does, the
//     keys in parallel (pipelined by the client); the later appearances of
//     a key follow its first, in batch order. On Cluster each key takes
//     its single transition, the keys in parallel. The same answers as
//     the batch scripts; a failed pipeline fails the keys it carried.
//
// What differs from the Lua path: a claim's token may run up to 250ms
// ahead of the server's clock (tokens still strictly increase per key);
// when a claim reaches the server more than 50ms after the client's
// estimate (a stalled client or network), its provisional token is
// visible to Get (inspection) until the second step replaces it, and only
// the replaced one is ever granted (the linearizability suite's model of
// this path lets a Get show an in-flight lease with a token below its
// own until the lease's token is known to be in place); a
// lease that needs the second step, a renewal and a claim of a released
// record compute their expiry from the server time of a read one round
// trip before the write, so such a lease ends up to that round trip
// earlier (never later) than asked; a short lease whose holder dies
// between the two steps of its claim stays in flight for up to 2s; Fill
// over a value of another type overwrites it without a compare. The
// estimate of the server's clock is a lower bound as long as the server's
// clock does not go back (as the Lua path's tokens also assume); a claim
// more than 250ms ahead of TIME is fixed all the same. RaiseToken keeps
// the record's expiry as it stands when it writes (KEEPTTL), so a Renew
// between its read and its write (which leaves the value as it was) is
// kept, unless the clock must first pass the new token; then, as on the
// Lua path, the expiry is set to max(the expiry read, token+1), which
// undoes such a Renew's extension. WaitReplicas works
// on both paths (the native WAIT runs on the connection that wrote;
// MOVED and ASK are not followed there, the call fails instead).
//
// # Durability: Options.WaitReplicas
//
// Redis replicates asynchronously: a primary acknowledges a write before
// any replica has it, so a failover can lose a record written just before
// it, and a repeat of that operation then runs again (its fencing token is
// still larger; tokens follow the clock).
//
// With Options.WaitReplicas = n > 0, Complete sends the complete script and
// WAIT n WaitTimeout together, on one connection to the primary that owns
// the key (for Cluster, the slot's primary; MOVED and ASK are followed with
// the WAIT resent next to the script), and returns nil only when at least n
// replicas have acknowledged the record. A repeated Complete (after a lost
// reply) writes the record again, unchanged, so that its WAIT covers it.
// Otherwise it returns, after WaitTimeout, an *idem.StoreError (Op
// "complete") wrapping a *ReplicationError that matches ErrNotReplicated.
// WAIT rolls nothing back: the record stays completed on the primary,
// repeats are replayed from it, and the lease is over. What callers see:
//
//   - idem.Guard.Do returns the work's response together with the error;
//     the work ran once. ErrNotReplicated is idem.ErrNotReplicated, so
//     Attempt.Complete does not release after it (the record is written).
//   - idemhttp has already sent the handler's response to the client (it
//     streams): the client gets the original answer, and the middleware
//     logs a warning that the response is stored but not on enough
//     replicas; a retry is replayed from the primary unless a failover
//     loses the record first.
//
// Only Complete waits. Acquire does not: a WAIT there would add a
// replication round trip to every first request, and what a failover can
// lose in flight is a lease, whose loss at worst lets a retry run the work
// while the first holder still does — the case fencing tokens exist for
// (the new token is larger, and the first holder's Complete then finds its
// lease gone and returns idem.ErrLeaseLost). A lost completion instead
// turns an acknowledged, replayable result into a second execution long
// after the first, which is what WAIT guards against.
//
// What WAIT changes: a failover that promotes a replica which acknowledged
// the record keeps it, and a completion written to an old primary after
// its replica was promoted (Sentinel demotes the old primary only seconds
// later, and clients keep writing to it until they hear of the switch)
// fails its WAIT instead of succeeding and then vanishing. The tests in
// reliability/failover measure it: under SENTINEL FAILOVER, about a
// thousand or more acknowledged completions were lost without WAIT, none with
// WaitReplicas 1. (A manual CLUSTER FAILOVER without FORCE loses nothing
// either way: the primary holds writes until the replica has caught up.)
// What remains: WAIT is not
// consensus. An automatic failover may promote a replica that had not
// acknowledged (with several replicas, WaitReplicas below their number),
// the primary and the acknowledging replicas can all be lost together
// (nothing is persisted unless AOF is on, and with appendfsync everysec
// the last second can be lost even then; replicas acknowledge what they
// applied in memory), and a completion whose WAIT failed is on the primary
// only. Default 0: no WAIT, no extra cost. WaitTimeout (default 1s) must be
// shorter than Options.Timeout and a go-redis client's ReadTimeout;
// WaitReplicas needs a *redis.Client (single node or Sentinel) or a
// *redis.ClusterClient with go-redis (not a Ring), and works with every
// rueidis client.
package redisstore
