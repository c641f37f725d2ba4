-- cancelretry.lua: cancel a fan-out group's retry waiting in the retry set
-- (Admin.Cancel with AdminOptions.Group naming a fan-out group). A fan-out
-- group's retry has no record and no callers (the answering group's record
-- is the request's): cancelling drops the member and its data, so that the
-- group does not run the request again, in one step with the count. A
-- promoter running at the same time either appended the retry first (the
-- member is gone and this script returns 0) or finds it gone.
--
-- KEYS[1]      the retry set (sorted set)
-- KEYS[2]      the schedule's data (hash)
-- KEYS[3]      the shard's counts (hash)
-- ARGV[1]      the member (the group's retry of one request id)
--
-- Returns 1 when the retry was cancelled, 0 when the set does not hold it.
if redis.call("ZSCORE", KEYS[1], ARGV[1]) == false then
  return 0
end
redis.call("HINCRBY", KEYS[3], "canceled", 1)
redis.call("ZREM", KEYS[1], ARGV[1])
redis.call("HDEL", KEYS[2], ARGV[1])
return 1
