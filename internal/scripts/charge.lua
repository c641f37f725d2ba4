-- charge.lua: count the handler starts of entries this consumer is about to
-- run, durably, before the handlers run.
--
-- A delivery is a handler start. Redis's own PEL delivery counter cannot tell
-- an entry read into a consumer's ring but never started from one that
-- started and crashed its consumer (XREADGROUP > sets it to 1 on read), and
-- miniredis counts differently again, so streamq keeps its own count: a hash
-- per consumer group, field entry id, value the starts so far. Reads, claims
-- and resumes count nothing; this script counts each start.
--
-- Idempotent under resend (go-redis sends a script again after a lost reply,
-- even when it ran): the caller passes the starts it saw at admission; a
-- count already at that + 1 is this same charge, and is returned unchanged.
--
-- Under maxmemory the first write is PEXPIRE (not refused when out of memory),
-- after which Redis lets the script finish its writes: charging must keep
-- working when memory is full, or no handler could start and free any.
--
-- KEYS[1]      the stream
-- KEYS[2]      the group's start-count hash
-- KEYS[2+i]    the record key of item i, or KEYS[1] when the entry has no id
-- ARGV[1]      consumer group
-- ARGV[2]      this consumer's name
-- ARGV[3]      in-flight record floor in milliseconds: a record that still
--              says "P<entry id>" is kept alive at least this long
-- ARGV[4]      TTL of the start-count hash in milliseconds, refreshed here
-- ARGV[3+2i]   entry id of item i
-- ARGV[4+2i]   starts of item i seen at admission (before this one)
--
-- Returns, per item, the starts including this one; -1 when another consumer
-- owns the entry now (not counted); -2 when it left the pending list.
local n = #KEYS - 2
local out = {}
local floor = tonumber(ARGV[3])
redis.call("PEXPIRE", KEYS[2], ARGV[4])
for i = 1, n do
  local eid = ARGV[3 + 2 * i]
  local expected = tonumber(ARGV[4 + 2 * i])
  local p = redis.call("XPENDING", KEYS[1], ARGV[1], eid, eid, 1)
  if not p[1] then
    out[i] = -2
  elseif p[1][2] ~= ARGV[2] then
    out[i] = -1
  else
    -- The common case, a first start, is one command.
    if expected == 0 and redis.call("HSETNX", KEYS[2], eid, 1) == 1 then
      out[i] = 1
    else
      local cur = tonumber(redis.call("HGET", KEYS[2], eid) or "0")
      if cur == expected + 1 then
        out[i] = cur -- this charge, resent
      else
        out[i] = redis.call("HINCRBY", KEYS[2], eid, 1)
      end
    end
    local rec = KEYS[2 + i]
    if rec ~= KEYS[1] then
      local ttl = redis.call("PTTL", rec)
      if ttl >= 0 and ttl < floor and redis.pcall("GET", rec) == "P" .. eid then
        redis.call("PEXPIRE", rec, floor)
      end
    end
  end
end
-- Again: the hash may have been created above.
redis.call("PEXPIRE", KEYS[2], ARGV[4])
return out
