-- release.lua: give back entries this consumer read ahead but will not start
-- (a shutdown), so that any consumer claims them at once, and take back a
-- start charge that may have been counted for a handler that never ran.
--
-- A worker whose start charge was sent but not answered (its reply lost, then
-- shutdown) does not know whether Redis counted it. The entry never started
-- here, so a count of exactly (seen + 1) is that charge, and is undone: a
-- released entry counts nothing. Without this, with MaxDeliveries 1, the next
-- consumer dead-letters the request without ever running it.
--
-- Ownership is checked per entry (XPENDING), so an entry another consumer
-- claimed meanwhile is left alone.
--
-- KEYS[1]      the stream
-- KEYS[2]      the group's start-count hash
-- ARGV[1]      consumer group
-- ARGV[2]      this consumer's name
-- ARGV[3]      idle time to set, in milliseconds (far above any MinIdle)
-- ARGV[2+2i]   entry id of item i
-- ARGV[3+2i]   the starts seen at admission when a charge of item i may have
--              been counted, or -1 when none was sent
--
-- Returns the ids that are no longer owned by this consumer.
local stream, starts, group, me = KEYS[1], KEYS[2], ARGV[1], ARGV[2]
local owned, lost, undo = {}, {}, {}
for i = 1, (#ARGV - 3) / 2 do
  local eid, seen = ARGV[2 + 2 * i], tonumber(ARGV[3 + 2 * i])
  local p = redis.call("XPENDING", stream, group, eid, eid, 1)
  if p[1] and p[1][2] == me then
    owned[#owned + 1] = eid
    if seen >= 0 then
      undo[#undo + 1] = {eid, seen}
    end
  else
    lost[#lost + 1] = eid
  end
end
-- XCLAIM first: under maxmemory a flagless script is checked at its first
-- write only, and XCLAIM is not refused, so the HSET below runs too.
if #owned > 0 then
  local args = {"XCLAIM", stream, group, me, 0}
  for _, id in ipairs(owned) do
    args[#args + 1] = id
  end
  args[#args + 1] = "IDLE"
  args[#args + 1] = ARGV[3]
  args[#args + 1] = "JUSTID"
  redis.call(unpack(args))
end
for _, u in ipairs(undo) do
  local eid, seen = u[1], u[2]
  if tonumber(redis.call("HGET", starts, eid) or "0") == seen + 1 then
    if seen == 0 then
      redis.call("HDEL", starts, eid)
    else
      redis.call("HSET", starts, eid, seen)
    end
  end
end
return lost
