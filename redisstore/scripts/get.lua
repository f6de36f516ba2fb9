-- get: read a record and its time to live, for inspection. Read-only.
--
-- KEYS[1]  the record key
--
-- Reply {1, ms left, 0, value} when present, {0} when absent.
local rec = redis.pcall('GET', KEYS[1])
if not rec then
  return {0}
end
if type(rec) == 'table' then -- WRONGTYPE: reported as an undecodable value
  rec = ''
end
return {1, redis.call('PTTL', KEYS[1]), 0, rec}
