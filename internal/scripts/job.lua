-- job.lua: read everything Admin.Job reports about one request id, in one
-- atomic step (reads only), so that a completion between two reads cannot
-- show a half-finished state.
--
-- KEYS[1]  the request's record
-- KEYS[2]  the stream of the request's shard
-- KEYS[3]  the group's start-count hash (see charge.lua)
-- ARGV[1]  consumer group
--
-- Returns {record or false, record PTTL in ms, entry present 0/1, holder
-- consumer or false, holder idle ms or false, starts or false}. The last four
-- are read only when the record says "P<entry id>" (in flight).
local rec = redis.call("GET", KEYS[1])
if not rec then
  return {false, -2, 0, false, false, false}
end
local ttl = redis.call("PTTL", KEYS[1])
if string.sub(rec, 1, 1) ~= "P" then
  return {rec, ttl, 0, false, false, false}
end
local eid = string.sub(rec, 2)
local present = 0
if #redis.call("XRANGE", KEYS[2], eid, eid, "COUNT", 1) > 0 then
  present = 1
end
local holder, idle = false, false
local ok, p = pcall(redis.call, "XPENDING", KEYS[2], ARGV[1], eid, eid, 1)
if ok and p[1] then
  holder, idle = p[1][2], p[1][3]
end
local starts = redis.call("HGET", KEYS[3], eid)
return {rec, ttl, present, holder, idle, starts}
