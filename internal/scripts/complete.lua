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
-- The history (Admin.History) is not written here: the committer adds what
-- the replies confirmed, once per second (committer.countHistory).
-- A whole rerun (a lost reply) is harmless: the records hold this batch's
-- outcomes, so every item counts as "already recorded".
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
--     following what the call's earlier staged writes do to it; else the
--     item becomes a dead letter and nothing of it is applied.
-- Right before an item's first write (so after the call's earlier items'
-- writes, which it sees), the numbers its counters need are checked as
-- Redis parses them: an increment argument, and the value a counter that
-- INCRBY (INCRBYFLOAT, HINCRBY, ...) increments holds, unless the item's own
-- earlier staged write touched that key (or hash field); a float counter's
-- sum must stay finite. A failed check makes the item a dead letter with
-- nothing of it applied.
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
-- KEYS[4+n+3c]     the group's start-count hash (see charge.lua): completed ids are
--                  removed from it (n: the number of items)
-- KEYS[5+n+3c ..] the progress keys of the items listed after "~" in ARGV[9], in
--                  that order (p: their number): each expires with its item's
--                  record (PEXPIRE to the record TTL) when the outcome is recorded
-- KEYS[5+n+3c+p ..] the keys of the staged writes, if any (declared for a cluster)
-- ARGV[1]          consumer group
-- ARGV[2]          notification channel
-- ARGV[3]          record TTL in milliseconds
-- ARGV[4]          "1": store successful results; "0": store only a done marker "N"
-- ARGV[5]          dead-letter stream length cap (approximate)
-- ARGV[6]          consumer name (recorded in dead letters)
-- ARGV[7]          time in milliseconds (recorded in dead letters and the completed list)
-- ARGV[8]          "PUBLISH", or "SPUBLISH" on a cluster (sharded pub/sub)
-- ARGV[9]          "1": a fan-out group (records nothing, publishes nothing, never
--                  deletes entries; a final failure is a dead letter of the group
--                  when this is the group's first completion of the entry); "0": the
--                  answering group. Then, for the answering group, ":<i>,<j>,..."
--                  when items i, j, ... are children of flows (entry field "pa"):
--                  each one's first outcome is recorded in its flow hash too, and
--                  the last child's releases the parent in this same step;
--                  "~<i>,<j>,..." when items i, j, ... have a progress key to
--                  expire with their record (a delivery that reported progress,
--                  or a redelivery: an earlier one may have); "+<e>" when e ARGV
--                  follow the items: pairs of an item index and the item's flow
--                  fields ("pa", "fp", "ff"; length-prefixed), which its dead
--                  letter keeps; and "/<m>" when the last m ARGV are the staged
--                  writes; and "#<count>,<age ms>" when the consumers keep
--                  a list of recently completed requests (ConsumerOptions.Retention;
--                  0: no bound of that kind), whose key is then the last KEYS;
--                  and "%" when an item is keyed (Key): only then are slots
--                  given back (fair.lua).
--                  A call without any of them carries no extra key or
--                  argument: "0" or "1".
-- ARGV[10+6(i-1) .. 15+6(i-1)]  item i: entry id, request id, code, value, payload, deliveries
--   code "R": value is the encoded response
--   code "E": value is an error message
--   code "L": value is an error message; the item is also appended to the dead-letter
--             stream, unless the request already had an outcome
--   code "S": acknowledge only (an entry requeued for another group)
-- ARGV[10+6n ..]   the items' flow fields ("+<e>" above), then the staged
--                  writes, per item that has them: the item's index, its number
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
-- fair.lua and flowrelease.lua come wrapped in completeLib (scripts.go):
-- their functions are made only in a call that needs them (a keyed item, a
-- flow's child or dead letter), once per call.
local libFns
local function lib()
  if not libFns then
    libFns = {completeLib()}
  end
  return libFns[1], libFns[2], libFns[3]
end

local group, channel, ttl, store = ARGV[1], ARGV[2], ARGV[3], ARGV[4] == "1"
local flag, txlen, extralen, children, progressed, keep, keyed = ARGV[9], 0, 0, nil, nil, nil, false
if #flag > 1 then
  for mark, v in string.gmatch(string.sub(flag, 2), "([:~+/#%%])([%d,]*)") do
    if mark == "%" then
      keyed = true
    elseif mark == ":" then
      children = v
    elseif mark == "~" then
      progressed = v
    elseif mark == "+" then
      extralen = tonumber(v)
    elseif mark == "#" then
      keep = v
    else
      txlen = tonumber(v)
    end
  end
  flag = string.sub(flag, 1, 1)
end
local fanout = flag == "1"
local n = (#ARGV - 9 - extralen - txlen) / 6

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
local starts = KEYS[4 + n + nflow]

-- The items whose progress key expires with their record: item index ->
-- the position of that key (after the start-count hash, in item order).
local progressOf
if progressed then
  progressOf = {}
  local at = 4 + n + nflow
  for idx in string.gmatch(progressed, "%d+") do
    at = at + 1
    progressOf[tonumber(idx)] = at
  end
end

-- The flow fields of the items that may become dead letters: item index ->
-- its fields, length-prefixed (name, value...).
local extra
if extralen > 0 then
  extra = {}
  for p = 10 + 6 * n, 9 + 6 * n + extralen, 2 do
    extra[tonumber(ARGV[p])] = ARGV[p + 1]
  end
end

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
  local p = 10 + 6 * n + extralen
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
  -- Counters: the commands whose increment argument and current value
  -- Redis parses as a number (kind "i" an integer, "f" a float; "I", "F"
  -- the same in a hash field), and where the increment is (its ARGV offset
  -- from the command's name).
  local counters = {INCR = "i", INCRBY = "i", DECR = "i", DECRBY = "i", INCRBYFLOAT = "f",
    HINCRBY = "I", HINCRBYFLOAT = "F"}
  local increments = {INCRBY = 2, DECRBY = 2, INCRBYFLOAT = 2, HINCRBY = 3, HINCRBYFLOAT = 3}
  -- isInteger: v is what Redis's string2ll takes (INCRBY's counters and
  -- increments): no sign but "-", no leading zero, no space, in int64.
  local function isInteger(v)
    if v == "0" then
      return true
    end
    if #v > 20 or not string.match(v, "^-?[1-9]%d*$") then
      return false
    end
    local digits = string.match(v, "%d+")
    if #digits ~= 19 then
      return #digits < 19
    end
    if string.sub(v, 1, 1) == "-" then
      return digits <= "9223372036854775808"
    end
    return digits <= "9223372036854775807"
  end
  -- floatValue returns the number v stands for when Redis's string2ld
  -- (strtold over all of v: INCRBYFLOAT's counters and increments) takes
  -- it and it is finite, else nil: no leading space, nothing after the
  -- number, no NaN; "inf" parses, but no increment of it is finite. Decimal
  -- and hexadecimal ("0x1.8p1") forms follow strtold's grammar. A number
  -- beyond a double's range (what Lua holds), which Redis takes where long
  -- double is wider, is refused too: refused here, nothing is written.
  local function floatValue(v)
    if #v == 0 or #v >= 5120 or string.find(v, "^%s") then
      return nil
    end
    local body = string.gsub(v, "^[+-]", "", 1)
    local mant, rest, nonzero
    if string.find(body, "^0[xX]") then
      mant, rest = string.match(body, "^0[xX](%x*%.?%x*)(.*)$")
      if not mant or not string.find(mant, "%x") then
        return nil
      end
      if rest ~= "" and not string.find(rest, "^[pP][+-]?%d+$") then
        return nil
      end
      nonzero = string.find(mant, "[1-9a-fA-F]")
    else
      mant, rest = string.match(body, "^(%d*%.?%d*)(.*)$")
      if not mant or not string.find(mant, "%d") then
        return nil
      end
      if rest ~= "" and not string.find(rest, "^[eE][+-]?%d+$") then
        return nil
      end
      nonzero = string.find(mant, "[1-9]")
    end
    -- The form is valid: Lua's tonumber (strtod) reads it whole.
    local n = tonumber(v)
    if not n or n ~= n or n == math.huge or n == -math.huge or (n == 0 and nonzero) then
      return nil
    end
    return n
  end
  -- counterError checks staged command j (t.cmds[j], a counter's) of an
  -- item before any of the item's writes: its increment, and the current
  -- value at the key (or hash field), unless touched says an earlier write
  -- of the item's changed it (Redis then refuses it while applying, after
  -- those writes). Returns an error message, or nil.
  local function counterError(j, c, touched)
    local b = c[2]
    local name = ARGV[b]
    local counter = counters[name]
    if not counter then
      return nil
    end
    local nothing = ": nothing of this request's staged writes was applied"
    local float = counter == "f" or counter == "F"
    local inc = 1
    if increments[name] then
      local arg = ARGV[b + increments[name]]
      if float then
        inc = floatValue(arg)
      elseif isInteger(arg) then
        inc = tonumber(arg)
      else
        inc = nil
      end
      if not inc then
        return "staged command " .. j .. " (" .. name .. ") has an increment that Redis refuses (" ..
          string.sub(arg, 1, 40) .. ")" .. nothing
      end
    end
    local key, at, place = ARGV[b + 1], ARGV[b + 1], "key " .. ARGV[b + 1]
    if counter == "I" or counter == "F" then
      at = key .. "\0" .. ARGV[b + 2]
      place = "field " .. ARGV[b + 2] .. " of key " .. key
    end
    if touched[key] or touched[at] then
      return nil
    end
    local v
    if at == key then
      v = redis.pcall("GET", key)
    else
      v = redis.pcall("HGET", key, ARGV[b + 2])
    end
    if type(v) ~= "string" then
      return nil -- nothing there (a 0), or another type (the type check's)
    end
    local ok
    if float then
      local cur = floatValue(v)
      ok = cur ~= nil
      if ok then
        local sum = cur + inc
        if sum ~= sum or sum == math.huge or sum == -math.huge then
          return "staged command " .. j .. " (" .. name .. ") would make the number at " .. place ..
            " infinite" .. nothing
        end
      end
    else
      ok = isInteger(v)
    end
    if not ok then
      local what = float and "a number" or "an integer"
      return "staged command " .. j .. " (" .. name .. ") needs " .. what .. " at " .. place .. ', which holds "' ..
        string.sub(v, 1, 40) .. '"' .. nothing
    end
    return nil
  end
  -- txCounters checks the counters of an item's writes, before the first of
  -- them, against the keys as the call's earlier items left them. Returns
  -- an error message, or nil.
  local function txCounters(t)
    local touched = {}
    for j, c in ipairs(t.cmds) do
      local err = counterError(j, c, touched)
      if err then
        return err
      end
      local where, b, e = string.sub(c[1], 2, 2), c[2], c[3]
      local step = 1
      if where == "F" then
        e = b + 1
      elseif where == "P" then
        step = 2
      end
      local counter = counters[ARGV[b]]
      for a = b + 1, e, step do
        if counter == "I" or counter == "F" then
          touched[ARGV[a] .. "\0" .. ARGV[b + 2]] = true -- the field
        else
          touched[ARGV[a]] = true -- the whole key
        end
      end
    end
    return nil
  end
  -- txTypes checks the key types one item's writes need, following what
  -- the call's earlier items and the item's own earlier writes do to them;
  -- it returns an error message, or nil and what the item's writes make of
  -- the keys.
  local function txTypes(t)
    local mine = {}
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
          mine[key] = want
        elseif kind == "=" then
          mine[key] = "string"
        elseif kind == "-" then
          mine[key] = "none"
        end
      end
    end
    return nil, mine
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
        local err, mine = txTypes(t)
        if err then
          t.state, t.err = "dead", err
          ARGV[b + 2], ARGV[b + 3] = "L", err
        else
          for k, v in pairs(mine) do
            types[k] = v
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
    local kept, keys, moved, movedProgress, movedExtra = {}, {}, childOf and {}, progressOf and {}, extra and {}
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
        if movedProgress then
          movedProgress[#keys] = progressOf[i]
        end
        if movedExtra then
          movedExtra[#keys] = extra[i]
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
    progressOf = movedProgress or progressOf
    extra = movedExtra or extra
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
    for i = 1, tx.sent do
      local t = tx[i]
      if t and t.state == "apply" then
        -- Its counters, as the call's earlier items left them.
        local err = txCounters(t)
        for j, c in ipairs(err and {} or t.cmds) do
          local r = redis.pcall(unpack(ARGV, c[2], c[3]))
          if type(r) == "table" and r.err then
            err = "staged command " .. j .. " (" .. ARGV[c[2]] .. ") failed: " .. r.err .. "; " .. (j - 1) ..
              " of the request's " .. #t.cmds .. " staged writes were applied"
            break
          end
        end
        if err then
          t.state, t.err = "dead", err
          local b = 10 + 6 * (t.at - 1)
          ARGV[b + 2], ARGV[b + 3] = "L", err
          firstAck[t.at] = true -- acknowledged by this call, and owned: the group's first
        end
      end
    end
  end
end

-- 1. Checks.
for i = 1, n do
  if ARGV[12 + 6 * (i - 1)] == "L" then
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
for i = 1, n do
  local eid = ARGV[4 + 6 * i] -- item(i)'s, read in place: no call per item
  if fanout and ARGV[6 + 6 * i] == "L" then
    firstAck[i] = redis.call("XACK", KEYS[1], group, eid) == 1
  else
    ids[#ids + 1] = eid
  end
end
-- unpack() has a limit of a few thousand values: go in chunks. Fewer
-- acknowledged than sent: an item was completed before (this call resent
-- after a lost reply, or a consumer whose lease lapsed completing an entry
-- another one completed), so step 3 checks such items' records first.
local replayed = false
for i = 1, #ids, 1000 do
  local j = math.min(i + 999, #ids)
  if redis.call("XACK", KEYS[1], group, unpack(ids, i, j)) < j - i + 1 then
    replayed = true
  end
end
-- The start counts of completed entries are no longer needed (HDEL frees, so
-- it is not refused under maxmemory either).
-- ids holds every item's entry id, in item order, unless a fan-out group
-- acknowledged dead letters one by one above.
local eids = ids
if #ids < n then
  eids = {}
  for i = 1, n do
    local _, eid = item(i)
    eids[i] = eid
  end
end
for i = 1, n, 1000 do
  redis.call("HDEL", starts, unpack(eids, i, math.min(i + 999, n)))
end
-- Delete the entries only when no other group may still need them; with
-- fan-out groups (the marker, set by their consumers before they create their
-- group, and by the trim), the periodic trim removes what every group is done
-- with. A fan-out group never deletes: the answering group may not exist yet.
if not fanout and n > 0 and redis.call("EXISTS", KEYS[3]) == 0 then
  for i = 1, n, 1000 do
    redis.call("XDEL", KEYS[1], unpack(eids, i, math.min(i + 999, n)))
  end
end

-- Keyed entries give back their slots and waiting keys take their turns
-- (fair.lua), only in calls with a keyed item ("%" in ARGV[9]): a queue
-- without keys runs exactly the commands it ran before keys existed.
local keyOf -- entry id -> key of the released slots (dead letters keep it)
if keyed and not fanout and #ids > 0 then
  -- A level's stream created by a turn is announced (fair.lua).
  local fairRelease, _, setPub = lib()
  setPub(ARGV[8])
  local dead = false -- only dead letters need the keys (they keep them)
  for i = 1, n do
    local _, _, _, code = item(i)
    dead = dead or code == "L"
  end
  keyOf = fairRelease(KEYS[1], ids, 1, #ids, dead)
end

if txApply then
  txApply(firstAck)
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
  if keyOf and keyOf[eid] then
    fields[#fields + 1], fields[#fields + 2] = "k", keyOf[eid] -- Requeue keeps the key
  end
  if extra and extra[i] then
    -- A flow's parent or child keeps its flow fields ("pa", "fp", "ff"),
    -- which requeue.lua copies back into the new entry.
    local _, flowLib = lib()
    local flowDec = flowLib()
    for _, f in ipairs(flowDec(extra[i])) do
      fields[#fields + 1] = f
    end
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

-- followUp appends the follow-up run a Replace left in the record of an
-- entry that ended ("P<entry id>+" then, length-prefixed, its level, its
-- record TTL and its stream fields; see produce.lua) and points the record
-- at it. Its stream is the shard's stream of that level: KEYS[1] or the
-- same name with another level's suffix (the same hash tag, so the same
-- slot). Only records that carry one get here: plain completions never do.
local function followUp(key, data)
  local function dec(str)
    local out, pos = {}, 1
    while pos <= #str do
      local colon = string.find(str, ":", pos, true)
      local len = tonumber(string.sub(str, pos, colon - 1))
      out[#out + 1] = string.sub(str, colon + 1, colon + len)
      pos = colon + 1 + len
    end
    return out
  end
  local d = dec(data)
  local base = KEYS[1]
  if string.sub(base, -12) == ":stream:high" then
    base = string.sub(base, 1, -6)
  elseif string.sub(base, -11) == ":stream:low" then
    base = string.sub(base, 1, -5)
  end
  local to = d[1] ~= "" and base .. ":" .. d[1] or base
  local eid
  if to == base then
    eid = redis.call("XADD", to, "*", unpack(dec(d[3])))
  else
    -- A level's stream: the append that creates it tells the consumers, as
    -- produce.lua's do (a "+<level>" wake notice).
    eid = redis.call("XADD", to, "NOMKSTREAM", "*", unpack(dec(d[3])))
    if not eid then
      eid = redis.call("XADD", to, "*", unpack(dec(d[3])))
      redis.call(ARGV[8], string.sub(base, 1, -7) .. "wake", "+" .. d[1])
    end
  end
  redis.call("SET", key, "P" .. eid, "PX", d[2])
end

-- superseded reports whether record rec names another entry of the request
-- than eid ("P<entry id>", with or without a follow-up behind it): the run
-- that entry carries (a Replace's follow-up, appended when eid was first
-- completed) decides the outcome, so a completion of eid again records,
-- announces and dead-letters nothing.
local function superseded(rec, eid)
  if type(rec) ~= "string" or string.sub(rec, 1, 1) ~= "P" then
    return false
  end
  local other = string.match(rec, "^P(%d+%-%d+)")
  return other ~= nil and other ~= eid
end

-- 3. Outcomes.
local notice = {}
local kept = keep and {} -- the members of the completed list (step 6)
for i = 1, n do
  local b = 4 + 6 * i -- item(i)'s fields, read in place
  local eid, rid, code, value = ARGV[b], ARGV[b + 1], ARGV[b + 2], ARGV[b + 3]
  if fanout then
    if code == "L" and firstAck[i] then
      deadLetter(i)
    end
  elseif code ~= "S" then
    local outcome = code .. value
    local first = true
    local key = KEYS[3 + i]
    if replayed and rid ~= "" and not (childOf and childOf[i]) and superseded(redis.pcall("GET", key), eid) then
      -- A second completion of an entry whose record names another entry
      -- now: nothing to record, announce or dead-letter (see superseded).
    elseif rid ~= "" then
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
        if type(prev) == "table" and isWrongType(prev) then
          redis.call("SET", key, rec, "PX", ttl) -- another program's key
          prev = false
        end
      end
      if prev and #prev > #eid + 2 and string.sub(prev, 1, #eid + 2) == "P" .. eid .. "+" and not (childOf and childOf[i]) then
        -- A Replace left a follow-up run behind this entry: it is appended
        -- now, and this run's outcome is neither kept nor announced (its
        -- callers get the follow-up's). Its dead letter, if any, stays.
        if code == "L" then
          deadLetter(i)
        end
        followUp(key, string.sub(prev, #eid + 3))
      else
        if prev and string.byte(prev, 1) ~= 80 then -- not "P"
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
        if progressOf and progressOf[i] then
          -- Its progress value lives as long as the record, no longer.
          redis.call("PEXPIRE", KEYS[progressOf[i]], ttl)
        end
        if childOf and childOf[i] and first then
          -- A flow's child: its first outcome counts in the flow, and the last
          -- child's releases the parent.
          local fk = childOf[i]
          local _, flowLib = lib()
          local _, childDone, release = flowLib()
          if childDone(KEYS[fk + 1], key, rec) then
            release(KEYS[fk + 1], KEYS[fk + 2], KEYS[fk + 3])
          end
        end
        -- A quiet record ("P<entry id>+": produced by Enqueue, EnqueueBatch
        -- or Send, and no caller that waits attached since; see produce.lua)
        -- is not announced: nobody listens for it.
        if not (first and prev and #prev == #eid + 2 and string.byte(prev, -1) == 43) then
          -- string.format's "%d" writes a length faster than the ".." of a
          -- number, which formats it as "%.14g" (the strings themselves go
          -- by "..": string.format's "%s" stops at a zero byte).
          notice[#notice + 1] = string.format("%d:", #rid) .. rid .. string.format("%d:", #outcome) .. outcome
        end
        if kept and first then
          kept[#kept + 1] = code .. "i" .. rid
        end
      end
    elseif code == "L" then
      deadLetter(i)
      if kept then
        kept[#kept + 1] = "Le" .. eid
      end
    elseif kept then
      kept[#kept + 1] = code .. "e" .. eid
    end
  end
end

-- 4. The notice.
if #notice > 0 then
  redis.call(ARGV[8], channel, table.concat(notice))
end

-- 5. The completed list (ConsumerOptions.Retention; absent otherwise):
-- each request's first outcome, scored by the completion time in
-- microseconds, kept unique and increasing per shard (one past the newest
-- score when the clock says less: two calls in one millisecond, or a
-- consumer whose clock is behind), so that Admin.Completed pages by score.
-- A duplicate outcome and a whole rerun add nothing (not "first"). Then the
-- list is cut to its bounds: by count (ZREMRANGEBYRANK) and by age
-- (ZREMRANGEBYSCORE, and a PEXPIRE so that an idle queue's list goes too).
if kept and #kept > 0 then
  local key = KEYS[#KEYS]
  local maxCount, maxAge = string.match(keep, "^(%d+),(%d+)$")
  maxCount, maxAge = tonumber(maxCount or "0"), tonumber(maxAge or "0")
  local now = tonumber(ARGV[7]) * 1000
  local top = redis.call("ZRANGE", key, -1, -1, "WITHSCORES")
  local score = now
  if top[2] and tonumber(top[2]) >= score then
    score = tonumber(top[2]) + 1
  end
  for i = 1, #kept, 500 do
    local args = {}
    for j = i, math.min(i + 499, #kept) do
      args[#args + 1] = string.format("%.0f", score)
      args[#args + 1] = kept[j]
      score = score + 1
    end
    redis.call("ZADD", key, unpack(args))
  end
  if maxCount > 0 then
    redis.call("ZREMRANGEBYRANK", key, 0, -maxCount - 1)
  end
  if maxAge > 0 then
    redis.call("ZREMRANGEBYSCORE", key, "-inf", "(" .. string.format("%.0f", now - maxAge * 1000))
    redis.call("PEXPIRE", key, maxAge)
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
