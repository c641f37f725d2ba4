-- charge.lua: count a delivery for a claimed or resumed entry whose handler
-- is about to start, if this consumer still owns it.
--
-- KEYS[1]   the stream
-- ARGV[1]   consumer group
-- ARGV[2]   this consumer's name
-- ARGV[3]   entry id
--
-- Returns the delivery count including this one, -1 when another consumer owns
-- the entry now, -2 when the entry left the pending list or the stream.
local p = redis.call("XPENDING", KEYS[1], ARGV[1], ARGV[3], ARGV[3], 1)
if not p[1] then
  return -2
end
if p[1][2] ~= ARGV[2] then
  return -1
end
-- XCLAIM without JUSTID counts a delivery and resets the idle time.
local c = redis.call("XCLAIM", KEYS[1], ARGV[1], ARGV[2], 0, ARGV[3])
if not c[1] then
  return -2
end
return p[1][4] + 1
