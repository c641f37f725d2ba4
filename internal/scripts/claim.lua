-- claim.lua: take over entries that other consumers left idle, with their delivery counts.
--
-- Claiming does not count a delivery (JUSTID): a claimed entry is charged one
-- delivery by charge.lua only when a handler starts it. Otherwise every crash
-- of a consumer would count against every entry it had merely prefetched, and
-- a poison message crashing its consumers would drag its neighbours into the
-- dead-letter stream with it.
--
-- KEYS[1]   the stream
-- ARGV[1]   consumer group
-- ARGV[2]   this consumer's name
-- ARGV[3]   minimum idle time in milliseconds
-- ARGV[4]   cursor (inclusive start id; "0-0" to start over)
-- ARGV[5]   COUNT
--
-- Returns {next cursor, claimed entries as {id, {field, value, ...}}, their
-- delivery counts so far, ids whose stream entry was deleted}. Deleted ids are
-- acknowledged here, so a vanished entry is never retried.
local r = redis.call("XAUTOCLAIM", KEYS[1], ARGV[1], ARGV[2], ARGV[3], ARGV[4], "COUNT", ARGV[5], "JUSTID")
local live, counts, gone = {}, {}, {}
for _, id in ipairs(r[2]) do
  local e = redis.call("XRANGE", KEYS[1], id, id)
  if e[1] then
    live[#live + 1] = e[1]
    local p = redis.call("XPENDING", KEYS[1], ARGV[1], id, id, 1)
    counts[#counts + 1] = p[1] and p[1][4] or 1
  else
    gone[#gone + 1] = id
  end
end
if type(r[3]) == "table" then
  for _, id in ipairs(r[3]) do
    gone[#gone + 1] = id
  end
end
for i = 1, #gone, 1000 do
  redis.call("XACK", KEYS[1], ARGV[1], unpack(gone, i, math.min(i + 999, #gone)))
end
return {r[1], live, counts, gone}
