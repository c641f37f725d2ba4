-- resume.lua: read this consumer's own pending entries, left by an earlier
-- process with the same name, without counting a delivery.
--
-- Unlike XREADGROUP from id 0, which counts a delivery for every entry read,
-- this counts nothing; charge.lua counts a start when a handler starts the
-- entry (see claim.lua for why).
--
-- KEYS[1]   the stream
-- KEYS[2]   the group's start-count hash (see charge.lua)
-- ARGV[1]   consumer group
-- ARGV[2]   this consumer's name
-- ARGV[3]   exclusive start id ("-" for the beginning)
-- ARGV[4]   COUNT
--
-- Returns {last id seen ("" when none), entries as {id, {field, value, ...}},
-- their handler starts so far, ids whose stream entry was deleted}. Deleted ids
-- are acknowledged and their counts dropped, so they leave the pending list;
-- the idle time of the others is reset.
-- The id right after ARGV[3], as an inclusive start ("(" is not understood
-- everywhere, miniredis included).
local start = ARGV[3]
if start ~= "-" then
  local ms, seq = string.match(start, "^(%d+)-(%d+)$")
  start = ms .. "-" .. string.format("%.0f", tonumber(seq) + 1)
end
local pend = redis.call("XPENDING", KEYS[1], ARGV[1], start, "+", ARGV[4], ARGV[2])
local live, counts, gone = {}, {}, {}
local last = ""
for _, p in ipairs(pend) do
  last = p[1]
  local e = redis.call("XRANGE", KEYS[1], p[1], p[1])
  if e[1] then
    live[#live + 1] = e[1]
    counts[#counts + 1] = tonumber(redis.call("HGET", KEYS[2], p[1]) or "0")
  else
    gone[#gone + 1] = p[1]
  end
end
for i = 1, #gone, 1000 do
  redis.call("XACK", KEYS[1], ARGV[1], unpack(gone, i, math.min(i + 999, #gone)))
  redis.call("HDEL", KEYS[2], unpack(gone, i, math.min(i + 999, #gone)))
end
-- Reset the idle time of the resumed entries (JUSTID: no delivery counted), so
-- that no claim pass, this consumer's included, takes them again before the
-- first lease renewal.
for i = 1, #live, 1000 do
  local args = {"XCLAIM", KEYS[1], ARGV[1], ARGV[2], 0}
  for j = i, math.min(i + 999, #live) do
    args[#args + 1] = live[j][1]
  end
  args[#args + 1] = "JUSTID"
  redis.call(unpack(args))
end
return {last, live, counts, gone}
