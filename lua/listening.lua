-- listening.lua: whether a broker is alive and listening, for the scripts that decide by it
-- (through lease_holder.lua): put in front of each when it is built (src/registry/offline.rs),
-- since a script Redis runs can call no other. Not a script of its own: it only defines one
-- function.

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
