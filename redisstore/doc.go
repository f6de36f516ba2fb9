// Package redisstore is an idem.Store on Redis: one string key per record,
// every transition one embedded Lua script (scripts/*.lua) and one round
// trip, time from Redis TIME. It runs on a single node, with Sentinel and
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
// What it does not guarantee: a change by another client reaches the
// cache when Redis's invalidation message does (Redis sends it with the
// change's reply); a connection that delivers nothing without closing (a
// partition) keeps its copies until rueidis declares it dead (3s with
// Open). With NewRueidis and a client that sends reads to replicas
// (SendToReplicas, ReplicaOnly), a replica may lag a purge by its
// replication delay: set Options.CacheSize negative there.
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
