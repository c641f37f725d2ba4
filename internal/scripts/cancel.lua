-- cancel.lua: cancel a scheduled request (a delayed job in the schedule, or
-- a retry of the answering group waiting in the retry set) and, with
-- ARGV[7], one in the stream (queued or running).
--
-- A request is scheduled while its record says "P@<due>"; a flow's parent
-- waiting for its children ("P&") is cancelled the same way (Admin.Cancel
-- then cancels its children that have no outcome; a child's completion
-- finds the record cancelled and appends nothing). Cancelling removes
-- it from the schedule, stores the outcome "C<message>" (ARGV[2] TTL) and
-- announces it like any outcome, so every caller waiting on it gets
-- ErrCanceled. One step: a promoter running at the same time either appended
-- the job first (the record then says "P<entry id>": this script cancels
-- the entry with "a", refuses it otherwise) or finds it gone. A cancellation adds 1 to field "canceled" of the
-- shard's counts hash (Stats.Canceled); it comes before the other writes, so
-- a key of another type there fails the script before it changes anything.
--
-- With ARGV[7] = "q" (the children of a cancelled flow parent), a queued
-- request is cancelled too: its entry, held by no consumer of group ARGV[6],
-- is deleted. With ARGV[7] = "a" (Admin.Cancel), a request in the stream is
-- cancelled whether or not a consumer holds it: queued (read by nobody) or
-- running (in a consumer's prefetch ring or in its handler). The decision is
-- made here, against the record, so it is exact under every race: an
-- outcome recorded first (complete.lua) makes this script refuse ({1,
-- record}), and a cancellation first makes every later completion of the
-- entry find the "C" outcome (complete.lua keeps the first outcome and
-- announces it again; retry.lua finds the entry no longer pending and
-- schedules nothing). The entry is acknowledged for the answering group,
-- deleted from its stream (so no group reads it any more, and no claim
-- after a crash runs it again) and its start count removed, all in this
-- step. When a consumer of the answering group held it, a cancel notice
-- "c" .. <len>:<group><len>:<consumer><len>:<stream index><len>:<entry id>
-- goes on the shard's wake channel (ARGV[9]), which every consumer's
-- promoter already listens to (an older consumer reads it as a wake-up):
-- that consumer cancels the handler's context, or drops the entry unstarted.
-- The stream index is 0 for the default level, 1 high, 2 low.
-- A flow's child counts its "C" outcome in its parent's flow, and
-- the last child's releases the parent (flowrelease.lua, which scripts.go
-- puts in front of this file). The parent is read here, in the step that
-- cancels (field "pa" of the request's stream fields: in the schedule's data
-- while scheduled or waiting for a retry, in its own flow hash while it is a
-- nested parent waiting for its children, in its entry while in the
-- stream), so a request that moved between the caller's reads and this step
-- still counts: when it is not the parent the caller named (ARGV[8], with
-- its keys as KEYS[14..16]), the script changes nothing and returns it, and
-- the caller runs it again naming that parent.
--
-- KEYS[1]      the record
-- KEYS[2]      the schedule (sorted set)
-- KEYS[3]      the schedule's data (hash)
-- KEYS[4]      the shard's counts (hash)
-- KEYS[5]      the retry set (sorted set)
-- KEYS[6]      the stream (the default level's)
-- KEYS[7]      the request's own flow hash (a nested flow's parent)
-- KEYS[8]      the request's progress key: it expires with the record
-- KEYS[9]      the answering group's start-count hash of KEYS[6] (KEYS[6]
--              when none)
-- KEYS[10]     the stream of level high
-- KEYS[11]     the stream of level low
-- KEYS[12]     the answering group's start-count hash of KEYS[10] (KEYS[6]
--              when none): entry ids are per stream, and so are start counts
-- KEYS[13]     the same of KEYS[11]
-- KEYS[14..16] optional: the flow hash, record and stream of the parent
--              named in ARGV[8] (absent when ARGV[8] is "" or no flow hash
--              of streamq's)
-- ARGV[1]      the request id
-- ARGV[2]      TTL of the stored outcome in milliseconds
-- ARGV[3]      the completion notice channel
-- ARGV[4]      "PUBLISH" or "SPUBLISH"
-- ARGV[5]      the message stored with the outcome
-- ARGV[6]      the answering group ("" when none)
-- ARGV[7]      "a": cancel a request in the stream too, held or not; "q":
--              in the stream and held by no consumer; "": scheduled (or
--              waiting) only
-- ARGV[8]      the flow hash the caller takes for the request's parent ("": none)
-- ARGV[9]      the shard's wake channel (cancel notices to consumers)
-- ARGV[10]     optional: the key (Key) of a request waiting for its key's
--              turn (record "P%"), and ARGV[11] its job as it waits in that
--              key's list (fair.lua's element: record key, start-count key,
--              start count, stream fields), which the caller read: its
--              stream fields name its parent, if any ("-": found in no
--              list, cancelled without a parent)
--
-- Returns {0} when the id has no record, {1, record} when it is not
-- cancelled (completed; or, without "a", in the stream: the record says
-- which), {2, the record it replaced, the consumer that held it or ""} when
-- it was cancelled, now or before (a record "C...": a second call, or one
-- that go-redis resent after a lost reply, changes, counts and announces
-- nothing); {3, parent} when the request's parent is not ARGV[8] (nothing
-- written); {4} when the record says "P%" and ARGV[11] is not the request's
-- job in the list of key ARGV[10] (nothing written): the caller finds it
-- there (the list is read in pages, never in this step) and runs the script
-- again with it.
local cur = redis.pcall("GET", KEYS[1])
if type(cur) == "table" then
  return redis.error_reply("WRONGTYPE key " .. KEYS[1] .. " is not a streamq record")
end
if not cur then
  return {0}
end
if string.sub(cur, 1, 1) == "C" then
  return {2, cur}
end
local queued = false
local streams = {KEYS[6], KEYS[10], KEYS[11]}
local level, holder = 0, ""
local fields = {}
if string.sub(cur, 1, 2) ~= "P@" and cur ~= "P&" and cur ~= "P%" then
  local mode = ARGV[7]
  if (mode ~= "q" and mode ~= "a") or string.sub(cur, 1, 1) ~= "P" then
    return {1, cur}
  end
  -- In the stream: find the entry (its level's stream holds it, with this
  -- request id), and whether a consumer of the answering group holds it.
  -- A Replace's follow-up after "+" is cancelled with it.
  local eid = string.match(cur, "^P([^+]*)")
  for l = 1, 3 do
    local e = redis.pcall("XRANGE", streams[l], eid, eid)
    if type(e) == "table" and e[1] and e[1][2] then
      local f = e[1][2]
      for i = 1, #f - 1, 2 do
        if f[i] == "id" and f[i + 1] == ARGV[1] then
          level, fields = l - 1, f
        end
      end
    end
    if #fields > 0 then
      break
    end
  end
  -- An entry found in no stream (deleted by hand) leaves nothing to delete
  -- or stop: entry ids are per stream, and an entry of another level with
  -- this id is another request's.
  if #fields > 0 then
    if ARGV[6] ~= "" then
      local ok, p = pcall(redis.call, "XPENDING", streams[level + 1], ARGV[6], eid, eid, 1)
      if ok and p[1] then
        if mode ~= "a" then
          return {1, cur}
        end
        holder = p[1][2]
      end
    end
    queued = eid
  end
end
-- The request's parent, from its stream fields.
local flowDec, childDone, release = flowLib()
if queued then
  -- read above
elseif cur == "P&" then
  local raw = redis.pcall("HGET", KEYS[7], "e")
  if type(raw) == "string" then
    fields = flowDec(raw)
  end
elseif cur == "P%" then
  -- Waiting for its key's turn: its fields are in its key's list only.
  -- ARGV[11] "-": the caller found it in no list (a state no script
  -- leaves): cancelled as before, without a parent.
  local el = ARGV[11] or ""
  if el ~= "-" then
    local d = el ~= "" and fairDec(el) or {} -- MessagePack or length-prefixed (fair.lua)
    if d[1] ~= KEYS[1] or not redis.call("LPOS", fairBase(KEYS[6]) .. "keys:q:" .. (ARGV[10] or ""), el) then
      return {4}
    end
    for j = 4, #d do
      fields[#fields + 1] = d[j]
    end
  end
else
  local raw = redis.pcall("HGET", KEYS[3], "r" .. ARGV[1])
  if type(raw) == "string" then
    fields = flowDec(flowDec(raw)[4] or "")
  end
end
local parent = ""
for i = 1, #fields - 1, 2 do
  if fields[i] == "pa" then
    parent = fields[i + 1]
  end
end
if parent ~= (ARGV[8] or "") then
  return {3, parent}
end
redis.call("HINCRBY", KEYS[4], "canceled", 1)
if queued then
  local stream = streams[level + 1]
  if holder ~= "" then
    redis.call("XACK", stream, ARGV[6], queued)
  end
  redis.call("XDEL", stream, queued)
  local starts = ({KEYS[9], KEYS[12], KEYS[13]})[level + 1]
  if starts ~= KEYS[6] then
    redis.call("HDEL", starts, queued)
  end
  fairPub = ARGV[4] -- a level's stream created by a turn is announced (fair.lua)
  fairRelease(stream, {queued}, 1, 1) -- a keyed entry's slot (fair.lua)
else
  local member = "r" .. ARGV[1]
  redis.call("ZREM", KEYS[2], member)
  redis.call("ZREM", KEYS[5], member)
  redis.call("HDEL", KEYS[3], member)
end
local outcome = "C" .. ARGV[5]
redis.call("SET", KEYS[1], outcome, "PX", ARGV[2])
redis.call("PEXPIRE", KEYS[8], ARGV[2])
redis.call(ARGV[4], ARGV[3], #ARGV[1] .. ":" .. ARGV[1] .. #outcome .. ":" .. outcome)
if holder ~= "" then
  local l, e = tostring(level), queued
  redis.call(ARGV[4], ARGV[9], "c" .. #ARGV[6] .. ":" .. ARGV[6] .. #holder .. ":" .. holder .. #l .. ":" .. l .. #e .. ":" .. e)
end
if parent ~= "" and KEYS[14] then
  if childDone(KEYS[14], KEYS[1], outcome) then
    release(KEYS[14], KEYS[15], KEYS[16])
  end
end
return {2, cur, holder}
