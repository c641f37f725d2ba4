-- retry.lua: acknowledge failed entries and schedule their next attempts, in
-- one step.
--
-- A failed attempt that is to be retried after a delay leaves the stream:
-- its entry is acknowledged (and deleted when the stream has one group and
-- the shard's fan-out marker is absent, as complete.lua deletes), and
-- the job waits in the retry set (a sorted set like the schedule, so that
-- retries and delayed jobs are listed apart) until the delay has passed on
-- the server's clock, when promote.lua appends it again as a new entry. Its
-- data (in the schedule's data hash) also keeps the attempt's error message
-- for Admin.Jobs. Its start count
-- moves with it (from the group's start-count hash into the schedule's data,
-- then back under the new entry id), so MaxDeliveries and Deliveries stay
-- exact; each move is one atomic step, so a crash at any point leaves the
-- count in exactly one place.
--
-- The new entry carries field "g" (this group) so that only this group runs
-- the retry: every other group already ran the original entry and skips it.
-- For the answering group the record becomes "P@<due>" (scheduled), its
-- remaining TTL lengthened by the delay (and at least the delay plus
-- ARGV[3]); a record that already holds an
-- outcome (another copy finished) means there is nothing to retry: the entry
-- is acknowledged only. A fan-out group leaves records alone.
--
-- A record holding a follow-up run behind the entry ("P<entry id>+...",
-- left by a Replace; see produce.lua) is not retried: the follow-up, the
-- newer payload, is appended now instead, with a fresh start count.
--
-- An entry no longer pending for this consumer (its lease lapsed and another
-- consumer took it, or this call is a resend after a lost reply) is left
-- alone: whoever holds it decides. So the script is idempotent under resend.
-- An entry pending for no consumer at all (Admin.Cancel acknowledged it, or
-- a resend finds it done) has its start count removed: a start charge sent
-- before the cancellation may have written it after cancel.lua removed it,
-- and no one else will (the entry is gone).
--
-- Reads come first, then XACK (the first write, not refused under maxmemory).
--
-- History: one HINCRBY adds the retries scheduled to the minute's field of
-- the hour's history hash (processed + failed<<32, both the count), and a
-- PEXPIRE of 25 hours follows only when that created the field (once per
-- minute and shard). See complete.lua.
--
-- KEYS[1]      the stream
-- KEYS[2]      the group's start-count hash
-- KEYS[3]      the retry set (sorted set)
-- KEYS[4]      the schedule's data (hash)
-- KEYS[4+i]    the record key of item i (KEYS[1] when it has none, or for a
--              fan-out group)
-- KEYS[5+n]    the history hash of the hour of ARGV[7]
-- KEYS[5+n+i]  with ARGV[4] "0#<m>" (Retention.Errors): the error list of
--              item i's request (KEYS[1] when it has none): the attempt's
--              "<ms> <start> <error>" is pushed, the list cut to m and given
--              the record's TTL. Without the mark there are no such keys.
-- KEYS[last]   the shard's fan-out marker (see complete.lua): present once a
--              fan-out group may read the stream, and then entries are
--              left to the trim
-- ARGV[1]      consumer group
-- ARGV[2]      this consumer's name
-- ARGV[3]      a scheduled record lives at least the delay plus this (ms)
-- ARGV[4]      "1": a fan-out group; "0": the answering group, then "#<m>"
--              with Retention.Errors (see KEYS), then "%" when an item is
--              keyed (Key): only then are slots given back (fair.lua)
-- ARGV[5]      the wake channel
-- ARGV[6]      "PUBLISH" or "SPUBLISH"
-- ARGV[7]      the caller's time in Unix ms (the history minute)
-- ARGV[8+5(i-1) .. 12+5(i-1)]  item i: entry id, request id, delay in ms,
--              payload (used only when the stream entry is gone), the
--              attempt's error message (kept for Admin.Jobs). A delay
--              ending in ":f" marks a failed payload fetch: the handler did
--              not start, so the entry's field "f" (failed fetches in a row)
--              is incremented; any other retry drops "f".
--
-- Returns, per item: 1 scheduled, 0 acknowledged only (the request already
-- has its outcome), -1 not pending for this consumer (nothing done).
local stream, starts, schedule, scheduleData = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local group, me, inflight = ARGV[1], ARGV[2], tonumber(ARGV[3])
local fanout = ARGV[4] == "1"
local keepErrors = string.match(ARGV[4], "^0#(%d+)%%?$")
local keyed = string.sub(ARGV[4], -1) == "%"
if keepErrors then
  keepErrors = tonumber(keepErrors)
end
local n = (#ARGV - 7) / 5
local hist = KEYS[5 + n]

local t = redis.call("TIME")
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

local function dec(str)
  local out, pos = {}, 1
  while pos <= #str do
    local colon = string.find(str, ":", pos, true)
    local len = tonumber(string.sub(str, pos, colon - 1))
    out[#out + 1] = string.sub(str, colon + 1, colon + len)
    pos = colon + 1 + len
  end
  return out
end

local function enc(list)
  local parts = {}
  for i, v in ipairs(list) do
    parts[i] = #v .. ":" .. v
  end
  return table.concat(parts)
end

-- 1. Reads.
local items = {}
local gone = {}
local out = {}
for i = 1, n do
  local b = 8 + 5 * (i - 1)
  local d = ARGV[b + 2]
  local fetchFailed = string.sub(d, -2) == ":f"
  if fetchFailed then
    d = string.sub(d, 1, -3)
  end
  local it = {eid = ARGV[b], rid = ARGV[b + 1], delay = tonumber(d), payload = ARGV[b + 3], err = ARGV[b + 4], key = KEYS[4 + i]}
  local p = redis.call("XPENDING", stream, group, it.eid, it.eid, 1)
  if not p[1] or p[1][2] ~= me then
    out[i] = -1
    if not p[1] then
      gone[#gone + 1] = it.eid
    end
  else
    out[i] = 1
    it.count = redis.call("HGET", starts, it.eid) or "0"
    local e = redis.call("XRANGE", stream, it.eid, it.eid)
    local fields = {}
    local fetches = 0
    if e[1] and e[1][2] then
      local f = e[1][2]
      for j = 1, #f, 2 do
        if f[j] == "f" then
          fetches = tonumber(f[j + 1]) or 0
        elseif f[j] ~= "g" and f[j] ~= "n" then
          fields[#fields + 1] = f[j]
          fields[#fields + 1] = f[j + 1]
        end
      end
    else
      fields = {"id", it.rid, "p", it.payload}
    end
    if fetchFailed then
      fields[#fields + 1] = "f"
      fields[#fields + 1] = tostring(fetches + 1)
    end
    fields[#fields + 1] = "g"
    fields[#fields + 1] = group
    it.fields = fields
    if not fanout and it.key ~= stream then
      local cur = redis.pcall("GET", it.key)
      if type(cur) == "string" and string.sub(cur, 1, 1) ~= "P" then
        out[i] = 0
      elseif type(cur) == "string" and #cur > #it.eid + 2 and string.sub(cur, 1, #it.eid + 2) == "P" .. it.eid .. "+" then
        it.follow = string.sub(cur, #it.eid + 3) -- a Replace's follow-up run (produce.lua)
      elseif cur == "P" .. it.eid .. "+" then
        it.quiet = true -- nobody waits (produce.lua): the retry stays quiet
      end
    end
  end
  items[i] = it
end

-- 2. Free first.
for i = 1, #gone, 1000 do
  redis.call("HDEL", starts, unpack(gone, i, math.min(i + 999, #gone)))
end
local acked = {}
for i = 1, n do
  if out[i] >= 0 then
    acked[#acked + 1] = items[i].eid
  end
end
-- unpack() has a limit of a few thousand values: go in chunks.
if #acked > 0 then
  local del = false
  -- The marker is set before a fan-out group is created: with it present
  -- and the group not made yet, the one group seen here would delete an
  -- entry that group is about to read (complete.lua leaves it).
  if not fanout and redis.call("EXISTS", KEYS[#KEYS]) == 0 then
    local ok, groups = pcall(redis.call, "XINFO", "GROUPS", stream)
    del = ok and #groups == 1
  end
  for i = 1, #acked, 1000 do
    local j = math.min(i + 999, #acked)
    redis.call("XACK", stream, group, unpack(acked, i, j))
    redis.call("HDEL", starts, unpack(acked, i, j))
    if del then
      redis.call("XDEL", stream, unpack(acked, i, j))
    end
  end
end

-- 3. Schedule.
local h = redis.call("ZRANGE", schedule, 0, 0, "WITHSCORES")
local head = h[2] and tonumber(h[2])
local wakeAt
local scheduled = 0
for i = 1, n do
  if out[i] == 1 then
    scheduled = scheduled + 1
    local it = items[i]
    local due = now + it.delay
    local member
    local rec = ""
    if it.follow then
      -- A Replace left a follow-up run behind this attempt: the newer payload
      -- runs now instead of this one's retry (see complete.lua's followUp).
      local d = dec(it.follow)
      local base = stream
      if string.sub(base, -12) == ":stream:high" then
        base = string.sub(base, 1, -6)
      elseif string.sub(base, -11) == ":stream:low" then
        base = string.sub(base, 1, -5)
      end
      local eid
      if d[1] == "" then
        eid = redis.call("XADD", base, "*", unpack(dec(d[3])))
      else
        -- A level's stream: the append that creates it tells the consumers.
        eid = redis.call("XADD", base .. ":" .. d[1], "NOMKSTREAM", "*", unpack(dec(d[3])))
        if not eid then
          eid = redis.call("XADD", base .. ":" .. d[1], "*", unpack(dec(d[3])))
          redis.call(ARGV[6], ARGV[5], "+" .. d[1])
        end
      end
      redis.call("SET", it.key, "P" .. eid, "PX", d[2])
    elseif fanout then
      member = "g" .. #group .. ":" .. group .. it.rid
    else
      member = "r" .. it.rid
      if it.key ~= stream then
        rec = it.key
        local ttl = redis.call("PTTL", it.key)
        redis.call("SET", it.key, it.quiet and "P@" .. due .. "+" or "P@" .. due, "PX", math.max(ttl, inflight) + it.delay)
        local errs = keepErrors and KEYS[5 + n + i]
        if errs and errs ~= stream then
          redis.call("LPUSH", errs, now .. " " .. it.count .. " " .. it.err)
          redis.call("LTRIM", errs, 0, keepErrors - 1)
          redis.call("PEXPIRE", errs, math.max(ttl, inflight) + it.delay)
        end
      end
    end
    if member then
      redis.call("ZADD", schedule, due, member)
      redis.call("HSET", scheduleData, member, enc({rec, starts, it.count, enc(it.fields), it.err}))
      if (not head or due < head) and (not wakeAt or due < wakeAt) then
        wakeAt = due
      end
    end
  end
end
if wakeAt then
  redis.call(ARGV[6], ARGV[5], tostring(wakeAt))
end
if scheduled > 0 then
  -- A failed attempt counts as processed and as failed (see complete.lua).
  local inc = string.format("%.0f", scheduled + scheduled * 4294967296)
  local minute = tostring(math.floor(tonumber(ARGV[7]) / 60000) % 60)
  if redis.call("HINCRBY", hist, minute, inc) == tonumber(inc) then
    redis.call("PEXPIRE", hist, 90000000)
  end
end
-- Keyed entries give back their slots (fair.lua); the retry takes its
-- key's turn again when promoted.
if keyed and not fanout and #acked > 0 then
  fairPub = ARGV[6] -- a level's stream created by a turn is announced (fair.lua)
  fairRelease(stream, acked, 1, #acked)
end
return out
