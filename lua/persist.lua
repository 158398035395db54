-- persist.lua: keep commands of rig sessions until the rig acks them (CONTRACT.md section 5),
-- fenced by ownership: a broker that no longer owns the rig cannot add to its session.
-- Run by EVALSHA from src/registry/sessions.rs, one batch per call.
--
-- KEYS[2i-1]  rig:<rig_id>                 (the lease, read only)
-- KEYS[2i]    sess:<rig_id>:<boot_id>      (hash: "next" -> next seq, "c:<seq>" -> command JSON,
--                                           "from" -> the first seq Redis numbered)
-- ARGV[1]     ttl_ms of session keys: decimal integer, 1 to 15 digits
-- ARGV[3i-1]  "<boot_id>|<broker_id>": this broker's lease tuple for that rig
-- ARGV[3i]    seq: decimal integer
-- ARGV[3i+1]  the command's JSON, exactly as sent to the rig
--
-- Nothing here names the session in `sess:lapses` (for its lapse report should the broker die
-- with the rig on it): the broker does that a second after a connection's first command is
-- kept, with lapse_watch.lua, so that a fan-out's keeps do not wait behind the names (a name
-- costs Redis about as much as the rest of the keep; src/registry/bridge/lapses.rs).
--
-- Returns an array of statuses, one per command in order:
--   "ok"      the lease is still ours: HSET c:<seq> and "next" = seq+1
--   "created" the same, but that HSET created the key, so it gets its PEXPIRE here: Redis had
--             no session for a rig whose broker holds it (the key was deleted or evicted on
--             its own, or lapsed with the rig connected and given nothing). The broker puts
--             its copy of the session back (rekeep.lua), or the commands only the lost key
--             held would be lost at the broker's death without a report. The tokio baseline,
--             which creates its sessions here, reads it as "ok".
--   "fenced"  the lease is someone else's: nothing written; the broker drops the command and
--             tells control, which never got an ok for it
--   "stale|<n>" the lease is ours, but the session's "next" is already n, above this seq:
--             another broker gave the rig commands under this session while this one could
--             not reach Redis (each deciding alone). Nothing written; the broker refuses the
--             command (control may send it again) and numbers the rig's next one from n.
--             A broker's own commands never meet this: it puts its session back with "next"
--             no higher than its first command still on its way here (sessions.rs)
--   "missing" there is no lease (Redis lost it: evicted, flushed, restarted empty): nothing
--             written; a broker that still holds the rig puts its lease back (refresh.lua)
--             and sends the command again, one that does not drops it as fenced
-- Errors "ERR fleetlink persist: ..." on malformed ARGV, before any write.
--
-- "next" is set, not raised: one broker's commands for a session arrive here in seq order
-- (its core numbers them, its bridge sends them in order), and a broker that lost the rig is
-- fenced out, so seq+1 is always the highest. Two calls per command keep a 10,000-command
-- burst cheap for Redis. A command does not restart the session's TTL: the broker holding the
-- rig extends it a few times per TTL and sets it afresh at the disconnect (sessions.rs,
-- `touch`), which is what keeps a session alive; a PEXPIRE per command cost Redis a third of
-- this script's calls for nothing more.

local ttl = ARGV[1]
if #KEYS % 2 ~= 0 or #ARGV ~= 1 + 3 * (#KEYS / 2) or type(ttl) ~= 'string' or #ttl > 15
    or not ttl:match('^[1-9]%d*$') then
  return redis.error_reply('ERR fleetlink persist: expected pairs of keys and ttl_ms, then tuple, seq, json per pair')
end
local n = #KEYS / 2
local seqs = {}
for i = 1, n do
  local seq = ARGV[3 * i]
  if #seq > 15 or not seq:match('^%d+$') then
    return redis.error_reply('ERR fleetlink persist: seq must be a decimal integer')
  end
  seqs[i] = tonumber(seq)
end

local out = {}
for i = 1, n do
  local sess = KEYS[2 * i]
  local lease = redis.pcall('GET', KEYS[2 * i - 1])
  if lease == false then
    out[i] = 'missing'
  elseif lease ~= ARGV[3 * i - 1] then
    out[i] = 'fenced'
  else
    -- pcall: a key of another type where the session belongs is damage (nothing of ours
    -- writes one); raised, it would fail every command of this batch, every time. It goes,
    -- as resume.lua does at a hello. A "next" that is no count ("inf") counts as none.
    local have = redis.pcall('HGET', sess, 'next')
    if type(have) == 'table' then
      redis.log(redis.LOG_WARNING, 'fleetlink persist: ' .. sess .. ' was not a session; deleted')
      redis.call('DEL', sess)
      have = false
    end
    if type(have) ~= 'string' or #have > 15 or not have:match('^%d+$') then
      have = '0'
    end
    if tonumber(have) > seqs[i] then
      -- Numbered past this seq by another broker while this one could not reach Redis (the
      -- rig connected to both): the rig may hold that seq with another command.
      out[i] = 'stale|' .. have
    else
      -- A seq past "next" (a session this call creates, or one whose rig's last_seq was
      -- past what Redis numbered: Redis lost the session, or it is new): Redis numbers this
      -- session from here, and never numbered the seqs skipped. "from" tells rekeep.lua an
      -- empty seq a broker on Redis gave to a command since acked (at or above it) from one
      -- the rig may hold (below it). In the same call: a session's commands come here in seq
      -- order, so this is once per session at most, the first command of a session created
      -- here (the tokio baseline's every session).
      -- Every field new ("next" too): the key did not exist, and a key with no TTL would
      -- outlive its rig forever. (Two calls written out: a table per command would cost
      -- every keep, and the gap is rare.)
      local field, next_text = 'c:' .. ARGV[3 * i], string.format('%.0f', seqs[i] + 1)
      local created
      if tonumber(have) < seqs[i] then
        created = redis.call('HSET', sess, field, ARGV[3 * i + 1], 'next', next_text, 'from',
            ARGV[3 * i]) == 3
      else
        created = redis.call('HSET', sess, field, ARGV[3 * i + 1], 'next', next_text) == 2
      end
      if created then
        redis.call('PEXPIRE', sess, ttl)
        out[i] = 'created'
      else
        out[i] = 'ok'
      end
    end
  end
end
return out
