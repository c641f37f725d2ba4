-- claim.lua: take over entries that other consumers left idle, with their delivery counts.
--
-- KEYS[1]   the stream
-- ARGV[1]   consumer group
-- ARGV[2]   this consumer's name
-- ARGV[3]   minimum idle time in milliseconds
-- ARGV[4]   cursor (inclusive start id; "0-0" to start over)
-- ARGV[5]   COUNT
--
-- Returns {next cursor, claimed entries as XAUTOCLAIM returns them, their delivery
-- counts, ids whose stream entry was deleted}. Deleted ids are acknowledged here,
-- so a vanished entry is never retried; entries that come back without fields (an
-- older server's way of reporting deletion) are treated the same way.
local r = redis.call("XAUTOCLAIM", KEYS[1], ARGV[1], ARGV[2], ARGV[3], ARGV[4], "COUNT", ARGV[5])
local live, counts, gone = {}, {}, {}
for _, m in ipairs(r[2]) do
  if type(m) == "table" and type(m[2]) == "table" then
    live[#live + 1] = m
    local p = redis.call("XPENDING", KEYS[1], ARGV[1], m[1], m[1], 1)
    if p[1] then
      counts[#counts + 1] = p[1][4]
    else
      counts[#counts + 1] = 1
    end
  elseif type(m) == "table" then
    gone[#gone + 1] = m[1]
  end
end
if type(r[3]) == "table" then
  for _, id in ipairs(r[3]) do
    gone[#gone + 1] = id
  end
end
if #gone > 0 then
  redis.call("XACK", KEYS[1], ARGV[1], unpack(gone))
end
return {r[1], live, counts, gone}
