-- before_event.lua: put in front of the scripts that publish events (a script can call no
-- other), where they call `before_event()` ahead of each PUBLISH.
--
-- A full Redis (maxmemory with noeviction) refuses a script's first write that may grow
-- memory, yet runs what comes before it: an event published ahead of that write went out, and
-- went out again with every retry of the refused call (review bb115: one rig_rebooted report
-- 274 times). This write of nothing (XX: the key never exists, as no rig or broker id holds a
-- space) is refused the same way, before anything is published; once it or any other write is
-- let through, Redis lets the rest of the call's writes through too. Once per call.

local probed = false
local function before_event()
  if not probed then
    redis.call('SET', 'broker:fleetlink probe', '', 'XX')
    probed = true
  end
end

