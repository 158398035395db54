-- offline_push.lua: hold a command for a rig that is not connected (CONTRACT.md section 5),
-- bounded per rig. Run by EVALSHA from src/registry/offline.rs.
--
-- Built with lua/lease_holder.lua in front of it (listening, lease_holder, tell).
--
-- KEYS[1]  offline:<rig_id>   (list of command entries, oldest first)
-- KEYS[2]  rig:<rig_id>       (the rig's lease)
-- ARGV[1]  the entry: JSON {"id","name","args","deadline_ms","reply_to"}
-- ARGV[2]  max entries per rig: decimal integer
-- ARGV[3]  ttl_ms for the list: decimal integer, 1 to 15 digits (the latest deadline, plus a
--          margin so the holding broker still finds the entry to report it expired)
-- ARGV[4]  the calling broker's id
--
-- Returns the list length after the push (or as it was, when the same entry is held already:
-- nothing written), or 0 when the list was full (nothing written), or
-- the id of another, live broker whose lease holds the rig (nothing written): the rig is
-- connected there, not offline, and a command held now would wait for its next hello. Checked
-- here, in the call that would write, so a hello landing between control's look-up of the
-- lease and this push cannot strand the command. A lease naming a broker that is not
-- listening, its broker:<id> key lapsed or nothing subscribed to its channel, is a dead
-- broker's (or one reconnecting to Redis): the command is held, and the rig is named in the
-- set offline:for:<holder>, which that broker reads at each refresh in case it still holds the
-- rig. Answered with the dead broker's id instead, control could only send the command again
-- until the key lapsed, 30 s later.
-- The lease's holder is checked through broker:<holder> and its channel, and told through
-- offline:for:<holder>, keys derived here, not passed in KEYS (single-instance Redis; not
-- cluster-safe, like resume.lua's).

local max, ttl = tonumber(ARGV[2]), ARGV[3]
-- ttl at most 15 digits, so that PEXPIRE takes it: refused after the RPUSH, it would leave the
-- list without a TTL for good.
if #KEYS ~= 2 or #ARGV ~= 4 or not max or type(ttl) ~= 'string' or #ttl > 15
    or not ttl:match('^[1-9]%d*$') then
  return redis.error_reply('ERR fleetlink offline_push: expected KEYS list, lease; ARGV entry, max, ttl_ms, broker_id')
end
local holder, listening = lease_holder(ARGV[4])
if listening then
  return holder
end
local len = redis.call('LLEN', KEYS[1])
-- The same entry, byte for byte (its id, args and deadline), is held already: a push whose
-- answer the broker never got (Redis hung past its wait) ran, and the broker, holding the
-- command itself meanwhile, pushes it again once Redis is back. Held once, or it would reach
-- the rig twice, under two seqs. LPOS needs Redis 6.0.6; before it, the list is scanned.
local found = redis.pcall('LPOS', KEYS[1], ARGV[1])
if type(found) == 'table' and found.err then
  found = false
  for _, e in ipairs(redis.call('LRANGE', KEYS[1], 0, -1)) do
    if e == ARGV[1] then
      found = true
      break
    end
  end
end
if found then
  tell(holder, ttl)
  return len
end
if len >= max then
  return 0
end
len = redis.call('RPUSH', KEYS[1], ARGV[1])
local current = redis.call('PTTL', KEYS[1])
if current < tonumber(ttl) then
  redis.call('PEXPIRE', KEYS[1], ttl)
end
tell(holder, ttl)
return len
