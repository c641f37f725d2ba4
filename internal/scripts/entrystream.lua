-- entrystream.lua: a function put in front of job.lua and forget.lua
-- (scripts.go), which both take the shard's stream as KEYS[2] and the
-- streams of priority levels "high" and "low" as KEYS[7] and KEYS[8].
--
-- entryStream returns the stream holding entry eid of request rid: the
-- shard's (KEYS[2]) or a priority level's (KEYS[7], KEYS[8]); false when no
-- stream holds it (an entry deleted by hand). Entry ids are per stream: an
-- entry of another stream with this id is another request's, which the
-- caller must not read or touch.
local function entryStream(eid, rid)
  for _, s in ipairs({KEYS[2], KEYS[7], KEYS[8]}) do
    local e = redis.call("XRANGE", s, eid, eid, "COUNT", 1)
    if e[1] and e[1][2] then
      local f = e[1][2]
      for j = 1, #f - 1, 2 do
        if f[j] == "id" and f[j + 1] == rid then
          return s
        end
      end
    end
  end
  return false
end
