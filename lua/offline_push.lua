-- offline_push.lua: hold a command for a rig that is not connected (CONTRACT.md section 5),
-- bounded per rig. Run by EVALSHA from src/registry/offline.rs.
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
  tell(holder)
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
tell(holder)
return len
