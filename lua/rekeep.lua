-- rekeep.lua: put a connected rig's unacked commands back into its session after Redis lost
-- them (it restarted empty, so this broker had to restore the rig's lease), fenced like
-- persist.lua. Run by EVALSHA from src/registry/sessions.rs, one rig per call; rare (only
-- after a restore), so it favours checks over speed.
--
-- KEYS[1]  rig:<rig_id>               (the lease, read only)
-- KEYS[2]  sess:<rig_id>:<boot_id>    (hash: "next" -> next seq, "c:<seq>" -> command JSON)
-- KEYS[3]  sessof:<rig_id>            (the rig's latest boot)
-- ARGV[1]  ttl_ms of session keys: decimal integer, 1 to 15 digits
-- ARGV[2]  "<boot_id>|<broker_id>": this broker's lease tuple for the rig
-- ARGV[3]  next: the session's next seq as the broker has it, decimal integer
-- ARGV[4], ARGV[5], ...  seq, command JSON (exactly as sent), for each command not yet acked
--
-- Returns:
--   "ok"      the lease is ours: every command HSET, "next" raised to at least ARGV[3] (never
--             lowered: commands kept since Redis came back may already be above these),
--             "sessof" set to this boot unless another boot is recorded there, TTLs set
--   "fenced"  the lease is someone else's (or gone): nothing written
-- Errors "ERR fleetlink rekeep: ..." on malformed ARGV, before any write.

local function count(s)
  return type(s) == 'string' and #s <= 15 and s:match('^%d+$') ~= nil
end

local ttl, tuple, nxt = ARGV[1], ARGV[2], ARGV[3]
if #KEYS ~= 3 or #ARGV < 3 or (#ARGV - 3) % 2 ~= 0 or not count(ttl) or ttl:match('^0')
    or type(tuple) ~= 'string' or not count(nxt) then
  return redis.error_reply('ERR fleetlink rekeep: expected KEYS lease, session, pointer; ARGV ttl_ms, tuple, next, then seq/json pairs')
end
local boot = tuple:match('^([^|]+)|')
if not boot then
  return redis.error_reply('ERR fleetlink rekeep: the tuple must be boot_id|broker_id')
end
for i = 4, #ARGV, 2 do
  if not count(ARGV[i]) then
    return redis.error_reply('ERR fleetlink rekeep: seq must be a decimal integer')
  end
end

if redis.pcall('GET', KEYS[1]) ~= tuple then
  return 'fenced'
end
local sess = KEYS[2]
for i = 4, #ARGV, 2 do
  redis.call('HSET', sess, 'c:' .. ARGV[i], ARGV[i + 1])
end
local have = tonumber(redis.call('HGET', sess, 'next') or '0') or 0
if tonumber(nxt) > have then
  redis.call('HSET', sess, 'next', nxt)
end
redis.call('PEXPIRE', sess, ttl)
redis.call('SET', KEYS[3], boot, 'PX', ttl, 'NX')
return 'ok'
