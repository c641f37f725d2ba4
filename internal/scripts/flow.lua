-- flow.lua: produce a flow: a parent request that runs once every child has
-- an outcome (see flowrelease.lua, which scripts.go puts in front of this
-- file, for the flow hash).
--
-- One atomic step: a known parent id writes nothing (its record answers, as
-- in produce.lua); otherwise each child is appended like a new request, with
-- field "pa" naming the flow hash, unless its record already holds an
-- outcome (that outcome is the child's: a child done before its parent was
-- produced counts as done). A child queued or running outside this flow
-- cannot join it (its entry has no "pa", so its completion would not release
-- the parent): the call fails before any write. When no child is left
-- without an outcome, the parent is released at once.
--
-- KEYS[1]          the parent's stream
-- KEYS[2]          the parent's record
-- KEYS[3]          the flow hash
-- KEYS[2+2i]       child i's stream
-- KEYS[3+2i]       child i's record
-- ARGV[1]          TTL of the in-flight records (parent, children, flow hash), ms
-- ARGV[2]          policy: "f" or "r"
-- ARGV[3]          the parent's request id
-- ARGV[4]          the parent's stream fields, length-prefixed
-- ARGV[5], ARGV[6] the parent's notice channel, "PUBLISH" or "SPUBLISH"
-- ARGV[7...]       per child: queue, request id, payload, f (a count), then
--                  f strings: extra stream fields, name then value
--
-- Returns {code, data}: 0 and the parent's entry id ("" while it waits) for a
-- new flow; 1 and the entry id ("" while it waits or is scheduled) when the
-- parent was in flight; 2 and the record when it has an outcome. Errors,
-- before any write: "WRONGTYPE ..." for a key of another type, "INFLIGHT
-- <queue>/<id>" for a child in flight outside this flow.
local ttl = ARGV[1]
local n = (#KEYS - 3) / 2
local flow, prec = KEYS[3], KEYS[2]

local function enc(list)
  local parts = {}
  for i, v in ipairs(list) do
    parts[i] = #v .. ":" .. v
  end
  return table.concat(parts)
end

local function get(key)
  local v = redis.pcall("GET", key)
  if type(v) == "table" then
    return nil, redis.error_reply("WRONGTYPE key " .. key .. " is not a streamq record")
  end
  return v
end

local pv, err = get(prec)
if err then
  return err
end
if pv then
  if string.sub(pv, 1, 1) == "P" then
    local c = string.sub(pv, 2, 2)
    if c == "@" or c == "&" then
      return {1, ""}
    end
    return {1, string.sub(pv, 2)}
  end
  return {2, pv}
end

-- Reads and checks first: nothing is written when the call fails.
local children = {}
local seen = {}
local a = 7
for i = 1, n do
  local c = {stream = KEYS[2 + 2 * i], rec = KEYS[3 + 2 * i], queue = ARGV[a], id = ARGV[a + 1], payload = ARGV[a + 2]}
  local f = tonumber(ARGV[a + 3])
  c.fa, c.fz = a + 4, a + 3 + f
  a = c.fz + 1
  if not seen[c.rec] then
    seen[c.rec] = true
    local v
    v, err = get(c.rec)
    if err then
      return err
    end
    if v and string.sub(v, 1, 1) == "P" then
      return redis.error_reply("INFLIGHT " .. c.queue .. "/" .. c.id)
    end
    c.prev = v
    children[#children + 1] = c
  end
end
if redis.call("EXISTS", flow) == 1 then
  -- A flow hash without its parent's record (forgotten): start afresh.
  redis.call("DEL", flow)
end

local pending = 0
local order = {}
for _, c in ipairs(children) do
  order[#order + 1] = c.rec
  order[#order + 1] = c.queue
  order[#order + 1] = c.id
  if c.prev then
    redis.call("HSET", flow, "k:" .. c.rec, c.prev)
  else
    local eid = redis.call("XADD", c.stream, "*", "id", c.id, "p", c.payload, "pa", flow, unpack(ARGV, c.fa, c.fz))
    redis.call("SET", c.rec, "P" .. eid, "PX", ttl)
    redis.call("HSET", flow, "k:" .. c.rec, "")
    pending = pending + 1
  end
end
redis.call("HSET", flow, "id", ARGV[3], "n", pending, "pol", ARGV[2], "ttl", ttl, "e", ARGV[4],
  "o", enc(order), "ch", ARGV[5], "pub", ARGV[6])
redis.call("SET", prec, "P&", "PX", ttl)
redis.call("PEXPIRE", flow, ttl)
if pending > 0 then
  return {0, ""}
end
local r = flowRelease(flow, prec, KEYS[1])
if r and string.sub(r, 1, 1) == "E" then
  return {2, r}
end
return {0, r or ""}
