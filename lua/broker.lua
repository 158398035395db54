-- broker.lua: this broker's liveness key (CONTRACT.md section 3, "broker:<broker_id>").
-- Run by EVALSHA from src/registry/scripts.rs every 10 s with a 30 s TTL; control counts the
-- live broker:* keys to know how many broadcast replies to expect.
--
-- KEYS[1]  broker:<broker_id>
-- KEYS[2]  sentinel:<broker_id>   (no TTL: gone only when Redis lost data)
-- ARGV[1]  JSON blob (address, cores, started_at, connections); stored as given
-- ARGV[2]  ttl_ms: decimal integer, 1 to 15 digits, no leading zero
--
-- Returns "ok" after SET KEYS[1] ARGV[1] PX ttl_ms, or "new" when the sentinel was not there
-- (and sets it): Redis lost its keys since this broker id last wrote it (it restarted empty,
-- FLUSHALL, eviction), when what Redis kept of the sessions here may be gone and the sessions
-- parked here must go back; or the id is new. The liveness key's own absence would say less:
-- it also expires in a partition longer than its TTL, while Redis keeps the sessions, and
-- taking that for lost data counted commands Redis did keep as never kept (rekeep.lua).
-- Errors  "ERR fleetlink broker: ..." on malformed ARGV, before any write.

local ttl = ARGV[2]
if #ARGV ~= 2 or type(ttl) ~= 'string' or #ttl > 15 or not ttl:match('^[1-9]%d*$') then
  return redis.error_reply('ERR fleetlink broker: expected ARGV json, ttl_ms')
end
local had = redis.call('EXISTS', KEYS[2])
redis.call('SET', KEYS[1], ARGV[1], 'PX', ttl)
if had == 1 then
  return 'ok'
end
redis.call('SET', KEYS[2], '1')
return 'new'
