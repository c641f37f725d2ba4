-- prune.lua: delete consumers that hold no pending entries and have been idle long.
--
-- A consumer with pending entries is never deleted: XGROUP DELCONSUMER would
-- discard its PEL and those entries could never be claimed again. The pending
-- check and the delete are one atomic step.
--
-- KEYS[1]   the stream
-- ARGV[1]   consumer group
-- ARGV[2]   minimum idle time in milliseconds
-- ARGV[3]   a consumer name to keep (the caller's own)
--
-- Returns the names deleted.
local deleted = {}
local ok, consumers = pcall(redis.call, "XINFO", "CONSUMERS", KEYS[1], ARGV[1])
if not ok then
  return deleted
end
local min_idle = tonumber(ARGV[2])
for _, c in ipairs(consumers) do
  local info = {}
  for j = 1, #c, 2 do
    info[c[j]] = c[j + 1]
  end
  if info["name"] ~= ARGV[3] and tonumber(info["pending"]) == 0 and tonumber(info["idle"]) >= min_idle then
    redis.call("XGROUP", "DELCONSUMER", KEYS[1], ARGV[1], info["name"])
    deleted[#deleted + 1] = info["name"]
  end
end
return deleted
