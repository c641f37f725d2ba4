-- forget.lua: make Redis forget a request id, so that producing it again runs
-- it again (Admin.Forget).
--
-- A request still in flight ("P<entry id>") is refused while a consumer of
-- the group holds its entry, unless forced. Otherwise its entry is deleted
-- (a queued request will not run), acknowledged for the group when forced,
-- and its start count removed. A scheduled request ("P@<due>": delayed, or a
-- retry waiting for its back-off) is removed from the schedule, so it will
-- not run either. Then the record is deleted. Every write frees memory, so
-- nothing here is refused under maxmemory.
--
-- KEYS[1]  the request's record
-- KEYS[2]  the stream of the request's shard
-- KEYS[3]  the group's start-count hash of KEYS[2] (see charge.lua)
-- KEYS[4]  the shard's schedule (sorted set)
-- KEYS[5]  the schedule's data (hash)
-- KEYS[6]  the shard's retry set (sorted set)
-- KEYS[7]  optional: the stream of priority level "high" of the shard
-- KEYS[8]  optional: the stream of priority level "low" of the shard
-- KEYS[9]  optional: the request's progress key, deleted with the record (a
--          request produced again later does not show this one's progress)
-- KEYS[10] optional: the request's error list (Retention.Errors), deleted
--          with the record for the same reason
-- KEYS[11] the group's start-count hash of KEYS[7] (entry ids are per
--          stream, and so are start counts)
-- KEYS[12] the group's start-count hash of KEYS[8]
-- KEYS[13] optional: the request's mode key (an open Throttle window),
--          deleted with the record, and also when there is no record (an
--          outcome that expired inside the window): producing the id again
--          then runs it again, as Forget promises
-- ARGV[1]  consumer group
-- ARGV[2]  "1": forget even while a consumer holds the entry
-- ARGV[3]  the request id (its member in the schedule is "r" .. id)
-- ARGV[4]  optional: "PUBLISH" or "SPUBLISH", for the wake channel notices
--          of the keys' turns a released slot lets in (fair.lua)
--
-- Returns {"missing"} when there is no record; {"held", consumer} when a
-- consumer holds the entry and ARGV[2] is not "1"; otherwise {"ok", the
-- record's value before it was deleted}.

-- entryStream (entrystream.lua, in front of this script) finds the stream
-- holding an entry: KEYS[2] or a level stream, KEYS[7] or KEYS[8].
local member = "r" .. ARGV[3]
local rec = redis.call("GET", KEYS[1])
if KEYS[13] then
  redis.call("DEL", KEYS[13])
end
if not rec then
  return {"missing"}
end
if string.sub(rec, 1, 2) == "P@" then
  redis.call("ZREM", KEYS[4], member)
  redis.call("ZREM", KEYS[6], member)
  redis.call("HDEL", KEYS[5], member)
elseif rec == "P&" or rec == "P%" then
  -- "P%": waiting for its key's turn (fair.lua), which drops a job whose
  -- record is gone.
  -- A flow's parent waiting for its children: no entry yet (the flow hash
  -- expires; a child's completion finds the record gone and appends nothing).
elseif string.sub(rec, 1, 1) == "P" then
  local eid = string.match(rec, "^P([^+]*)") -- a Replace's follow-up ("+...") goes with it
  local stream = entryStream(eid, ARGV[3])
  if stream then -- else in no stream: nothing to delete (entrystream.lua)
    local ok, p = pcall(redis.call, "XPENDING", stream, ARGV[1], eid, eid, 1)
    if ok and p[1] then
      if ARGV[2] ~= "1" then
        return {"held", p[1][2]}
      end
      redis.call("XACK", stream, ARGV[1], eid)
    end
    redis.call("XDEL", stream, eid)
    local counts = KEYS[3]
    if stream == KEYS[7] then
      counts = KEYS[11]
    elseif stream == KEYS[8] then
      counts = KEYS[12]
    end
    redis.call("HDEL", counts, eid)
    fairPub = ARGV[4]
    fairRelease(stream, {eid}, 1, 1) -- a keyed entry's slot (fair.lua)
  end
end
redis.call("DEL", KEYS[1])
if KEYS[9] then
  redis.call("DEL", KEYS[9])
end
if KEYS[10] then
  redis.call("DEL", KEYS[10])
end
return {"ok", rec}
