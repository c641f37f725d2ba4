-- produce.lua: append requests to the stream unless their id is already known.
--
-- The dedup check and the XADD are one atomic step, so any number of producers
-- submitting one id cause at most one stream entry while the id's record lives.
--
-- KEYS[1]          the stream
-- KEYS[1+i]        the record key of item i (i = 1..n)
-- ARGV[1]          TTL of a new in-flight record, in milliseconds
-- ARGV[2]          "1": all or nothing (a batch); "0": items are independent
-- ARGV[3...]       the items, one after another, each as:
--                    request id, payload, due time (Unix ms; "0": now),
--                    flags (single letters; none defined yet), f (a count),
--                    then f strings: extra stream fields, name then value
--
-- Returns a flat array of n (code, data) pairs:
--   0, entry id   appended now
--   1, entry id   already in flight: the caller attaches to it
--   2, record     already completed: the record holds the outcome
--  -1, reason     rejected (only when ARGV[2] is "0")
-- With ARGV[2] = "1", an invalid item fails the whole call before any write.
--
-- The common case, a new id, costs two commands: XADD, then SET NX GET of the
-- record. When the id turns out to be known, the fresh entry is deleted again
-- in the same step, so no consumer ever sees it.
local ttl = ARGV[1]
local atomic = ARGV[2] == "1"
local n = #KEYS - 1

-- Split ARGV into items.
local items = {}
local a = 3
for i = 1, n do
  local f = tonumber(ARGV[a + 4])
  local fields = {}
  for j = 1, f do
    fields[j] = ARGV[a + 4 + j]
  end
  items[i] = {id = ARGV[a], payload = ARGV[a + 1], due = ARGV[a + 2], flags = ARGV[a + 3], fields = fields}
  a = a + 5 + f
end

if atomic then
  -- Validate every item before the first write: Lua does not roll back.
  for i = 1, n do
    local v = redis.pcall("TYPE", KEYS[1 + i])
    local t = type(v) == "table" and v.ok or v
    if t ~= "none" and t ~= "string" then
      return redis.error_reply("WRONGTYPE item " .. i .. ": key " .. KEYS[1 + i] .. " is not a streamq record")
    end
  end
end

local out = {}
local written = {}
for i = 1, n do
  local key = KEYS[1 + i]
  if written[key] then
    -- The same id appeared earlier in this call.
    out[#out + 1] = 1
    out[#out + 1] = written[key]
  else
    local it = items[i]
    local eid = redis.call("XADD", KEYS[1], "*", "id", it.id, "p", it.payload, unpack(it.fields))
    local prev = redis.pcall("SET", key, "P" .. eid, "NX", "GET", "PX", ttl)
    if type(prev) == "table" and prev.err then
      redis.call("XDEL", KEYS[1], eid)
      out[#out + 1] = -1
      out[#out + 1] = "key " .. key .. " holds a value that is not a streamq record"
    elseif not prev then
      written[key] = eid
      out[#out + 1] = 0
      out[#out + 1] = eid
    else
      redis.call("XDEL", KEYS[1], eid)
      if string.sub(prev, 1, 1) == "P" then
        out[#out + 1] = 1
        out[#out + 1] = string.sub(prev, 2)
      else
        out[#out + 1] = 2
        out[#out + 1] = prev
      end
    end
  end
end
return out
