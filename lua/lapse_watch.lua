-- lapse_watch.lua: names in `sess:lapses` sessions holding commands, so that they are reported
-- `expired` as they lapse even if this broker stops before then (lapse_sweep.lua;
-- docs/protocol.md, "Sessions and resume"): those of rigs that just left this broker with
-- commands unacked, and a second after their connection's first command was kept (or they
-- resumed here with commands, or were put back after an outage) those of rigs connected here,
-- should this broker die with them on it. Run by EVALSHA from src/registry/lapse_scripts.rs,
-- one call per batch; built behind lua/lease_holder.lua and lua/lapse_end.lua.
--
-- KEYS[1]  sess:lapses
-- ARGV[1]  broker_id of the broker naming them (the one they left, or are connected to)
-- ARGV[2]  its --session-ttl, ms: decimal, 1 to 15 digits
-- ARGV[3]  "left" (rigs that left it: it writes its TTL into each session, "t") or "held"
--          (rigs connected to it: "t" only where the rig's lease is still its own)
-- ARGV[4..] rig_id, boot_id per session
--
-- A session named already keeps its time. Returns how many were not named because the set
-- was full: those lapse unreported unless this broker is still there to ask.

local broker, ttl, mode = ARGV[1], ARGV[2], ARGV[3]
if #KEYS ~= 1 or #ARGV < 5 or #ARGV % 2 ~= 1 or not count_text(ttl) or tonumber(ttl) < 1
    or (mode ~= 'left' and mode ~= 'held') then
  return redis.error_reply('ERR fleetlink lapse_watch: expected KEYS sess:lapses; ARGV broker_id, ttl_ms, left or held, then rig_id, boot_id per session')
end
lapses_sound(KEYS[1])
local refused = 0
for i = 4, #ARGV, 2 do
  if not lapse_name(KEYS[1], ARGV[i], ARGV[i + 1], tonumber(ttl), broker, mode == 'held') then
    refused = refused + 1
  end
end
return refused
