-- session_lapse.lua: what becomes of a session whose rig left with commands unacked, asked by
-- the broker it left as the session nears the end of its --session-ttl (CONTRACT.md section 5;
-- docs/protocol.md, "Sessions and resume"). Run by EVALSHA from src/registry/sessions.rs.
--
-- Redis would drop the session at its TTL, and with it the only record of those commands:
-- neither a resume (the same boot) nor a report (a new boot, rig_rebooted) would ever come, and
-- control, told `ok`, would hear nothing more. So, just before, they are published here as
-- `expired`, as standalone reports its own sessions, and removed from the session, which keeps
-- its "next" (the same boot coming back in its last moments goes on without reusing a seq).
-- Published here, in the call that removes them, a reply lost on its way back cannot lose them.
--
-- KEYS[1]  sess:<rig_id>:<boot_id>   the session
-- KEYS[2]  rig:<rig_id>              the rig's lease
-- ARGV[1]  rig_id
-- ARGV[2]  boot_id
-- ARGV[3]  broker_id (named in the events)
-- ARGV[4]  the events' "at": the broker's clock, RFC 3339
-- ARGV[5]  how near its end the session must be to be ended now, ms: decimal, 1 to 15 digits
--
-- Returns -1 when there is nothing to do: no session, one a newer boot ended (reported then),
-- or the rig is connected again with this boot (whichever broker it leaves next asks again);
-- {ms} when the session has more than ARGV[5] ms left (it was seen since: ask again then);
-- else how many commands it reported.

local rig, boot, broker, at, near = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5]
if #KEYS ~= 2 or #ARGV ~= 5 or type(near) ~= 'string' or #near > 15
    or not near:match('^[1-9]%d*$') then
  return redis.error_reply('ERR fleetlink session_lapse: expected KEYS session, lease; ARGV rig_id, boot_id, broker_id, at, near_ms')
end
if redis.call('TYPE', KEYS[1]).ok ~= 'hash' or redis.call('HEXISTS', KEYS[1], 'gone') == 1 then
  return -1
end
local lease = redis.pcall('GET', KEYS[2])
if type(lease) == 'string' and lease:sub(1, #boot + 1) == boot .. '|' then
  return -1
end
local left = redis.call('PTTL', KEYS[1])
if left < 0 then
  return -1
end
if left > tonumber(near) then
  return { left }
end
local all = redis.call('HGETALL', KEYS[1])
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
  redis.call('HDEL', KEYS[1], c.field)
end
return #order
