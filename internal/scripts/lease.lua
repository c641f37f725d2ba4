-- lease.lua: reset the idle time of entries this consumer still owns.
--
-- Ownership is checked and the idle time set in one atomic step, so a lease never
-- takes back an entry another consumer has claimed.
--
-- KEYS[1]   the stream
-- ARGV[1]   consumer group
-- ARGV[2]   this consumer's name
-- ARGV[3]   idle time to set, in milliseconds: "0" renews the lease; a value
--           at or above the claimers' minimum idle time releases the entries
--           so that another consumer can claim them at once; a value in between
--           schedules a retry after (minimum idle - value)
-- ARGV[4..] entry ids
--
-- Returns the ids that are no longer owned by this consumer.
local owned, lost = {}, {}
for i = 4, #ARGV do
  local p = redis.call("XPENDING", KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)
  if p[1] and p[1][2] == ARGV[2] then
    owned[#owned + 1] = ARGV[i]
  else
    lost[#lost + 1] = ARGV[i]
  end
end
if #owned > 0 then
  -- unpack() must be the last argument: in the middle of a list Lua keeps only
  -- its first value, which would renew (or release) one entry per call.
  local args = {"XCLAIM", KEYS[1], ARGV[1], ARGV[2], 0}
  for _, id in ipairs(owned) do
    args[#args + 1] = id
  end
  args[#args + 1] = "IDLE"
  args[#args + 1] = ARGV[3]
  args[#args + 1] = "JUSTID"
  redis.call(unpack(args))
end
return lost
