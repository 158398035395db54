-- broker.lua: this broker's liveness key (CONTRACT.md section 3, "broker:<broker_id>").
-- Run by EVALSHA from src/registry/scripts.rs every 10 s with a 30 s TTL; control counts the
-- live broker:* keys to know how many broadcast replies to expect.
--
-- KEYS[1]  broker:<broker_id>
-- KEYS[2]  sentinel:<broker_id>   (no TTL: gone only when Redis lost data)
-- ARGV[1]  JSON blob (address, cores, started_at, connections); stored as given
-- ARGV[2]  ttl_ms: decimal integer, 1 to 15 digits, no leading zero
-- ARGV[3]  optional: "start" on a process's first call (until one succeeds)
--
-- Returns "ok" after SET KEYS[1] ARGV[1] PX ttl_ms, or "new" when the sentinel was not there
-- (and sets it): Redis lost its keys since this broker id last wrote it (it restarted empty,
-- FLUSHALL, eviction), when what Redis kept of the sessions here may be gone and the sessions
-- parked here must go back; or the id is new. The liveness key's own absence would say less:
-- it also expires in a partition longer than its TTL, while Redis keeps the sessions, and
-- taking that for lost data counted commands Redis did keep as never kept (rekeep.lua).
-- With "start", "unclean" instead of "ok" when the sentinel does not say "clean": the last
-- process under this id did not exit cleanly (killed, or its drain could not release its
-- leases), so leases naming this id may be left over from it, holding rigs no process here
-- has. The broker sweeps them (stale_leases.lua). The sentinel then says "running" until a
-- clean exit writes "clean" (src/registry/fleet/writes.rs, `retire`); a sentinel an older
-- build wrote ("1") counts as unclean.
-- Errors  "ERR fleetlink broker: ..." on malformed ARGV, before any write.

local ttl = ARGV[2]
if (#ARGV ~= 2 and #ARGV ~= 3) or type(ttl) ~= 'string' or #ttl > 15
    or not ttl:match('^[1-9]%d*$') or (#ARGV == 3 and ARGV[3] ~= 'start') then
  return redis.error_reply('ERR fleetlink broker: expected ARGV json, ttl_ms[, "start"]')
end
local had = redis.call('GET', KEYS[2])
redis.call('SET', KEYS[1], ARGV[1], 'PX', ttl)
if had == false then
  redis.call('SET', KEYS[2], 'running')
  return 'new'
end
if ARGV[3] == 'start' then
  redis.call('SET', KEYS[2], 'running')
  if had ~= 'clean' then
    return 'unclean'
  end
end
return 'ok'
