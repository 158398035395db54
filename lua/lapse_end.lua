-- lapse_end.lua: what session_lapse.lua, lapse_watch.lua and lapse_sweep.lua share, put in
-- front of each when they are built (src/registry/sessions.rs), since a script that Redis runs
-- can call no other. Not a script of its own: it only defines functions.
--
-- A rig that left with commands unacked is named in the sorted set `sess:lapses`, scored by when
-- its session should first be asked about (Redis's clock, ms), as "<boot_id>|<rig_id>|<broker_id>"
-- (a rig_id has no '|', a boot_id is 36 characters): the broker it left asks on time; any
-- other asks for it once that broker has stopped (it died, or drained and exited), or a while
-- after it should have.

-- Damage: a key of another type where the set belongs (nothing of ours writes one) would fail
-- every call, every time. It goes, as persist.lua drops a damaged session.
local function lapses_sound(set)
  local t = redis.call('TYPE', set).ok
  if t ~= 'zset' and t ~= 'none' then
    redis.log(redis.LOG_WARNING, 'fleetlink: ' .. set .. ' was not a sorted set; deleted')
    redis.call('DEL', set)
  end
end

-- Redis's clock in ms: every broker's scores count on the one clock.
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local function lapse_member(rig, boot, broker)
  return boot .. '|' .. rig .. '|' .. broker
end

-- rig, boot, broker of a member, or nil for one no broker wrote.
local function lapse_parts(member)
  local boot, rig, broker = string.match(member, '^(' .. string.rep('[0-9a-f-]', 36)
      .. ')|([%w._-]+)|(.+)$')
  return rig, boot, broker
end

-- What becomes of session (rig, boot) asked about as it nears its end, by `broker` (named in
-- the events, stamped `at`):
--   -1     nothing to do: no session, one a newer boot ended (reported then), or the rig is
--          connected again with this boot (whichever broker it leaves next watches it again)
--   {ms}   more than `near` ms left (the rig was seen since): ask again then
--   n      it was within `near` of its end: its n unacked commands are published `expired`
--          and removed from it, in this call, so a reply lost on its way back cannot lose
--          them. It keeps its "next": the same boot coming back in its last moments goes on
--          without reusing a seq.
local function lapse_end(rig, boot, broker, at, near)
  local sess, lease_key = 'sess:' .. rig .. ':' .. boot, 'rig:' .. rig
  if redis.call('TYPE', sess).ok ~= 'hash' or redis.call('HEXISTS', sess, 'gone') == 1 then
    return -1
  end
  local lease = redis.pcall('GET', lease_key)
  if type(lease) == 'string' and lease:sub(1, #boot + 1) == boot .. '|' then
    return -1
  end
  local left = redis.call('PTTL', sess)
  if left < 0 then
    return -1
  end
  if left > near then
    return { left }
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
    redis.call('PUBLISH', 'fleetlink:events', '{"type":"expired","rig_id":' .. cjson.encode(rig)
        .. ',"boot_id":' .. cjson.encode(boot) .. ',"seq":' .. c.seq .. ',"id":'
        .. (id and cjson.encode(id) or 'null') .. ',"broker_id":' .. cjson.encode(broker)
        .. ',"at":' .. cjson.encode(at) .. ',"detail":'
        .. cjson.encode('its rig stayed away longer than its session is kept (--session-ttl) and never acked it; the rig may have run it')
        .. '}')
    redis.call('HDEL', sess, c.field)
  end
  return #order
end

-- After lapse_end answered `r` for `member`: ended (or nothing to do), it is no longer
-- watched; seen since, it is asked about again `before` ms ahead of its new end (named again
-- if another broker's sweep took it out meanwhile: the broker asking still watches it).
local function lapse_settle(set, member, r, before)
  if type(r) == 'table' then
    redis.call('ZADD', set, now_ms() + math.max(r[1] - before, 0), member)
  else
    redis.call('ZREM', set, member)
  end
end

-- Whether `s` is a count as the brokers send them: decimal digits, 1 to 15 of them.
local function count_text(s)
  return type(s) == 'string' and #s <= 15 and s:match('^%d+$') ~= nil
end
