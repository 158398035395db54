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
--   "ok"      the lease is still ours: HSET c:<seq> and "next" = seq+1; PEXPIRE only when
--             that HSET created the key (a session Redis had lost, before its re-keep)
--   "fenced"  the lease is someone else's: nothing written; the broker drops the command and
--             tells control, which never got an ok for it
--   "missing" there is no lease (Redis lost it: evicted, flushed, restarted empty): nothing
--             written; a broker that still holds the rig puts its lease back (refresh.lua)
--             and sends the command again, one that does not drops it as fenced
-- Errors "ERR fleetlink persist: ..." on malformed ARGV, before any write.
--
-- "next" is set, not raised: one broker's commands for a session arrive here in seq order
-- (its core numbers them, its bridge sends them in order), and a broker that lost the rig is
-- fenced out, so seq+1 is always the highest. Two calls per command keep a 10,000-command
-- burst cheap for Redis. A command does not restart the session's TTL: the broker holding the
-- rig extends it a few times per TTL and sets it afresh at the disconnect (sessions.rs,
-- `touch`), which is what keeps a session alive; a PEXPIRE per command cost Redis a third of
-- this script's calls for nothing more.

local ttl = ARGV[1]
if #KEYS % 2 ~= 0 or #ARGV ~= 1 + 3 * (#KEYS / 2) or type(ttl) ~= 'string' or #ttl > 15
    or not ttl:match('^[1-9]%d*$') then
  return redis.error_reply('ERR fleetlink persist: expected pairs of keys and ttl_ms, then tuple, seq, json per pair')
end
local n = #KEYS / 2
local seqs = {}
for i = 1, n do
  local seq = ARGV[3 * i]
  if #seq > 15 or not seq:match('^%d+$') then
    return redis.error_reply('ERR fleetlink persist: seq must be a decimal integer')
  end
  seqs[i] = tonumber(seq)
end

local out = {}
local lk = {}
for i = 1, n do lk[i] = KEYS[2 * i - 1] end
local leases = redis.call('MGET', unpack(lk))
for i = 1, n do
  local sess = KEYS[2 * i]
  local lease = leases[i]
  if lease == false then
    out[i] = 'missing'
  elseif lease ~= ARGV[3 * i - 1] then
    out[i] = 'fenced'
  else
    if redis.call('HSET', sess, 'c:' .. ARGV[3 * i], ARGV[3 * i + 1]) == 2 then
      redis.call('PEXPIRE', sess, ttl)
    end
    out[i] = 'ok'
  end
end
return out
