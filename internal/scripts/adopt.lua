-- adopt.lua: take back entries of this consumer's own pending list that it
-- does not hold, without counting a delivery.
--
-- They are there when go-redis resent an XREADGROUP or a claim after a lost
-- reply: the first run put entries into this consumer's pending list and the
-- reply that named them never arrived. The consumer finds them by comparing
-- its pending count with what it holds, lists its pending ids, and passes
-- those it does not hold here (entries scheduled for a retry excluded).
--
-- KEYS[1]   the stream
-- KEYS[2]   the group's start-count hash (see charge.lua)
-- ARGV[1]   consumer group
-- ARGV[2]   this consumer's name
-- ARGV[3..] entry ids
--
-- Returns {entries as {id, {field, value, ...}}, their handler starts so far,
-- ids whose stream entry was deleted}. Ids no longer pending for this consumer
-- are skipped. Deleted ids are acknowledged and their counts dropped; the
-- idle time of the others is reset.
local live, ids, counts, gone = {}, {}, {}, {}
for i = 3, #ARGV do
  local id = ARGV[i]
  local p = redis.call("XPENDING", KEYS[1], ARGV[1], id, id, 1)
  if p[1] and p[1][2] == ARGV[2] then
    local e = redis.call("XRANGE", KEYS[1], id, id)
    if e[1] then
      live[#live + 1] = e[1]
      ids[#ids + 1] = id
      counts[#counts + 1] = tonumber(redis.call("HGET", KEYS[2], id) or "0")
    else
      gone[#gone + 1] = id
    end
  end
end
for i = 1, #gone, 1000 do
  redis.call("XACK", KEYS[1], ARGV[1], unpack(gone, i, math.min(i + 999, #gone)))
  redis.call("HDEL", KEYS[2], unpack(gone, i, math.min(i + 999, #gone)))
end
for i = 1, #ids, 1000 do
  local args = {"XCLAIM", KEYS[1], ARGV[1], ARGV[2], 0}
  for j = i, math.min(i + 999, #ids) do
    args[#args + 1] = ids[j]
  end
  args[#args + 1] = "JUSTID"
  redis.call(unpack(args))
end
return {live, counts, gone}
