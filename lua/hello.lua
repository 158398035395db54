-- hello.lua: claim a rig for one boot on one broker, unless a newer boot already owns it.
-- Run by EVALSHA from src/registry/scripts.rs (CONTRACT.md section 3, "hello").
--
-- KEYS[1]  rig:<rig_id>
-- ARGV[1]  boot_id: canonical lowercase UUID text, 36 chars
-- ARGV[2]  broker_id
-- ARGV[3]  ttl_ms: decimal integer, 1 to 15 digits, no leading zero
--
-- Returns {"ok", previous}   when there was no entry, or the entry's boot_id <= ARGV[1]:
--                            SET KEYS[1] "<boot_id>|<broker_id>" PX ttl_ms; previous is the
--                            value replaced, or "" when there was none (or it was not a string).
--         {"older", current} when the entry's boot_id > ARGV[1] (close 4409): nothing written.
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

local boot, broker, ttl = ARGV[1], ARGV[2], ARGV[3]
if #ARGV ~= 3 or not is_boot(boot) or type(ttl) ~= 'string' or #ttl > 15
    or not ttl:match('^[1-9]%d*$') then
  return redis.error_reply('ERR fleetlink hello: expected ARGV boot_id, broker_id, ttl_ms')
end

local current = redis.pcall('GET', KEYS[1])
if type(current) ~= 'string' then
  current = ''
end
local bar = current:find('|', 1, true)
local owner_boot = bar and current:sub(1, bar - 1)
if is_boot(owner_boot) and not newer_or_equal(boot, owner_boot) then
  return { 'older', current }
end
redis.call('SET', KEYS[1], boot .. '|' .. broker, 'PX', ttl)
return { 'ok', current }
