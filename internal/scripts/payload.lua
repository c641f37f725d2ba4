-- payload.lua: the start of one stream entry's payload (reads only), so that
-- a caller that shows a job does not transfer a large payload whole.
--
-- KEYS[1]      the stream
-- ARGV[1]      the entry id
-- ARGV[2]      the most bytes to return
--
-- Returns the first ARGV[2] bytes of the entry's field "p", "" when it has
-- none, or nil when the stream holds no such entry.
local e = redis.call("XRANGE", KEYS[1], ARGV[1], ARGV[1], "COUNT", 1)
if not e[1] or not e[1][2] then
  return false
end
local f = e[1][2]
for j = 1, #f - 1, 2 do
  if f[j] == "p" then
    return string.sub(f[j + 1], 1, tonumber(ARGV[2]))
  end
end
return ""
