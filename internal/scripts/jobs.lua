-- jobs.lua: read one shard's part of an Admin.Jobs page, in one step (reads
-- only). Admin.Jobs sends one call per shard (for queued and running jobs,
-- per shard and priority level stream), pipelined, and merges the parts by
-- the state's sort key; each call's work is bounded by the
-- page size and, with a filter, by a scan window, whatever the queue's size.
--
-- ARGV[1] is the mode:
--
-- "z": a sorted set (the schedule, or the retry set), ordered by (due time,
--   member), members compared as bytes (as Redis orders equal scores).
--   KEYS[1] the set, KEYS[2] the schedule's data (hash).
--   ARGV[2] "1": scan up (soonest first), "0": down
--   ARGV[3] "1": start after/before the cursor (ARGV[4] score, ARGV[5]
--           member), exclusive; "0": from the first (up) or last (down)
--   ARGV[6] the most matches to return
--   ARGV[7] the most members to scan
--   ARGV[8] only members whose error (data part 5) contains this; "" for all
--   ARGV[9] only this member ("": any); the cursor is then ignored
--   Returns {total, behind, more, frontier score, frontier member, then per
--   match: member, score, start count, error, production time (ms or ""),
--   payload (its first 4096 bytes), priority level (field "pr": "high",
--   "low", or "" for the default)}.
--   behind: 1 when members lie on the other side of the cursor; more: 1 when
--   members lie beyond the last one scanned; the frontier is the last member
--   scanned ("" when none).
--
-- "s": a stream: the queued entries of a group (those after its
--   last-delivered-id), or a dead-letter stream.
--   KEYS[1] the stream, KEYS[2] unused (the caller sends the group's
--   start-count hash, as for "p").
--   ARGV[2] "1": scan up (oldest first), "0": down
--   ARGV[3] the entry id to start from ("" for the first/last), ARGV[4] "1"
--           when it is exclusive; ARGV[5] unused
--   ARGV[6] the most matches, ARGV[7] the most entries to scan
--   ARGV[8] only entries whose field "error" contains this; "" for all
--   ARGV[9] only entries whose field "id" is this; "" for all
--   ARGV[10] the consumer group whose unread entries to list; "" for every
--           entry (a dead-letter stream)
--   ARGV[11] the most bytes of entries (field names and values) to read;
--           "" or "0" for no bound. Each XRANGE brings whole entries into
--           Lua (payloads included: Redis cannot read some fields only),
--           so the scan reads in chunks sized from the entries read so far
--           and stops, like the window, once it read this many bytes; it
--           reads at least one entry.
--   Returns {total, behind, more, frontier id, "", then per match {entry id,
--   its fields as a flat list of names and values, field "p" (payload) cut
--   to its first 4096 bytes}}. total: the group's lag (-1 when Redis does
--   not know it; the stream's length when the group does not exist yet), or
--   the stream's length.
--
-- "p": a group's pending entries (XPENDING), by entry id.
--   KEYS[1] the stream, KEYS[2] the group's start-count hash.
--   ARGV[2..6] as for "s"; ARGV[7..9] unused; ARGV[10] the consumer group.
--   Returns {total (the group's pending count), behind, more, frontier id,
--   "", then per match {entry id, consumer, idle ms, Redis delivery count,
--   request id or false, start count or false, payload (its first 4096
--   bytes)}}. XPENDING reads only upward and, on some servers, takes no
--   exclusive bounds: bounds are made inclusive here, and scanning down
--   bisects the id space (milliseconds, then sequence) for the start of the
--   last ARGV[6] entries: at most about 110 XPENDING calls of ARGV[6]
--   entries each.
local mode = ARGV[1]
local up = ARGV[2] == "1"
local want = tonumber(ARGV[6])
local window = tonumber(ARGV[7])
local cap = 4096 -- payload bytes returned per job

-- less compares strings as bytes (Lua's < follows the server's locale).
local function less(a, b)
  local n = math.min(#a, #b)
  for i = 1, n do
    local x, y = string.byte(a, i), string.byte(b, i)
    if x ~= y then
      return x < y
    end
  end
  return #a < #b
end

local function dec(s)
  local out = {}
  local pos = 1
  while pos <= #s do
    local colon = string.find(s, ":", pos, true)
    if not colon then
      break
    end
    local len = tonumber(string.sub(s, pos, colon - 1))
    if not len then
      break
    end
    out[#out + 1] = string.sub(s, colon + 1, colon + len)
    pos = colon + 1 + len
  end
  return out
end

if mode == "z" then
  local set, data = KEYS[1], KEYS[2]
  local total = redis.call("ZCARD", set)
  local needle = ARGV[8]
  -- row returns a member's reply, or nil when it does not match.
  local function row(member, score)
    local d = dec(redis.call("HGET", data, member) or "")
    if needle ~= "" and not string.find(d[5] or "", needle, 1, true) then
      return nil
    end
    local f = dec(d[4] or "")
    local payload, level = "", ""
    for j = 1, #f, 2 do
      if f[j] == "p" then
        payload = string.sub(f[j + 1] or "", 1, cap)
      elseif f[j] == "pr" then
        level = f[j + 1] or ""
      end
    end
    return {member, score, d[3] or "0", d[5] or "", d[6] or "", payload, level}
  end
  if ARGV[9] ~= "" then
    local score = redis.call("ZSCORE", set, ARGV[9])
    local out = {total, 0, 0, "", ""}
    if score then
      out[6] = row(ARGV[9], score)
    end
    return out
  end
  -- below returns the number of members before (score, member).
  local function below(score, member)
    local lo = redis.call("ZCOUNT", set, "-inf", "(" .. score)
    local hi = lo + redis.call("ZCOUNT", set, score, score)
    while lo < hi do
      local mid = math.floor((lo + hi) / 2)
      local m = redis.call("ZRANGE", set, mid, mid)[1]
      if m and less(m, member) then
        lo = mid + 1
      else
        hi = mid
      end
    end
    return lo
  end
  local rank, behind
  if ARGV[3] == "1" then
    local b = below(ARGV[4], ARGV[5])
    local at = redis.call("ZSCORE", set, ARGV[5])
    local on = at and tonumber(at) == tonumber(ARGV[4])
    if up then
      rank = b
      if on then
        rank = b + 1
      end
      behind = rank > 0
    else
      rank = b - 1
      behind = b < total
    end
  else
    behind = false
    rank = 0
    if not up then
      rank = total - 1
    end
  end
  local out = {total, behind and 1 or 0, 0, "", ""}
  local scanned, found = 0, 0
  local chunk = math.min(math.max(want, 16), 500)
  while found < want and scanned < window and rank >= 0 and rank < total do
    local n = math.min(chunk, window - scanned)
    local page
    if up then
      page = redis.call("ZRANGE", set, rank, rank + n - 1, "WITHSCORES")
    else
      page = redis.call("ZRANGE", set, math.max(rank - n + 1, 0), rank, "WITHSCORES")
      -- reverse to scan down
      local rev = {}
      for i = #page - 1, 1, -2 do
        rev[#rev + 1] = page[i]
        rev[#rev + 1] = page[i + 1]
      end
      page = rev
    end
    if #page == 0 then
      break
    end
    for i = 1, #page, 2 do
      scanned = scanned + 1
      if up then rank = rank + 1 else rank = rank - 1 end
      out[4], out[5] = page[i + 1], page[i]
      local r = row(page[i], page[i + 1])
      if r then
        out[#out + 1] = r
        found = found + 1
        if found >= want then
          break
        end
      end
    end
  end
  if rank >= 0 and rank < total then
    out[3] = 1
  end
  return out
end

-- Stream ids.
local function parse(id)
  local dash = string.find(id, "-", 1, true)
  if not dash then
    return tonumber(id), 0
  end
  return tonumber(string.sub(id, 1, dash - 1)), tonumber(string.sub(id, dash + 1))
end
local function idLess(a, b)
  local am, as = parse(a)
  local bm, bs = parse(b)
  return am < bm or (am == bm and as < bs)
end

local stream = KEYS[1]
local group = ARGV[10]
local from, excl = ARGV[3], ARGV[4] == "1"

-- The group's last-delivered-id bounds the queued entries ("s" with a group).
local floor = false
local lag = -1
local pendingTotal = 0
if group ~= "" then
  local ok, groups = pcall(redis.call, "XINFO", "GROUPS", stream)
  if ok then
    for _, g in ipairs(groups) do
      local f = {}
      for j = 1, #g, 2 do
        f[g[j]] = g[j + 1]
      end
      if f["name"] == group then
        floor = f["last-delivered-id"]
        pendingTotal = f["pending"] or 0
        if type(f["lag"]) == "number" then
          lag = f["lag"]
        end
      end
    end
  end
end

-- lower and upper bounds of the scan (Redis range syntax), and of the
-- opposite side for "behind".
local function bounds()
  -- The scan side: from the cursor on, in the scan's direction.
  local scanFrom = "-"
  if not up then
    scanFrom = "+"
  end
  if from ~= "" then
    scanFrom = (excl and "(" or "") .. from
  end
  -- The opposite side: the complement of the scan side.
  local other = false
  if from ~= "" then
    other = (excl and "" or "(") .. from
  end
  return scanFrom, other
end

if mode == "s" then
  local needle, only = ARGV[8], ARGV[9]
  local total
  if group ~= "" then
    total = lag
    if not floor then
      floor = "0-0"
      total = redis.call("XLEN", stream)
    end
  else
    total = redis.call("XLEN", stream)
  end
  local scanFrom, other = bounds()
  -- Queued entries lie strictly after the floor.
  local floorB = floor and ("(" .. floor) or false
  local lowScan, highScan, lowOther, highOther
  if up then
    lowScan, highScan = scanFrom, "+"
    if floor and (from == "" or not idLess(floor, from)) then
      lowScan = floorB
    end
    if other then
      lowOther, highOther = floorB or "-", other
    end
  else
    lowScan, highScan = floorB or "-", scanFrom
    if other then
      lowOther, highOther = other, "+"
      if floor and not idLess(floor, from) then
        lowOther = floorB
      end
    end
  end
  local behind = 0
  if other then
    local probe
    if up then
      probe = redis.call("XREVRANGE", stream, highOther, lowOther, "COUNT", 1)
    else
      probe = redis.call("XRANGE", stream, lowOther, highOther, "COUNT", 1)
    end
    if #probe > 0 then
      behind = 1
    end
  end
  local out = {total, behind, 0, "", ""}
  local scanned, found = 0, 0
  local filtered = needle ~= "" or only ~= ""
  local chunk = want
  if filtered then
    chunk = 200
  end
  local budget = tonumber(ARGV[11]) or 0
  local bytes = 0
  local lo, hi = lowScan, highScan
  while found < want and scanned < window and (budget <= 0 or bytes < budget) do
    local n = math.min(chunk, window - scanned)
    if budget > 0 then
      -- As many entries as the bytes left hold, at the mean size so far
      -- (a few to start with).
      local fit = 4
      if scanned > 0 then
        fit = math.floor((budget - bytes) / math.max(bytes / scanned, 1))
      end
      n = math.max(math.min(n, fit), 1)
    end
    local page
    if up then
      page = redis.call("XRANGE", stream, lo, hi, "COUNT", n)
    else
      page = redis.call("XREVRANGE", stream, hi, lo, "COUNT", n)
    end
    local stopped = false
    for _, e in ipairs(page) do
      scanned = scanned + 1
      out[4] = e[1]
      local f = e[2] or {}
      local id, err = "", ""
      for j = 1, #f, 2 do
        bytes = bytes + #f[j] + #(f[j + 1] or "")
        if f[j] == "id" then
          id = f[j + 1]
        elseif f[j] == "error" then
          err = f[j + 1]
        end
      end
      if (only == "" or id == only) and (needle == "" or string.find(err, needle, 1, true)) then
        local kept = {}
        for j = 1, #f, 2 do
          kept[#kept + 1] = f[j]
          if f[j] == "p" then
            kept[#kept + 1] = string.sub(f[j + 1], 1, cap)
          else
            kept[#kept + 1] = f[j + 1]
          end
        end
        out[#out + 1] = {e[1], kept}
        found = found + 1
        if found >= want then
          stopped = true
          break
        end
      end
    end
    if #page < n and not stopped then
      -- The end of the stream: nothing beyond.
      return out
    end
    if up then
      lo = "(" .. out[4]
    else
      hi = "(" .. out[4]
    end
  end
  -- Stopped by the count or the window: is there anything beyond?
  local probe
  if up then
    probe = redis.call("XRANGE", stream, "(" .. out[4], highScan, "COUNT", 1)
  else
    probe = redis.call("XREVRANGE", stream, "(" .. out[4], lowScan, "COUNT", 1)
  end
  if #probe > 0 then
    out[3] = 1
  end
  return out
end

-- mode "p": pending entries. XPENDING takes no exclusive bounds in every
-- server this runs on (miniredis), so bounds are made inclusive here.
local function id(ms, seq)
  return string.format("%.0f-%.0f", ms, seq)
end
local function succ(x)
  local ms, seq = parse(x)
  return id(ms, seq + 1)
end
local function pred(x)
  local ms, seq = parse(x)
  if seq > 0 then
    return id(ms, seq - 1)
  end
  return string.format("%.0f-18446744073709551615", ms - 1)
end
-- inclusive turns a range bound into an inclusive one; low: it starts a range.
local function inclusive(b, low)
  if string.sub(b, 1, 1) ~= "(" then
    return b
  end
  if low then
    return succ(string.sub(b, 2))
  end
  return pred(string.sub(b, 2))
end
local starts = KEYS[2]
local out = {pendingTotal, 0, 0, "", ""}
if not floor then
  return out
end
local scanFrom, other = bounds()
scanFrom = inclusive(scanFrom, up)
if other then
  other = inclusive(other, not up)
end
if other then
  local probe
  if up then
    probe = redis.call("XPENDING", stream, group, "-", other, 1)
  else
    probe = redis.call("XPENDING", stream, group, other, "+", 1)
  end
  if #probe > 0 then
    out[2] = 1
  end
end
local rows
if up then
  rows = redis.call("XPENDING", stream, group, scanFrom, "+", want)
else
  -- The last `want` entries up to scanFrom: find the id S where they start,
  -- the largest with want entries in [S, scanFrom].
  local function count(s)
    return #redis.call("XPENDING", stream, group, s, scanFrom, want)
  end
  local first = redis.call("XPENDING", stream, group, "-", scanFrom, want)
  if #first < want then
    rows = first
  else
    local lom = parse(first[1][1])
    local him
    if scanFrom == "+" then
      -- Every pending id is at most the group's last-delivered id.
      him = math.max(parse(floor), lom)
    else
      him = parse(scanFrom)
    end
    -- Milliseconds first: the largest m with count(m) >= want.
    while lom < him do
      local mid = math.floor((lom + him + 1) / 2)
      if count(string.format("%.0f", mid)) >= want then
        lom = mid
      else
        him = mid - 1
      end
    end
    -- Then the sequence within that millisecond (count(lom-0) >= want).
    local slo, shi = 0, 9007199254740991
    while slo < shi do
      local mid = math.floor((slo + shi + 1) / 2)
      if count(id(lom, mid)) >= want then
        slo = mid
      else
        shi = mid - 1
      end
    end
    rows = redis.call("XPENDING", stream, group, id(lom, slo), scanFrom, want)
  end
  local rev = {}
  for i = #rows, 1, -1 do
    rev[#rev + 1] = rows[i]
  end
  rows = rev
end
for _, p in ipairs(rows) do
  local e = redis.call("XRANGE", stream, p[1], p[1])
  local rid, payload = false, ""
  if e[1] and e[1][2] then
    local f = e[1][2]
    for j = 1, #f, 2 do
      if f[j] == "id" then
        rid = f[j + 1]
      elseif f[j] == "p" then
        payload = string.sub(f[j + 1], 1, cap)
      end
    end
  end
  out[#out + 1] = {p[1], p[2], p[3], p[4], rid, redis.call("HGET", starts, p[1]), payload}
  out[4] = p[1]
end
if #rows >= want then
  local probe
  if up then
    probe = redis.call("XPENDING", stream, group, succ(out[4]), "+", 1)
  else
    probe = redis.call("XPENDING", stream, group, "-", pred(out[4]), 1)
  end
  if #probe > 0 then
    out[3] = 1
  end
end
return out
