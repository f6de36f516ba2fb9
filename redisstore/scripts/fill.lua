-- fill: write a completed record copied from a durable store (the
-- PostgreSQL table of tieredstore, which is the truth for completions).
-- One atomic step, safe to repeat.
--
-- KEYS[1]  the record key
-- ARGV[1]  the completion's token (6 bytes)
-- ARGV[2]  its fingerprint (16 bytes), or '' to take the fingerprint from
--          the in-flight record of lease ARGV[5]
-- ARGV[3]  the time the completion has left in the durable store, in ms
-- ARGV[4]  the encoded response
-- ARGV[5]  lease id (16 bytes) of the lease that completed, or ''
--
-- What is there decides:
--   absent, released, in flight (any lease), not a record   written
--   completed with the same token                           left alone (2)
--   completed with a smaller token (an older completion)    written
--   completed with a larger token (a newer completion)      left alone (0)
-- An in-flight record of another lease is overwritten: the durable store
-- has the key completed, so that holder can never complete it, and its
-- next renewal tells it so. Nothing is written when ARGV[3] is not
-- positive (the completion has expired).
--
-- The record expires when the completion does, but never before the
-- clock has passed the largest token the key had, so that the next token
-- is larger than every one issued before (as acquire.lua keeps them).
--
-- Reply {1} written, {2} already there, {0} refused (a newer completion,
-- or no time left), {3} not written: ARGV[2] is '' and the record is not
-- ARGV[5]'s in-flight record.
local key = KEYS[1]
local left = tonumber(ARGV[3])
if left <= 0 then
  return {0}
end
local rec = redis.pcall('GET', key)
if type(rec) == 'table' then -- WRONGTYPE: another kind of value
  rec = false
end
local token = struct.unpack('>I6', ARGV[1], 1)
local fp = ARGV[2]
local top = token
if rec then
  local kind, n = string.byte(rec, 1), #rec
  local known = (kind == 70 and n == 39) or (kind == 67 and n >= 24) or (kind == 82 and n == 7)
  if known then
    local had = struct.unpack('>I6', rec, 2)
    if kind == 67 then -- 'C'
      if had == token then
        return {2}
      elseif had > token then
        return {0}
      end
    end
    if fp == '' and kind == 70 and string.sub(rec, 24) == ARGV[5] then
      fp = string.sub(rec, 8, 23)
    end
    top = math.max(top, had)
  end
end
if #fp ~= 16 then
  return {3}
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('SET', key, 'C' .. ARGV[1] .. fp .. ARGV[4], 'PXAT', math.max(now + left, top + 1))
return {1}
