-- stale_leases.lua: remove the leases a previous process of this broker id left behind
-- (CONTRACT.md section 3, "rig:<rig_id>"). Run by EVALSHA from src/registry/fleet/sweep.rs
-- over the keys of one SCAN step, once broker.lua said "unclean" at this process's start.
--
-- A process killed outright leaves its rigs' leases to lapse by --registry-ttl. Restarted under
-- the same id before then, it listens on its channel again, so the leases read as rigs
-- connected to a live broker: `fleetctl status` and `list` name it, and other brokers answer
-- a command for such a rig `rig_not_connected` rather than hold it for the rig's return.
-- The caller leaves out every rig this process holds (connected or parked), all of whose
-- leases it wrote itself; any other lease naming this id is its predecessor's.
--
-- KEYS[i]  rig:<rig_id>
-- ARGV[1]  this broker's id
--
-- Returns { key1, lease1, key2, lease2, ... }: the leases removed, with what they held, so
-- that the broker publishes a `disconnected` for each rig (its predecessor, killed, could not).

local removed = {}
for _, key in ipairs(KEYS) do
  -- pcall: a key of another type under rig:* is none of ours to judge.
  local lease = redis.pcall('GET', key)
  if type(lease) == 'string' and string.match(lease, '^[^|]*|(.+)$') == ARGV[1] then
    redis.call('DEL', key)
    removed[#removed + 1] = key
    removed[#removed + 1] = lease
  end
end
return removed
