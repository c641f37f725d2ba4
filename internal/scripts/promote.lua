-- promote.lua: append the scheduled jobs that are due to the stream, or
-- (Admin.RunNow) one scheduled job at once.
--
-- Jobs wait in the schedule (delayed jobs) or the retry set (retries), sorted
-- sets scored by due time in Unix ms, with their data in a hash (see
-- produce.lua and retry.lua). One call moves at most ARGV[1] due jobs,
-- earliest first from each set (the schedule's first), atomically: each is removed from the schedule and appended
-- in the same step, so any number of promoters running this script at once
-- append every job exactly once. "Due" is read from the server's clock (TIME),
-- one clock for every producer and consumer.
--
-- Per job: its record, when it still says "P@<due>" (scheduled), becomes
-- "P<entry id>" (its TTL kept), so callers and the lookup see the entry; a
-- record holding an outcome drops the job (another copy already finished).
-- A job carrying a start count (a retry) gets field "n" (the count, read by
-- the consumer at admission) and the count is written to its group's
-- start-count hash under the new entry id, so MaxDeliveries and Deliveries
-- stay exact: the count lives in the start-count hash (under the old entry
-- id) until retry.lua moves it into the schedule's data, and there until this
-- script moves it back, each move one atomic step.
--
-- The first write is ZREM, which is not refused under maxmemory.
--
-- A job whose fields hold "k" (a key) goes to its key's turn instead
-- (fair.lua): appended now with a slot when its key may append, else into
-- its key's list, its record "P%" (RunNow then answers {1, ""}). Every
-- periodic call also lets waiting keys take their turns while slots are
-- free (a backstop: releases normally do it).
--
-- KEYS[1]      the stream
-- KEYS[2]      the schedule (sorted set)
-- KEYS[3]      the schedule's data (hash)
-- KEYS[4]      the retry set (sorted set)
-- KEYS[5]      RunNow only: the member's run-now marker (else any key of
--              the shard, unused: the promoter passes KEYS[1])
-- KEYS[6]      RunNow only: the request's record (KEYS[1] for a fan-out
--              group's retry, which has none; else unused, as KEYS[5])
-- KEYS[7]      optional: the stream of priority level "high"
-- KEYS[8]      optional: the stream of priority level "low"
-- ARGV[1]      the most jobs to append in this call
-- ARGV[2]      TTL of a start-count hash in milliseconds, refreshed when written
-- ARGV[3]      RunNow only: the member to append now, whatever its due time
-- ARGV[4]      RunNow only: TTL of the run-now marker in milliseconds
--              (the promoter passes "" and 0)
-- ARGV[5]      optional: the wake channel, where a call that creates a
--              priority level's stream publishes "+high" or "+low" (as
--              produce.lua does), so the consumers read the level at once
-- ARGV[6]      with ARGV[5]: "PUBLISH" or "SPUBLISH"
--
-- Returns {jobs moved (appended, or dropped for an outcome), next due time
-- in Unix ms over both sets or -1 when nothing is scheduled, the server's
-- time in Unix ms}. With ARGV[3] (RunNow) it
-- returns {1, entry id} when it appended the member, or when the member is
-- in neither set and the marker says an earlier call appended it as an
-- entry that is still in a stream (a resend after a lost reply; the marker,
-- set with the append and kept ARGV[4] ms, holds the entry id; the sets are
-- read first, so a job that failed again and waits for its retry is
-- promoted again); {0, record or false} when the member is in neither set; {2, record} when it was dropped because
-- the request already has an outcome.
--
-- The data of a job is length-prefixed strings ("<len>:<s>"...): its record
-- key ("" for none), its start-count hash key ("" for none), its start count,
-- and its stream fields (themselves length-prefixed, name then value). A job
-- whose fields hold "pr" (its priority level: "high" or "low") is appended to
-- that level's stream (KEYS[7], KEYS[8]), any other to KEYS[1]. Keys
-- named in the data carry the shard's hash tag (their names are built by the
-- writer from internal/keys), so they are in this call's slot.
local t = redis.call("TIME")
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
if ARGV[5] then
  fairPub = ARGV[6] -- a level's stream created by a key's turn is announced (fair.lua)
end

local function dec(s)
  local out = {}
  local pos = 1
  while pos <= #s do
    local colon = string.find(s, ":", pos, true)
    local len = tonumber(string.sub(s, pos, colon - 1))
    out[#out + 1] = string.sub(s, colon + 1, colon + len)
    pos = colon + 1 + len
  end
  return out
end

-- promote removes member from set and appends it; it returns the new
-- entry id, or false when the job was dropped (no data, or an outcome).
local function promote(member, set)
  local raw = redis.call("HGET", KEYS[3], member)
  redis.call("ZREM", set, member)
  local eid = false
  if raw then
    redis.call("HDEL", KEYS[3], member)
    local d = dec(raw)
    local rec, starts, count, fields = d[1], d[2], tonumber(d[3]) or 0, dec(d[4] or "")
    local cur = false
    local run = true
    if rec ~= "" then
      cur = redis.pcall("GET", rec)
      if type(cur) == "table" then
        cur = false -- another program's key: run the job, leave the key
      elseif cur and string.sub(cur, 1, 1) ~= "P" then
        run = false -- the request already has its outcome
      end
    end
    local fk = run and fairKeyOf(fields, 1, #fields)
    if fk then
      -- A keyed job goes to its key's turn (fair.lua), like a new one.
      if cur and string.sub(cur, 1, 2) == "P@" then
        redis.call("SET", rec, "P%", "KEEPTTL")
      end
      local el = {rec, starts, tostring(count)}
      for j = 1, #fields do
        el[#el + 1] = fields[j]
      end
      local base = fairBase(KEYS[1])
      if fairMayAppend(base, fk) then
        eid = fairAppend(base, fk, fairEnc(el))
      else
        fairWait(base, fk, fairEnc(el))
        eid = ""
      end
    elseif run then
      if count > 0 then
        fields[#fields + 1] = "n"
        fields[#fields + 1] = tostring(count)
      end
      local to = KEYS[1]
      for j = 1, #fields - 1, 2 do
        if fields[j] == "pr" then
          if fields[j + 1] == "high" and KEYS[7] then
            to = KEYS[7]
          elseif fields[j + 1] == "low" and KEYS[8] then
            to = KEYS[8]
          end
        end
      end
      if to == KEYS[1] then
        eid = redis.call("XADD", to, "*", unpack(fields))
      else
        -- NOMKSTREAM costs nothing while the level's stream exists.
        eid = redis.call("XADD", to, "NOMKSTREAM", "*", unpack(fields))
        if not eid then
          eid = redis.call("XADD", to, "*", unpack(fields))
          if ARGV[5] then
            redis.call(ARGV[6], ARGV[5], to == KEYS[7] and "+high" or "+low")
          end
        end
      end
      if cur and string.sub(cur, 1, 2) == "P@" then
        -- "P@<due>+": a quiet request (nobody waits; see produce.lua) stays quiet.
        redis.call("SET", rec, string.byte(cur, -1) == 43 and "P" .. eid .. "+" or "P" .. eid, "KEEPTTL")
      end
      if count > 0 and starts ~= "" then
        redis.call("HSET", starts, eid, count)
        redis.call("PEXPIRE", starts, ARGV[2])
      end
    end
  end
  return eid
end

if ARGV[3] and ARGV[3] ~= "" then
  -- RunNow: one member, due or not.
  local member = ARGV[3]
  local set = false
  if redis.call("ZSCORE", KEYS[4], member) then
    set = KEYS[4]
  elseif redis.call("ZSCORE", KEYS[2], member) then
    set = KEYS[2]
  end
  local rec = false
  if KEYS[6] ~= KEYS[1] then
    rec = redis.pcall("GET", KEYS[6])
    if type(rec) == "table" then
      rec = false
    end
  end
  if not set then
    -- A resend after a lost reply: the marker holds the entry the first
    -- call appended, and answers only while that entry is still in one of
    -- the streams (queued or running). A member back in a set (the job
    -- failed again and waits for its retry) was promoted above instead.
    local done = redis.call("GET", KEYS[5])
    if done then
      for _, s in ipairs({KEYS[1], KEYS[7], KEYS[8]}) do
        if s and #redis.call("XRANGE", s, done, done, "COUNT", 1) > 0 then
          return {1, done}
        end
      end
    end
    return {0, rec}
  end
  local eid = promote(member, set)
  if not eid then
    return {2, rec or ""}
  end
  if eid ~= "" then
    redis.call("SET", KEYS[5], eid, "PX", ARGV[4])
  end
  return {1, eid}
end

local appended = 0
local limit = tonumber(ARGV[1])
for _, set in ipairs({KEYS[2], KEYS[4]}) do
  if appended < limit then
    local due = redis.call("ZRANGEBYSCORE", set, "-inf", now, "LIMIT", 0, limit - appended)
    for _, member in ipairs(due) do
      -- Counted whether appended or dropped, so a call never does more than
      -- ARGV[1] jobs' work.
      promote(member, set)
      appended = appended + 1
    end
  end
end

-- The backstop of keyed jobs (fair.lua): waiting keys take their turns
-- when slots are free (they normally do when a slot is released); and keys
-- that their rate limit held back (keys:timed) go back into the ring once
-- they may append, their time counting as a due time below. One EXISTS of
-- both keys: a queue without keys pays what it paid before.
local fb = fairBase(KEYS[1])
local timedHead
if fb and redis.call("EXISTS", fb .. "keys:ready", fb .. "keys:timed") > 0 then
  local timed = fb .. "keys:timed"
  -- At most 1000 keys per call (Lua's unpack takes about 8,000 values, and
  -- the call stays short); the rest are due still, so nextDue below makes
  -- the promoter call again at once.
  local due = redis.call("ZRANGEBYSCORE", timed, "-inf", now, "LIMIT", 0, 1000)
  if #due > 0 then
    redis.call("ZREM", timed, unpack(due))
    redis.call("RPUSH", fb .. "keys:ready", unpack(due))
  end
  fairPump(fb)
  local h = redis.call("ZRANGE", timed, 0, 0, "WITHSCORES")
  timedHead = h[2] and tonumber(h[2])
end

local nextDue = timedHead or -1
for _, set in ipairs({KEYS[2], KEYS[4]}) do
  local head = redis.call("ZRANGE", set, 0, 0, "WITHSCORES")
  if head[2] and (nextDue < 0 or tonumber(head[2]) < nextDue) then
    nextDue = tonumber(head[2])
  end
end
return {appended, nextDue, now}
