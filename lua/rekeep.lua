-- rekeep.lua: put a rig's session (its next seq and unacked commands) back into Redis after
-- Redis lost it or missed part of it (it restarted empty, or was away while commands were
-- delivered unkept). Run by EVALSHA from src/registry/sessions.rs, one rig per call; rare
-- (only after a reconnect or a restored lease), so it favours checks over speed.
--
-- KEYS[1]  rig:<rig_id>               (the lease, read only)
-- KEYS[2]  sess:<rig_id>:<boot_id>    (hash: "next" -> next seq, "c:<seq>" -> command JSON)
-- KEYS[3]  sessof:<rig_id>            (the rig's latest boot)
-- ARGV[1]  ttl_ms of session keys: decimal integer, 1 to 15 digits
-- ARGV[2]  "<boot_id>|<broker_id>": this broker's lease tuple for the rig
-- ARGV[3]  next: the session's next seq as the broker has it, decimal integer
-- ARGV[4]  mode, which decides the fence:
--            "live"    a rig connected here: written only under our lease (as persist.lua)
--            "parked"  a rig that disconnected from here, whose session this broker still
--                      holds: its lease was released or lost, so written when no one else
--                      holds the rig: the lease is ours, or it is absent and the session key
--                      does not exist (if it does, another broker or the rig's new connection
--                      wrote a newer truth there)
-- ARGV[5], ARGV[6], ...  seq, command JSON (exactly as sent), for each command not yet acked
--
-- Returns:
--   "ok"      written: every command HSET, "next" raised to at least ARGV[3] (never lowered:
--             commands kept since Redis came back may already be above these), "sessof" set
--             to this boot unless another boot is recorded there, TTLs set
--   "fenced"  the fence above refused: nothing written
-- Errors "ERR fleetlink rekeep: ..." on malformed ARGV, before any write.

local function count(s)
  return type(s) == 'string' and #s <= 15 and s:match('^%d+$') ~= nil
end

local ttl, tuple, nxt, mode = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
if #KEYS ~= 3 or #ARGV < 4 or (#ARGV - 4) % 2 ~= 0 or not count(ttl) or ttl:match('^0')
    or type(tuple) ~= 'string' or not count(nxt) then
  return redis.error_reply('ERR fleetlink rekeep: expected KEYS lease, session, pointer; ARGV ttl_ms, tuple, next, mode, then seq/json pairs')
end
if mode ~= 'live' and mode ~= 'parked' then
  return redis.error_reply('ERR fleetlink rekeep: mode must be live or parked')
end
local boot = tuple:match('^([^|]+)|')
if not boot then
  return redis.error_reply('ERR fleetlink rekeep: the tuple must be boot_id|broker_id')
end
for i = 5, #ARGV, 2 do
  if not count(ARGV[i]) then
    return redis.error_reply('ERR fleetlink rekeep: seq must be a decimal integer')
  end
end

-- pcall: a lease key of another type answers WRONGTYPE as a table: someone else's.
local lease = redis.pcall('GET', KEYS[1])
local sess = KEYS[2]
if lease ~= tuple then
  if mode == 'live' or lease ~= false or redis.call('EXISTS', sess) == 1 then
    return 'fenced'
  end
end
for i = 5, #ARGV, 2 do
  redis.call('HSET', sess, 'c:' .. ARGV[i], ARGV[i + 1])
end
local have = tonumber(redis.call('HGET', sess, 'next') or '0') or 0
if tonumber(nxt) > have then
  redis.call('HSET', sess, 'next', nxt)
end
redis.call('PEXPIRE', sess, ttl)
redis.call('SET', KEYS[3], boot, 'PX', ttl, 'NX')
return 'ok'
