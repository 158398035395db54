-- offline_return.lua: put commands back at the head of a rig's hold, in order (CONTRACT.md
-- section 5). A broker that took them at the rig's hello and cannot number them yet (the rig
-- has more held than its outbox takes) returns them here rather than keep them in its memory,
-- so a broker killed before the rig made room for them loses none; it takes them again as the
-- rig acks, and the rig's next hello, on any broker, finds them. Run by EVALSHA from
-- src/registry/offline.rs.
--
-- Built with lua/lease_holder.lua in front of it (listening, lease_holder, tell).
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
tell(holder, ttl)
return len
