-- job.lua: read everything Admin.Job reports about one request id, in one
-- atomic step (reads only), so that a completion between two reads cannot
-- show a half-finished state.
--
-- KEYS[1]  the request's record
-- KEYS[2]  the stream of the request's shard
-- KEYS[3]  the group's start-count hash of KEYS[2] (see charge.lua)
-- KEYS[4]  the shard's schedule (sorted set)
-- KEYS[5]  the schedule's data (hash)
-- KEYS[6]  the shard's retry set (sorted set)
-- KEYS[7]  optional: the stream of priority level "high" of the shard
-- KEYS[8]  optional: the stream of priority level "low" of the shard
-- KEYS[9]  optional: the id's flow-control key (Throttle's open window)
-- KEYS[10] optional: the shard's list of completed requests (keys.Completed)
-- KEYS[11] optional: the request's error list (Retention.Errors), read only
--          when it exists (so a server's ACL needs LRANGE only where the
--          consumers keep errors)
-- KEYS[12] the group's start-count hash of KEYS[7] (entry ids are per
--          stream, and so are start counts)
-- KEYS[13] the group's start-count hash of KEYS[8]
-- ARGV[1]  consumer group
-- ARGV[2]  the request id (its member in the schedule is "r" .. id)
--
-- Returns {record or false, record PTTL in ms, present 0/1/2, holder
-- consumer or false, holder idle ms or false, starts or false, last error or
-- false, priority level ("high", "low") or false}. The rest are read only while the request is in flight: for
-- "P<entry id>", present says the entry is in the stream; for "P@<due>"
-- (scheduled), present is 1 when the request is in the schedule (a delayed
-- request), 2 when it is in the retry set, or in the schedule with a
-- start-count key in its data (a retry scheduled before the retry set
-- existed), and starts is the start count its schedule data carries
-- (a retry's starts so far; "0" for a delayed request), the last error the
-- error message a retry's data keeps. "P&" (a flow's parent waiting for its
-- children) reads nothing more.
-- Then three more: the flow-control mode ("t" Throttle, its window open; "d"
-- a Debounce wait; "r" a Replace: the waiting request took a Replace's
-- payload, or a follow-up run waits behind the entry) or false; the mode's
-- time (Unix ms: Throttle's window end, Debounce's latest due time) or
-- false; the follow-up run's stream fields (length-prefixed) or false.
-- Then three more: the payload or false (the stream entry's, queued or
-- running, or the one a scheduled request or retry keeps in its data); the
-- completion score or false (microseconds: the request's in the list of
-- completed requests, when that list is kept and still holds it); the error
-- list (newest first) or false.

-- entryStream (entrystream.lua, in front of this script) finds the stream
-- holding an entry: KEYS[2] or a level stream, KEYS[7] or KEYS[8].
local member = "r" .. ARGV[2]
local mode, modeAt, follow = false, false, false
if KEYS[9] then
  local w = redis.pcall("GET", KEYS[9])
  if type(w) == "string" then
    mode, modeAt = "t", w
  end
end
-- errorList returns the request's error list, or false when none is kept.
local function errorList()
  if KEYS[11] and redis.call("EXISTS", KEYS[11]) == 1 then
    return redis.call("LRANGE", KEYS[11], 0, -1)
  end
  return false
end
-- reply completes a reply of eight values: the mode's three, then the
-- payload, the completion score and the error list.
local function reply(t, payload, done)
  t[9], t[10], t[11] = mode, modeAt, follow
  t[12], t[13], t[14] = payload or false, done or false, errorList()
  return t
end
local rec = redis.call("GET", KEYS[1])
if not rec then
  return reply({false, -2, 0, false, false, false, false, false})
end
local ttl = redis.call("PTTL", KEYS[1])
if string.sub(rec, 1, 1) ~= "P" then
  local done = false
  if KEYS[10] then
    local code = string.sub(rec, 1, 1)
    if code == "N" then
      code = "R"
    end
    done = redis.call("ZSCORE", KEYS[10], code .. "i" .. ARGV[2]) or false
  end
  return reply({rec, ttl, 0, false, false, false, false, false}, false, done)
end
if rec == "P%" then
  -- Waiting for its key's turn (fair.lua): not in a stream yet.
  return reply({rec, ttl, 0, false, false, false, false, false})
end
if string.sub(rec, 2, 2) == "@" then
  local raw = redis.call("HGET", KEYS[5], member)
  local present = 0
  if redis.call("ZSCORE", KEYS[6], member) then
    present = 2
  elseif redis.call("ZSCORE", KEYS[4], member) then
    present = 1
  end
  local starts, lastErr, level, payload = false, false, false, false
  -- fieldOf reads a field ("pr", "p") from a job's stream fields
  -- (themselves length-prefixed, name then value), as promote.lua does.
  local function fieldOf(s, want)
    local pos, name = 1, nil
    while pos <= #s do
      local colon = string.find(s, ":", pos, true)
      local len = colon and tonumber(string.sub(s, pos, colon - 1))
      if not len then
        return false
      end
      local v = string.sub(s, colon + 1, colon + len)
      if name == nil then
        name = v
      else
        if name == want then
          return v
        end
        name = nil
      end
      pos = colon + 1 + len
    end
    return false
  end
  if raw then
    -- Length-prefixed strings: record key, start-count hash key, count,
    -- fields, error (a retry's), ...
    local pos, i = 1, 0
    while pos <= #raw and i < 8 do
      local colon = string.find(raw, ":", pos, true)
      if not colon then
        break
      end
      local len = tonumber(string.sub(raw, pos, colon - 1))
      if not len then
        break
      end
      i = i + 1
      if i == 2 and len > 0 and present == 1 then
        present = 2 -- a retry an older version left in the schedule
      elseif i == 3 then
        starts = string.sub(raw, colon + 1, colon + len)
      elseif i == 4 then
        local fields = string.sub(raw, colon + 1, colon + len)
        level, payload = fieldOf(fields, "pr"), fieldOf(fields, "p")
      elseif i == 5 then
        lastErr = string.sub(raw, colon + 1, colon + len)
      elseif i == 7 then
        local m = string.sub(raw, colon + 1, colon + len)
        if m == "d" or m == "r" then
          mode = m
        end
      elseif i == 8 and mode == "d" then
        modeAt = string.sub(raw, colon + 1, colon + len)
      end
      pos = colon + 1 + len
    end
  end
  return reply({rec, ttl, present, false, false, starts, lastErr, level}, payload)
end
if rec == "P&" then
  return reply({rec, ttl, 0, false, false, false, false, false}) -- a flow's parent waiting for its children
end
local eid = string.match(rec, "^P([^+]*)")
if #rec > #eid + 2 then
  -- A Replace's follow-up run: level, record TTL, stream fields.
  local raw, pos, i = string.sub(rec, #eid + 3), 1, 0
  while pos <= #raw do
    local colon = string.find(raw, ":", pos, true)
    local len = tonumber(string.sub(raw, pos, colon - 1))
    i = i + 1
    if i == 3 then
      follow = string.sub(raw, colon + 1, colon + len)
    end
    pos = colon + 1 + len
  end
  mode = "r"
end
local stream = entryStream(eid, ARGV[2])
local present, payload = 0, false
local holder, idle = false, false
local level, starts = false, false
if stream then -- else in no stream (entrystream.lua): nothing of it to read
  local entry = redis.call("XRANGE", stream, eid, eid, "COUNT", 1)
  present = 1
  local f = entry[1][2]
  for i = 1, #f, 2 do
    if f[i] == "p" then
      payload = f[i + 1]
    end
  end
  local ok, p = pcall(redis.call, "XPENDING", stream, ARGV[1], eid, eid, 1)
  if ok and p[1] then
    holder, idle = p[1][2], p[1][3]
  end
  local counts = KEYS[3]
  if stream == KEYS[7] then
    level, counts = "high", KEYS[12]
  elseif stream == KEYS[8] then
    level, counts = "low", KEYS[13]
  end
  starts = redis.call("HGET", counts, eid)
end
return reply({rec, ttl, present, holder, idle, starts, false, level}, payload)
