-- charge.lua: count the handler starts of entries this consumer is about to
-- run, durably, before the handlers run, checking that it still owns each.
--
-- A delivery is a handler start. Redis's own PEL delivery counter cannot tell
-- an entry read into a consumer's ring but never started from one that
-- started and crashed its consumer (XREADGROUP > sets it to 1 on read), and
-- miniredis counts differently again, so streamq keeps its own count: a hash
-- per consumer group, field entry id, value the starts so far. Reads, claims
-- and resumes count nothing; a start is counted when it happens.
--
-- Most starts do not come here: an entry that this consumer read, claimed or
-- renewed less than MinIdle/2 ago cannot have been claimed by anyone since,
-- so the committer counts it with a plain HSET of the count it saw plus one
-- (committer.go). This script is for the rest (entries held longer, or whose
-- lease may have lapsed): it checks the owner first.
--
-- Idempotent under resend (go-redis sends a script again after a lost reply,
-- even when it ran): the caller passes the starts it saw at admission; a
-- count already at that + 1 is this same charge, and is returned unchanged.
-- (The price: a consumer whose lease lapsed, whose entry another consumer
-- started, and that took the entry back, counts that start once for both.)
--
-- Under maxmemory the first write is PEXPIRE (not refused when out of memory),
-- after which Redis lets the script finish its writes: charging must keep
-- working when memory is full, or no handler could start and free any.
--
-- KEYS[1]      the stream
-- KEYS[2]      the group's start-count hash
-- ARGV[1]      consumer group
-- ARGV[2]      this consumer's name
-- ARGV[3]      TTL of the start-count hash in milliseconds, refreshed here
-- ARGV[2+2i]   entry id of item i
-- ARGV[3+2i]   starts of item i seen at admission (before this one)
--
-- Returns, per item, the starts including this one; -1 when another consumer
-- owns the entry now (not counted); -2 when it left the pending list, or the
-- group is gone (a Redis restarted without persistence).
local stream, starts, group, me = KEYS[1], KEYS[2], ARGV[1], ARGV[2]
local n = (#ARGV - 3) / 2
local out = {}
local existed = redis.call("PEXPIRE", starts, ARGV[3]) == 1
for i = 1, n do
  local eid, expected = ARGV[2 + 2 * i], tonumber(ARGV[3 + 2 * i])
  local p = redis.pcall("XPENDING", stream, group, eid, eid, 1)
  if type(p) == "table" and p.err then
    if string.sub(p.err, 1, 7) ~= "NOGROUP" then
      error(p)
    end
    out[i] = -2
  elseif not p[1] then
    out[i] = -2
  elseif p[1][2] ~= me then
    out[i] = -1
  else
    local cur = tonumber(redis.call("HGET", starts, eid) or "0")
    if cur == expected + 1 then
      out[i] = cur -- this charge, resent
    else
      out[i] = redis.call("HINCRBY", starts, eid, 1)
    end
  end
end
if not existed then
  -- The hash was created above: give it its TTL.
  redis.call("PEXPIRE", starts, ARGV[3])
end
return out
