-- flowrelease.lua: the functions that release a flow's parent, shared by
-- flow.lua, complete.lua and cancel.lua (scripts.go puts this file in front
-- of each, so all run the same code, with fair.lua in front of it).
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
-- and, only for a parent produced with a priority level or a due time:
--   st        the stream of the parent's level (else the default level's)
--   lv        the notice ("+high", "+low") published on wk when the
--             parent's append creates that stream
--   due       the parent's due time (Unix ms, server clock): released
--             before it, the parent waits in the schedule (sch, its data
--             sd) like a delayed request, and a due time ahead of the
--             schedule's head is published on wk
--   wk, pub   the parent shard's wake channel and "PUBLISH" / "SPUBLISH"
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
    local f = redis.call("HMGET", flow, "pol", "ttl", "e", "o", "st", "lv", "due", "sch", "sd", "wk", "pub")
    local ttl = f[2]
    local fields = flowDec(f[3])
    local failed = {}
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
    local due = tonumber(f[7])
    if due and #failed == 0 then
      -- At or After: a parent released before its due time waits in the
      -- schedule (a failed one is failed at once).
      local t = redis.call("TIME")
      local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
      if due > now then
        local head = redis.call("ZRANGE", f[8], 0, 0, "WITHSCORES")
        local member = "r" .. redis.call("HGET", flow, "id")
        local parts = {}
        for i, v in ipairs(fields) do
          parts[i] = #v .. ":" .. v
        end
        local data = {prec, "", "0", table.concat(parts), "", tostring(now)}
        for i, v in ipairs(data) do
          data[i] = #v .. ":" .. v
        end
        redis.call("ZADD", f[8], due, member)
        redis.call("HSET", f[9], member, table.concat(data))
        redis.call("SET", prec, "P@" .. due, "PX", tonumber(ttl) + due - now)
        redis.call("PEXPIRE", flow, tonumber(ttl) + due - now)
        if not head[2] or due < tonumber(head[2]) then
          redis.call(f[11], f[10], tostring(due))
        end
        return nil
      end
    end
    local eid
    local fk = fairKeyOf(fields, 1, #fields)
    if fk then
      -- A keyed parent (Key) takes its key's turn like any keyed job
      -- (fair.lua): appended now with a slot, into its level's stream, or
      -- waiting in its key's list with its record "P%".
      local base = fairBase(f[5] or pstream)
      local el = {prec, "", "0"}
      for i = 1, #fields do
        el[i + 3] = fields[i]
      end
      if f[11] then
        fairPub = f[11]
      end
      if fairMayAppend(base, fk) then
        eid = fairAppend(base, fk, fairEnc(el))
      else
        fairWait(base, fk, fairEnc(el))
        eid = nil
        redis.call("SET", prec, "P%", "PX", ttl)
      end
      if eid then
        redis.call("SET", prec, "P" .. eid, "PX", ttl)
      end
      redis.call("PEXPIRE", flow, ttl)
      return eid or nil
    end
    if f[5] then
      -- A level's stream: created by this append, the consumers are told.
      eid = redis.pcall("XADD", f[5], "NOMKSTREAM", "*", unpack(fields))
      if not eid then
        eid = redis.pcall("XADD", f[5], "*", unpack(fields))
        if type(eid) == "string" then
          redis.call(f[11], f[10], f[6])
        end
      end
    else
      eid = redis.pcall("XADD", pstream, "*", unpack(fields))
    end
    if type(eid) ~= "string" then
      return nil -- the parent's stream key holds another type: not appended
    end
    redis.call("SET", prec, "P" .. eid, "PX", ttl)
    redis.call("PEXPIRE", flow, ttl)
    return eid
  end
  return flowDec, flowChildDone, flowRelease
end
