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
--
-- Returns the new entry id, or false when the dead letter no longer exists.
if redis.call("XDEL", KEYS[2], ARGV[1]) == 0 then
  return false
end
local eid = redis.call("XADD", KEYS[1], "*", "id", ARGV[2], "p", ARGV[3])
if ARGV[2] ~= "" then
  redis.call("SET", KEYS[3], "P" .. eid, "PX", ARGV[4])
end
return eid
