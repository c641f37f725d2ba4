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
-- The counting itself is chargeStart (start.lua, put in front of this file);
-- complete.lua charges the same way when a start travels with an outcome.
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
local existed = redis.call("PEXPIRE", KEYS[2], ARGV[4]) == 1
for i = 1, n do
  out[i] = chargeStart(KEYS[1], KEYS[2], ARGV[1], ARGV[2], floor,
    ARGV[3 + 2 * i], tonumber(ARGV[4 + 2 * i]), KEYS[2 + i])
end
if not existed then
  -- The hash was created above: give it its TTL.
  redis.call("PEXPIRE", KEYS[2], ARGV[4])
end
return out
