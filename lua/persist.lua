-- persist.lua: keep commands of rig sessions until the rig acks them (CONTRACT.md section 5),
-- fenced by ownership: a broker that no longer owns the rig cannot add to its session.
-- Run by EVALSHA from src/registry/sessions.rs, one batch per call.
--
-- KEYS[2i-1]  rig:<rig_id>                 (the lease, read only)
-- KEYS[2i]    sess:<rig_id>:<boot_id>      (hash: "next" -> next seq, "c:<seq>" -> command JSON)
-- ARGV[1]     ttl_ms of session keys: decimal integer, 1 to 15 digits
-- ARGV[3i-1]  "<boot_id>|<broker_id>": this broker's lease tuple for that rig
-- ARGV[3i]    seq: decimal integer
-- ARGV[3i+1]  the command's JSON, exactly as sent to the rig
--
-- Returns an array of statuses, one per command in order:
--   "ok"      the lease is still ours: HSET c:<seq>, raise "next" to seq+1, PEXPIRE
--   "fenced"  the lease is someone else's (or gone): nothing written; the broker drops the
--             command and tells control, which never got an ok for it
-- Errors "ERR fleetlink persist: ..." on malformed ARGV, before any write.

local ttl = ARGV[1]
if #KEYS % 2 ~= 0 or #ARGV ~= 1 + 3 * (#KEYS / 2) or type(ttl) ~= 'string' or #ttl > 15
    or not ttl:match('^[1-9]%d*$') then
  return redis.error_reply('ERR fleetlink persist: expected pairs of keys and ttl_ms, then tuple, seq, json per pair')
end
for i = 1, #KEYS / 2 do
  if not ARGV[3 * i]:match('^%d+$') then
    return redis.error_reply('ERR fleetlink persist: seq must be a decimal integer')
  end
end

local out = {}
for i = 1, #KEYS / 2 do
  local lease, sess = KEYS[2 * i - 1], KEYS[2 * i]
  local tuple, seq, json = ARGV[3 * i - 1], ARGV[3 * i], ARGV[3 * i + 1]
  if redis.pcall('GET', lease) ~= tuple then
    out[i] = 'fenced'
  else
    redis.call('HSET', sess, 'c:' .. seq, json)
    local nxt = tonumber(redis.call('HGET', sess, 'next') or '1')
    if tonumber(seq) + 1 > nxt then
      redis.call('HSET', sess, 'next', tostring(tonumber(seq) + 1))
    end
    redis.call('PEXPIRE', sess, ttl)
    out[i] = 'ok'
  end
end
return out
