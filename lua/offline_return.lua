-- offline_return.lua: put commands back at the head of a rig's hold, in order (CONTRACT.md
-- section 5). A broker that took them at the rig's hello and cannot number them yet (the rig
-- has more held than its outbox takes) returns them here rather than keep them in its memory,
-- so a broker killed before the rig made room for them loses none; it takes them again as the
-- rig acks, and the rig's next hello, on any broker, finds them. Run by EVALSHA from
-- src/registry/offline.rs.
--
-- KEYS[1]  offline:<rig_id>   (list of command entries, oldest first)
-- KEYS[2]  rig:<rig_id>       (the rig's lease)
-- ARGV[1]  ttl_ms for the list: decimal integer, 1 to 15 digits (their latest deadline plus
--          the margin offline_push.lua keeps); the list's TTL is only ever lengthened
-- ARGV[2]  the calling broker's id
-- ARGV[3..] the entries, oldest first
--
-- No per-rig bound: each was counted when it was first held. Returns the list's length, or,
-- writing nothing, the id of another live broker whose lease holds the rig: the rig moved
-- there (its connection here closed, or was superseded), and its connection there took the
-- hold at its hello; put back, these would wait for the rig's next hello. The caller hands
-- them to that broker instead. Checked as offline_push.lua checks, through broker:<holder> and
-- its channel: handed to a broker nobody hears on its channel, they would be lost, so they
-- are put back and that broker told through offline:for:<holder>, as offline_push.lua tells it.

local ttl = ARGV[1]
if #KEYS ~= 2 or #ARGV < 3 or type(ttl) ~= 'string' or #ttl > 15
    or not ttl:match('^[1-9]%d*$') then
  return redis.error_reply('ERR fleetlink offline_return: expected KEYS list, lease; ARGV ttl_ms, broker_id, entries')
end
-- The broker the rig's lease names, when it is another one, and whether it is listening: its
-- broker:<id> key is there (it lapses 30 s after a broker dies) and something subscribes to its
-- channel (nothing does for a broker that died, or for one reconnecting to Redis). Where a
-- Redis refuses PUBSUB in scripts, the key alone decides.
local function lease_holder(me)
  local lease = redis.call('GET', KEYS[2])
  local holder = lease and string.match(lease, '^[^|]*|(.+)$')
  if not holder or holder == me then
    return nil, false
  end
  if redis.call('EXISTS', 'broker:' .. holder) ~= 1 then
    return holder, false
  end
  local subs = redis.pcall('PUBSUB', 'NUMSUB', 'fleetlink:broker:' .. holder)
  return holder, type(subs) ~= 'table' or subs.err ~= nil or tonumber(subs[2]) ~= 0
end

-- Held for a rig whose lease names a broker that is not listening: should that broker still
-- hold the rig (it was reconnecting to Redis), it finds the rig in offline:for:<broker> at its
-- next refresh and has its connection take them; otherwise the rig's next hello does.
local function tell(holder)
  if holder then
    local set = 'offline:for:' .. holder
    redis.call('SADD', set, string.sub(KEYS[1], #'offline:' + 1))
    if redis.call('PTTL', set) < tonumber(ttl) then
      redis.call('PEXPIRE', set, ttl)
    end
  end
end

local holder, listening = lease_holder(ARGV[2])
if listening then
  return holder
end
local len = 0
for i = #ARGV, 3, -1 do
  len = redis.call('LPUSH', KEYS[1], ARGV[i])
end
if redis.call('PTTL', KEYS[1]) < tonumber(ttl) then
  redis.call('PEXPIRE', KEYS[1], ttl)
end
tell(holder)
return len
