-- start.lua: the start charge shared by charge.lua and complete.lua (scripts.go
-- puts this function in front of both, so there is one implementation).
--
-- chargeStart counts one handler start of entry eid for this consumer, before
-- the handler runs, and keeps its in-flight record alive:
--   stream, starts  the stream and the group's start-count hash
--   group, me       the consumer group and this consumer's name
--   floor           a record that still says "P<eid>" is kept alive at least
--                   this many milliseconds
--   eid, expected   the entry and the starts seen at admission (before this one)
--   rec             the entry's record key, or the stream's key when it has none
-- It returns the starts including this one; -1 when another consumer owns the
-- entry now (not counted); -2 when the entry left the pending list, or the
-- group is gone (a Redis restarted without persistence: complete.lua charges
-- after its writes, and must not fail there).
-- Idempotent under resend: a count already at expected + 1 is this same charge.
local function chargeStart(stream, starts, group, me, floor, eid, expected, rec)
  local p = redis.pcall("XPENDING", stream, group, eid, eid, 1)
  if type(p) == "table" and p.err then
    if string.sub(p.err, 1, 7) == "NOGROUP" then
      return -2
    end
    error(p)
  end
  if not p[1] then
    return -2
  elseif p[1][2] ~= me then
    return -1
  end
  local n
  -- The common case, a first start, is one command.
  if expected == 0 and redis.call("HSETNX", starts, eid, 1) == 1 then
    n = 1
  else
    local cur = tonumber(redis.call("HGET", starts, eid) or "0")
    if cur == expected + 1 then
      n = cur -- this charge, resent
    else
      n = redis.call("HINCRBY", starts, eid, 1)
    end
  end
  if rec ~= stream then
    local ttl = redis.call("PTTL", rec)
    if ttl >= 0 and ttl < floor and redis.pcall("GET", rec) == "P" .. eid then
      redis.call("PEXPIRE", rec, floor)
    end
  end
  return n
end
