-- lapse_sweep.lua: asks about the sessions named in `sess:lapses` (lapse_end.lua) that are
-- due, whoever named them, so that a session is reported `expired` as it lapses, once, even
-- when the broker the rig left died or drained before then, or the rig was still connected to
-- a broker that died. Run by EVALSHA from src/registry/lapse_scripts.rs by every broker, up to
-- ten times a second; built behind lua/lease_holder.lua and lua/lapse_end.lua.
--
-- A session comes due here a little after the broker the rig left asks about it by itself
-- (lapse_score): a sweep asks only for a broker that did not (it stopped, is stuck, or cannot
-- reach Redis though this one can). Each is judged by the TTL its session now lives by
-- (lapse_ttl), else by the one its entry names, not by the caller's.
--
-- KEYS[1]  sess:lapses
-- ARGV[1]  broker_id of the caller (named in the events)
-- ARGV[2]  the events' "at": the caller's clock, RFC 3339
-- ARGV[3]  most entries asked about in this call: decimal, 1 to 15 digits
--
-- Returns { asked, missed, next, rig_id, boot_id, reported, named_by, ... }: how many due
-- entries it asked about (as many as ARGV[3]: call again), how many of those had lapsed
-- unreported already, in how many ms the next entry is due (-1: none; sessions of other
-- brokers' TTLs come due on their own times, which the caller's sweep must not miss), then
-- each session it reported commands of.

local me, at, most = ARGV[1], ARGV[2], ARGV[3]
if #KEYS ~= 1 or #ARGV ~= 3 or not count_text(most) or tonumber(most) < 1 then
  return redis.error_reply('ERR fleetlink lapse_sweep: expected KEYS sess:lapses; ARGV broker_id, at, most')
end
lapses_sound(KEYS[1])
local now = now_ms()
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, tonumber(most))
local out = { #due, 0, -1 }
for _, member in ipairs(due) do
  local rig, boot, ttl, owner = lapse_parts(member)
  if not rig then
    redis.call('ZREM', KEYS[1], member)
  else
    local r, judged = lapse_end(rig, boot, me, at, ttl)
    lapse_settle(KEYS[1], member, r, judged)
    if r == -2 then
      out[2] = out[2] + 1
    elseif type(r) == 'number' and r > 0 then
      out[#out + 1] = rig
      out[#out + 1] = boot
      out[#out + 1] = r
      out[#out + 1] = owner
    end
  end
end
local first = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
if first[2] then
  out[3] = math.max(tonumber(first[2]) - now, 0)
end
return out
