-- broker.lua: this broker's liveness key (CONTRACT.md section 3, "broker:<broker_id>").
-- Run by EVALSHA from src/registry/scripts.rs every 10 s with a 30 s TTL; control counts the
-- live broker:* keys to know how many broadcast replies to expect.
--
-- KEYS[1]  broker:<broker_id>
-- ARGV[1]  JSON blob (address, cores, started_at, connections); stored as given
-- ARGV[2]  ttl_ms: decimal integer, 1 to 15 digits, no leading zero
--
-- Returns "ok" after SET KEYS[1] ARGV[1] PX ttl_ms, or "new" when the key was not there
-- before: at start, after an outage longer than its TTL, or because Redis lost its keys while
-- it stayed up (FLUSHALL, eviction), when the sessions parked on this broker must go back.
-- Errors  "ERR fleetlink broker: ..." on malformed ARGV, before any write.

local ttl = ARGV[2]
if #ARGV ~= 2 or type(ttl) ~= 'string' or #ttl > 15 or not ttl:match('^[1-9]%d*$') then
  return redis.error_reply('ERR fleetlink broker: expected ARGV json, ttl_ms')
end
local had = redis.call('EXISTS', KEYS[1])
redis.call('SET', KEYS[1], ARGV[1], 'PX', ttl)
if had == 1 then
  return 'ok'
end
return 'new'
