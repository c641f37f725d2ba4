-- fair.lua: fair queuing by key, shared by produce.lua, complete.lua,
-- retry.lua, promote.lua, requeue.lua and fairadmin.lua (prepended to each).
--
-- A request produced with a key (entry field "k") does not go to the stream
-- while its key has jobs waiting, the queue's window is full or the key is at
-- its limit: it waits in its key's list. Keys with waiting jobs take turns
-- (a list used as a ring); each turn appends up to the key's weight of its
-- jobs to the shard's stream of its level, where consumers read them like
-- any entry. An appended keyed entry holds a slot of its key until its
-- outcome (complete.lua) or retry (retry.lua) releases it, in the same step
-- that acknowledges it; a crashed consumer's entries keep their slots until
-- another consumer claims and finishes them. So the number of slots of a key
-- bounds how many of its handlers run at once, and a key at its limit has no
-- entry in any consumer's ring.
--
-- Keys of a shard (base "streamq:{Q}:"), each absent while empty (a key is
-- in exactly one of keys:ready, keys:parked and keys:timed while its list
-- exists):
--   keys:q:<key>   list: the key's waiting jobs, oldest first, each an
--                  array of strings (fairEnc): record key ("" for none),
--                  start-count key ("" for none), start count, stream fields
--   keys:ready     list: the keys with waiting jobs that may append, in
--                  turn order (a key is in ready, parked or timed, one only,
--                  exactly while its list exists)
--   keys:parked    set: the keys with waiting jobs that may not append now
--                  (at their limit, or paused)
--   keys:slots     hash: slot (entry id, or "<level>/<entry id>" for a
--                  level's entry: fairSlot) -> key, the keyed entries
--                  appended and not yet released
--   keys:running   hash: key -> its slots, kept only while a limit is set
--                  (fairTracked: "limit", or a key's "l:<key>"), the one
--                  thing that reads it on a job's way; without one a
--                  key's slots are counted in keys:slots when an operator
--                  asks (fairRunning)
--   keys:cfg       hash, optional: "window" (the most slots of the shard,
--                  default 128), "limit" (the most slots of a key, 0 or
--                  absent: no limit), "rate" (every key's rate limit, see
--                  below), "lk" (how many keys have their own limit;
--                  absent: none), and per key "l:<key>" (its limit), "p:<key>"
--                  ("1": paused), "w:<key>" (its weight, default 1),
--                  "r:<key>" (its own rate limit)
--   keys:timed     sorted set: the keys with waiting jobs that their rate
--                  limit holds back, scored by the Unix ms at which the
--                  next may append (promote.lua moves them back to
--                  keys:ready then)
--   keys:turn      string "<n>:<key>", with a TTL of a minute: what is left
--                  of the turn of a key of weight > 1 at the head of
--                  keys:ready, when the window's room ended it early
--   keys:t:<key>   string, with a TTL: the key's rate-limit state (its
--                  theoretical arrival time in µs of the server's clock),
--                  gone once the key is idle
--
-- Rate limit per key (ConsumerOptions.KeyRate, Admin.SetKeyRate): "<N>:<Per
-- in ns>:<Burst>", the queue's RateLimit semantics (GCRA, as ratelimit.lua)
-- applied to the key's appends to the stream: in any window W at most
-- W*N/Per + Burst of the key's jobs are appended. A key whose rate lets
-- nothing in leaves the ring for keys:timed, so it blocks no other key and
-- nothing polls it: the promoter appends its next jobs at that time (the
-- time goes on the wake channel when it is the earliest of keys:timed).
--
-- Priority levels: a keyed job waits in its key's one list whatever its
-- level (a key's jobs take their turns in produce order), and its turn
-- appends it to its level's stream (field "pr"), where it competes by level
-- with every other entry. Entry ids are per stream, so a level entry's slot
-- is named "<level>/<entry id>" (fairSlot): a high and a normal entry may
-- share an id.
local fairDefaultWindow = 128
-- The command that publishes on the shard's wake channel ("PUBLISH" or
-- "SPUBLISH"), set by the scripts that know it: an append that creates a
-- level's stream then tells the consumers at once ("+high", "+low"); without
-- it they find the stream at their next check.
local fairPub

-- The server's clock in µs, read once per call.
local fairNowUs
local function fairClock()
  if not fairNowUs then
    local t = redis.call("TIME")
    fairNowUs = tonumber(t[1]) * 1000000 + tonumber(t[2])
  end
  return fairNowUs
end

-- fairRateOf parses a stored rate ("<N>:<Per ns>:<Burst>") into the
-- emission interval T in µs (Per/N, rounded up as the consumer's RateLimit
-- does) and the burst; nil for none.
local function fairRateOf(v)
  if not v then
    return nil
  end
  local n, per, b = string.match(v, "^(%d+):(%d+):(%d+)$")
  if not n then
    return nil
  end
  n, per, b = tonumber(n), tonumber(per), tonumber(b)
  if n < 1 or per < 1 then
    return nil
  end
  return math.ceil(math.ceil(per / n) / 1000), math.max(1, b)
end

-- fairRateRoom returns how many jobs key may append now under rate {T, B}
-- (at most want) and its state to pass to fairRateUse.
local function fairRateRoom(base, key, rate, want)
  local now = fairClock()
  local tat = math.max(tonumber(redis.call("GET", base .. "keys:t:" .. key)) or 0, now)
  local first = tat + rate[1] - rate[2] * rate[1] - now -- µs until the next may append
  if first > 0 then
    return 0, tat
  end
  return math.min(want, math.floor(-first / rate[1]) + 1), tat
end

-- fairRateUse records n appends of key at state tat (fairRateRoom); it
-- returns the time (µs of the server's clock) from which the next may
-- append.
local function fairRateUse(base, key, rate, tat, n)
  local now = fairClock()
  if n > 0 then
    tat = tat + n * rate[1]
    -- %.0f: Lua prints large numbers in exponent form, losing digits.
    redis.call("SET", base .. "keys:t:" .. key, string.format("%.0f", tat),
      "PX", string.format("%.0f", math.ceil((tat - now) / 1000) + 1))
  end
  return tat + rate[1] - rate[2] * rate[1]
end

-- fairTime moves key (out of the ring) into keys:timed until us (µs of the
-- server's clock), telling the promoters when it is the earliest there.
local function fairTime(base, key, us, undo)
  local at = math.ceil(us / 1000)
  local timed = base .. "keys:timed"
  local head = redis.call("ZRANGE", timed, 0, 0, "WITHSCORES")
  redis.call("ZADD", timed, at, key)
  if undo then
    undo[#undo + 1] = {"ZREM", timed, key}
  end
  if fairPub and (not head[2] or at < tonumber(head[2])) then
    redis.call(fairPub, base .. "wake", string.format("%.0f", at))
  end
end
local fairStartsTTL = 604800000 -- a start-count hash lives 7 days (promote.lua)

-- fairBase returns the prefix of a shard's keys from one of its stream names.
local function fairBase(stream)
  return string.match(stream, "^(.*}:)stream")
end

-- fairEnc encodes a waiting job (an array of strings) as a MessagePack
-- array, which cmsgpack packs and unpacks in C: length-prefixed strings
-- cost about 2.5 us per job to read back in Lua, and as much to write (a
-- number concatenated to a string is formatted as a double). A server
-- without cmsgpack (an embedded test server) gets length-prefixed strings
-- ("<len>:<s>"...), which fairDec tells apart by their first byte, a digit
-- (a MessagePack array's is 0x90 or more).
local fairMsgpack = rawget(_G, "cmsgpack") -- read without the undefined-global check
local function fairEnc(list)
  if fairMsgpack then
    return fairMsgpack.pack(list)
  end
  local parts = {}
  for i, v in ipairs(list) do
    parts[i] = string.format("%d:", #v) .. v
  end
  return table.concat(parts)
end

local function fairDec(s)
  if string.byte(s, 1) > 57 then
    return fairMsgpack.unpack(s)
  end
  local out = {}
  local pos = 1
  while pos <= #s do
    local colon = string.find(s, ":", pos, true)
    local len = tonumber(string.sub(s, pos, colon - 1))
    out[#out + 1] = string.sub(s, colon + 1, colon + len)
    pos = colon + 1 + len
  end
  return out
end

-- The shard's settings, read once per call: window, default limit, and
-- whether the settings hash exists (per-key settings are read only then).
-- fairCfg is {window, default limit, default rate or false, how many keys
-- have their own limit}, or false without settings.
local fairCfg
local function fairConf(base)
  if fairCfg == nil then
    local c = base .. "keys:cfg"
    if redis.call("EXISTS", c) == 1 then
      local v = redis.call("HMGET", c, "window", "limit", "rate", "lk")
      fairCfg = {tonumber(v[1]) or fairDefaultWindow, tonumber(v[2]) or 0, v[3] or false, tonumber(v[4]) or 0}
    else
      fairCfg = false
    end
  end
  if fairCfg then
    return fairCfg[1], fairCfg[2], true
  end
  return fairDefaultWindow, 0, false
end

-- fairKeyConf returns a key's limit (0: none), whether it is paused, its
-- weight, and its rate limit ({T µs, burst}, or nil).
local function fairKeyConf(base, key, limit, on)
  if not on then
    return limit, false, 1, nil
  end
  local v = redis.call("HMGET", base .. "keys:cfg", "l:" .. key, "p:" .. key, "w:" .. key, "r:" .. key)
  local t, b = fairRateOf(v[4] or fairCfg[3] or nil)
  local rate = t and {t, b} or nil
  return tonumber(v[1]) or limit, v[2] == "1", math.max(1, tonumber(v[3]) or 1), rate
end

-- fairTracked says whether the shard keeps keys:running: only while a
-- limit may apply (a default limit, or a key's own), the one reader of a
-- key's count on a job's way. Without one, a take is one HSET of
-- keys:slots and a call's releases one HDEL.
local function fairTracked(base)
  local _, limit, on = fairConf(base)
  return on and (limit > 0 or fairCfg[4] > 0)
end

-- fairRetrack brings keys:running in step after a change of keys:cfg
-- (fairadmin.lua), given whether it was kept before: counted again from
-- keys:slots when a limit appears, deleted when the last one goes.
local function fairRetrack(base, was)
  fairCfg = nil
  local now = fairTracked(base)
  if now == was then
    return
  end
  local running = base .. "keys:running"
  redis.call("DEL", running)
  if now then
    local count, order = {}, {}
    for _, k in ipairs(redis.call("HVALS", base .. "keys:slots")) do
      if not count[k] then
        order[#order + 1] = k
      end
      count[k] = (count[k] or 0) + 1
    end
    -- In chunks: Lua's unpack takes about 8,000 values.
    for i = 1, #order, 1000 do
      local args = {}
      for j = i, math.min(i + 999, #order) do
        args[#args + 1], args[#args + 2] = order[j], count[order[j]]
      end
      redis.call("HSET", running, unpack(args))
    end
  end
end

-- fairRunning returns key -> its slots for the keys of want (a set), or
-- for every key with a slot when want is nil: from keys:running while it
-- is kept, else counted in keys:slots (one HVALS of at most the window's
-- fields: the operator's views only).
local function fairRunning(base, want)
  local out = {}
  if fairTracked(base) then
    local running = base .. "keys:running"
    if want then
      for k in pairs(want) do
        out[k] = tonumber(redis.call("HGET", running, k)) or 0
      end
    else
      local all = redis.call("HGETALL", running)
      for i = 1, #all, 2 do
        out[all[i]] = tonumber(all[i + 1])
      end
    end
    return out
  end
  for _, k in ipairs(redis.call("HVALS", base .. "keys:slots")) do
    if not want or want[k] then
      out[k] = (out[k] or 0) + 1
    end
  end
  for k in pairs(want or {}) do
    out[k] = out[k] or 0
  end
  return out
end

-- fairSlot names the slot of entry eid of stream (a stream of the shard of
-- base): the entry id for the default level's stream, "<level>/<entry id>"
-- for a level's ("...}:stream:high").
local function fairSlot(base, stream, eid)
  if #stream == #base + 6 then
    return eid
  end
  return string.sub(stream, #base + 8) .. "/" .. eid
end

-- fairTake gives entry eid of stream a slot of key (and counts it in
-- keys:running while that is kept). undo, when set, gets how to take it
-- back.
local function fairTake(base, key, eid, stream, undo)
  local slot = fairSlot(base, stream, eid)
  redis.call("HSET", base .. "keys:slots", slot, key)
  if undo then
    undo[#undo + 1] = {"HDEL", base .. "keys:slots", slot}
  end
  if fairTracked(base) then
    redis.call("HINCRBY", base .. "keys:running", key, 1)
    if undo then
      undo[#undo + 1] = {"HINCRBY", base .. "keys:running", key, -1}
    end
  end
end

-- fairAppend appends one waiting job of key (its encoded element) to the
-- stream with a slot, and returns its entry id; false when the job was
-- dropped because its request already has an outcome (cancelled, or another
-- copy finished).
local function fairAppend(base, key, el)
  local d = fairDec(el)
  local rec, starts, count = d[1], d[2], tonumber(d[3]) or 0
  local level
  for j = 4, #d - 1, 2 do
    if d[j] == "pr" then
      level = d[j + 1]
    end
  end
  if count > 0 then
    d[#d + 1], d[#d + 2] = "n", tostring(count)
  end
  local stream = base .. "stream"
  local eid
  if level then
    -- Its level's stream (see the header): NOMKSTREAM as every append to a
    -- level; the append that creates the stream tells the consumers.
    stream = stream .. ":" .. level
    eid = redis.call("XADD", stream, "NOMKSTREAM", "*", unpack(d, 4))
    if not eid then
      eid = redis.call("XADD", stream, "*", unpack(d, 4))
      if fairPub then
        redis.call(fairPub, base .. "wake", "+" .. level)
      end
    end
  else
    eid = redis.call("XADD", stream, "*", unpack(d, 4))
  end
  if rec ~= "" then
    -- One command for the record: "P<entry id>" (its TTL kept). A record
    -- that held an outcome (cancelled while waiting) is put back, and one
    -- that was gone (forgotten, or expired: its callers were told it was
    -- lost) removed again: the job is dropped. A key of another type is
    -- left alone (SET GET fails on it, writing nothing) and the job runs.
    local old = redis.pcall("SET", rec, "P" .. eid, "KEEPTTL", "GET")
    if type(old) ~= "table" and (not old or string.sub(old, 1, 1) ~= "P") then
      if old then
        redis.call("SET", rec, old, "KEEPTTL")
      else
        redis.call("DEL", rec)
      end
      redis.call("XDEL", stream, eid)
      return false
    end
  end
  if count > 0 and starts ~= "" then
    redis.call("HSET", starts, eid, count)
    redis.call("PEXPIRE", starts, fairStartsTTL)
  end
  fairTake(base, key, eid, stream)
  return eid
end

-- fairPump appends waiting jobs, key by key in turn, while the shard has
-- free slots; it returns how many it appended.
local function fairPump(base)
  local window, limit, on = fairConf(base)
  local ready = base .. "keys:ready"
  local room = window - redis.call("HLEN", base .. "keys:slots")
  local moved = 0
  while room > 0 do
    -- The key whose turn it is moves to the end of the ring at once (one
    -- command); it leaves the ring below when it has nothing left or may
    -- not append.
    local key = redis.call("LMOVE", ready, ready, "LEFT", "RIGHT")
    if not key then
      break
    end
    local lim, paused, w, rate = fairKeyConf(base, key, limit, on)
    local run = 0
    if lim > 0 then
      run = tonumber(redis.call("HGET", base .. "keys:running", key)) or 0
    end
    local q = base .. "keys:q:" .. key
    -- A weighted key's turn lasts w appends, across calls: under a backlog
    -- each outcome frees one place, so a turn cut at the window's edge goes
    -- on at the next free place (keys:turn holds what is left of it).
    local credit, turn = w, false
    if w > 1 then
      turn = redis.call("GET", base .. "keys:turn")
      local n, k = string.match(turn or "", "^(%d+):(.*)$")
      if k == key then
        credit = tonumber(n)
      end
    end
    local take = math.min(credit, room)
    if lim > 0 then
      take = math.min(take, lim - run)
    end
    if paused then
      take = 0
    end
    local tat, allowed
    if rate and take > 0 then
      allowed, tat = fairRateRoom(base, key, rate, take)
      take = allowed
    end
    local left, appended = true, 0
    while take > 0 do
      local el = redis.call("LPOP", q)
      if not el then
        left = false
        break
      end
      if fairAppend(base, key, el) then
        take, room, run, moved, appended = take - 1, room - 1, run + 1, moved + 1, appended + 1
      end
    end
    local nextAt
    if tat then
      nextAt = fairRateUse(base, key, rate, tat, appended)
    end
    local keep = false -- its weighted turn goes on
    if not (left and redis.call("EXISTS", q) == 1) then
      redis.call("RPOP", ready) -- nothing waits any more
    elseif paused or (lim > 0 and run >= lim) then
      redis.call("RPOP", ready)
      redis.call("SADD", base .. "keys:parked", key)
    elseif nextAt and nextAt > fairClock() then
      -- Its rate lets nothing more in now: out of the ring until then.
      redis.call("RPOP", ready)
      fairTime(base, key, nextAt)
    elseif credit - appended > 0 and room == 0 then
      keep = true
      redis.call("LMOVE", ready, ready, "RIGHT", "LEFT") -- back to the head
      redis.call("SET", base .. "keys:turn", (credit - appended) .. ":" .. key, "PX", 60000)
    end
    if turn and not keep then
      redis.call("DEL", base .. "keys:turn")
    end
  end
  return moved
end

-- fairMayAppend says whether a new job of key appends at once: the key has
-- nothing waiting, is neither paused nor at its limit, and the shard has a
-- free slot.
local function fairMayAppend(base, key)
  local window, limit, on = fairConf(base)
  if redis.call("EXISTS", base .. "keys:q:" .. key) == 1 then
    return false
  end
  local lim, paused, _, rate = fairKeyConf(base, key, limit, on)
  if paused then
    return false
  end
  if lim > 0 and (tonumber(redis.call("HGET", base .. "keys:running", key)) or 0) >= lim then
    return false
  end
  if redis.call("HLEN", base .. "keys:slots") >= window then
    return false
  end
  if rate then
    -- The caller appends the job: its rate's token is taken here.
    local n, tat = fairRateRoom(base, key, rate, 1)
    if n == 0 then
      return false
    end
    fairRateUse(base, key, rate, tat, 1)
  end
  return true
end

-- fairWait puts a job at the end of its key's list (element: see the
-- header); a key that had nothing waiting takes its turn at the end of the
-- ring, or is parked. undo, when set, gets how to take it back (newest
-- last).
local function fairWait(base, key, el, undo)
  local q = base .. "keys:q:" .. key
  if redis.call("RPUSH", q, el) == 1 then
    local window, limit, on = fairConf(base)
    local lim, paused, _, rate = fairKeyConf(base, key, limit, on)
    local run = 0
    if lim > 0 then
      run = tonumber(redis.call("HGET", base .. "keys:running", key)) or 0
    end
    local may, tat = 1, nil
    if rate then
      may, tat = fairRateRoom(base, key, rate, 1)
    end
    if paused or (lim > 0 and run >= lim) then
      redis.call("SADD", base .. "keys:parked", key)
      if undo then
        undo[#undo + 1] = {"SREM", base .. "keys:parked", key}
      end
    elseif may == 0 then
      -- Held back by its rate: out of the ring until it may append.
      fairTime(base, key, fairRateUse(base, key, rate, tat, 0), undo)
    else
      redis.call("RPUSH", base .. "keys:ready", key)
      if undo then
        undo[#undo + 1] = {"RPOP", base .. "keys:ready"}
      end
    end
  end
  if undo then
    undo[#undo + 1] = {"RPOP", q}
  end
end

-- fairRelease gives back the slots of the entries in eids of stream (from
-- index from to to; those that hold one) and appends waiting jobs in their
-- place. With wantKeys it returns entry id -> key of the released slots
-- (dead letters keep the key). A shard without slots costs one EXISTS.
-- Only a kept keys:running (fairTracked), a parked key or wantKeys needs
-- the slots' keys (one HMGET, then one HDEL of those found, and per key
-- one HINCRBY and its unpark); else a call's slots go in one HDEL.
local function fairRelease(stream, eids, from, to, wantKeys)
  local base = fairBase(stream)
  local slots = base .. "keys:slots"
  if redis.call("EXISTS", slots) == 0 then
    return nil
  end
  local running, parked, ready = base .. "keys:running", base .. "keys:parked", base .. "keys:ready"
  local tracked = fairTracked(base)
  local anyParked = redis.call("EXISTS", parked) == 1
  local released = wantKeys and {} or nil
  -- In chunks: Lua's unpack takes about 8,000 values.
  for i = from, to, 1000 do
    local names = {}
    for j = i, math.min(i + 999, to) do
      names[#names + 1] = fairSlot(base, stream, eids[j])
    end
    if tracked or anyParked or wantKeys then
      local held = redis.call("HMGET", slots, unpack(names))
      local gone, count, order = {}, {}, {}
      for j = 1, #names do
        local key = held[j]
        if key then
          gone[#gone + 1] = names[j]
          if released then
            released[eids[i + j - 1]] = key
          end
          if not count[key] then
            order[#order + 1] = key
          end
          count[key] = (count[key] or 0) + 1
        end
      end
      if #gone > 0 then
        redis.call("HDEL", slots, unpack(gone))
      end
      for _, key in ipairs(order) do
        if tracked and redis.call("HINCRBY", running, key, -count[key]) <= 0 then
          redis.call("HDEL", running, key)
        end
        if anyParked and redis.call("SREM", parked, key) == 1 then
          redis.call("RPUSH", ready, key)
        end
      end
    else
      redis.call("HDEL", slots, unpack(names))
    end
  end
  fairPump(base)
  return released
end

-- fairKeyOf returns the value of field "k" among fields (name, value, ...)
-- from index a to z, or nil.
local function fairKeyOf(fields, a, z)
  for j = a, z - 1, 2 do
    if fields[j] == "k" then
      return fields[j + 1]
    end
  end
  return nil
end
