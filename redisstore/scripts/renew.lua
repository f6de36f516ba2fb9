-- renew: extend a live lease. One atomic step.
--
-- KEYS[1]  the record key
-- ARGV[1]  lease id (16 bytes)
-- ARGV[2]  new lease duration in ms, from now (> 0)
--
-- Reply {1} renewed, {0} lease lost (expired, taken over, released or
-- completed): nothing changed.
local key = KEYS[1]
local rec = redis.pcall('GET', key)
if type(rec) ~= 'string' or #rec ~= 39 or string.byte(rec, 1) ~= 70 or string.sub(rec, 24) ~= ARGV[1] then
  return {0}
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('PEXPIREAT', key, math.max(now + tonumber(ARGV[2]), struct.unpack('>I6', rec, 2) + 1))
return {1}
