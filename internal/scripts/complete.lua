-- complete.lua: record outcomes, acknowledge and delete entries, notify waiters.
--
-- The per-shard committer sends one call per tick for every outcome that
-- finished since the last one, in the same pipelined round trip as the start
-- charges of the next jobs (committer.go).
--
-- Recording is first-writer-wins: when a request id already has an outcome (a
-- redelivered duplicate finished second), the stored outcome is put back (its
-- TTL restarts) and re-announced, and the entry is still acknowledged.
--
-- Order matters, because Lua does not roll back:
--   1. checks (reads only): the dead-letter key must be a stream or absent, so
--      that nothing after the first write can fail and a retry after an error
--      never meets half of its own earlier run;
--   2. XACK (and XDEL): the first write frees memory and is not refused under
--      maxmemory (Redis checks a flagless script for OOM at its first write
--      only, and XACK is not a DENYOOM command), so the record SETs and dead
--      letters that follow run under memory pressure too;
--   3. per item: the dead letter (before its record, so that a retry would
--      write it again rather than never), then the record;
--   4. the notice;
--   5. the history: one HINCRBY adds this call's completions to the field of
--      the minute of ARGV[7] in the hour's history hash, as processed +
--      failed<<32 (one command carries both counts); a PEXPIRE of 25 hours
--      follows only when the reply equals the increment (the field was just
--      created: at most once per minute and shard). Every item but "S"
--      counts as processed, "E" and "L" also as failed (retry.lua counts the
--      retries it schedules as both). With fan-out groups, every group's
--      completions count.
-- A whole rerun (a lost reply) is harmless: the records hold this batch's
-- outcomes, so every item counts as "already recorded" and nothing is added.
--
-- KEYS[1]          the stream
-- KEYS[2]          the dead-letter stream (of this group when it is a fan-out group)
-- KEYS[3]          the shard's fan-out marker: present once a fan-out group may
--                  read the stream, and then entries are left to the trim
-- KEYS[3+i]        the record key of item i; the dead-letter key when the item has no id
-- KEYS[3+n+...]    for each child of a flow among the items (ARGV[9]), in item
--                  order, three keys: the flow hash, the parent's record and the
--                  parent's stream (flowrelease.lua)
-- KEYS[#KEYS-1]    the history hash of the hour of ARGV[7]
-- KEYS[#KEYS]      the group's start-count hash (see charge.lua): completed ids are
--                  removed from it
-- ARGV[1]          consumer group
-- ARGV[2]          notification channel
-- ARGV[3]          record TTL in milliseconds
-- ARGV[4]          "1": store successful results; "0": store only a done marker "N"
-- ARGV[5]          dead-letter stream length cap (approximate)
-- ARGV[6]          consumer name (recorded in dead letters)
-- ARGV[7]          time in milliseconds (recorded in dead letters; the history minute)
-- ARGV[8]          "PUBLISH", or "SPUBLISH" on a cluster (sharded pub/sub)
-- ARGV[9]          "1": a fan-out group (records nothing, publishes nothing, never
--                  deletes entries; a final failure is a dead letter of the group
--                  when this is the group's first completion of the entry); "0": the
--                  answering group; "0:<i>,<j>,...": the answering group, and items
--                  i, j, ... are children of flows (entry field "pa"): each one's
--                  first outcome is recorded in its flow hash too, and the last
--                  child's releases the parent in this same step. A call without
--                  children carries no extra key or argument.
-- ARGV[10+6(i-1) .. 15+6(i-1)]  item i: entry id, request id, code, value, payload, deliveries
--   code "R": value is the encoded response
--   code "E": value is an error message
--   code "L": value is an error message; the item is also appended to the dead-letter
--             stream, unless the request already had an outcome
--   code "S": acknowledge only (an entry requeued for another group)
--
-- Returns the number of items; an error reply, before any write, when the
-- dead-letter key holds another type.
local group, channel, ttl, store = ARGV[1], ARGV[2], ARGV[3], ARGV[4] == "1"
local starts = KEYS[#KEYS]
local fanout = ARGV[9] == "1"
local n = (#ARGV - 9) / 6

local function item(i)
  local b = 10 + 6 * (i - 1)
  return b, ARGV[b], ARGV[b + 1], ARGV[b + 2], ARGV[b + 3]
end

-- The children of flows among the items: item index -> its first flow key.
local childOf
if #ARGV[9] > 1 then
  childOf = {}
  local k = 3 + n
  for idx in string.gmatch(string.sub(ARGV[9], 3), "%d+") do
    childOf[tonumber(idx)] = k
    k = k + 3
  end
end

-- 1. Checks.
for i = 1, n do
  local _, _, _, code = item(i)
  if code == "L" then
    local t = redis.call("TYPE", KEYS[2])
    t = t["ok"] or t
    if t ~= "stream" and t ~= "none" then
      return redis.error_reply("WRONGTYPE dead-letter key " .. KEYS[2] .. " holds a " .. t ..
        ", not a stream: rename or delete it (outcomes are retried until then)")
    end
    break
  end
end

-- 2. Free first. A fan-out group acknowledges dead letters one by one: the
-- reply says whether this is the group's first completion of the entry.
local ids = {}
local firstAck = {}
local processed, failed = 0, 0
for i = 1, n do
  local _, eid, _, code = item(i)
  if code ~= "S" then
    processed = processed + 1
    if code == "E" or code == "L" then
      failed = failed + 1
    end
  end
  if fanout and code == "L" then
    firstAck[i] = redis.call("XACK", KEYS[1], group, eid) == 1
  else
    ids[#ids + 1] = eid
  end
end
-- unpack() has a limit of a few thousand values: go in chunks.
for i = 1, #ids, 1000 do
  redis.call("XACK", KEYS[1], group, unpack(ids, i, math.min(i + 999, #ids)))
end
-- The start counts of completed entries are no longer needed (HDEL frees, so
-- it is not refused under maxmemory either).
for i = 1, n, 1000 do
  local chunk = {}
  for j = i, math.min(i + 999, n) do
    local _, eid = item(j)
    chunk[#chunk + 1] = eid
  end
  redis.call("HDEL", starts, unpack(chunk))
end
-- Delete the entries only when no other group may still need them; with
-- fan-out groups (the marker, set by their consumers before they create their
-- group, and by the trim), the periodic trim removes what every group is done
-- with. A fan-out group never deletes: the answering group may not exist yet.
if not fanout and n > 0 and redis.call("EXISTS", KEYS[3]) == 0 then
  for i = 1, n, 1000 do
    local chunk = {}
    for j = i, math.min(i + 999, n) do
      local _, eid = item(j)
      chunk[#chunk + 1] = eid
    end
    redis.call("XDEL", KEYS[1], unpack(chunk))
  end
end

local function deadLetter(i)
  local b, eid, rid, _, value = item(i)
  redis.call("XADD", KEYS[2], "MAXLEN", "~", ARGV[5], "*",
    "id", rid, "entry", eid, "p", ARGV[b + 4], "error", value,
    "deliveries", ARGV[b + 5], "consumer", ARGV[6], "at", ARGV[7])
end

-- isWrongType reports whether a pcall reply is a WRONGTYPE error (another
-- program's key, overwritten); any other error is raised, never taken for it.
local function isWrongType(reply)
  if type(reply) == "table" and reply.err then
    if string.sub(reply.err, 1, 9) == "WRONGTYPE" then
      return true
    end
    error(reply)
  end
  return false
end

-- 3. Outcomes.
local notice = {}
for i = 1, n do
  local _, eid, rid, code, value = item(i)
  if fanout then
    if code == "L" and firstAck[i] then
      deadLetter(i)
    end
  elseif code ~= "S" then
    local outcome = code .. value
    local first = true
    if rid ~= "" then
      local key = KEYS[3 + i]
      local rec = outcome
      if code == "R" and not store then
        rec = "N"
      end
      local prev
      if code == "L" then
        -- Read first: the dead letter goes before the record.
        prev = redis.pcall("GET", key)
        if isWrongType(prev) then
          prev = false
        end
      else
        -- One command in the common case; the rare duplicate puts the first
        -- outcome back.
        prev = redis.pcall("SET", key, rec, "GET", "PX", ttl)
        if isWrongType(prev) then
          redis.call("SET", key, rec, "PX", ttl) -- another program's key
          prev = false
        end
      end
      if prev and string.sub(prev, 1, 1) ~= "P" then
        outcome = prev
        first = false
      end
      -- A duplicate that failed for good after another copy recorded an
      -- outcome is not a dead letter: the request already has its outcome.
      if code == "L" and first then
        deadLetter(i)
      end
      if code == "L" or not first then
        redis.call("SET", key, first and rec or prev, "PX", ttl)
      end
      if childOf and childOf[i] and first then
        -- A flow's child: its first outcome counts in the flow, and the last
        -- child's releases the parent.
        local fk = childOf[i]
        local _, childDone, release = flowLib()
        if childDone(KEYS[fk + 1], key, rec) then
          release(KEYS[fk + 1], KEYS[fk + 2], KEYS[fk + 3])
        end
      end
      notice[#notice + 1] = #rid .. ":" .. rid .. #outcome .. ":" .. outcome
    elseif code == "L" then
      deadLetter(i)
    end
  end
end

-- 4. The notice.
if #notice > 0 then
  redis.call(ARGV[8], channel, table.concat(notice))
end

-- 5. The history.
if processed > 0 then
  local hist = KEYS[#KEYS - 1]
  local inc = string.format("%.0f", processed + failed * 4294967296)
  local minute = tostring(math.floor(tonumber(ARGV[7]) / 60000) % 60)
  if redis.call("HINCRBY", hist, minute, inc) == tonumber(inc) then
    redis.call("PEXPIRE", hist, 90000000)
  end
end

return n
