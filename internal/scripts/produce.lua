-- produce.lua: append requests to the stream unless their id is already known.
--
-- The dedup check and the XADD are one atomic step, so any number of producers
-- submitting one id cause at most one stream entry while the id's record lives.
--
-- KEYS[1]          the stream
-- KEYS[1+i]        the record key of item i (i = 1..n)
-- ARGV[1]          TTL of a new in-flight record, in milliseconds
-- ARGV[2]          "1": all or nothing (a batch); "0": items are independent
-- ARGV[1+2i]       request id of item i
-- ARGV[2+2i]       payload of item i
--
-- Returns a flat array of n (code, data) pairs:
--   0, entry id   appended now
--   1, entry id   already in flight: the caller attaches to it
--   2, record     already completed: the record holds the outcome
--  -1, reason     rejected (only when ARGV[2] is "0")
-- With ARGV[2] = "1", an invalid item fails the whole call before any write.
local ttl = ARGV[1]
local atomic = ARGV[2] == "1"
local n = #KEYS - 1

-- Validate every item before the first write: Lua does not roll back.
local current = {}
for i = 1, n do
  local v = redis.pcall("GET", KEYS[1 + i])
  if type(v) == "table" and v.err then
    if atomic then
      return redis.error_reply("WRONGTYPE item " .. i .. ": key " .. KEYS[1 + i] .. " is not a streamq record")
    end
  end
  current[i] = v
end

local out = {}
local written = {}
for i = 1, n do
  local key = KEYS[1 + i]
  local v = current[i]
  if type(v) == "table" then
    out[#out + 1] = -1
    out[#out + 1] = "key " .. key .. " holds a value that is not a streamq record"
  elseif written[key] then
    -- The same id appeared earlier in this call.
    out[#out + 1] = 1
    out[#out + 1] = written[key]
  elseif v and string.sub(v, 1, 1) == "P" then
    out[#out + 1] = 1
    out[#out + 1] = string.sub(v, 2)
  elseif v then
    out[#out + 1] = 2
    out[#out + 1] = v
  else
    local eid = redis.call("XADD", KEYS[1], "*", "id", ARGV[1 + 2 * i], "p", ARGV[2 + 2 * i])
    redis.call("SET", key, "P" .. eid, "PX", ttl)
    written[key] = eid
    out[#out + 1] = 0
    out[#out + 1] = eid
  end
end
return out
