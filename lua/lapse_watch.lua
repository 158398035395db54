-- lapse_watch.lua: names in `sess:lapses` the sessions of rigs that just left this broker with
-- commands unacked, so that they are reported `expired` as they lapse even if this broker
-- stops before then (lapse_sweep.lua; docs/protocol.md, "Sessions and resume"). Run by EVALSHA
-- from src/registry/sessions.rs, one call per batch of departures; built behind
-- lua/lapse_end.lua.
--
-- KEYS[1]  sess:lapses
-- ARGV[1]  in how many ms a session is first asked about: decimal, 1 to 15 digits
-- ARGV[2]  most sessions `sess:lapses` may name: decimal, 1 to 15 digits
-- ARGV[3]  broker_id of the broker they left
-- ARGV[4..] rig_id, boot_id per session
--
-- A session named already keeps its time (it was seen since, and is asked again nearer its new
-- end). Returns how many were not named because `sess:lapses` was full: those lapse unreported
-- unless this broker is still there to ask.

local delay, most, broker = ARGV[1], ARGV[2], ARGV[3]
if #KEYS ~= 1 or #ARGV < 5 or #ARGV % 2 ~= 1 or not count_text(delay)
    or not count_text(most) then
  return redis.error_reply('ERR fleetlink lapse_watch: expected KEYS lapses; ARGV delay_ms, most, broker_id, then rig_id, boot_id per session')
end
lapses_sound(KEYS[1])
local at, room = now_ms() + tonumber(delay), tonumber(most) - redis.call('ZCARD', KEYS[1])
local refused = 0
for i = 4, #ARGV, 2 do
  local member = lapse_member(ARGV[i], ARGV[i + 1], broker)
  if redis.call('ZSCORE', KEYS[1], member) then
    -- named already
  elseif room > 0 then
    redis.call('ZADD', KEYS[1], at, member)
    room = room - 1
  else
    refused = refused + 1
  end
end
return refused
