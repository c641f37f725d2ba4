-- ratelimit.lua: take up to N tokens of a rate limit shared by every consumer
-- of a group, with GCRA (the generic cell rate algorithm) on the server's
-- clock, so that consumers on hosts with different clocks agree.
--
-- The state is one number: the theoretical arrival time (TAT), in
-- microseconds of the server's TIME. A token's TAT is the previous one plus
-- the emission interval T (the period divided by the rate); the token may be
-- used from TAT - B*T on (B is the burst). The caller asks for as many tokens
-- as it has workers waiting and gets every token usable within the horizon,
-- each with the moment it may be used: one call serves several starts, and
-- a caller never starts one early, so in any window of W microseconds at
-- most W/T + B tokens are used, however many consumers share the key.
-- Tokens granted and never used (the consumer stopped, or no worker was
-- waiting for one by (B-1)*T after its time: a later use could join the
-- next moments' tokens and exceed the bound) are lost: the rate only drops.
--
-- KEYS[1]  the limit's key (a string: the TAT)
-- ARGV[1]  T, the emission interval in microseconds (>= 1)
-- ARGV[2]  B, the burst (>= 1)
-- ARGV[3]  tokens wanted (>= 1)
-- ARGV[4]  horizon in microseconds: grant tokens usable within this long
--
-- Returns {granted, first, now}: now is the server's time in microseconds;
-- token i (0-based) may be used first + i*T microseconds after now (at once
-- when that is <= 0). When granted is 0, first is how long to wait, in
-- microseconds, until a token is usable within the horizon.
local t = redis.call("TIME")
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local T = tonumber(ARGV[1])
local B = tonumber(ARGV[2])
local want = tonumber(ARGV[3])
local horizon = tonumber(ARGV[4])
local tat = tonumber(redis.call("GET", KEYS[1]) or "0") or 0
if tat < now then
  tat = now
end
-- The next token's TAT is tat + T; it is usable from tat + T - B*T.
local first = tat + T - B * T - now
local k = math.floor((horizon - first) / T) + 1
if k < 0 then
  k = 0
end
if k > want then
  k = want
end
if k == 0 then
  return {0, first - horizon, now}
end
tat = tat + k * T
-- %.0f: Lua prints large numbers in exponent form, losing digits.
redis.call("SET", KEYS[1], string.format("%.0f", tat), "PX", string.format("%.0f", math.ceil((tat - now) / 1000) + 1))
return {k, first, now}
