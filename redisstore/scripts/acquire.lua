-- acquire: take an idempotency record, or report why not. One atomic step.
--
-- KEYS[1]  the record key
-- ARGV[1]  lease id (16 bytes)
-- ARGV[2]  fingerprint (16 bytes)
-- ARGV[3]  lease duration in ms (> 0)
--
-- Reply {code, token, ms[, value]}:
--   1 acquired   token of the lease (a repeated call with the same lease id
--                gets its own lease back), lease ms left
--   2 replay     the record's token, retention ms left, the record value
--   3 in flight  the holder's token, lease ms left
--   4 mismatch   the record's token (the fingerprint differs)
--   0 corrupt    the stored value is not a record (or not a string, or an
--                in-flight record without an expiry)
--
-- Record values (token: 6-byte big-endian ms-based fencing token):
--   'F' token fingerprint(16) lease_id(16)   in flight, expires at lease end
--   'C' token fingerprint(16) response        completed, expires at retention end
--   'R' token                                 released: absent to acquire,
--                                             kept so the next token is larger
-- A new token is max(previous token + 1, server time in ms), and every
-- record expires only after the clock has passed its token, so tokens
-- strictly increase per key even across expiry.
local key = KEYS[1]
local rec = redis.pcall('GET', key)
if type(rec) == 'table' then -- WRONGTYPE: another kind of value
  return {0, 0, 0}
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local token = now
if rec then
  local kind, n = string.byte(rec, 1), #rec
  if kind == 70 and n == 39 then -- 'F'
    local held, left = struct.unpack('>I6', rec, 2), redis.call('PTTL', key)
    if left < 0 then
      return {0, 0, 0}
    end
    if string.sub(rec, 24) == ARGV[1] then
      return {1, held, left}
    end
    if string.sub(rec, 8, 23) ~= ARGV[2] then
      return {4, held, 0}
    end
    return {3, held, left}
  elseif kind == 67 and n >= 24 then -- 'C'
    local done = struct.unpack('>I6', rec, 2)
    if string.sub(rec, 8, 23) ~= ARGV[2] then
      return {4, done, 0}
    end
    return {2, done, redis.call('PTTL', key), rec}
  elseif kind == 82 and n == 7 then -- 'R'
    local last = struct.unpack('>I6', rec, 2)
    if last >= token then
      token = last + 1
    end
  else
    return {0, 0, 0}
  end
end
local ttl = tonumber(ARGV[3])
redis.call('SET', key, 'F' .. struct.pack('>I6', token) .. ARGV[2] .. ARGV[1],
  'PXAT', math.max(now + ttl, token + 1))
return {1, token, ttl}
