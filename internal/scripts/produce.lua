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
-- KEYS[n+4], [n+5] the streams of priority levels "high" and "low", only
--                  when ARGV[2] holds "L"
-- KEYS[last n]     only when ARGV[2] holds "M": the mode key of item i
--                  (flow-control state, see below), after every other key
-- ARGV[1]          TTL of a new in-flight record, in milliseconds
-- ARGV[2]          "1": all or nothing (a batch); "0": items are independent;
--                  followed by "L" when level streams follow the schedule's
--                  keys (an item of another priority level than the default),
--                  then "M" when the items carry a flow-control mode,
--                  then "K" when items may carry a key (stream field "k"):
--                  such an item appends at once only when fair.lua's
--                  fairMayAppend says so (taking a slot of its key), else it
--                  waits in its key's list with its record "P%" (code 0,
--                  entry id "")
-- ARGV[3...]       the items, one after another, each as:
--                    request id, payload, due time (Unix ms of the server's
--                    clock; "0": now), flags (single letters: "r", the due
--                    time is a delay in ms from now; "f", a stored failure
--                    "E..." or dead letter "L..." does not deduplicate: the
--                    record is replaced as for a new id; "H" or "L", the
--                    item goes to the high or low level's stream instead of
--                    KEYS[1], its extra fields naming the level so that a
--                    retry or a delayed item is appended there too), f (a count),
--                    then f strings: extra stream fields, name then value;
--                    with "M", then three more: the mode ("": none; "t",
--                    Throttle; "d", Debounce; "r", Replace) and its two
--                    numbers in ms (Throttle: the window, 0; Debounce: the
--                    quiet period, the longest wait; Replace: 0, 0)
-- ARGV[after the items]    the wake channel, then "PUBLISH" or "SPUBLISH"
--
-- Plain calls: when every item is due now, on the default level, with no
-- mode and no key (ARGV[2] would be "0" or "1"), and no item of an atomic
-- call carries a flag, the call comes in a shorter form, told by ARGV[2]
-- "0P" (independent items) or "1P" (all or nothing): KEYS[1] the stream,
-- KEYS[1+i] the record key of item i; ARGV[1] the TTL, ARGV[2] the call,
-- then the items without their due times: request id, payload, flags, f,
-- then f strings. No schedule's keys and no wake channel, which such a call
-- never uses (each argument costs Redis the making of a Lua string on every
-- call). One Enqueue is the one-item case of this form.
--
-- A call that creates a priority level's stream publishes "+high" or "+low"
-- on the wake channel once it succeeded, so that consumers start reading the
-- level at once instead of at their next check (one EXISTS per
-- ClaimInterval). Appends to a level's stream use XADD NOMKSTREAM, and only
-- the append that finds no stream runs XADD again: no command more per item.
--
-- Returns a flat array of n (code, data) pairs:
--   0, entry id   appended now ("" when scheduled)
--   1, entry id   already in flight: the caller attaches to it ("" when it
--                 is scheduled)
--   2, record     already completed: the record holds the outcome
--  -1, reason     rejected (only when ARGV[2] is "0")
--   3, eid+record  (modes only) a new run that replaced a stored outcome:
--                 "<len>:<entry id>" ("" when scheduled), then the outcome
--                 replaced, so the producer answers that run's callers first
--   4, ""         (Throttle only) the id ran in the open window and its
--                 outcome has expired
--   5, reason     (Replace only) the id is part of a flow, or has a key
--                 (field "k"): nothing written
--
-- Flow-control modes (only in calls with "M"; never in atomic batches, which
-- the producer refuses). Each reads the record as it stands at the item (not
-- the call's first read), so items of one id in one call see each other:
--   Throttle(W): a record in flight ("P...") is attached to; else, while the
--     mode key lives (the window is open), a stored outcome is answered and a
--     missing one gives code 4; else a new run is appended (replacing a
--     stored outcome) and the mode key is set for W ms.
--   Debounce(d, m): a record "P@<due>" whose schedule member carries mode
--     "d" in its data (a debounce waiting for its quiet period) gets this
--     item's payload and fields, and its due time moves to min(now + d,
--     first produce + m), the record to "P@<new due>" (code 1). A record in
--     flight otherwise (promoted, running, a plain delayed job) is attached
--     to. No record, or a stored outcome: a new cycle is scheduled at now +
--     min(d, m), its data holding the production time (the cycle's first
--     produce, kept by later produces) and mode "d" as the seventh string.
-- With ARGV[2] = "1", an invalid item (a record key of another type) fails
-- the whole call, and the call's own writes before it are undone in the same
-- step, so nothing of the batch remains. (Undoing the rare failure is cheaper
-- than checking every key's type first: one command less per item.)
--
-- The records are read first, with one command for the whole call (GET for
-- one item, else MGET in chunks of 1000): a known id is answered from its
-- record and writes nothing. (Appending an entry and deleting it again, as
-- this script did, cost two commands per duplicate and stayed in Redis's lag
-- of every group for good, since Redis counts entries added, not entries
-- still there.) A new id costs two commands: XADD, then SET NX GET of the
-- record; the GET fails on a key of another type, which the read took for a
-- missing record, and that rare entry is deleted again. A call with no new id
-- writes nothing, so it is answered under maxmemory too; otherwise its first
-- write is a new id's XADD or record SET, which Redis refuses under maxmemory
-- before anything is written.
-- readRecords returns the stored records of the n items (KEYS[2] ..
-- KEYS[n+1]), read before any write: false for none, or for a key of
-- another type (SET NX GET then fails on it). GET for one item (cheaper than
-- MGET of one key; it fails on another type: the same false), else MGET in
-- chunks of 1000 (unpack's limit).
local function readRecords(n)
  if n == 1 then
    local v = redis.pcall("GET", KEYS[2])
    return {type(v) ~= "table" and v}
  elseif n <= 1000 then
    return redis.call("MGET", unpack(KEYS, 2, n + 1))
  end
  local prevs = {}
  for s = 1, n, 1000 do
    local e = math.min(s + 999, n)
    local vals = redis.call("MGET", unpack(KEYS, s + 1, e + 1))
    for j = s, e do
      prevs[j] = vals[j - s + 1]
    end
  end
  return prevs
end

-- Quiet records. An item with flag "q" (Enqueue, EnqueueBatch, Send: its
-- caller does not wait for the outcome) appended at once is recorded as
-- "P<entry id>+", an empty follow-up (a delayed one "P@<due>+", which
-- promote.lua and retry.lua carry over): every reader takes the entry id before
-- "+" as for "P<entry id>", and complete.lua announces no outcome for it (a
-- notice nobody listens for costs Redis the notice's making on every
-- completion). An item without "q" that attaches to such a record (a caller
-- that waits) makes it "P<entry id>" again, in the same step, so its outcome
-- is announced. Any other rewrite of the record drops the mark: a record
-- that lost it only costs a notice.
-- heard makes a quiet record (prev, as read) announced again. Under
-- maxmemory Redis refuses that write, and the item is still answered (a
-- duplicate writes nothing else): its caller then gets the outcome from its
-- producer's record checks instead of a notice.
local function heard(key, prev)
  if string.byte(prev, -1) == 43 and string.find(prev, "+", 2, true) == #prev then -- "+"
    redis.pcall("SET", key, string.sub(prev, 1, -2), "KEEPTTL")
  end
end

-- Plain calls (the producer's ARGV[2] "0P" or "1P", see the header): the
-- same steps as the general path below, without its set-up and without the
-- branches of what a plain item cannot be.
if string.byte(ARGV[2], 2) == 80 then -- "P"
  local ttl, stream, n = ARGV[1], KEYS[1], #KEYS - 1
  local atomic = string.byte(ARGV[2], 1) == 49 -- "1"
  local created = atomic and redis.call("EXISTS", stream) == 0
  local prevs = readRecords(n) -- false: none, or a key of another type
  -- written: the ids appended by this call (a repeated id attaches to its
  -- first item), needed only with more than one item. One item's reply table
  -- is made at its size (growing a table from empty costs Redis a resize per
  -- step on every call).
  local out, written = n == 1 and {false, false} or {}, n > 1 and {}
  local hushed -- the keys of quiet records written by this call (n > 1)
  local a = 3 -- the current item's first argument
  for i = 1, n do
    local key, id, payload, flags = KEYS[1 + i], ARGV[a], ARGV[a + 1], ARGV[a + 2]
    local fa = a + 4
    local f = ARGV[a + 3]
    local fz = f == "0" and a + 3 or a + 3 + tonumber(f)
    a = fz + 1
    local prev, o = prevs[i], 2 * i - 1
    local quiet = flags == "q" or (flags ~= "" and string.find(flags, "q", 1, true) ~= nil)
    local replaced = false
    if prev and flags ~= "" then
      -- A stored failure with flag "f" (RetryFailed; never in an atomic
      -- call) is replaced as for a new id.
      local c = string.byte(prev, 1)
      replaced = (c == 69 or c == 76) and string.find(flags, "f", 1, true) ~= nil -- "E", "L"
    end
    if written and written[key] then
      out[o], out[o + 1] = 1, written[key] -- the same id earlier in this call
      if hushed and hushed[key] and not quiet then
        redis.pcall("SET", key, "P" .. written[key], "KEEPTTL")
        hushed[key] = nil
      end
    elseif prev and not replaced then
      -- A known id: completed, or in flight ("P<entry>", or "P@", "P&" and
      -- "P%" with no entry yet).
      if string.byte(prev, 1) ~= 80 then
        out[o], out[o + 1] = 2, prev
      else
        local c = string.sub(prev, 2, 2)
        out[o], out[o + 1] = 1, (c == "@" or c == "&" or c == "%") and "" or string.match(prev, "^P([^+]*)")
        if not quiet then
          heard(key, prev)
        end
      end
    else
      local eid
      if fa > fz then
        eid = redis.call("XADD", stream, "*", "id", id, "p", payload)
      else
        eid = redis.call("XADD", stream, "*", "id", id, "p", payload, unpack(ARGV, fa, fz))
      end
      local r
      if replaced then
        r = redis.call("SET", key, quiet and "P" .. eid .. "+" or "P" .. eid, "PX", ttl)
      else
        r = redis.pcall("SET", key, quiet and "P" .. eid .. "+" or "P" .. eid, "NX", "GET", "PX", ttl)
      end
      if type(r) == "table" and r.err then
        -- A key of another type (MGET read it as missing).
        redis.call("XDEL", stream, eid)
        if string.sub(r.err, 1, 9) ~= "WRONGTYPE" then
          error(r)
        end
        if atomic then
          -- Undo this call's appends and records, newest first.
          for j = i - 1, 1, -1 do
            if out[2 * j - 1] == 0 then -- appended (a repeated id answers 1)
              redis.call("XDEL", stream, out[2 * j])
              redis.call("DEL", KEYS[1 + j])
            end
          end
          if created and redis.call("XLEN", stream) == 0 then
            redis.call("DEL", stream) -- created by this call's XADD
          end
          return redis.error_reply("WRONGTYPE item " .. i .. ": key " .. key .. " is not a streamq record")
        end
        out[o], out[o + 1] = -1, "key " .. key .. " holds a value that is not a streamq record"
      else
        if written then
          written[key] = eid
          if quiet then
            hushed = hushed or {}
            hushed[key] = true
          end
        end
        out[o], out[o + 1] = 0, eid
      end
    end
  end
  return out
end

-- fair.lua goes here
local ttl = tonumber(ARGV[1])
local call = ARGV[2]
local atomic = string.sub(call, 1, 1) == "1"
local leveled, moded = false, false
-- "K": items may carry a key (field "k"): see fair.lua, whose functions are
-- made only then (fairLib, scripts.go).
local fairBase, fairKeyOf, fairMayAppend, fairWait, fairEnc, fairTake
local fairShard = false
if #call > 1 then -- plain calls ("0", "1") have no letters to look for
  leveled = string.find(call, "L", 2, true) ~= nil
  moded = string.find(call, "M", 2, true) ~= nil
  if string.find(call, "K", 2, true) ~= nil then
    local setPub
    fairBase, fairKeyOf, fairMayAppend, fairWait, fairEnc, fairTake, setPub = fairLib()
    fairShard = fairBase(KEYS[1])
    setPub(ARGV[#ARGV]) -- the wake channel's publish command ends ARGV
  end
end
local n = #KEYS - 3
if leveled then
  n = n - 2
end
if moded then
  n = n / 2 -- one mode key per item follows the other keys
end
local stream, schedule, scheduleData = KEYS[1], KEYS[n + 2], KEYS[n + 3]
-- streamOf returns the stream an item with these flags is appended to.
local function streamOf(flags)
  if leveled then
    if string.find(flags, "H", 1, true) then
      return KEYS[n + 4]
    elseif string.find(flags, "L", 1, true) then
      return KEYS[n + 5]
    end
  end
  return stream
end

-- quietFlag says an item's flags hold "q" (see heard).
local function quietFlag(flags)
  return flags ~= "" and string.find(flags, "q", 1, true) ~= nil
end

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

-- The earliest job scheduled before this call (nil: none).
local head
local headRead = false
local wakeAt

-- Atomic batches log how to take back each write (Lua does not roll back):
-- an invalid item undoes them all, newest first, and fails the call.
local undo
local newLevels = {} -- notices of the level streams this call created
local created = {} -- streams this call created (atomic batches only)
local out = {} -- the reply: (code, data) per item
if atomic then
  undo = {}
  local streams = {stream}
  if leveled then
    streams[2], streams[3] = KEYS[n + 4], KEYS[n + 5]
  end
  for _, s in ipairs(streams) do
    if redis.call("EXISTS", s) == 0 then
      created[#created + 1] = s
    end
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
    local u = undo[j]
    if type(u) == "number" then
      redis.call("XDEL", stream, out[2 * u])
      redis.call("DEL", KEYS[1 + u])
    else
      redis.call(unpack(u))
    end
  end
  for _, s in ipairs(created) do
    if redis.call("XLEN", s) == 0 then
      redis.call("DEL", s) -- created by this call's XADD
    end
  end
  return redis.error_reply("WRONGTYPE item " .. i .. ": key " .. key .. " is not a streamq record")
end
-- claimRecord writes the record of an item to be written: prev, a stored
-- failure (RetryFailed), is overwritten, its value and TTL logged to put
-- back; with no record, SET NX GET claims the key, failing on a key of
-- another type (MGET reads it as missing). Returns nil, or the error reply
-- (see notWrongType).
local function claimRecord(key, prev, value, px)
  if not prev then
    local r = redis.pcall("SET", key, value, "NX", "GET", "PX", px)
    if type(r) == "table" and r.err then
      return r
    end
    if undo then
      undo[#undo + 1] = {"DEL", key}
    end
    return nil
  end
  if undo then
    local old = redis.call("PTTL", key)
    if old > 0 then
      undo[#undo + 1] = {"SET", key, prev, "PX", old}
    else
      undo[#undo + 1] = {"SET", key, prev}
    end
  end
  redis.call("SET", key, value, "PX", px)
  return nil
end

-- The stored records, read before any write (false: none, or a key of
-- another type).
local prevs = readRecords(n)

-- modesLib makes the functions of flow-control modes and returns
-- flowControl: only a call with "M" calls it, so that the other calls of
-- the general path do not make their closures.
local function modesLib()
-- dec splits length-prefixed strings (the schedule's data).
local function dec(str)
  local out = {}
  local pos = 1
  while pos <= #str do
    local colon = string.find(str, ":", pos, true)
    local len = tonumber(string.sub(str, pos, colon - 1))
    out[#out + 1] = string.sub(str, colon + 1, colon + len)
    pos = colon + 1 + len
  end
  return out
end

-- scheduleItem puts a flow-control item into the schedule, due at due, and
-- returns its data, for the caller to complete and write: record key "",
-- no start count, its stream fields, no error, produced (the production
-- time) and its mode. (Modes are never in atomic calls: nothing to undo.)
local function scheduleItem(id, payload, fa, fz, due, produced, mode)
  if not headRead then
    local h = redis.call("ZRANGE", schedule, 0, 0, "WITHSCORES")
    if h[2] then
      head = tonumber(h[2])
    end
    headRead = true
  end
  local fields = {"id", id, "p", payload}
  for j = fa, fz do
    fields[#fields + 1] = ARGV[j]
  end
  redis.call("ZADD", schedule, due, "r" .. id)
  return {"", "", "0", enc(fields), "", produced, mode}
end

-- appendTo appends fields to stream to as the general path does: a level's
-- stream with NOMKSTREAM, and the append that creates it tells the
-- consumers (newLevels, published at the end).
local function appendTo(to, fields)
  if to == stream then
    return redis.call("XADD", to, "*", unpack(fields))
  end
  local eid = redis.call("XADD", to, "NOMKSTREAM", "*", unpack(fields))
  if not eid then
    eid = redis.call("XADD", to, "*", unpack(fields))
    newLevels[#newLevels + 1] = to == KEYS[n + 4] and "+high" or "+low"
  end
  return eid
end

-- idAfter reports whether stream entry id a is after b ("<ms>-<seq>").
local function idAfter(a, b)
  local am, as = string.match(a, "^(%d+)-(%d+)$")
  local bm, bs = string.match(b, "^(%d+)-(%d+)$")
  if not am or not bm then
    return false
  end
  am, bm = tonumber(am), tonumber(bm)
  return am > bm or (am == bm and tonumber(as) > tonumber(bs))
end

-- inFlow reports whether stream fields (name, value...) belong to a flow.
local function inFlow(f)
  for j = 1, #f - 1, 2 do
    if f[j] == "pa" or f[j] == "fp" then
      return true
    end
  end
  return false
end

local flowRefusal = "request is part of a flow: Replace cannot change it"

-- keyed reports whether stream fields (name, value...) carry a key (field
-- "k"): its job holds or waits for a slot of its key (fair.lua), which an
-- entry deleted or fields rewritten here would never give back.
local function keyed(f)
  for j = 1, #f - 1, 2 do
    if f[j] == "k" then
      return true
    end
  end
  return false
end

local keyRefusal = "request has a key (Key): Replace cannot change it"

-- replace answers one Replace item (see the header): its code and data.
local function replace(key, cur, id, payload, due, flags, fa, fz)
  local c = cur and string.sub(cur, 1, 1)
  local fields = {"id", id, "p", payload}
  for j = fa, fz do
    fields[#fields + 1] = ARGV[j]
  end
  if c == "P" then
    local tag = string.sub(cur, 2, 2)
    if tag == "&" then
      return 5, flowRefusal
    end
    if tag == "%" then
      return 5, keyRefusal -- waiting for its key's turn (fair.lua)
    end
    if tag == "@" then
      -- Waiting (delayed, debounced, or a retry's back-off): new fields,
      -- same due time.
      local member = "r" .. id
      local raw = redis.call("HGET", scheduleData, member)
      if raw then
        local d = dec(raw)
        local old = dec(d[4] or "")
        if inFlow(old) then
          return 5, flowRefusal
        end
        if keyed(old) then
          return 5, keyRefusal
        end
        for j = 1, #old - 1, 2 do
          if old[j] == "g" then
            fields[#fields + 1], fields[#fields + 2] = "g", old[j + 1]
          end
        end
        d[3], d[4], d[5] = "0", enc(fields), ""
        d[6] = d[6] or ""
        if d[7] ~= "d" then
          d[7] = "r"
        end
        redis.call("HSET", scheduleData, member, enc(d))
      end
      if not quietFlag(flags) then
        heard(key, cur) -- "P@<due>+": a quiet request waiting in the schedule
      end
      return 1, ""
    end
    -- Its entry: the one with this id and this request id (entry ids are
    -- per stream: another level's entry with this id is another request's).
    local eid = string.match(cur, "^P([^+]*)")
    local s, ef
    for _, st in ipairs({stream, KEYS[n + 4], KEYS[n + 5]}) do
      local e = redis.call("XRANGE", st, eid, eid)
      if e[1] then
        local f = e[1][2]
        for j = 1, #f - 1, 2 do
          if f[j] == "id" and f[j + 1] == id then
            s, ef = st, f
          end
        end
      end
      if s then
        break
      end
    end
    if ef and inFlow(ef) then
      return 5, flowRefusal
    end
    if ef and keyed(ef) then
      return 5, keyRefusal
    end
    if s then
      local read = false
      local ok, groups = pcall(redis.call, "XINFO", "GROUPS", s)
      if ok then
        for _, g in ipairs(groups) do
          for j = 1, #g - 1, 2 do
            if g[j] == "last-delivered-id" and not idAfter(eid, g[j + 1]) then
              read = true
            end
          end
        end
      end
      if not read then
        -- Nobody has read it: this item takes its place. A promoted retry's
        -- group ("g": other groups skip the entry) goes with it, as for a
        -- retry replaced while it waits; its start count ("n", also in the
        -- group's start-count hash under the entry id) restarts, and leaves
        -- the hash with the entry.
        for j = 1, #ef - 1, 2 do
          if ef[j] == "g" then
            fields[#fields + 1], fields[#fields + 2] = "g", ef[j + 1]
            local starts = s .. ":starts:" .. ef[j + 1]
            if s == stream then
              starts = string.sub(s, 1, -7) .. "starts:" .. ef[j + 1]
            end
            redis.call("HDEL", starts, eid)
          end
        end
        redis.call("XDEL", s, eid)
        local neid = appendTo(streamOf(flags), fields)
        redis.call("SET", key, "P" .. neid, "PX", ttl)
        return 1, neid
      end
    end
    -- Read by a consumer (or gone): one follow-up run, kept in the record.
    local lvl = ""
    if string.find(flags, "H", 1, true) then
      lvl = "high"
    elseif string.find(flags, "L", 1, true) then
      lvl = "low"
    end
    redis.call("SET", key, "P" .. eid .. "+" .. enc({lvl, tostring(ttl), enc(fields)}), "KEEPTTL")
    return 1, ""
  end
  -- No record, or a stored outcome: a new run.
  if due > 0 and string.find(flags, "r", 1, true) then
    due = serverNow() + due
  end
  if due > 0 and due > serverNow() then
    local err = claimRecord(key, cur, "P@" .. due, ttl + due - serverNow())
    if err then
      notWrongType(err)
      return -1, "key " .. key .. " holds a value that is not a streamq record"
    end
    local data = scheduleItem(id, payload, fa, fz, due, tostring(serverNow()), "r")
    data[1] = key
    redis.call("HSET", scheduleData, "r" .. id, enc(data))
    if (not head or due < head) and (not wakeAt or due < wakeAt) then
      wakeAt = due
    end
    if cur then
      return 3, "0:" .. cur
    end
    return 0, ""
  end
  local to = streamOf(flags)
  local eid = appendTo(to, fields)
  local err = claimRecord(key, cur, "P" .. eid, ttl)
  if err then
    redis.call("XDEL", to, eid)
    notWrongType(err)
    return -1, "key " .. key .. " holds a value that is not a streamq record"
  end
  if cur then
    return 3, #eid .. ":" .. eid .. cur
  end
  return 0, eid
end

-- flowControl answers one item of a flow-control mode (see the header):
-- its code and data.
local function flowControl(i, key, id, payload, flags, fa, fz, mode, ma, mb, due)
  local cur = redis.pcall("GET", key)
  if type(cur) ~= "string" then
    cur = false -- none, or a key of another type (SET NX GET then fails)
  end
  if mode == "r" then
    return replace(key, cur, id, payload, due, flags, fa, fz)
  end
  local c = cur and string.sub(cur, 1, 1)
  if mode == "t" then
    if c == "P" then
      if not quietFlag(flags) then
        heard(key, cur)
      end
      c = string.sub(cur, 2, 2)
      return 1, (c == "@" or c == "&" or c == "%") and "" or string.match(cur, "^P([^+]*)")
    end
    local mkey = KEYS[#KEYS - n + i]
    if redis.call("EXISTS", mkey) == 1 then
      if cur then
        return 2, cur
      end
      return 4, ""
    end
    local to = streamOf(flags)
    local fields = {"id", id, "p", payload}
    for j = fa, fz do
      fields[#fields + 1] = ARGV[j]
    end
    local eid = appendTo(to, fields)
    local err = claimRecord(key, cur, "P" .. eid, ttl)
    if err then
      redis.call("XDEL", to, eid)
      notWrongType(err)
      return -1, "key " .. key .. " holds a value that is not a streamq record"
    end
    redis.call("SET", mkey, tostring(serverNow() + ma), "PX", ma)
    if cur then
      return 3, #eid .. ":" .. eid .. cur
    end
    return 0, eid
  end
  -- Debounce: ma the quiet period, mb the longest wait.
  local member = "r" .. id
  if c == "P" then
    if string.sub(cur, 2, 2) == "@" then
      local raw = redis.call("HGET", scheduleData, member)
      local d = raw and dec(raw)
      if d and d[7] == "d" and redis.call("ZSCORE", schedule, member) then
        local first = tonumber(d[6]) or serverNow()
        local due = math.min(serverNow() + ma, first + mb)
        local data = scheduleItem(id, payload, fa, fz, due, d[6], "d")
        data[1], data[8] = d[1], tostring(first + mb)
        redis.call("HSET", scheduleData, member, enc(data))
        redis.call("SET", key, "P@" .. due, "PX", ttl + due - serverNow())
        return 1, ""
      end
    end
    if not quietFlag(flags) then
      heard(key, cur)
    end
    c = string.sub(cur, 2, 2)
    return 1, (c == "@" or c == "&" or c == "%") and "" or string.match(cur, "^P([^+]*)")
  end
  local due = serverNow() + math.min(ma, mb)
  local err = claimRecord(key, cur, "P@" .. due, ttl + due - serverNow())
  if err then
    notWrongType(err)
    return -1, "key " .. key .. " holds a value that is not a streamq record"
  end
  local data = scheduleItem(id, payload, fa, fz, due, tostring(serverNow()), "d")
  data[1], data[8] = key, tostring(serverNow() + mb)
  redis.call("HSET", scheduleData, member, enc(data))
  if (not head or due < head) and (not wakeAt or due < wakeAt) then
    wakeAt = due
  end
  if cur then
    return 3, "0:" .. cur
  end
  return 0, ""
end
return flowControl
end
local flowControl = moded and modesLib()

local o = 0
local written = {}
local hushed = {} -- the keys of quiet records written by this call
local a = 3 -- the current item's first argument
for i = 1, n do
  local key = KEYS[1 + i]
  local id, payload, due, flags = ARGV[a], ARGV[a + 1], ARGV[a + 2], ARGV[a + 3]
  due = due == "0" and 0 or tonumber(due) or 0
  local fa, fz = a + 5, a + 4 + tonumber(ARGV[a + 4]) -- its extra stream fields
  a = fz + 1
  local mode, ma, mb
  if moded then
    mode, ma, mb = ARGV[a], tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2])
    a = a + 3
  end
  local prev = prevs[i]
  if mode and (mode == "t" or mode == "d" or mode == "r") then
    out[o + 1], out[o + 2] = flowControl(i, key, id, payload, flags, fa, fz, mode, ma, mb, due)
    if out[o + 1] == 0 or out[o + 1] == 3 or (mode == "r" and out[o + 1] == 1) then
      local d = out[o + 2]
      if out[o + 1] == 3 then
        local colon = string.find(d, ":", 1, true)
        d = string.sub(d, colon + 1, colon + tonumber(string.sub(d, 1, colon - 1)))
      end
      written[key] = d
    end
  elseif written[key] then
    -- The same id appeared earlier in this call.
    out[o + 1], out[o + 2] = 1, written[key]
    if hushed[key] and not quietFlag(flags) then
      -- Written quiet by this call: "P<entry id>+", or "P@<due>+".
      local cur = redis.pcall("GET", key)
      if type(cur) == "string" then
        heard(key, cur)
      end
      hushed[key] = nil
    end
  elseif prev and not (string.find(flags, "f", 1, true) and (string.sub(prev, 1, 1) == "E" or string.sub(prev, 1, 1) == "L")) then
    -- A known id, whatever its due time: in flight, or completed (a stored
    -- failure is replaced instead with flag "f", RetryFailed).
    if string.sub(prev, 1, 1) == "P" then
      -- "P@<due>" scheduled, "P&" a flow's parent waiting for its children,
      -- "P%" waiting for its key's turn: no entry yet.
      local c = string.sub(prev, 2, 2)
      out[o + 1], out[o + 2] = 1, (c == "@" or c == "&" or c == "%") and "" or string.match(prev, "^P([^+]*)")
      if not quietFlag(flags) then
        heard(key, prev)
      end
    else
      out[o + 1], out[o + 2] = 2, prev
    end
  else
    if due > 0 and string.find(flags, "r", 1, true) then
      due = serverNow() + due
    end
    local err
    if due > 0 and due > serverNow() then
      -- A quiet item stays quiet through its wait: "P@<due>+" (promote.lua).
      err = claimRecord(key, prev, quietFlag(flags) and "P@" .. due .. "+" or "P@" .. due, ttl + due - serverNow())
      if err then
        notWrongType(err)
      else
        if not headRead then
          local h = redis.call("ZRANGE", schedule, 0, 0, "WITHSCORES")
          if h[2] then
            head = tonumber(h[2])
          end
          headRead = true
        end
        local member = "r" .. id
        local fields = {"id", id, "p", payload}
        for j = fa, fz do
          fields[#fields + 1] = ARGV[j]
        end
        if undo then
          -- A member left by a job whose record expired unpromoted is
          -- overwritten here: an undo puts it back.
          local oldScore = redis.call("ZSCORE", schedule, member)
          local oldData = redis.call("HGET", scheduleData, member)
          undo[#undo + 1] = oldScore and {"ZADD", schedule, oldScore, member} or {"ZREM", schedule, member}
          undo[#undo + 1] = oldData and {"HSET", scheduleData, member, oldData} or {"HDEL", scheduleData, member}
        end
        redis.call("ZADD", schedule, due, member)
        -- Then no error (a retry's), and when it was produced (Admin.Jobs).
        redis.call("HSET", scheduleData, member, enc({key, "", "0", enc(fields), "", tostring(serverNow())}))
        if (not head or due < head) and (not wakeAt or due < wakeAt) then
          wakeAt = due
        end
        written[key] = ""
        hushed[key] = quietFlag(flags) or nil
        out[o + 1], out[o + 2] = 0, ""
      end
    else
      local fk = fairShard and fairKeyOf(ARGV, fa, fz)
      if fk and not fairMayAppend(fairShard, fk) then
        -- A keyed job that waits for its key's turn (fair.lua): record "P%".
        err = claimRecord(key, prev, "P%", ttl)
        if err then
          notWrongType(err)
        else
          local el = {key, "", "0", "id", id, "p", payload}
          for j = fa, fz do
            el[#el + 1] = ARGV[j]
          end
          fairWait(fairShard, fk, fairEnc(el), undo)
          written[key] = ""
          out[o + 1], out[o + 2] = 0, ""
        end
      else
        local to = leveled and streamOf(flags) or stream
        local eid
        if to == stream then
          eid = redis.call("XADD", to, "*", "id", id, "p", payload, unpack(ARGV, fa, fz))
        else
          -- A level's stream: NOMKSTREAM costs nothing while it exists; the
          -- call that creates it tells the consumers (see the end).
          eid = redis.call("XADD", to, "NOMKSTREAM", "*", "id", id, "p", payload, unpack(ARGV, fa, fz))
          if not eid then
            eid = redis.call("XADD", to, "*", "id", id, "p", payload, unpack(ARGV, fa, fz))
            newLevels[#newLevels + 1] = to == KEYS[n + 4] and "+high" or "+low"
          end
        end
        local quiet = quietFlag(flags) and not fk -- a keyed job's record is rewritten by fair.lua
        if prev then
          err = claimRecord(key, prev, quiet and "P" .. eid .. "+" or "P" .. eid, ttl)
        else
          -- claimRecord's SET NX GET, inline: the common case (ARGV[1] is
          -- the TTL as sent, as a string)
          err = redis.pcall("SET", key, quiet and "P" .. eid .. "+" or "P" .. eid, "NX", "GET", "PX", ARGV[1])
          if type(err) ~= "table" or not err.err then
            err = nil
          end
        end
        if err then
          redis.call("XDEL", to, eid)
          notWrongType(err)
        else
          if undo then
            if prev or to ~= stream then
              if not prev then
                undo[#undo + 1] = {"DEL", key}
              end
              undo[#undo + 1] = {"XDEL", to, eid}
            else
              -- item i's XADD to the stream and its new record: rejectAll
              -- deletes both (no table per item)
              undo[#undo + 1] = i
            end
          end
          if fk then
            fairTake(fairShard, fk, eid, to, undo)
          end
          written[key] = eid
          hushed[key] = quiet or nil
          out[o + 1], out[o + 2] = 0, eid
        end
      end
    end
    if err then
      if atomic then
        return rejectAll(i, key)
      end
      out[o + 1], out[o + 2] = -1, "key " .. key .. " holds a value that is not a streamq record"
    end
  end
  o = o + 2
end
if wakeAt then
  redis.call(ARGV[a + 1], ARGV[a], tostring(wakeAt))
end
for _, notice in ipairs(newLevels) do
  redis.call(ARGV[a + 1], ARGV[a], notice)
end
return out
