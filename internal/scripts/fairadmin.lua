-- fairadmin.lua: read or change one shard's keys (fair.lua in front).
--
-- KEYS[1]      the shard's default-level stream (the other names follow it)
-- ARGV[1]      the operation:
--   "top" n      the n keys with the most waiting jobs (then the most slots)
--                among the keys that have any, looking at most at 500 keys
--                of each kind (see below): {key, waiting, running,
--                paused, limit, weight, rate, held} per key, flat (rate:
--                "<N>:<Per ns>:<Burst>" or ""; held: 1 while its rate holds
--                it back, keys:timed)
--   "get" key    that key's {key, waiting, running, paused, limit, weight,
--                rate, held}
--   "pause" key  the key appends nothing more until "resume"
--   "resume" key
--   "limit" key n  the key's own limit (0: the shard's default again)
--   "weight" key w the key's weight (1: the default)
--   "window" w   the shard's window (0: the default)
--   "deflimit" n the shard's default limit per key (0: none)
--   "rate" key r the key's own rate limit ("<N>:<Per ns>:<Burst>"; "": the
--                shard's default again)
--   "defrate" r  the shard's default rate per key ("": none)
--   "set" f v... the consumer's settings (fields "window", "limit",
--                "rate"), stored as given; lets nothing in
-- ARGV[#ARGV]  "PUBLISH" or "SPUBLISH": a key held back for its rate is
--              announced on the wake channel (fair.lua's fairTime)
-- Changes return how many waiting jobs they let in at once.
local base = fairBase(KEYS[1])
local cfg = base .. "keys:cfg"
local op = ARGV[1]
fairPub = ARGV[#ARGV]

-- stat returns key's reply; runOf, when given, holds the slots of every
-- key (fairRunning), else the key's are read alone.
local function stat(key, runOf)
  local window, limit, on = fairConf(base)
  local lim, paused, w = fairKeyConf(base, key, limit, on)
  local rate = ""
  if on then
    rate = redis.call("HGET", cfg, "r:" .. key) or fairCfg[3] or ""
  end
  local run
  if runOf then
    run = runOf[key] or 0
  else
    run = fairRunning(base, {[key] = true})[key]
  end
  return {key, redis.call("LLEN", base .. "keys:q:" .. key), run, paused and 1 or 0, lim, w,
    rate, redis.call("ZSCORE", base .. "keys:timed", key) and 1 or 0}
end

if op == "get" then
  return stat(ARGV[2])
end
if op == "top" then
  local seen, list = {}, {}
  -- At most topScan keys of each kind are looked at (the next in turn, the
  -- parked, those with slots, the held), so a call's work is bounded
  -- whatever the number of active keys: 10,000 keys in the ring blocked
  -- the server 37-56 ms per call, and the dashboard polls every 2 s.
  local topScan = 500
  local parked, running, slots = base .. "keys:parked", base .. "keys:running", base .. "keys:slots"
  -- Without keys:running (fairTracked), every key's slots are counted
  -- once from keys:slots (slot -> key): every slot while there are at
  -- most 10 times topScan, else a sample of topScan slots (a key's count
  -- is then its slots in the sample).
  local runOf, held = nil, {}
  if not fairTracked(base) then
    if redis.call("HLEN", slots) <= 10 * topScan then
      runOf = fairRunning(base)
      for k in pairs(runOf) do held[#held + 1] = k end
    else
      runOf = {}
      local sample = redis.call("HRANDFIELD", slots, topScan, "WITHVALUES")
      for i = 2, #sample, 2 do
        local k = sample[i]
        if not runOf[k] then held[#held + 1] = k end
        runOf[k] = (runOf[k] or 0) + 1
      end
    end
    table.sort(held)
  elseif redis.call("HLEN", running) <= topScan then
    held = redis.call("HKEYS", running)
  else
    held = redis.call("HRANDFIELD", running, topScan)
  end
  local function add(k)
    if not seen[k] then
      seen[k] = true
      list[#list + 1] = stat(k, runOf)
    end
  end
  for _, k in ipairs(redis.call("LRANGE", base .. "keys:ready", 0, topScan - 1)) do add(k) end
  if redis.call("SCARD", parked) <= topScan then
    for _, k in ipairs(redis.call("SMEMBERS", parked)) do add(k) end
  else
    for _, k in ipairs(redis.call("SRANDMEMBER", parked, topScan)) do add(k) end
  end
  for i = 1, math.min(#held, topScan) do add(held[i]) end
  for _, k in ipairs(redis.call("ZRANGE", base .. "keys:timed", 0, topScan - 1)) do add(k) end
  table.sort(list, function(a, b)
    if a[2] ~= b[2] then return a[2] > b[2] end
    if a[3] ~= b[3] then return a[3] > b[3] end
    return a[1] < b[1]
  end)
  local out = {}
  for i = 1, math.min(tonumber(ARGV[2]), #list) do
    for j = 1, 8 do
      out[#out + 1] = list[i][j]
    end
  end
  return out
end

local key = ARGV[2]
-- Whether keys:running was kept before this change (fair.lua's
-- fairRetrack brings it in step after).
local was = fairTracked(base)
if op == "set" then
  for i = 2, #ARGV - 2, 2 do
    redis.call("HSET", cfg, ARGV[i], ARGV[i + 1])
  end
  fairRetrack(base, was)
  return 0
elseif op == "pause" then
  redis.call("HSET", cfg, "p:" .. key, "1")
  return 0
elseif op == "resume" then
  redis.call("HDEL", cfg, "p:" .. key)
elseif op == "limit" then
  -- "lk" counts the keys with their own limit (fairTracked).
  if tonumber(ARGV[3]) > 0 then
    if redis.call("HSET", cfg, "l:" .. key, ARGV[3]) == 1 then
      redis.call("HINCRBY", cfg, "lk", 1)
    end
  elseif redis.call("HDEL", cfg, "l:" .. key) == 1 and redis.call("HINCRBY", cfg, "lk", -1) <= 0 then
    redis.call("HDEL", cfg, "lk")
  end
elseif op == "weight" then
  if tonumber(ARGV[3]) > 1 then
    redis.call("HSET", cfg, "w:" .. key, ARGV[3])
  else
    redis.call("HDEL", cfg, "w:" .. key)
  end
elseif op == "rate" then
  if ARGV[3] ~= "" then
    redis.call("HSET", cfg, "r:" .. key, ARGV[3])
  else
    redis.call("HDEL", cfg, "r:" .. key)
  end
  -- A changed rate takes effect at once, from a fresh state (the old one
  -- would hold the key for the old rate's time): a key held back by its
  -- old rate takes its turn again (the pump holds it back again if it must
  -- wait).
  fairRetrack(base, was)
  redis.call("DEL", base .. "keys:t:" .. key)
  if redis.call("ZREM", base .. "keys:timed", key) == 1 then
    redis.call("RPUSH", base .. "keys:ready", key)
  end
  return fairPump(base)
elseif op == "window" or op == "deflimit" or op == "defrate" then
  local field = ({window = "window", deflimit = "limit", defrate = "rate"})[op]
  if (op == "defrate" and ARGV[2] ~= "") or (op ~= "defrate" and tonumber(ARGV[2]) > 0) then
    redis.call("HSET", cfg, field, ARGV[2])
  else
    redis.call("HDEL", cfg, field)
  end
  fairRetrack(base, was)
  -- A raised default may let parked or held keys in: each takes its turn
  -- again (the pump parks or holds again those that must wait).
  for _, k in ipairs(redis.call("SMEMBERS", base .. "keys:parked")) do
    redis.call("SREM", base .. "keys:parked", k)
    redis.call("RPUSH", base .. "keys:ready", k)
  end
  local held = redis.call("ZRANGE", base .. "keys:timed", 0, -1)
  if #held > 0 then
    redis.call("DEL", base .. "keys:timed")
    -- In chunks: Lua's unpack takes about 8,000 values.
    for i = 1, #held, 1000 do
      redis.call("RPUSH", base .. "keys:ready", unpack(held, i, math.min(i + 999, #held)))
    end
  end
  return fairPump(base)
else
  return redis.error_reply("fairadmin: unknown operation " .. tostring(op))
end
fairRetrack(base, was)
-- A parked key may append again: it takes its turn at the end of the ring.
if redis.call("SREM", base .. "keys:parked", key) == 1 then
  redis.call("RPUSH", base .. "keys:ready", key)
end
return fairPump(base)
