-- session_lapse.lua: what becomes of a session whose rig left with commands unacked, asked by
-- the broker it left as the session nears the end of its --session-ttl (CONTRACT.md section 5;
-- docs/protocol.md, "Sessions and resume"). Run by EVALSHA from src/registry/lapse_scripts.rs.
--
-- Redis would drop the session at its TTL, and with it the only record of those commands:
-- neither a resume (the same boot) nor a report (a new boot, rig_rebooted) would ever come, and
-- control, told `ok`, would hear nothing more. So, just before, they are published here as
-- `expired`, as standalone reports its own sessions (lapse_end in lua/lapse_end.lua, which is
-- built in front of this script, behind lua/lease_holder.lua). The session's entry in
-- `sess:lapses` follows the answer, so that no sweep asks for it while this broker does.
--
-- KEYS[1]  sess:lapses   the sessions watched (see lapse_end.lua)
-- ARGV[1]  rig_id
-- ARGV[2]  boot_id
-- ARGV[3]  broker_id (named in the events, and the entry's)
-- ARGV[4]  the events' "at": the broker's clock, RFC 3339
-- ARGV[5]  the broker's --session-ttl, ms: decimal, 1 to 15 digits
--
-- Returns lapse_end's answer: -2, -1, {ms left, 1}, {ms left}, or how many it reported.

local rig, boot, broker, at, ttl = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5]
if #KEYS ~= 1 or #ARGV ~= 5 or not count_text(ttl) or tonumber(ttl) < 1 then
  return redis.error_reply('ERR fleetlink session_lapse: expected KEYS sess:lapses; ARGV rig_id, boot_id, broker_id, at, ttl_ms')
end
lapses_sound(KEYS[1])
ttl = tonumber(ttl)
local r, judged = lapse_end(rig, boot, broker, at, ttl)
lapse_settle(KEYS[1], lapse_member(rig, boot, ttl, broker), r, judged)
return r
