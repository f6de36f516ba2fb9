-- raise: make the token of a lease just granted larger than a floor
-- (tieredstore: the largest token its durable store has committed for the
-- key, which Redis may have lost). One atomic step, safe to repeat.
--
-- KEYS[1]  the record key
-- ARGV[1]  lease id (16 bytes)
-- ARGV[2]  the floor (decimal)
--
-- Reply {1, token} with the lease's token, now larger than the floor,
-- {0, 0} lease lost: nothing changed. The record keeps its expiry, unless
-- the clock has to pass the new token first.
local key = KEYS[1]
local rec = redis.pcall('GET', key)
if type(rec) ~= 'string' or #rec ~= 39 or string.byte(rec, 1) ~= 70 or string.sub(rec, 24) ~= ARGV[1] then
  return {0, 0}
end
local token, floor = struct.unpack('>I6', rec, 2), tonumber(ARGV[2])
if token > floor then
  return {1, token}
end
token = floor + 1
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local left = redis.call('PTTL', key)
redis.call('SET', key, 'F' .. struct.pack('>I6', token) .. string.sub(rec, 8),
  'PXAT', math.max(now + math.max(left, 1), token + 1))
return {1, token}
