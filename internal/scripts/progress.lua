-- progress.lua: store a handler's progress value and announce it.
--
-- Only the handler of the entry the record names reports: a record that no
-- longer says "P<this entry id>" (the request completed, or another
-- consumer's copy runs now) stores and announces nothing. Each value gets
-- the next sequence number of the id (kept in the stored value, so reruns
-- after a crash continue it); producers drop a value older than one they
-- have, so the latest wins.
--
-- The notice goes on the completion channel as
-- "~<len>:<id><len>:<seq><len>:<value>": the leading "~" tells it apart from
-- completion notices (which start with a digit), and a listener that does
-- not know it finds no length prefix and ignores it.
--
-- KEYS[1]  the request's record
-- KEYS[2]  the progress key ("<seq>:<value>")
-- ARGV[1]  the entry id
-- ARGV[2]  the value
-- ARGV[3]  the least TTL of the progress key, ms (the consumer's ResultTTL):
--          it lives the longer of this and the record's TTL. Not the
--          record's alone: a running request's record is kept alive by the
--          consumer's leases (lease.lua), which do not touch this key, so a
--          handler running past the record's TTL of its last report lost
--          the value. complete.lua expires it with the record when the
--          outcome is recorded; forget.lua and cancel.lua too.
-- ARGV[4]  the notice channel
-- ARGV[5]  "PUBLISH" or "SPUBLISH"
-- ARGV[6]  the request id
--
-- Returns the value's sequence number, or 0 when nothing was stored. A
-- quiet request ("P<entry id>+": nobody waits for it) stores its value and
-- announces nothing.
-- "P<entry id>", or with a follow-up run kept behind it ("+...", Replace).
local rec = redis.call("GET", KEYS[1])
if not rec or string.match(rec, "^P([^+]*)") ~= ARGV[1] then
  return 0
end
local seq = 1
local cur = redis.pcall("GET", KEYS[2])
if type(cur) == "string" then
  seq = (tonumber(string.match(cur, "^(%d+):")) or 0) + 1
end
local ttl = math.max(redis.call("PTTL", KEYS[1]), tonumber(ARGV[3]))
redis.call("SET", KEYS[2], seq .. ":" .. ARGV[2], "PX", ttl)
if #rec == #ARGV[1] + 2 and string.byte(rec, -1) == 43 then
  -- A quiet request (see produce.lua): nobody listens. A producer that
  -- starts listening reads the stored value.
  return seq
end
local s = tostring(seq)
redis.call(ARGV[5], ARGV[4], "~" .. #ARGV[6] .. ":" .. ARGV[6] .. #s .. ":" .. s .. #ARGV[2] .. ":" .. ARGV[2])
return seq
