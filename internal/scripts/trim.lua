-- trim.lua: remove stream entries that every consumer group is done with.
--
-- The safe point is the minimum over all groups of the smallest pending id when
-- the group has pending entries, else its last-delivered id + 1. Entries below it
-- have been delivered to and acknowledged by every group. With no group, nothing
-- is trimmed. Both inputs only move forward, so trimming "MINID ~" to the point is
-- safe even as entries are appended and delivered concurrently.
--
-- KEYS[1]   the stream
-- KEYS[2]   the shard's fan-out marker: set here when the stream has more than
--           one group (a group made by hand, or by a fan-out consumer of an
--           older streamq), so that completions stop deleting entries another
--           group may not have read (complete.lua)
--
-- Returns {entries removed, safe point ("" when none)}.
local function next_id(id)
  local ms, seq = string.match(id, "^(%d+)-(%d+)$")
  if not ms then
    ms, seq = id, "0" -- miniredis reports a group created at "0" as "0"
  end
  return ms .. "-" .. string.format("%.0f", tonumber(seq) + 1)
end

local function less(a, b)
  local am, as = string.match(a, "^(%d+)-(%d+)$")
  local bm, bs = string.match(b, "^(%d+)-(%d+)$")
  if #am ~= #bm then return #am < #bm end
  if am ~= bm then return am < bm end
  if #as ~= #bs then return #as < #bs end
  return as < bs
end

if redis.call("EXISTS", KEYS[1]) == 0 then
  return {0, ""}
end
local groups = redis.call("XINFO", "GROUPS", KEYS[1])
local safe = nil
for _, g in ipairs(groups) do
  local info = {}
  for j = 1, #g, 2 do
    info[g[j]] = g[j + 1]
  end
  local point
  if tonumber(info["pending"]) > 0 then
    local summary = redis.call("XPENDING", KEYS[1], info["name"])
    point = summary[2]
  else
    point = next_id(info["last-delivered-id"])
  end
  if safe == nil or less(point, safe) then
    safe = point
  end
end
if safe == nil then
  return {0, ""}
end
local removed = redis.call("XTRIM", KEYS[1], "MINID", "~", safe)
if #groups > 1 and redis.call("EXISTS", KEYS[2]) == 0 then
  redis.call("SET", KEYS[2], "1")
end
return {removed, safe}
