-- periodic.lua: record that a periodic job's slot was produced, and when the
-- next one is due, for Periodic's missed-slot check and for dashboards.
--
-- Replicas race: a late replica may record an older slot after a newer one.
-- "last" only moves forward, and "next" is written only with the newest
-- "last" (or, with no slot, only forward), so both stay the newest.
--
-- KEYS[1]  the queue's periodic hash
-- ARGV[1]  the job's name
-- ARGV[2]  the slot produced, unix milliseconds; 0 when only "next" is set
-- ARGV[3]  the next slot after it, unix milliseconds; 0 when there is none
--
-- Fields "<name>:last" and "<name>:next". Returns the "last" recorded before
-- this call (0 when none).
local lastField, nextField = ARGV[1] .. ":last", ARGV[1] .. ":next"
local slot, nxt = tonumber(ARGV[2]), tonumber(ARGV[3])
local last = tonumber(redis.call("HGET", KEYS[1], lastField) or "0") or 0
if slot > 0 then
  if slot < last then
    return last
  end
  redis.call("HSET", KEYS[1], lastField, ARGV[2])
end
if nxt > 0 then
  local cur = tonumber(redis.call("HGET", KEYS[1], nextField) or "0") or 0
  if slot > 0 or nxt > cur then
    redis.call("HSET", KEYS[1], nextField, ARGV[3])
  end
end
return last
