-- lease.lua: reset the idle time of entries this consumer still owns, and keep
-- their in-flight records alive while they are held.
--
-- Ownership is checked and the idle time set in one atomic step, so a lease never
-- takes back an entry another consumer has claimed.
--
-- While a consumer holds an entry (in its ring, in a handler, or awaiting
-- completion), the entry's record, when it still says "P<entry id>", is kept
-- at least ARGV[4] milliseconds ahead (never shortened): InflightTTL bounds
-- the time a request waits unheld, not the time spent working on it. So is
-- the request's progress value, when the call names its key: a handler may
-- report once and work on, silent, for longer than the value's TTL from that
-- report (the longer of the record's and ResultTTL; complete.lua expires it
-- with the record once the outcome is recorded).
--
-- KEYS[1]     the stream
-- KEYS[1+i]   the record key of the i-th entry (ARGV[5+i]), or KEYS[1] when it
--             has no record (an entry without a valid request id)
-- KEYS[1+n+j] the progress key of the j-th entry listed in ARGV[5] (n: the
--             number of entries)
-- ARGV[1]     consumer group
-- ARGV[2]     this consumer's name
-- ARGV[3]     idle time to set, in milliseconds: "0" renews the lease; a value
--             at or above the claimers' minimum idle time releases the entries
--             so that another consumer can claim them at once; a value in between
--             schedules a retry after (minimum idle - value)
-- ARGV[4]     record floor in milliseconds; "0" leaves records alone
-- ARGV[5]     "" or "~<i>,<j>,...": the entries (1-based, in order) whose
--             progress key follows the record keys (only with a floor: the
--             consumer names those whose delivery reported progress, or that
--             started before this delivery)
-- ARGV[6..]   entry ids
--
-- Returns the ids that are no longer owned by this consumer, those whose
-- request was cancelled prefixed with "c" (an entry id starts with a digit).
local owned, lost = {}, {}
local floor = tonumber(ARGV[4])
local n = #ARGV - 5
local progressOf -- entry index -> the position of its progress key
if ARGV[5] ~= "" then
  progressOf = {}
  local at = 1 + n
  for idx in string.gmatch(ARGV[5], "%d+") do
    at = at + 1
    progressOf[tonumber(idx)] = at
  end
end
-- keepAlive sets key's TTL to floor when it is shorter (never shortens it;
-- a key without one, or gone, is left alone).
local function keepAlive(key)
  local ttl = redis.call("PTTL", key)
  if ttl >= 0 and ttl < floor then
    redis.call("PEXPIRE", key, floor)
  end
end
for i = 6, #ARGV do
  local p = redis.call("XPENDING", KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)
  if p[1] and p[1][2] == ARGV[2] then
    owned[#owned + 1] = ARGV[i]
    local rec = KEYS[i - 4]
    if floor > 0 and rec and rec ~= KEYS[1] then
      local v = redis.pcall("GET", rec)
      -- "P<entry id>", or with a follow-up run kept behind it ("+...", Replace)
      if type(v) == "string" and string.match(v, "^P([^+]*)") == ARGV[i] then
        keepAlive(rec)
        if progressOf and progressOf[i - 5] then
          keepAlive(KEYS[progressOf[i - 5]])
        end
      end
    end
  else
    -- Not owned any more: claimed by another consumer, or cancelled
    -- (cancel.lua acknowledged and deleted the entry and stored "C..."),
    -- which is reported as "c<entry id>" so that the handler's cause is
    -- ErrCanceled when the cancel notice was lost.
    local rec, gone = KEYS[i - 4], ARGV[i]
    if rec and rec ~= KEYS[1] then
      local v = redis.pcall("GET", rec)
      if type(v) == "string" and string.sub(v, 1, 1) == "C" then
        gone = "c" .. gone
      end
    end
    lost[#lost + 1] = gone
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
