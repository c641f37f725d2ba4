-- requeue.lua: move a dead letter back to the queue's stream (of its priority level).
--
-- The request keeps its id; its record is reset to in flight so that new callers
-- of that id attach to the new entry instead of getting the old error. The
-- new entry keeps the dead letter's flow fields ("pa", "fp", "ff": a flow's
-- parent still reads its children).
--
-- Idempotent by dead-letter id: a marker remembers the new entry id for a while,
-- so a call sent again after its reply was lost (go-redis resends a command
-- after a connection error) returns the entry the first call created instead
-- of reporting the dead letter missing.
--
-- A request id in flight again (its record "P<entry>" or "P@<due>": produced
-- again with RetryFailed, or requeued from another dead letter, and queued,
-- running or waiting in the schedule) is refused: a second entry would run
-- the request twice, and overwriting the record would cut off the callers of
-- the one in flight. The record belongs to the answering group, so only its
-- requeue (ARGV[7] = "1") checks it.
--
-- The first write is the XADD, so under maxmemory the script is refused before
-- it changes anything (a script is checked for memory at its first write).
--
-- KEYS[1]   the stream
-- KEYS[2]   the dead-letter stream
-- KEYS[3]   the record key of the request id
-- KEYS[4]   the requeue marker of the dead letter
-- ARGV[1]   dead-letter entry id
-- ARGV[2]   request id
-- ARGV[3]   payload
-- ARGV[4]   in-flight record TTL in milliseconds
-- ARGV[5]   marker TTL in milliseconds
-- ARGV[6]   the group that runs the new entry (field "g"; other groups only
--           acknowledge it), or "" for every group
-- ARGV[7]   "1": reset the record to in flight (the answering group); "0": leave
--           it (a fan-out group's dead letter)
-- ARGV[8]   the dead letter's priority level ("high", "low"; "" or absent for the
--           default level): the new entry's field "pr" (KEYS[1] is then that
--           level's stream)
-- ARGV[9]   optional: the wake channel, where a requeue that creates a level's
--           stream publishes "+high" or "+low" (see produce.lua)
-- ARGV[10]  with ARGV[9]: "PUBLISH" or "SPUBLISH"
--
-- Returns the new entry id (also when the marker says this dead letter was
-- already requeued), false when the dead letter does not exist, or
-- {"inflight", record} when the request id is in flight again (nothing
-- written).
local dead = redis.call("XRANGE", KEYS[2], ARGV[1], ARGV[1])
if #dead == 0 then
  return redis.call("GET", KEYS[4])
end
if ARGV[2] ~= "" and ARGV[7] ~= "0" then
  -- A key of another type is overwritten below, as before: pcall.
  local rec = redis.pcall("GET", KEYS[3])
  if type(rec) == "string" and string.sub(rec, 1, 1) == "P" then
    return {"inflight", rec}
  end
end
local fields = {"id", ARGV[2], "p", ARGV[3]}
if ARGV[6] ~= "" then
  fields[#fields + 1], fields[#fields + 2] = "g", ARGV[6]
end
if ARGV[8] and ARGV[8] ~= "" then
  fields[#fields + 1], fields[#fields + 2] = "pr", ARGV[8]
end
-- A flow's parent or child keeps its flow fields: a parent still reads its
-- children (Message.Children), a child's outcome was counted in its flow.
local df = dead[1][2]
for i = 1, #df - 1, 2 do
  local f = df[i]
  if f == "pa" or f == "fp" or f == "ff" or f == "k" then
    fields[#fields + 1], fields[#fields + 2] = f, df[i + 1]
  end
end
-- A keyed request takes its key's turn (fair.lua): appended now with a
-- slot, or waiting in its key's list with its record "P%" (reply "").
local fk = fairKeyOf(fields, 1, #fields)
local fb = fk and fairBase(KEYS[1])
if fk and not fairMayAppend(fb, fk) then
  local rec = ""
  if ARGV[2] ~= "" and ARGV[7] ~= "0" then
    rec = KEYS[3]
  end
  local el = {rec, "", "0"}
  for i = 1, #fields do
    el[#el + 1] = fields[i]
  end
  fairWait(fb, fk, fairEnc(el))
  redis.call("XDEL", KEYS[2], ARGV[1])
  if rec ~= "" then
    redis.call("SET", rec, "P%", "PX", ARGV[4])
  end
  redis.call("SET", KEYS[4], "", "PX", ARGV[5])
  return ""
end
local eid
if ARGV[8] and ARGV[8] ~= "" then
  -- A level's stream: a requeue that creates it tells the consumers (ARGV[9]).
  eid = redis.call("XADD", KEYS[1], "NOMKSTREAM", "*", unpack(fields))
  if not eid then
    eid = redis.call("XADD", KEYS[1], "*", unpack(fields))
    if ARGV[9] then
      redis.call(ARGV[10], ARGV[9], "+" .. ARGV[8])
    end
  end
else
  eid = redis.call("XADD", KEYS[1], "*", unpack(fields))
end
if fk then
  fairTake(fb, fk, eid, KEYS[1])
end
redis.call("XDEL", KEYS[2], ARGV[1])
if ARGV[2] ~= "" and ARGV[7] ~= "0" then
  redis.call("SET", KEYS[3], "P" .. eid, "PX", ARGV[4])
end
redis.call("SET", KEYS[4], eid, "PX", ARGV[5])
return eid
