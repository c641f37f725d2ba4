-- produce.lua: append requests to the stream unless their id is already known.
--
-- The dedup check and the XADD are one atomic step, so any number of producers
-- submitting one id cause at most one stream entry while the id's record lives.
--
-- A delayed item (a due time later than the server's clock) is not appended:
-- its record is claimed as "P@<due ms>" (live until due + the in-flight TTL)
-- and it waits in the schedule (a sorted set scored by due time, and a hash
-- holding what promote.lua appends at the due time). When it is due ahead of
-- every job already scheduled, a notice on the wake channel makes the
-- consumers' promoters set their timers to it.
--
-- KEYS[1]          the stream
-- KEYS[1+i]        the record key of item i (i = 1..n)
-- KEYS[n+2]        the schedule (sorted set)
-- KEYS[n+3]        the schedule's data (hash)
-- ARGV[1]          TTL of a new in-flight record, in milliseconds
-- ARGV[2]          "1": all or nothing (a batch); "0": items are independent
-- ARGV[3...]       the items, one after another, each as:
--                    request id, payload, due time (Unix ms of the server's
--                    clock; "0": now), flags (single letters: "r", the due
--                    time is a delay in ms from now; "f", a stored failure
--                    "E..." or dead letter "L..." does not deduplicate: the
--                    record is replaced as for a new id), f (a count),
--                    then f strings: extra stream fields, name then value
-- ARGV[after the items]    the wake channel, then "PUBLISH" or "SPUBLISH"
--
-- Returns a flat array of n (code, data) pairs:
--   0, entry id   appended now ("" when scheduled)
--   1, entry id   already in flight: the caller attaches to it ("" when it
--                 is scheduled)
--   2, record     already completed: the record holds the outcome
--  -1, reason     rejected (only when ARGV[2] is "0")
-- With ARGV[2] = "1", an invalid item (a record key of another type) fails
-- the whole call, and the call's own writes before it are undone in the same
-- step, so nothing of the batch remains. (Undoing the rare failure is cheaper
-- than checking every key's type first: one command less per item.)
--
-- The common case, a new id, costs two commands: XADD, then SET NX GET of the
-- record. When the id turns out to be known, the fresh entry is deleted again
-- in the same step, so no consumer ever sees it.
local ttl = tonumber(ARGV[1])
local atomic = ARGV[2] == "1"
local n = #KEYS - 3
local schedule, scheduleData = KEYS[n + 2], KEYS[n + 3]

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
local wake, publish = ARGV[a], ARGV[a + 1]

-- The server's clock, read only when an item has a due time.
local now
local function serverNow()
  if not now then
    local t = redis.call("TIME")
    now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  end
  return now
end

-- enc length-prefixes strings ("<len>:<s>"...) for the schedule's data.
local function enc(list)
  local parts = {}
  for i, v in ipairs(list) do
    parts[i] = #v .. ":" .. v
  end
  return table.concat(parts)
end

-- rerun reports whether item it replaces the stored outcome prev: a failure
-- or dead letter, with flag "f" (RetryFailed).
local function rerun(it, prev)
  local c = string.sub(prev, 1, 1)
  return (c == "E" or c == "L") and string.find(it.flags, "f", 1, true) ~= nil
end

-- The earliest job scheduled before this call (nil: none).
local head
local headRead = false
local wakeAt

-- Atomic batches log how to take back each write (Lua does not roll back):
-- an invalid item undoes them all, newest first, and fails the call.
local undo
local hadStream = true
if atomic then
  undo = {}
  hadStream = redis.call("EXISTS", KEYS[1]) == 1
end
local function logUndo(...)
  if undo then
    undo[#undo + 1] = {...}
  end
end
-- notWrongType raises a pcall error that is not WRONGTYPE (out of memory at
-- the first write, say): only another program's key is an item's fault.
local function notWrongType(reply)
  if string.sub(reply.err, 1, 9) ~= "WRONGTYPE" then
    error(reply)
  end
end
-- rejectAll undoes this call's writes and returns the error for item i.
local function rejectAll(i, key)
  for j = #undo, 1, -1 do
    redis.call(unpack(undo[j]))
  end
  if not hadStream then
    redis.call("DEL", KEYS[1]) -- created by this call's XADD
  end
  return redis.error_reply("WRONGTYPE item " .. i .. ": key " .. key .. " is not a streamq record")
end
-- replaceRecord overwrites a stored failure (RetryFailed), logging its value
-- and TTL to put back.
local function replaceRecord(key, prev, value, px)
  if undo then
    local old = redis.call("PTTL", key)
    if old > 0 then
      logUndo("SET", key, prev, "PX", old)
    else
      logUndo("SET", key, prev)
    end
  end
  redis.call("SET", key, value, "PX", px)
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
    local due = tonumber(it.due) or 0
    if due > 0 and string.find(it.flags, "r", 1, true) then
      due = serverNow() + due
    end
    if due > 0 and due > serverNow() then
      local prev = redis.pcall("SET", key, "P@" .. due, "NX", "GET", "PX", ttl + due - serverNow())
      if type(prev) == "table" and prev.err then
        notWrongType(prev)
        if atomic then
          return rejectAll(i, key)
        end
        out[#out + 1] = -1
        out[#out + 1] = "key " .. key .. " holds a value that is not a streamq record"
      elseif not prev or rerun(it, prev) then
        if prev then
          replaceRecord(key, prev, "P@" .. due, ttl + due - serverNow())
        else
          logUndo("DEL", key)
        end
        if not headRead then
          local h = redis.call("ZRANGE", schedule, 0, 0, "WITHSCORES")
          if h[2] then
            head = tonumber(h[2])
          end
          headRead = true
        end
        local member = "r" .. it.id
        local fields = {"id", it.id, "p", it.payload}
        for j = 1, #it.fields do
          fields[#fields + 1] = it.fields[j]
        end
        if undo then
          -- A member left by a job whose record expired unpromoted is
          -- overwritten here: an undo puts it back.
          local oldScore = redis.call("ZSCORE", schedule, member)
          local oldData = redis.call("HGET", scheduleData, member)
          if oldScore then
            logUndo("ZADD", schedule, oldScore, member)
          else
            logUndo("ZREM", schedule, member)
          end
          if oldData then
            logUndo("HSET", scheduleData, member, oldData)
          else
            logUndo("HDEL", scheduleData, member)
          end
        end
        redis.call("ZADD", schedule, due, member)
        redis.call("HSET", scheduleData, member, enc({key, "", "0", enc(fields)}))
        if (not head or due < head) and (not wakeAt or due < wakeAt) then
          wakeAt = due
        end
        written[key] = ""
        out[#out + 1] = 0
        out[#out + 1] = ""
      elseif string.sub(prev, 1, 1) == "P" then
        out[#out + 1] = 1
        out[#out + 1] = string.sub(prev, 2, 2) == "@" and "" or string.sub(prev, 2)
      else
        out[#out + 1] = 2
        out[#out + 1] = prev
      end
    else
      local eid = redis.call("XADD", KEYS[1], "*", "id", it.id, "p", it.payload, unpack(it.fields))
      local prev = redis.pcall("SET", key, "P" .. eid, "NX", "GET", "PX", ttl)
      if type(prev) == "table" and prev.err then
        redis.call("XDEL", KEYS[1], eid)
        notWrongType(prev)
        if atomic then
          return rejectAll(i, key)
        end
        out[#out + 1] = -1
        out[#out + 1] = "key " .. key .. " holds a value that is not a streamq record"
      elseif not prev or rerun(it, prev) then
        if prev then
          replaceRecord(key, prev, "P" .. eid, ttl)
        else
          logUndo("DEL", key)
        end
        logUndo("XDEL", KEYS[1], eid)
        written[key] = eid
        out[#out + 1] = 0
        out[#out + 1] = eid
      else
        redis.call("XDEL", KEYS[1], eid)
        if string.sub(prev, 1, 1) == "P" then
          out[#out + 1] = 1
          out[#out + 1] = string.sub(prev, 2, 2) == "@" and "" or string.sub(prev, 2)
        else
          out[#out + 1] = 2
          out[#out + 1] = prev
        end
      end
    end
  end
end
if wakeAt then
  redis.call(publish, wake, tostring(wakeAt))
end
return out
