-- lapse_end.lua: what the scripts watching sessions share (session_lapse.lua, lapse_watch.lua,
-- lapse_sweep.lua), put in front of each when they are built (src/registry/lapse_scripts.rs),
-- behind lua/before_event.lua and lua/lease_holder.lua, since a script that Redis runs can call
-- no other. Not a script of its own: it only defines functions.
--
-- A session holding commands unacked is named in the sorted set `sess:lapses` as
-- "<boot_id>|<ttl_ms>|<rig_id>|<broker_id>" (a boot_id is 36 characters, a rig_id has no '|'):
-- the broker that kept the commands, and the --session-ttl it keeps sessions for, which sets
-- when the session is asked about. Its score (Redis's clock, ms) is when any broker's sweep may
-- ask about it: a little after the broker the rig left asks by itself, so that a session
-- whose broker stopped (killed, or drained and exited) is still reported as it lapses, and a
-- session whose rig is still connected to a broker that dies too.

-- Most sessions named at once, for every broker together: past it a session is not named,
-- and only the broker it left can report it.
local LAPSES_MOST = 1000000

-- Whether `s` is a count as the brokers send them: decimal digits, 1 to 15 of them.
local function count_text(s)
  return type(s) == 'string' and #s <= 15 and s:match('^%d+$') ~= nil
end

-- Damage: a key of another type where the set belongs (nothing of ours writes one) would fail
-- every call, every time. It goes, as persist.lua drops a damaged session.
local function lapses_sound(set)
  local t = redis.call('TYPE', set).ok
  if t ~= 'zset' and t ~= 'none' then
    redis.log(redis.LOG_WARNING, 'fleetlink: ' .. set .. ' was not a sorted set; deleted')
    redis.call('DEL', set)
  end
end

-- Redis's clock in ms: every broker's scores count on the one clock. (Redis 5 and later
-- replicate a script by its effects, so a script may read the clock and then write.)
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- For a session kept `ttl` ms: how near its end it is ended (a tenth, 100 ms to 30 s), how
-- long before its end the broker the rig left asks, and how much later a sweep may (as
-- src/registry/bridge/lapses.rs reckons them).
local function lapse_timing(ttl)
  local near = math.min(math.max(math.floor(ttl / 10), 100), 30000)
  return near, math.floor(near * 2 / 3), math.floor(near / 3)
end

local function lapse_member(rig, boot, ttl, broker)
  return boot .. '|' .. ttl .. '|' .. rig .. '|' .. broker
end

-- rig, boot, ttl (a number), broker of a member, or nil for one no broker wrote.
local function lapse_parts(member)
  local boot, ttl, rig, broker = string.match(member, '^(' .. string.rep('[0-9a-f-]', 36)
      .. ')|(%d+)|([%w._-]+)|(.+)$')
  if not boot or #ttl > 15 then
    return nil
  end
  return rig, boot, tonumber(ttl), broker
end

-- When a sweep may ask about a session with `left` ms to live, kept `ttl` ms.
local function lapse_score(left, ttl)
  local _, before, grace = lapse_timing(ttl)
  return now_ms() + math.max(left - before, 0) + grace
end

-- Writes into session `sess`, when Redis has it, the TTL its broker now keeps it for (see
-- lapse_ttl).
local function lapse_mark_ttl(sess, ttl)
  if redis.call('TYPE', sess).ok == 'hash' then
    redis.call('HSET', sess, 't', ttl)
  end
end

-- Names session (rig, boot), kept `ttl` ms by `broker`, unless it is named already (it keeps
-- its time) or the set is full (false). A departure's broker is the last to hold the rig, and
-- writes its TTL into the session; a connected rig's (`held`) only while the lease is still
-- its own: one named late, after the rig moved on, must not put its TTL over the TTL of the
-- broker the rig moved to (which would have the session reported early, or late).
local function lapse_name(set, rig, boot, ttl, broker, held)
  local member, sess = lapse_member(rig, boot, ttl, broker), 'sess:' .. rig .. ':' .. boot
  if not held or redis.call('GET', 'rig:' .. rig) == boot .. '|' .. broker then
    lapse_mark_ttl(sess, ttl)
  end
  if redis.call('ZSCORE', set, member) then
    return true
  end
  if redis.call('ZCARD', set) >= LAPSES_MOST then
    return false
  end
  local left = redis.call('PTTL', sess)
  if left < 0 then
    left = ttl
  end
  redis.call('ZADD', set, lapse_score(left, ttl), member)
  return true
end

local function has_unacked(sess)
  for _, field in ipairs(redis.call('HKEYS', sess)) do
    if field:sub(1, 2) == 'c:' then
      return true
    end
  end
  return false
end

-- The TTL the session now lives by: the one its last broker wrote into it ("t", as the rig
-- left it or as it named it with a command), which can be shorter than the TTL of the broker
-- that named an entry (a broker restarted with a shorter --session-ttl, or the rig moved to
-- one); `ttl` (the entry's) for a session without one.
local function lapse_ttl(sess, ttl)
  local t = redis.pcall('HGET', sess, 't')
  if type(t) == 'string' and count_text(t) and tonumber(t) >= 1 then
    return tonumber(t)
  end
  return ttl
end

-- What becomes of session (rig, boot) asked about as it nears its end, by `broker` (named in
-- the events, stamped `at`), kept `ttl` ms by the broker that named it (see lapse_ttl); the
-- answer, then the TTL it was judged by:
--   -2       no session: it lapsed (or Redis lost it) before anyone asked, unreported
--   -1       nothing left to watch: no command unacked (and the rig not connected), or a newer
--            boot ended it (reported then)
--   {ms, 1}  the rig is connected with this boot, through a broker that is there: asked again
--            by a sweep as its new end nears, whether or not it holds commands now (that
--            broker may die with the rig on it; it named the session once, a second after
--            the connection's first command, and counts on it staying named). Not within
--            `near` of its end: a broker holding the rig extends the session every third of
--            its TTL, so one that got this near is held by no one, whatever the lease says (a
--            dead connection's lease outlives a shorter session, and its broker, restarted
--            under the same id, listens again); it is judged as a rig that left
--   {ms}     more than `near` left (the rig was seen since): ask again then
--   n        it was within `near` of its end: its n unacked commands are published `expired`
--            and removed from it, in this call, so a reply lost on its way back cannot lose
--            them. It keeps its "next": the same boot coming back in its last moments goes on
--            without reusing a seq.
local function lapse_end(rig, boot, broker, at, ttl)
  local sess = 'sess:' .. rig .. ':' .. boot
  local kind = redis.call('TYPE', sess).ok
  if kind == 'none' then
    return -2, ttl
  end
  if kind ~= 'hash' or redis.call('HEXISTS', sess, 'gone') == 1 then
    return -1, ttl
  end
  ttl = lapse_ttl(sess, ttl)
  local left = redis.call('PTTL', sess)
  if left < 0 then
    return -1, ttl
  end
  local near = lapse_timing(ttl)
  local lease = redis.pcall('GET', 'rig:' .. rig)
  if left > near and type(lease) == 'string' and lease:sub(1, #boot + 1) == boot .. '|'
      and listening(lease:sub(#boot + 2)) then
    return { left, 1 }, ttl
  end
  if not has_unacked(sess) then
    return -1, ttl
  end
  if left > near then
    return { left }, ttl
  end
  local all = redis.call('HGETALL', sess)
  local order = {}
  for i = 1, #all, 2 do
    local field = all[i]
    local seq = field:sub(1, 2) == 'c:' and field:sub(3) or nil
    if seq and #seq <= 15 and seq:match('^[1-9]%d*$') then
      order[#order + 1] = { seq = seq, json = all[i + 1], field = field }
    end
  end
  -- Seqs compare as digit strings: shorter first, then by text (cjson would round big ones).
  table.sort(order, function(a, b)
    if #a.seq ~= #b.seq then
      return #a.seq < #b.seq
    end
    return a.seq < b.seq
  end)
  for _, c in ipairs(order) do
    local decoded, cmd = pcall(cjson.decode, c.json)
    local id = (decoded and type(cmd) == 'table' and type(cmd.id) == 'string') and cmd.id or nil
    before_event()
    redis.call('PUBLISH', 'fleetlink:events', '{"type":"expired","rig_id":' .. cjson.encode(rig)
        .. ',"boot_id":' .. cjson.encode(boot) .. ',"seq":' .. c.seq .. ',"id":'
        .. (id and cjson.encode(id) or 'null') .. ',"broker_id":' .. cjson.encode(broker)
        .. ',"at":' .. cjson.encode(at) .. ',"detail":'
        -- Not "the rig stayed away": a broker cut off from Redis for the session's last tenth
        -- cannot renew it either, with its rig connected, and the rig's ack may follow.
        .. cjson.encode('no broker renewed its session within --session-ttl (its rig stayed away, or the broker holding it could not reach Redis) and no ack of it reached Redis; the rig may have run it, and an ack may still follow')
        .. '}')
    redis.call('HDEL', sess, c.field)
  end
  return #order, ttl
end

-- After lapse_end answered `r` for `member` (a session kept `ttl` ms): one still to watch is
-- asked about again by a sweep as its new end nears, named again if another broker's sweep
-- took it out meanwhile; any other is no longer watched.
local function lapse_settle(set, member, r, ttl)
  if type(r) == 'table' then
    redis.call('ZADD', set, lapse_score(r[1], ttl), member)
  else
    redis.call('ZREM', set, member)
  end
end

