-- purge.lua: delete a dead-letter stream and return how many entries it
-- held, in one step (Admin.PurgeDeadLetters without ids), so that a dead
-- letter added meanwhile is either counted and deleted, or kept.
--
-- KEYS[1]      the dead-letter stream
--
-- Returns the number of entries deleted.
local n = redis.call("XLEN", KEYS[1])
redis.call("DEL", KEYS[1])
return n
