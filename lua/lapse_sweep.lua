-- lapse_sweep.lua: asks, for brokers that are no longer there to ask, about the sessions they
-- named in `sess:lapses` (lapse_watch.lua), so that a rig that left a broker which then died or
-- drained still has its unacked commands reported `expired` as its session lapses, once.
-- Run by EVALSHA from src/registry/sessions.rs by every broker, a few times a second at most;
-- built behind lua/lease_holder.lua and lua/lapse_end.lua.
--
-- A due entry is another broker's to ask while that broker is listening (lease_holder.lua's
-- `listening`), unless it is more than the grace overdue (that broker is stuck, or cannot
-- reach Redis though this one can); this broker's own entries are asked about once they are
-- the grace overdue (it restarted under the same --broker-id, and lost its own watch).
--
-- KEYS[1]  sess:lapses
-- ARGV[1]  broker_id of the caller (named in the events)
-- ARGV[2]  the events' "at": the caller's clock, RFC 3339
-- ARGV[3]  near_ms, ARGV[4] before_ms: as in session_lapse.lua
-- ARGV[5]  grace_ms
-- ARGV[6]  most entries looked at in this call
--
-- Returns { looked, asked, rig_id, boot_id, reported, owner, ... }: how many due entries it
-- looked at, how many of those it asked about (each then left the due ones: worth calling
-- again when it looked at ARGV[6] and asked about some), then each session it reported
-- commands of.

local me, at, near, before, grace, most = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6]
if #KEYS ~= 1 or #ARGV ~= 6 or not count_text(near) or tonumber(near) < 1
    or not count_text(before) or not count_text(grace) or not count_text(most)
    or tonumber(most) < 1 then
  return redis.error_reply('ERR fleetlink lapse_sweep: expected KEYS lapses; ARGV broker_id, at, near_ms, before_ms, grace_ms, most')
end
lapses_sound(KEYS[1])
local now = now_ms()
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'WITHSCORES', 'LIMIT', 0, tonumber(most))
local out, asked = { #due / 2, 0 }, 0
for i = 1, #due, 2 do
  local member, score = due[i], tonumber(due[i + 1])
  local rig, boot, owner = lapse_parts(member)
  if not rig then
    asked = asked + 1
    redis.call('ZREM', KEYS[1], member)
  elseif score + tonumber(grace) <= now or (owner ~= me and not listening(owner)) then
    asked = asked + 1
    local r = lapse_end(rig, boot, me, at, tonumber(near))
    lapse_settle(KEYS[1], member, r, tonumber(before))
    if type(r) == 'number' and r > 0 then
      out[#out + 1] = rig
      out[#out + 1] = boot
      out[#out + 1] = r
      out[#out + 1] = owner
    end
  end
end
out[2] = asked
return out
