-- promote.lua: append the scheduled jobs that are due to the stream.
--
-- Jobs wait in the schedule (a sorted set scored by due time in Unix ms) with
-- their data in a hash (see produce.lua and retry.lua). One call moves at most
-- ARGV[1] due jobs, atomically: each is removed from the schedule and appended
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
-- KEYS[1]      the stream
-- KEYS[2]      the schedule (sorted set)
-- KEYS[3]      the schedule's data (hash)
-- KEYS[4]      the stream of priority level "high"
-- KEYS[5]      the stream of priority level "low"
-- ARGV[1]      the most jobs to append in this call
-- ARGV[2]      TTL of a start-count hash in milliseconds, refreshed when written
--
-- Returns {appended, next due time in Unix ms or -1 when nothing is
-- scheduled, the server's time in Unix ms}.
--
-- The data of a job is length-prefixed strings ("<len>:<s>"...): its record
-- key ("" for none), its start-count hash key ("" for none), its start count,
-- and its stream fields (themselves length-prefixed, name then value). A job
-- whose fields hold "pr" (its priority level: "high" or "low") is appended to
-- that level's stream (KEYS[4], KEYS[5]), any other to KEYS[1]. Keys
-- named in the data carry the shard's hash tag (their names are built by the
-- writer from internal/keys), so they are in this call's slot.
local t = redis.call("TIME")
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

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

local due = redis.call("ZRANGEBYSCORE", KEYS[2], "-inf", now, "LIMIT", 0, tonumber(ARGV[1]))
local appended = 0
for _, member in ipairs(due) do
  local raw = redis.call("HGET", KEYS[3], member)
  redis.call("ZREM", KEYS[2], member)
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
    if run then
      if count > 0 then
        fields[#fields + 1] = "n"
        fields[#fields + 1] = tostring(count)
      end
      local to = KEYS[1]
      for j = 1, #fields - 1, 2 do
        if fields[j] == "pr" then
          if fields[j + 1] == "high" and KEYS[4] then
            to = KEYS[4]
          elseif fields[j + 1] == "low" and KEYS[5] then
            to = KEYS[5]
          end
        end
      end
      local eid = redis.call("XADD", to, "*", unpack(fields))
      if cur and string.sub(cur, 1, 2) == "P@" then
        redis.call("SET", rec, "P" .. eid, "KEEPTTL")
      end
      if count > 0 and starts ~= "" then
        redis.call("HSET", starts, eid, count)
        redis.call("PEXPIRE", starts, ARGV[2])
      end
      appended = appended + 1
    end
  end
end

local head = redis.call("ZRANGE", KEYS[2], 0, 0, "WITHSCORES")
local nextDue = -1
if head[2] then
  nextDue = tonumber(head[2])
end
return {appended, nextDue, now}
