-- complete.lua: record outcomes, acknowledge and delete entries, notify waiters.
--
-- The per-shard committer sends one call per tick for every outcome that
-- finished since the last one, in the same pipelined round trip as the start
-- charges of the next jobs (committer.go).
--
-- Recording is first-writer-wins: when a request id already has an outcome (a
-- redelivered duplicate finished second), the stored outcome is put back (its
-- TTL restarts) and re-announced, and the entry is still acknowledged.
--
-- Order matters, because Lua does not roll back:
--   1. checks (reads only): the dead-letter key must be a stream or absent, so
--      that nothing after the first write can fail and a retry after an error
--      never meets half of its own earlier run;
--   2. XACK (and XDEL): the first write frees memory and is not refused under
--      maxmemory (Redis checks a flagless script for OOM at its first write
--      only, and XACK is not a DENYOOM command), so the record SETs and dead
--      letters that follow run under memory pressure too;
--   3. per item: the dead letter (before its record, so that a retry would
--      write it again rather than never), then the record;
--   4. the notice;
--   5. the history: one HINCRBY adds this call's completions to the field of
--      the minute of ARGV[7] in the hour's history hash, as processed +
--      failed<<32 (one command carries both counts); a PEXPIRE of 25 hours
--      follows only when the reply equals the increment (the field was just
--      created: at most once per minute and shard). Every item but "S"
--      counts as processed, "E" and "L" also as failed (retry.lua counts the
--      retries it schedules as both). With fan-out groups, every group's
--      completions count.
-- A whole rerun (a lost reply) is harmless: the records hold this batch's
-- outcomes, so every item counts as "already recorded" and nothing is added.
--
-- Staged writes (a handler's Tx, successful items only; see tx.go) ride in
-- the call that records their item, after the items (ARGV[9] says how many
-- ARGV they take, so a call without them reads exactly what it always did).
-- An item with staged writes is checked before the first write of the call:
--   - its entry must be pending for this consumer (XPENDING), else the item
--     is dropped whole: no XACK, no record, no start-count HDEL, no writes
--     (its lease was lost: the new owner runs it and applies its own writes;
--     or a resent call already completed it);
--   - its request must not have an outcome yet (the record holds P..., or
--     nothing), else its writes are skipped and it completes as a duplicate;
--   - every staged key must hold the type its command needs (or nothing),
--     following what the call's earlier staged writes do to it, and a counter
--     that INCRBY (HINCRBY, ...) increments must hold a number unless a
--     staged write of the call touched it first; else the item becomes a
--     dead letter and nothing of it is applied.
-- A dropped item is taken out of the call (ARGV and KEYS compacted), and a
-- dead one gets code "L", so the phases below run unchanged and a call
-- without staged writes runs exactly what it always did. The writes run
-- (redis.pcall) after the XACKs, before the records; a write that Redis
-- refuses then (a value that is not a number, ...) stops the item's writes
-- and makes it a dead letter whose error says how many ran: Lua does not
-- roll back. Nothing is raised after the first write.
--
-- KEYS[1]          the stream (the shard's default-level stream, or a priority
--                  level's: "...:stream:high", "...:stream:low"; a dead letter
--                  from a level's stream records the level as field "pr")
-- KEYS[2]          the dead-letter stream (of this group when it is a fan-out group)
-- KEYS[3]          the shard's fan-out marker: present once a fan-out group may
--                  read the stream, and then entries are left to the trim
-- KEYS[3+i]        the record key of item i; the dead-letter key when the item has no id
-- KEYS[4+n ..]    for each child of a flow among the items (ARGV[9]), in item
--                  order, three keys: the flow hash, the parent's record and the
--                  parent's stream (flowrelease.lua); c: the number of children
-- KEYS[4+n+3c]     the history hash of the hour of ARGV[7] (n: the number of items)
-- KEYS[5+n+3c]     the group's start-count hash (see charge.lua): completed ids are
--                  removed from it
-- KEYS[6+n+3c ..] the keys of the staged writes, if any (declared for a cluster)
-- ARGV[1]          consumer group
-- ARGV[2]          notification channel
-- ARGV[3]          record TTL in milliseconds
-- ARGV[4]          "1": store successful results; "0": store only a done marker "N"
-- ARGV[5]          dead-letter stream length cap (approximate)
-- ARGV[6]          consumer name (recorded in dead letters)
-- ARGV[7]          time in milliseconds (recorded in dead letters; the history minute)
-- ARGV[8]          "PUBLISH", or "SPUBLISH" on a cluster (sharded pub/sub)
-- ARGV[9]          "1": a fan-out group (records nothing, publishes nothing, never
--                  deletes entries; a final failure is a dead letter of the group
--                  when this is the group's first completion of the entry); "0": the
--                  answering group. Then, for the answering group, ":<i>,<j>,..."
--                  when items i, j, ... are children of flows (entry field "pa"):
--                  each one's first outcome is recorded in its flow hash too, and
--                  the last child's releases the parent in this same step; and
--                  "/<m>" when the last m ARGV are the staged writes. A call
--                  without children or staged writes carries no extra key or
--                  argument: "0" or "1".
-- ARGV[10+6(i-1) .. 15+6(i-1)]  item i: entry id, request id, code, value, payload, deliveries
--   code "R": value is the encoded response
--   code "E": value is an error message
--   code "L": value is an error message; the item is also appended to the dead-letter
--             stream, unless the request already had an outcome
--   code "S": acknowledge only (an entry requeued for another group)
-- ARGV[10+6n ..]   staged writes, per item that has them: the item's index, its number
--                  of commands, then per command: a header (the key type it needs: s
--                  string, h hash, S set, l list, z zset, x stream, = any then string,
--                  - any then none, . any unchanged; then where its keys are: F the
--                  first argument, A all, P every other one), its argument count, and
--                  its arguments (the command's name first)
--
-- Returns the number of items; with staged writes, one value per item instead:
-- 0 completed as sent, 1 its staged writes skipped (the request already had an
-- outcome), 2 dropped (not pending for this consumer: nothing done), or a string,
-- the error that made it a dead letter (a staged write refused). An error reply,
-- before any write, when the dead-letter key holds another type.
local group, channel, ttl, store = ARGV[1], ARGV[2], ARGV[3], ARGV[4] == "1"
local flag, txlen, children = ARGV[9], 0, nil
if #flag > 1 then
  local slash = string.find(flag, "/", 1, true)
  if slash then
    txlen = tonumber(string.sub(flag, slash + 1))
    flag = string.sub(flag, 1, slash - 1)
  end
  if #flag > 1 then
    children = string.sub(flag, 3)
  end
  flag = string.sub(flag, 1, 1)
end
local fanout = flag == "1"
local n = (#ARGV - 9 - txlen) / 6

-- The children of flows among the items: item index -> the position before
-- its three flow keys (KEYS[p+1], KEYS[p+2], KEYS[p+3]).
local childOf
local nflow = 0
if children then
  childOf = {}
  for idx in string.gmatch(children, "%d+") do
    childOf[tonumber(idx)] = 3 + n + nflow
    nflow = nflow + 3
  end
end
local history, starts = KEYS[4 + n + nflow], KEYS[5 + n + nflow]

local function item(i)
  local b = 10 + 6 * (i - 1)
  return b, ARGV[b], ARGV[b + 1], ARGV[b + 2], ARGV[b + 3]
end

-- 0. Staged writes (none in most calls: then this costs nothing more).
-- tx[i] = {state, cmds = {{header, first ARGV, last ARGV}}, err} by the
-- item's index as sent; state "apply", "skip", "drop" or "dead". Checked
-- here, before any write: an item whose writes cannot apply becomes a dead
-- letter (its code and value in ARGV are rewritten to "L" and the reason),
-- and dropped items are taken out of the item list (ARGV and KEYS
-- compacted), so the phases below run as for any call.
local tx, txApply
if txlen > 0 then
  tx = {}
  local p = 10 + 6 * n
  while p <= #ARGV do
    local i, c = tonumber(ARGV[p]), tonumber(ARGV[p + 1])
    p = p + 2
    local cmds = {}
    for j = 1, c do
      local m = tonumber(ARGV[p + 1])
      cmds[j] = {ARGV[p], p + 2, p + 1 + m}
      p = p + 2 + m
    end
    tx[i] = {state = "apply", cmds = cmds}
  end

  local typeNames = {s = "string", h = "hash", S = "set", l = "list", z = "zset", x = "stream"}
  local types = {} -- key -> its type after the staged writes checked so far
  local function typeOf(mine, key)
    local v = mine[key] or types[key]
    if not v then
      v = redis.call("TYPE", key)
      v = v["ok"] or v
      types[key] = v
    end
    return v
  end
  -- Counters whose current value is checked too (an INCRBY on "abc" would
  -- fail while applying, after the item's earlier writes), unless a staged
  -- write of this call touched the key (or the hash field) before.
  local counters = {INCR = "i", INCRBY = "i", DECR = "i", DECRBY = "i", INCRBYFLOAT = "f",
    HINCRBY = "I", HINCRBYFLOAT = "F"}
  local written = {} -- keys ("key" or "key\0field") staged writes of this call touch
  local function badCounter(kind, v)
    if not v then
      return false
    elseif kind == "i" or kind == "I" then
      return not (v == "0" or (#v <= 20 and string.match(v, "^-?[1-9]%d*$")))
    end
    return tonumber(v) == nil
  end
  -- txTypes checks the key types one item's writes need (and the values of
  -- the counters it increments); it returns an error message, or nil and
  -- what the item's writes make of the keys.
  local function txTypes(t)
    local mine, touched = {}, {}
    for j, c in ipairs(t.cmds) do
      local kind, where, b, e = string.sub(c[1], 1, 1), string.sub(c[1], 2, 2), c[2], c[3]
      local step = 1
      if where == "F" then
        e = b + 1
      elseif where == "P" then
        step = 2
      end
      for a = b + 1, e, step do
        local key = ARGV[a]
        local want = typeNames[kind]
        if want then
          local cur = typeOf(mine, key)
          if cur ~= want and cur ~= "none" then
            return "WRONGTYPE staged command " .. j .. " (" .. ARGV[b] .. ") needs a " .. want .. " at key " ..
              key .. ", which holds a " .. cur .. ": nothing of this request's staged writes was applied"
          end
          local counter, at = counters[ARGV[b]], key
          if counter == "I" or counter == "F" then
            at = key .. "\0" .. ARGV[b + 2]
          end
          if counter and cur == want and not (touched[key] or written[key] or touched[at] or written[at]) then
            local v
            if at == key then
              v = redis.call("GET", key)
            else
              v = redis.call("HGET", key, ARGV[b + 2])
            end
            if badCounter(counter, v) then
              local what, place = "an integer", "key " .. key
              if counter == "f" or counter == "F" then
                what = "a number"
              end
              if at ~= key then
                place = "field " .. ARGV[b + 2] .. " of key " .. key
              end
              return "staged command " .. j .. " (" .. ARGV[b] .. ") needs " .. what .. " at " .. place .. ', which holds "' ..
                string.sub(v, 1, 40) .. '": nothing of this request\'s staged writes was applied'
            end
          end
          touched[at] = true -- the field for HINCRBY, else the whole key
          mine[key] = want
        elseif kind == "=" then
          mine[key], touched[key] = "string", true
        elseif kind == "-" then
          mine[key], touched[key] = "none", true
        end
      end
    end
    return nil, mine, touched
  end

  local me, seen, dropped = ARGV[6], {}, false
  for i = 1, n do
    local b, eid, rid, code = item(i)
    local t = tx[i]
    if t then
      local pend = redis.call("XPENDING", KEYS[1], group, eid, eid, 1)
      if not pend[1] or pend[1][2] ~= me then
        t.state, dropped = "drop", true
      elseif not fanout and rid ~= "" then
        local prev = seen[rid]
        if not prev then
          prev = redis.pcall("GET", KEYS[3 + i])
          prev = type(prev) == "string" and string.sub(prev, 1, 1) ~= "P"
        end
        if prev then
          t.state = "skip"
        end
      end
      if t.state == "apply" then
        local err, mine, touched = txTypes(t)
        if err then
          t.state, t.err = "dead", err
          ARGV[b + 2], ARGV[b + 3] = "L", err
        else
          for k, v in pairs(mine) do
            types[k] = v
          end
          for k in pairs(touched) do
            written[k] = true
          end
        end
      end
    end
    if rid ~= "" and code ~= "S" and not (t and t.state == "drop") then
      seen[rid] = true -- this item records the request's outcome, or finds one
    end
  end

  -- Any item may turn into a dead letter while its writes run.
  local dt = redis.call("TYPE", KEYS[2])
  dt = dt["ok"] or dt
  if dt ~= "stream" and dt ~= "none" then
    return redis.error_reply("WRONGTYPE dead-letter key " .. KEYS[2] .. " holds a " .. dt ..
      ", not a stream: rename or delete it (outcomes are retried until then)")
  end

  -- Take dropped items out: no XACK, HDEL, XDEL, record or notice for them.
  tx.sent = n
  if dropped then
    local kept, keys, moved = {}, {}, childOf and {}
    for i = 1, n do
      local t = tx[i]
      if not (t and t.state == "drop") then
        local b = 10 + 6 * (i - 1)
        for f = 0, 5 do
          kept[#kept + 1] = ARGV[b + f]
        end
        keys[#keys + 1] = KEYS[3 + i]
        if moved then
          moved[#keys] = childOf[i] -- the item's new index; its flow keys stay where they are
        end
        if t then
          t.at = #keys
        end
      end
    end
    for f = 1, #kept do
      ARGV[9 + f] = kept[f]
    end
    for k = 1, #keys do
      KEYS[3 + k] = keys[k]
    end
    n = #keys
    childOf = moved or childOf
  end
  for i, t in pairs(tx) do
    if type(i) == "number" and t.at == nil then
      t.at = i
    end
  end

  -- txApply runs the writes of the items to apply (after the XACKs: the
  -- call's first write stays XACK). A write Redis refuses stops its item's
  -- writes (those before it stay: no rollback) and makes it a dead letter.
  txApply = function(firstAck)
    local dead = 0
    for i = 1, tx.sent do
      local t = tx[i]
      if t and t.state == "apply" then
        for j, c in ipairs(t.cmds) do
          local r = redis.pcall(unpack(ARGV, c[2], c[3]))
          if type(r) == "table" and r.err then
            t.state = "dead"
            t.err = "staged command " .. j .. " (" .. ARGV[c[2]] .. ") failed: " .. r.err .. "; " .. (j - 1) ..
              " of the request's " .. #t.cmds .. " staged writes were applied"
            local b = 10 + 6 * (t.at - 1)
            ARGV[b + 2], ARGV[b + 3] = "L", t.err
            firstAck[t.at] = true -- acknowledged by this call, and owned: the group's first
            dead = dead + 1
            break
          end
        end
      end
    end
    return dead
  end
end

-- 1. Checks.
for i = 1, n do
  local _, _, _, code = item(i)
  if code == "L" then
    local t = redis.call("TYPE", KEYS[2])
    t = t["ok"] or t
    if t ~= "stream" and t ~= "none" then
      return redis.error_reply("WRONGTYPE dead-letter key " .. KEYS[2] .. " holds a " .. t ..
        ", not a stream: rename or delete it (outcomes are retried until then)")
    end
    break
  end
end

-- 2. Free first. A fan-out group acknowledges dead letters one by one: the
-- reply says whether this is the group's first completion of the entry.
local ids = {}
local firstAck = {}
local processed, failed = 0, 0
for i = 1, n do
  local _, eid, _, code = item(i)
  if code ~= "S" then
    processed = processed + 1
    if code == "E" or code == "L" then
      failed = failed + 1
    end
  end
  if fanout and code == "L" then
    firstAck[i] = redis.call("XACK", KEYS[1], group, eid) == 1
  else
    ids[#ids + 1] = eid
  end
end
-- unpack() has a limit of a few thousand values: go in chunks.
for i = 1, #ids, 1000 do
  redis.call("XACK", KEYS[1], group, unpack(ids, i, math.min(i + 999, #ids)))
end
-- The start counts of completed entries are no longer needed (HDEL frees, so
-- it is not refused under maxmemory either).
for i = 1, n, 1000 do
  local chunk = {}
  for j = i, math.min(i + 999, n) do
    local _, eid = item(j)
    chunk[#chunk + 1] = eid
  end
  redis.call("HDEL", starts, unpack(chunk))
end
-- Delete the entries only when no other group may still need them; with
-- fan-out groups (the marker, set by their consumers before they create their
-- group, and by the trim), the periodic trim removes what every group is done
-- with. A fan-out group never deletes: the answering group may not exist yet.
if not fanout and n > 0 and redis.call("EXISTS", KEYS[3]) == 0 then
  for i = 1, n, 1000 do
    local chunk = {}
    for j = i, math.min(i + 999, n) do
      local _, eid = item(j)
      chunk[#chunk + 1] = eid
    end
    redis.call("XDEL", KEYS[1], unpack(chunk))
  end
end

if txApply then
  failed = failed + txApply(firstAck) -- the history counts these as failed too
end

-- The priority level of this call's dead letters: nil until the first one
-- needs it, then the level stream's name ("high", "low") read from the end of
-- KEYS[1] ("...}:stream:high"), or false for the default level's stream
-- ("...}:stream"), whose dead letters carry no "pr" field.
local deadLevel

local function deadLetter(i)
  local b, eid, rid, _, value = item(i)
  if deadLevel == nil then
    deadLevel = false
    if string.sub(KEYS[1], -12) == ":stream:high" then
      deadLevel = "high"
    elseif string.sub(KEYS[1], -11) == ":stream:low" then
      deadLevel = "low"
    end
  end
  local fields = {"id", rid, "entry", eid, "p", ARGV[b + 4], "error", value,
    "deliveries", ARGV[b + 5], "consumer", ARGV[6], "at", ARGV[7]}
  if deadLevel then
    fields[15], fields[16] = "pr", deadLevel
  end
  redis.call("XADD", KEYS[2], "MAXLEN", "~", ARGV[5], "*", unpack(fields))
end

-- isWrongType reports whether a pcall reply is a WRONGTYPE error (another
-- program's key, overwritten); any other error is raised, never taken for it.
local function isWrongType(reply)
  if type(reply) == "table" and reply.err then
    if string.sub(reply.err, 1, 9) == "WRONGTYPE" then
      return true
    end
    error(reply)
  end
  return false
end

-- 3. Outcomes.
local notice = {}
for i = 1, n do
  local _, eid, rid, code, value = item(i)
  if fanout then
    if code == "L" and firstAck[i] then
      deadLetter(i)
    end
  elseif code ~= "S" then
    local outcome = code .. value
    local first = true
    if rid ~= "" then
      local key = KEYS[3 + i]
      local rec = outcome
      if code == "R" and not store then
        rec = "N"
      end
      local prev
      if code == "L" then
        -- Read first: the dead letter goes before the record.
        prev = redis.pcall("GET", key)
        if isWrongType(prev) then
          prev = false
        end
      else
        -- One command in the common case; the rare duplicate puts the first
        -- outcome back.
        prev = redis.pcall("SET", key, rec, "GET", "PX", ttl)
        if isWrongType(prev) then
          redis.call("SET", key, rec, "PX", ttl) -- another program's key
          prev = false
        end
      end
      if prev and string.sub(prev, 1, 1) ~= "P" then
        outcome = prev
        first = false
      end
      -- A duplicate that failed for good after another copy recorded an
      -- outcome is not a dead letter: the request already has its outcome.
      if code == "L" and first then
        deadLetter(i)
      end
      if code == "L" or not first then
        redis.call("SET", key, first and rec or prev, "PX", ttl)
      end
      if childOf and childOf[i] and first then
        -- A flow's child: its first outcome counts in the flow, and the last
        -- child's releases the parent.
        local fk = childOf[i]
        local _, childDone, release = flowLib()
        if childDone(KEYS[fk + 1], key, rec) then
          release(KEYS[fk + 1], KEYS[fk + 2], KEYS[fk + 3])
        end
      end
      notice[#notice + 1] = #rid .. ":" .. rid .. #outcome .. ":" .. outcome
    elseif code == "L" then
      deadLetter(i)
    end
  end
end

-- 4. The notice.
if #notice > 0 then
  redis.call(ARGV[8], channel, table.concat(notice))
end

-- 5. The history.
if processed > 0 then
  local hist = history
  local inc = string.format("%.0f", processed + failed * 4294967296)
  local minute = tostring(math.floor(tonumber(ARGV[7]) / 60000) % 60)
  if redis.call("HINCRBY", hist, minute, inc) == tonumber(inc) then
    redis.call("PEXPIRE", hist, 90000000)
  end
end

if tx then
  local out = {}
  for i = 1, tx.sent do
    local t = tx[i]
    if not t or t.state == "apply" then
      out[i] = 0
    elseif t.state == "skip" then
      out[i] = 1
    elseif t.state == "drop" then
      out[i] = 2
    else
      out[i] = t.err
    end
  end
  return out
end
return n
