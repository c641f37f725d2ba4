-- requeue.lua: move a dead letter back to the queue's stream.
--
-- The request keeps its id; its record is reset to in flight so that new callers
-- of that id attach to the new entry instead of getting the old error.
--
-- KEYS[1]   the stream
-- KEYS[2]   the dead-letter stream
-- KEYS[3]   the record key of the request id
-- ARGV[1]   dead-letter entry id
-- ARGV[2]   request id
-- ARGV[3]   payload
-- ARGV[4]   in-flight record TTL in milliseconds
-- ARGV[5]   the group that runs the new entry (field "g"; other groups only
--           acknowledge it), or "" for every group
-- ARGV[6]   "1": reset the record to in flight (the answering group); "0": leave
--           it (a fan-out group's dead letter)
--
-- Returns the new entry id, or false when the dead letter no longer exists.
if redis.call("XDEL", KEYS[2], ARGV[1]) == 0 then
  return false
end
local fields = {"id", ARGV[2], "p", ARGV[3]}
if ARGV[5] ~= "" then
  fields[5], fields[6] = "g", ARGV[5]
end
local eid = redis.call("XADD", KEYS[1], "*", unpack(fields))
if ARGV[2] ~= "" and ARGV[6] ~= "0" then
  redis.call("SET", KEYS[3], "P" .. eid, "PX", ARGV[4])
end
return eid
