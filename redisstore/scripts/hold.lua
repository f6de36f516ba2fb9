-- hold: check that a lease is live and extend it, like renew, and return
-- its record's token and fingerprint. One atomic step. It is for stores
-- layered on this one (tieredstore), which complete the key elsewhere and
-- need the lease's fingerprint to do so.
--
-- KEYS[1]  the record key
-- ARGV[1]  lease id (16 bytes)
-- ARGV[2]  new lease duration in ms, from now (> 0)
--
-- Reply {1, token, ms left, fingerprint} held, {0, 0, 0} lease lost
-- (expired, taken over, released or completed): nothing changed.
local key = KEYS[1]
local rec = redis.pcall('GET', key)
if type(rec) ~= 'string' or #rec ~= 39 or string.byte(rec, 1) ~= 70 or string.sub(rec, 24) ~= ARGV[1] then
  return {0, 0, 0}
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local token = struct.unpack('>I6', rec, 2)
local at = math.max(now + tonumber(ARGV[2]), token + 1)
redis.call('PEXPIREAT', key, at)
return {1, token, at - now, string.sub(rec, 8, 23)}
