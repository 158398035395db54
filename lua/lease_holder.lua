-- lease_holder.lua: what offline_push.lua and offline_return.lua share, put in front of each
-- of them when they are built (src/registry/offline.rs), behind listening.lua, since a script
-- that Redis runs can call no other. Not a script of its own: it only defines two functions.
--
-- KEYS[1]  offline:<rig_id>, KEYS[2]  rig:<rig_id>, as in both scripts.

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
