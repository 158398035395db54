-- lease_holder.lua: what offline_push.lua and offline_return.lua share, put in front of each
-- of them when they are built (src/registry/offline.rs), since a script that Redis runs can
-- call no other. Not a script of its own: it only defines functions.
--
-- KEYS[1]  offline:<rig_id>, KEYS[2]  rig:<rig_id>, as in both scripts.

-- Whether broker `id` is alive and listening: its broker:<id> key is there (it lapses 30 s
-- after a broker dies) and something subscribes to its channel (nothing does for a broker that
-- died, or for one reconnecting to Redis). Where a Redis refuses PUBSUB in scripts, the key
-- alone decides.
local function listening(id)
  if redis.call('EXISTS', 'broker:' .. id) ~= 1 then
    return false
  end
  local subs = redis.pcall('PUBSUB', 'NUMSUB', 'fleetlink:broker:' .. id)
  return type(subs) ~= 'table' or subs.err ~= nil or tonumber(subs[2]) ~= 0
end

-- The broker the rig's lease names, when it is another one, and whether it is listening.
local function lease_holder(me)
  local lease = redis.call('GET', KEYS[2])
  local holder = lease and string.match(lease, '^[^|]*|(.+)$')
  if not holder or holder == me then
    return nil, false
  end
  return holder, listening(holder)
end

-- Held for a rig whose lease names a broker that is not listening: should that broker still
-- hold the rig (it was reconnecting to Redis), it finds the rig in offline:for:<broker> at its
-- next refresh and has its connection take them; otherwise the rig's next hello does.
local function tell(holder, ttl)
  if holder then
    local set = 'offline:for:' .. holder
    redis.call('SADD', set, string.sub(KEYS[1], #'offline:' + 1))
    if redis.call('PTTL', set) < tonumber(ttl) then
      redis.call('PEXPIRE', set, ttl)
    end
  end
end
