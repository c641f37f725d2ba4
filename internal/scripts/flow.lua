-- flow.lua: produce a flow: a parent request that runs once every child has
-- an outcome (see flowrelease.lua, which scripts.go puts in front of this
-- file, for the flow hash). A child may itself be a flow's parent (a nested
-- flow, or a chain): the call carries the whole tree.
--
-- One atomic step: a known root id writes nothing (its record answers, as
-- in produce.lua). Otherwise every node below the root is checked first
-- (reads only): a node whose record holds an outcome is done with it (a
-- child done before its parent was produced counts as done, and an inner
-- node's own children are not looked at); a node queued, running or waiting
-- outside this call cannot join it (its entry has no "pa", so its completion
-- would not release the parent): the call fails before any write. Then each
-- new leaf is appended like a new request, with field "pa" naming its
-- parent's flow hash, and each new inner node gets its flow hash and the
-- record "P&"; an inner node (the root too) with no child left without an
-- outcome is released at once (flowRelease).
--
-- KEYS[1..3]       the root's stream, record and flow hash
-- KEYS[3i+1..3i+3] node i's (i = 1..n) stream, record and flow hash (the
--                  last unused for a leaf)
-- ARGV[1]          TTL of the in-flight records and flow hashes, ms
-- ARGV[2]          the root's policy: "f" or "r"
-- ARGV[3]          the root's request id
-- ARGV[4]          the root's stream fields, length-prefixed
-- ARGV[5]          the root's due time ("0": none; "<ms>": Unix ms of the
--                  server's clock; "r<ms>": a delay from the server's clock)
-- ARGV[6]          the root's placement, length-prefixed name/value pairs
--                  ("" for a request of the default level without a due
--                  time): "st" the stream of its priority level, "lv" the
--                  notice a call creating that stream publishes ("+high",
--                  "+low"), "sch" and "sd" its shard's schedule and data,
--                  "wk" its shard's wake channel, "pub" "PUBLISH" or
--                  "SPUBLISH". A parent keeps them in its flow hash for its
--                  release (flowrelease.lua); a leaf uses them at once.
-- ARGV[7...]       per node below the root, in an order where a parent
--                  comes before its children: its parent's index (0: the
--                  root), queue, request id, payload, kind ("l" a leaf, or
--                  an inner node's policy "f" / "r"), an inner node's stream
--                  fields length-prefixed (with its own "pa"; "" for a
--                  leaf), its due time and placement (as ARGV[5], ARGV[6]),
--                  f (a count), then f strings: a leaf's extra stream
--                  fields, name then value
--
-- A leaf with a due time later than the server's clock waits in its shard's
-- schedule like a delayed request (record "P@<due>", promote.lua appends it
-- with its "pa"); an inner node or the root with one waits there once
-- released (flowrelease.lua). A leaf of a priority level is appended to its
-- level's stream, and the call that creates that stream tells the
-- consumers on the wake channel (as produce.lua does).
--
-- Returns {code, data}: 0 and the root's entry id ("" while it waits) for a
-- new flow (a parent released at once whose children failed under policy
-- "f" is appended to be failed by a consumer: see flowrelease.lua); 1 and
-- the entry id ("" while it waits or is scheduled) when the
-- root was in flight; 2 and the record when it has an outcome. Errors,
-- before any write: "WRONGTYPE ..." for a key of another type, "INFLIGHT
-- <queue>/<id>" for a node in flight outside this call, "DUPLICATE
-- <queue>/<id>" for an id given twice.
local ttl = ARGV[1]
local flowDec, _, flowRelease = flowLib()

local function enc(list)
  local parts = {}
  for i, v in ipairs(list) do
    parts[i] = #v .. ":" .. v
  end
  return table.concat(parts)
end

local function get(key)
  local v = redis.pcall("GET", key)
  if type(v) == "table" then
    return nil, redis.error_reply("WRONGTYPE key " .. key .. " is not a streamq record")
  end
  return v
end

local pv, err = get(KEYS[2])
if err then
  return err
end
if pv then
  if string.sub(pv, 1, 1) == "P" then
    if string.byte(pv, -1) == 43 and string.find(pv, "+", 2, true) == #pv then
      -- A quiet record, "P<entry id>+" or "P@<due>+" (see produce.lua's
      -- heard): this caller waits.
      redis.pcall("SET", KEYS[2], string.sub(pv, 1, -2), "KEEPTTL")
    end
    local c = string.sub(pv, 2, 2)
    if c == "@" or c == "&" or c == "%" then
      return {1, ""}
    end
    return {1, string.match(pv, "^P([^+]*)")} -- without a Replace's follow-up
  end
  return {2, pv}
end

local root = {stream = KEYS[1], rec = KEYS[2], flow = KEYS[3], id = ARGV[3], kind = ARGV[2], e = ARGV[4],
  due = ARGV[5], place = ARGV[6], kids = {}}
local nodes = {[0] = root}
local seen = {[KEYS[2]] = true}
local a = 7
local i = 0
while a <= #ARGV do
  i = i + 1
  local nd = {stream = KEYS[3 * i + 1], rec = KEYS[3 * i + 2], flow = KEYS[3 * i + 3], queue = ARGV[a + 1],
    id = ARGV[a + 2], payload = ARGV[a + 3], kind = ARGV[a + 4], e = ARGV[a + 5], due = ARGV[a + 6],
    place = ARGV[a + 7], kids = {}}
  local f = tonumber(ARGV[a + 8])
  nd.fa, nd.fz = a + 9, a + 8 + f
  local parent = nodes[tonumber(ARGV[a])]
  a = nd.fz + 1
  if seen[nd.rec] then
    return redis.error_reply("DUPLICATE " .. nd.queue .. "/" .. nd.id)
  end
  seen[nd.rec] = true
  nodes[i] = nd
  parent.kids[#parent.kids + 1] = nd
end

-- Reads and checks first: nothing is written when the call fails.
local function typeIs(key, want)
  local t = redis.call("TYPE", key)
  t = t["ok"] or t
  return t == want or t == "none"
end
local function check(nd)
  if not typeIs(nd.flow, "hash") then
    return redis.error_reply("WRONGTYPE key " .. nd.flow .. " is not a streamq flow")
  end
  for _, k in ipairs(nd.kids) do
    if not typeIs(k.stream, "stream") then
      return redis.error_reply("WRONGTYPE key " .. k.stream .. " is not a stream")
    end
    local v
    v, err = get(k.rec)
    if err then
      return err
    end
    if v and string.sub(v, 1, 1) == "P" then
      return redis.error_reply("INFLIGHT " .. k.queue .. "/" .. k.id)
    end
    k.prev = v
    if not v and k.kind ~= "l" then
      local e = check(k)
      if e then
        return e
      end
    end
  end
  return nil
end
if not typeIs(root.stream, "stream") then
  return redis.error_reply("WRONGTYPE key " .. root.stream .. " is not a stream")
end
err = check(root)
if err then
  return err
end

-- The server's clock, read only when a node has a due time.
local now
local function serverNow()
  if not now then
    local t = redis.call("TIME")
    now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  end
  return now
end

-- placement decodes a node's placement (see ARGV[6]) into a table, and
-- its due time into Unix ms (nil: none).
local function placement(nd)
  local p = {}
  local list = flowDec(nd.place)
  for j = 1, #list - 1, 2 do
    p[list[j]] = list[j + 1]
  end
  local due
  if string.sub(nd.due, 1, 1) == "r" then
    local d = tonumber(string.sub(nd.due, 2)) or 0
    if d > 0 then
      due = serverNow() + d
    end
  else
    due = tonumber(nd.due)
    if due == 0 then
      due = nil
    end
  end
  return p, due
end

-- leaf appends a leaf, or schedules it when it is due later.
local function leaf(nd, parentFlow)
  local p, due = placement(nd)
  if due and due > serverNow() then
    local fields = {"id", nd.id, "p", nd.payload, "pa", parentFlow}
    for j = nd.fa, nd.fz do
      fields[#fields + 1] = ARGV[j]
    end
    local member = "r" .. nd.id
    local head = redis.call("ZRANGE", p.sch, 0, 0, "WITHSCORES")
    redis.call("ZADD", p.sch, due, member)
    redis.call("HSET", p.sd, member, enc({nd.rec, "", "0", enc(fields), "", tostring(serverNow())}))
    redis.call("SET", nd.rec, "P@" .. due, "PX", ttl + due - serverNow())
    if not head[2] or due < tonumber(head[2]) then
      redis.call(p.pub, p.wk, tostring(due))
    end
    return
  end
  local eid
  local fk = fairKeyOf(ARGV, nd.fa, nd.fz)
  if fk then
    -- A keyed child (Key) takes its key's turn like any keyed job
    -- (fair.lua): appended now with a slot, into its level's stream, or
    -- waiting in its key's list with its record "P%". The record is
    -- written first: fairAppend drops a job whose record is gone.
    redis.call("SET", nd.rec, "P%", "PX", ttl)
    local base = fairBase(nd.stream)
    local el = {nd.rec, "", "0", "id", nd.id, "p", nd.payload, "pa", parentFlow}
    for j = nd.fa, nd.fz do
      el[#el + 1] = ARGV[j]
    end
    if p.pub then
      fairPub = p.pub
    end
    if fairMayAppend(base, fk) then
      fairAppend(base, fk, fairEnc(el))
    else
      fairWait(base, fk, fairEnc(el))
    end
    return
  end
  if p.st then
    -- A level's stream: the call that creates it tells the consumers.
    eid = redis.call("XADD", p.st, "NOMKSTREAM", "*", "id", nd.id, "p", nd.payload, "pa", parentFlow,
      unpack(ARGV, nd.fa, nd.fz))
    if not eid then
      eid = redis.call("XADD", p.st, "*", "id", nd.id, "p", nd.payload, "pa", parentFlow, unpack(ARGV, nd.fa, nd.fz))
      redis.call(p.pub, p.wk, p.lv)
    end
  else
    eid = redis.call("XADD", nd.stream, "*", "id", nd.id, "p", nd.payload, "pa", parentFlow,
      unpack(ARGV, nd.fa, nd.fz))
  end
  redis.call("SET", nd.rec, "P" .. eid, "PX", ttl)
end

-- build writes a node's subtree; it returns the node's outcome record when
-- it has one (done), or nil while it is pending (waiting, or in the stream).
-- parentFlow is the flow hash of the node's parent (nil for the root).
local function build(nd, parentFlow)
  if nd.prev then
    return nd.prev
  end
  if nd.kind == "l" then
    leaf(nd, parentFlow)
    return nil
  end
  if redis.call("EXISTS", nd.flow) == 1 then
    redis.call("DEL", nd.flow) -- left by a parent whose record is gone (forgotten)
  end
  local pending = 0
  local order = {}
  for _, k in ipairs(nd.kids) do
    order[#order + 1] = k.rec
    order[#order + 1] = k.queue
    order[#order + 1] = k.id
    local out = build(k, nd.flow)
    redis.call("HSET", nd.flow, "k:" .. k.rec, out or "")
    if not out then
      pending = pending + 1
    end
  end
  redis.call("HSET", nd.flow, "id", nd.id, "n", pending, "pol", nd.kind,
    "ttl", ttl, "e", nd.e, "o", enc(order))
  if nd.place ~= "" then
    -- Its level and due time, for its release (flowrelease.lua).
    local p, due = placement(nd)
    local list = {}
    for name, v in pairs(p) do
      list[#list + 1] = name
      list[#list + 1] = v
    end
    if due then
      list[#list + 1] = "due"
      list[#list + 1] = tostring(due)
    end
    if #list > 0 then
      redis.call("HSET", nd.flow, unpack(list))
    end
  end
  redis.call("SET", nd.rec, "P&", "PX", ttl)
  redis.call("PEXPIRE", nd.flow, ttl)
  if pending > 0 then
    return nil
  end
  return nil, flowRelease(nd.flow, nd.rec, nd.stream)
end

local out, eid = build(root, nil)
if out then
  return {2, out}
end
return {0, eid or ""}
