-- complete: store the result of a live lease. One atomic step.
--
-- KEYS[1]  the record key
-- ARGV[1]  lease id (16 bytes)
-- ARGV[2]  the lease's token (6 bytes, as in the record)
-- ARGV[3]  retention in ms (> 0)
-- ARGV[4]  the encoded response
-- ARGV[5]  optional: '1' when a WAIT follows on the same connection
--          (Options.WaitReplicas). A repeat then writes the record again,
--          unchanged, so that the WAIT also covers the first write, whose
--          reply was lost and which may have gone out on another connection.
--
-- Reply {1} completed (also when this lease already completed it: a repeat
-- after a lost reply), {0} lease lost: nothing changed.
--
-- A completed record keeps the token, not the lease id, so a repeat is
-- told by the token and the response together: the record must hold this
-- very response. The token alone is not enough: when a failover lost the
-- key's record, two servers can issue one token to two leases in the same
-- millisecond, and the later Complete of the two would otherwise be taken
-- for a repeat and answered {1} with its result written nowhere. If both
-- runs answered the same bytes, {1} is true: the record holds them.
local key = KEYS[1]
local rec = redis.pcall('GET', key)
if type(rec) ~= 'string' then -- absent, or another kind of value
  return {0}
end
local kind = string.byte(rec, 1)
if kind == 70 and #rec == 39 and string.sub(rec, 24) == ARGV[1] then -- 'F', ours
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  redis.call('SET', key, 'C' .. string.sub(rec, 2, 23) .. ARGV[4],
    'PXAT', math.max(now + tonumber(ARGV[3]), struct.unpack('>I6', rec, 2) + 1))
  return {1}
end
if kind == 67 and #rec >= 24 and string.sub(rec, 2, 7) == ARGV[2] and string.sub(rec, 24) == ARGV[4] then -- 'C', ours
  if ARGV[5] == '1' then
    redis.call('SET', key, rec, 'KEEPTTL')
  end
  return {1}
end
return {0}
