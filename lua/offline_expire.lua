-- offline_expire.lua: remove a held command whose deadline passed, for the broker that held it
-- to report it expired (CONTRACT.md section 5, docs/protocol.md), and remember the removal for
-- a while. Run by EVALSHA from src/registry/offline.rs.
--
-- Remembered because the broker may never hear this answer (Redis hung past the broker's wait
-- after running it, or the connection broke): it asks again once Redis answers, and without
-- the mark the command, gone from the list, would read as one a hello took, which the broker
-- reports nothing for. Marked by the entry's hash, not the command id, which control may reuse.
--
-- KEYS[1]  offline:<rig_id>           (list of command entries, oldest first)
-- KEYS[2]  offline:expired:<rig_id>   (set of hashes of entries this script removed)
-- ARGV[1]  the entry, byte for byte as held
-- ARGV[2]  how long the mark is kept, ms: decimal integer, 1 to 15 digits
--
-- Returns 1 when it removed the entry now, 2 when an earlier call removed it, 0 when the entry
-- is not there otherwise (a hello took it: delivered).

local ttl = ARGV[2]
if #KEYS ~= 2 or #ARGV ~= 2 or type(ttl) ~= 'string' or #ttl > 15
    or not ttl:match('^[1-9]%d*$') then
  return redis.error_reply('ERR fleetlink offline_expire: expected KEYS list, marks; ARGV entry, ttl_ms')
end
local mark = redis.sha1hex(ARGV[1])
if redis.call('LREM', KEYS[1], 1, ARGV[1]) > 0 then
  redis.call('SADD', KEYS[2], mark)
  if redis.call('PTTL', KEYS[2]) < tonumber(ttl) then
    redis.call('PEXPIRE', KEYS[2], ttl)
  end
  return 1
end
if redis.call('SISMEMBER', KEYS[2], mark) == 1 then
  return 2
end
return 0
