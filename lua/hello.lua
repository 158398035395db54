-- hello.lua: claim rigs for one boot each on one broker, unless a newer boot already owns one.
-- Run by EVALSHA from src/registry/scripts.rs (CONTRACT.md section 3, "hello"), for every
-- hello of a batch in one call: a storm's hellos cost Redis one script call per batch, not
-- one per rig (a call's own setup was two thirds of a one-rig call's time).
--
-- KEYS[i]    rig:<rig_id> of the i-th hello, 1 <= i <= #KEYS
-- ARGV[1]    broker_id
-- ARGV[2]    ttl_ms: decimal integer, 1 to 15 digits, no leading zero
-- ARGV[2+i]  the i-th hello's boot_id: canonical lowercase UUID text, 36 chars
--
-- Returns one entry per key, in order:
--         {"ok", previous}   when there was no entry, or the entry's boot_id <= the hello's:
--                            SET KEYS[i] "<boot_id>|<broker_id>" PX ttl_ms; previous is the
--                            value replaced, or "" when there was none (or it was not a string).
--         {"older", current} when the entry's boot_id is newer (close 4409): nothing written.
-- The hellos run in order, so two hellos of one rig in a batch meet as two calls would.
-- Errors  "ERR fleetlink hello: ..." on malformed ARGV, before any write.
--
-- An entry whose text before the first '|' is not a canonical boot_id (garbage, no '|', or a
-- key of another type) counts as no entry and is overwritten.
-- Boot ids are compared byte by byte, not with Lua's '<': Redis calls
-- setlocale(LC_COLLATE, "") and Lua's string '<' uses strcoll, so '<' depends on the locale.

local H = '[0-9a-f]'
local BOOT = '^' .. H:rep(8) .. '%-' .. H:rep(4) .. '%-' .. H:rep(4) .. '%-' .. H:rep(4)
    .. '%-' .. H:rep(12) .. '$'

local function is_boot(s)
  return type(s) == 'string' and s:match(BOOT) ~= nil
end

-- a >= b for two canonical boot ids (same length, same dash positions).
local function newer_or_equal(a, b)
  for i = 1, #a do
    local x, y = a:byte(i), b:byte(i)
    if x ~= y then
      return x > y
    end
  end
  return true
end

local broker, ttl = ARGV[1], ARGV[2]
local ok = #KEYS > 0 and #ARGV == 2 + #KEYS and type(ttl) == 'string' and #ttl <= 15
    and ttl:match('^[1-9]%d*$') ~= nil
for i = 1, #KEYS do
  ok = ok and is_boot(ARGV[2 + i])
end
if not ok then
  return redis.error_reply('ERR fleetlink hello: expected KEYS rig keys; ARGV broker_id, ttl_ms, then a boot_id per key')
end

local out = {}
for i = 1, #KEYS do
  local boot = ARGV[2 + i]
  local current = redis.pcall('GET', KEYS[i])
  if type(current) ~= 'string' then
    current = ''
  end
  local bar = current:find('|', 1, true)
  local owner_boot = bar and current:sub(1, bar - 1)
  if is_boot(owner_boot) and not newer_or_equal(boot, owner_boot) then
    out[i] = { 'older', current }
  else
    redis.call('SET', KEYS[i], boot .. '|' .. broker, 'PX', ttl)
    out[i] = { 'ok', current }
  end
end
return out
