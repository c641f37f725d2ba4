-- flowrelease.lua: the functions that release a flow's parent, shared by
-- flow.lua and complete.lua (scripts.go puts this file in front of each, so
-- both run the same code).
--
-- A flow is a parent request that runs once each of its children has an
-- outcome. Its hash (keys.Flow, under the parent's hash tag) holds:
--   id        the parent's request id
--   n         the children without an outcome yet
--   pol       "f": a failed child fails the parent; "r": the parent runs anyway
--   ttl       the parent's in-flight record TTL in milliseconds
--   e         the parent's stream fields, length-prefixed ("<len>:<s>"...)
--   o         the children in order, length-prefixed triples: record key,
--             queue, request id
--   k:<child record key>   "" while the child has no outcome, then its
--             outcome record ("R...", "N", "E...", "L...", "C...")
-- The parent's record says "P&" while it waits for its children. Nothing
-- here raises an error on a key of another type (it counts or appends
-- nothing instead): complete.lua and cancel.lua have written before.

-- flowLib returns the functions below (flowDec, flowChildDone, flowRelease):
-- a script calls it only when it needs them, so a call without flows pays for
-- one closure, not three.
local function flowLib()
  local function flowDec(s)
    local out = {}
    local pos = 1
    while s and pos <= #s do
      local colon = string.find(s, ":", pos, true)
      local len = tonumber(string.sub(s, pos, colon - 1))
      out[#out + 1] = string.sub(s, colon + 1, colon + len)
      pos = colon + 1 + len
    end
    return out
  end

  -- flowChildDone records the first outcome of the child whose record key is
  -- child; it returns true when that child was the flow's last. A child
  -- counted already (a rerun after a lost reply) or a flow that is gone
  -- (expired, forgotten) changes nothing.
  local function flowChildDone(flow, child, outcome)
    -- pcall: a key of another type (not streamq's) counts nothing and fails
    -- nothing, since complete.lua has written before this.
    if redis.pcall("HGET", flow, "k:" .. child) ~= "" then
      return false
    end
    redis.call("HSET", flow, "k:" .. child, outcome)
    local left = redis.pcall("HINCRBY", flow, "n", -1)
    return type(left) == "number" and left <= 0
  end

  -- flowRelease runs when the parent's last child has its outcome: it appends
  -- the parent's entry (its record becomes "P<entry id>"). With policy "f" and
  -- a failed child, the entry carries field "ff", the parent's failure listing
  -- the children's errors: a consumer records that failure without running the
  -- handler, through the ordinary completion (so a nested parent's failure
  -- counts for its own parent like any outcome). A parent whose record no
  -- longer says "P&" (cancelled, forgotten, released already) is left alone.
  -- Returns the parent's entry id, or nil.
  local function flowRelease(flow, prec, pstream)
    if redis.pcall("GET", prec) ~= "P&" then
      return nil
    end
    local f = redis.call("HMGET", flow, "pol", "ttl", "e", "o")
    local ttl = f[2]
    local fields = flowDec(f[3])
    if f[1] == "f" then
      local o = flowDec(f[4])
      local names = {}
      for i = 1, #o, 3 do
        names[#names + 1] = "k:" .. o[i]
      end
      local vals = {}
      if #names > 0 then
        vals = redis.call("HMGET", flow, unpack(names))
      end
      local failed = {}
      for i, v in ipairs(vals) do
        local c = v and string.sub(v, 1, 1)
        if c == "E" or c == "L" or c == "C" then
          local j = 3 * (i - 1) + 1
          failed[#failed + 1] = o[j + 1] .. "/" .. o[j + 2] .. ": " .. string.sub(v, 2)
        end
      end
      if #failed > 0 then
        fields[#fields + 1] = "ff"
        fields[#fields + 1] = "a child of the flow failed: " .. table.concat(failed, "; ")
      end
    end
    local eid = redis.pcall("XADD", pstream, "*", unpack(fields))
    if type(eid) ~= "string" then
      return nil -- the parent's stream key holds another type: not appended
    end
    redis.call("SET", prec, "P" .. eid, "PX", ttl)
    redis.call("PEXPIRE", flow, ttl)
    return eid
  end
  return flowDec, flowChildDone, flowRelease
end
