-- offline_push.lua: hold a command for a rig that is not connected (CONTRACT.md section 5),
-- bounded per rig. Run by EVALSHA from src/registry/offline.rs.
--
-- KEYS[1]  offline:<rig_id>   (list of command entries, oldest first)
-- ARGV[1]  the entry: JSON {"id","name","args","deadline_ms","reply_to"}
-- ARGV[2]  max entries per rig: decimal integer
-- ARGV[3]  ttl_ms for the list: decimal integer, 1 to 15 digits (the latest deadline, plus a
--          margin so the holding broker still finds the entry to report it expired)
--
-- Returns the list length after the push, or 0 when the list was full (nothing written).

local max, ttl = tonumber(ARGV[2]), ARGV[3]
if #KEYS ~= 1 or #ARGV ~= 3 or not max or type(ttl) ~= 'string' or not ttl:match('^[1-9]%d*$') then
  return redis.error_reply('ERR fleetlink offline_push: expected KEYS list; ARGV entry, max, ttl_ms')
end
local len = redis.call('LLEN', KEYS[1])
if len >= max then
  return 0
end
len = redis.call('RPUSH', KEYS[1], ARGV[1])
local current = redis.call('PTTL', KEYS[1])
if current < tonumber(ttl) then
  redis.call('PEXPIRE', KEYS[1], ttl)
end
return len
