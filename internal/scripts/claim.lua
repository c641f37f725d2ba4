-- claim.lua: take over entries that other consumers left idle, with their start counts.
--
-- Claiming counts nothing (JUSTID, and Redis's delivery counter is not used):
-- charge.lua counts a start when a handler starts the entry. Otherwise every
-- crash or shutdown of a consumer would count against every entry it had
-- merely prefetched, and a poison message crashing its consumers would drag
-- its neighbours into the dead-letter stream with it.
--
-- KEYS[1]   the stream
-- KEYS[2]   the group's start-count hash (see charge.lua)
-- ARGV[1]   consumer group
-- ARGV[2]   this consumer's name
-- ARGV[3]   minimum idle time in milliseconds
-- ARGV[4]   cursor (inclusive start id; "0-0" to start over)
-- ARGV[5]   COUNT
--
-- Returns {next cursor, claimed entries as {id, {field, value, ...}}, their
-- handler starts so far, ids whose stream entry was deleted}. Deleted ids are
-- acknowledged and their counts dropped here, so a vanished entry is never
-- retried.
--
-- A resend of this script after a lost reply (go-redis does that) finds the
-- entries the first run claimed no longer idle: they sit in this consumer's
-- pending list unseen until its adoption pass (adopt.lua) takes them.
local r = redis.call("XAUTOCLAIM", KEYS[1], ARGV[1], ARGV[2], ARGV[3], ARGV[4], "COUNT", ARGV[5], "JUSTID")
local live, ids, gone = {}, {}, {}
for _, id in ipairs(r[2]) do
  local e = redis.call("XRANGE", KEYS[1], id, id)
  if e[1] then
    live[#live + 1] = e[1]
    ids[#ids + 1] = id
  else
    gone[#gone + 1] = id
  end
end
if type(r[3]) == "table" then
  for _, id in ipairs(r[3]) do
    gone[#gone + 1] = id
  end
end
local counts = {}
for i = 1, #ids, 1000 do
  local c = redis.call("HMGET", KEYS[2], unpack(ids, i, math.min(i + 999, #ids)))
  for j = 1, #c do
    counts[#counts + 1] = tonumber(c[j] or "0")
  end
end
for i = 1, #gone, 1000 do
  redis.call("XACK", KEYS[1], ARGV[1], unpack(gone, i, math.min(i + 999, #gone)))
  redis.call("HDEL", KEYS[2], unpack(gone, i, math.min(i + 999, #gone)))
end
return {r[1], live, counts, gone}
