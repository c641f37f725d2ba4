-- complete.lua: record outcomes, acknowledge and delete entries, notify waiters.
--
-- Recording is first-writer-wins: when a request id already has an outcome (a
-- redelivered duplicate finished second), the stored outcome is put back (its
-- TTL restarts) and re-announced, and the entry is still acknowledged.
--
-- KEYS[1]          the stream
-- KEYS[2]          the dead-letter stream
-- KEYS[2+i]        the record key of item i; the dead-letter key when the item has no id
-- KEYS[#KEYS]      the group's start-count hash (see charge.lua): completed ids are
--                  removed from it
-- ARGV[1]          consumer group
-- ARGV[2]          notification channel
-- ARGV[3]          record TTL in milliseconds
-- ARGV[4]          "1": store successful results; "0": store only a done marker "N"
-- ARGV[5]          dead-letter stream length cap (approximate)
-- ARGV[6]          consumer name (recorded in dead letters)
-- ARGV[7]          time in milliseconds (recorded in dead letters)
-- ARGV[8]          "PUBLISH", or "SPUBLISH" on a cluster (sharded pub/sub)
-- ARGV[9+6(i-1) .. 14+6(i-1)]  item i: entry id, request id, code, value, payload, deliveries
--   code "R": value is the encoded response
--   code "E": value is an error message
--   code "L": value is an error message; the item is also appended to the dead-letter
--             stream, unless the request already had an outcome
--
-- Returns the number of items.
local group, channel, ttl, store = ARGV[1], ARGV[2], ARGV[3], ARGV[4] == "1"
local starts = KEYS[#KEYS]
local n = #KEYS - 3
local ids = {}
local notice = {}
for i = 1, n do
  local b = 9 + 6 * (i - 1)
  local eid, rid, code, value = ARGV[b], ARGV[b + 1], ARGV[b + 2], ARGV[b + 3]
  ids[i] = eid
  local outcome = code .. value
  local first = true
  if rid ~= "" then
    local key = KEYS[2 + i]
    local rec = outcome
    if code == "R" and not store then
      rec = "N"
    end
    -- One command in the common case; the rare duplicate puts the first
    -- outcome back.
    local prev = redis.pcall("SET", key, rec, "GET", "PX", ttl)
    if type(prev) == "table" then
      redis.call("SET", key, rec, "PX", ttl) -- not a string: another program's key
    elseif prev and string.sub(prev, 1, 1) ~= "P" then
      redis.call("SET", key, prev, "PX", ttl)
      outcome = prev
      first = false
    end
    notice[#notice + 1] = #rid .. ":" .. rid .. #outcome .. ":" .. outcome
  end
  -- A duplicate that failed for good after another copy recorded an outcome
  -- is not a dead letter: the request already has its outcome.
  if code == "L" and first then
    redis.call("XADD", KEYS[2], "MAXLEN", "~", ARGV[5], "*",
      "id", rid, "entry", eid, "p", ARGV[b + 4], "error", value,
      "deliveries", ARGV[b + 5], "consumer", ARGV[6], "at", ARGV[7])
  end
end
-- unpack() has a limit of a few thousand values: go in chunks.
for i = 1, #ids, 1000 do
  redis.call("XACK", KEYS[1], group, unpack(ids, i, math.min(i + 999, #ids)))
  redis.call("HDEL", starts, unpack(ids, i, math.min(i + 999, #ids)))
end
-- Delete the entries only when no other group may still need them; with
-- several groups, the periodic trim removes what every group is done with.
-- (XINFO fails when the stream itself is gone, e.g. after a Redis restart
-- without persistence: then there is nothing to delete.)
local ok, groups = pcall(redis.call, "XINFO", "GROUPS", KEYS[1])
if ok and #groups == 1 then
  for i = 1, #ids, 1000 do
    redis.call("XDEL", KEYS[1], unpack(ids, i, math.min(i + 999, #ids)))
  end
end
if #notice > 0 then
  redis.call(ARGV[8], channel, table.concat(notice))
end
return n
