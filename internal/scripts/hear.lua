-- hear.lua: a producer that listens now makes the quiet records of its
-- waiting requests announced, and reads them.
--
-- A request produced while its producer did not listen (Enqueue,
-- EnqueueBatch, Send, or ProduceBatch before any Wait) is recorded quiet,
-- "P<entry id>+", and its completion is not announced (produce.lua's heard).
-- When such a producer subscribes, its check of the records of its waiting
-- requests runs this for the quiet ones it read, so that their outcomes are
-- announced from now on: the check (a read) and the change are one step, so
-- a completion in between is read here, never missed.
--
-- KEYS  the record keys (all of one shard)
--
-- Returns each record as it stands afterwards (false: none, or a key of
-- another type). Under maxmemory Redis refuses the writes: the records are
-- returned as read, still quiet, and a later check tries again (until then
-- only the checks find their outcomes).
local out = {}
for i, key in ipairs(KEYS) do
  local v = redis.pcall("GET", key)
  if type(v) ~= "string" then
    v = false
  elseif string.byte(v, -1) == 43 and string.find(v, "+", 2, true) == #v then -- quiet
    local r = redis.pcall("SET", key, string.sub(v, 1, -2), "KEEPTTL")
    if type(r) ~= "table" or not r.err then
      v = string.sub(v, 1, -2)
    end
  end
  out[i] = v
end
return out
