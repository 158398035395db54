-- resume.lua: what rigs' hellos find of their sessions (CONTRACT.md section 5). Run right after
-- hello.lua said these boots own their rigs, by EVALSHA from src/registry/sessions.rs (behind
-- lua/before_event.lua, which guards its events against a full Redis), for
-- every accepted hello of a batch in one call (a call's own setup cost Redis as much as a new
-- session's writes).
--
-- KEYS[2i-1]  sess:<rig_id>:<boot_id>   the i-th rig's session (hash: "next", "c:<seq>" -> JSON,
--                                       "r" -> what its last broker remembered of it,
--                                       "from" -> the first seq Redis numbered: rekeep.lua)
-- KEYS[2i]    sessof:<rig_id>           the boot_id of that rig's latest session
-- ARGV[1]     ttl_ms of session keys: decimal integer, 1 to 15 digits
-- ARGV[2]     broker_id of the broker running the hellos (named in the rig_rebooted events)
-- ARGV[3]     the events' "at": the broker's clock, RFC 3339
-- ARGV[2i+2]  the i-th rig's boot_id: canonical lowercase UUID text
-- ARGV[2i+3]  the i-th rig_id
--
-- Returns one entry per rig, in order: { next, cmds, rebooted, previous_boot, recall }:
--   next           this session's next seq as text, "0" when the session is new (it is
--                  then recorded with next = 1, so a later hello of the same boot resumes it)
--   cmds           { seq1, json1, seq2, json2, ... }: its unacked commands (any order)
--   rebooted       how many unacked commands the previous boot's session had (the rig's latest
--                  on record, sessof, when it names another boot: a newer one too, when this
--                  older boot came back after it and found its lease free): each is
--                  published here as a rig_rebooted event on fleetlink:events, and the session
--                  is cut down to a tombstone ("next", and "gone" -> this boot_id), in this one
--                  atomic call (never replayed). Reported by the
--                  broker instead, a reply lost after this ran would lose the reports with the
--                  session.
--   previous_boot  that boot_id, or ""
--   recall         the session's "r" field as its last broker wrote it when the rig
--                  disconnected (acked commands' ids awaiting results, the last ack's time),
--                  or "" (a new session, or none written)
-- Sets each sessof: key to its boot and refreshes the session's TTL; a session of its own that
-- a newer boot ended (a tombstone: "gone") goes on, no longer one. The previous session's key
-- is "sess:<rig_id>:<previous boot>" (single-instance Redis; not cluster-safe). The rigs run
-- in order, as separate calls would.
-- Errors "ERR fleetlink resume: ..." on malformed ARGV, before any write.

local H = '[0-9a-f]'
local BOOT = '^' .. H:rep(8) .. '%-' .. H:rep(4) .. '%-' .. H:rep(4) .. '%-' .. H:rep(4)
    .. '%-' .. H:rep(12) .. '$'

local ttl, broker, at = ARGV[1], ARGV[2], ARGV[3]
local n = #KEYS / 2
local ok = #KEYS > 0 and #KEYS % 2 == 0 and #ARGV == 3 + 2 * n and type(ttl) == 'string'
    and #ttl <= 15 and ttl:match('^[1-9]%d*$') ~= nil
for i = 1, n do
  local boot = ARGV[2 * i + 2]
  ok = ok and type(boot) == 'string' and boot:match(BOOT) ~= nil
end
if not ok then
  return redis.error_reply('ERR fleetlink resume: expected KEYS session, pointer per rig; ARGV ttl_ms, broker_id, at, then boot_id, rig_id per rig')
end

-- A session's fields as a table (empty when there is none, or the key is not a hash).
local function fields(key)
  local out = {}
  local all = redis.pcall('HGETALL', key)
  if type(all) ~= 'table' or all.err then
    return out
  end
  for i = 1, #all, 2 do
    out[all[i]] = all[i + 1]
  end
  return out
end

-- A seq as the brokers write it: decimal digits without a leading zero, at most 15 (the
-- broker's last seq is 999999999999998, and rekeep.lua and persist.lua take no more). A
-- "c:007" would reach control as "seq":007, which is no JSON.
local function seq_text(s)
  return type(s) == 'string' and #s <= 15 and (s == '0' or s:match('^[1-9]%d*$') ~= nil)
end

-- { seq1, json1, seq2, json2, ... } of a session's unacked commands. A "c:" field whose seq
-- is no seq is skipped (`bad` lists them): nothing of ours writes one.
local function unacked(f, bad)
  local out = {}
  for field, value in pairs(f) do
    if field:sub(1, 2) == 'c:' then
      if seq_text(field:sub(3)) then
        out[#out + 1] = field:sub(3)
        out[#out + 1] = value
      elseif bad then
        bad[#bad + 1] = field
      end
    end
  end
  return out
end

-- Publishes one rig_rebooted event per unacked command of the older session `key`, in seq
-- order (control need not sort them); returns how many. The seq is the field's own text
-- (cjson would round a large one), so seqs compare as digit strings: shorter first, then by
-- text. The id comes from the command as sent.
local function report(rig, boot, prev, key)
  local cmds, n, seqs = unacked(fields(key)), 0, {}
  local order = {}
  for i = 1, #cmds, 2 do
    if cmds[i]:match('^%d+$') then
      order[#order + 1] = i
    end
  end
  table.sort(order, function(a, b)
    local x, y = cmds[a], cmds[b]
    if #x ~= #y then
      return #x < #y
    end
    return x < y
  end)
  for _, i in ipairs(order) do
    local seq = cmds[i]
    n = n + 1
    seqs[#seqs + 1] = seq
    local decoded, cmd = pcall(cjson.decode, cmds[i + 1])
    local id = (decoded and type(cmd) == 'table' and type(cmd.id) == 'string') and cmd.id or nil
    before_event()
    redis.call('PUBLISH', 'fleetlink:events', '{"type":"rig_rebooted","rig_id":'
        .. cjson.encode(rig) .. ',"boot_id":' .. cjson.encode(prev) .. ',"new_boot_id":'
        .. cjson.encode(boot) .. ',"seq":' .. seq .. ',"id":'
        .. (id and cjson.encode(id) or 'null') .. ',"broker_id":' .. cjson.encode(broker)
        .. ',"at":' .. cjson.encode(at) .. '}')
  end
  return n, table.concat(seqs, ',')
end

local function resume(sess, ptr, boot, rig)
  -- A key of another type where the session belongs is damage (nothing of ours writes one):
  -- it holds no command, and left there it would fail this call, and with it every hello in
  -- the batch, at each of the rig's attempts. It goes, and the session starts afresh.
  local kind = redis.call('TYPE', sess).ok
  if kind ~= 'none' and kind ~= 'hash' then
    redis.log(redis.LOG_WARNING, 'fleetlink resume: ' .. sess .. ' was a ' .. kind
        .. ', not a session; deleted')
    redis.call('DEL', sess)
  end
  local f = fields(sess)
  local nxt = f['next']
  -- A "next" the broker cannot read is damage too: left, it would turn the rig's every
  -- hello away (each of which extends the key's TTL). The session starts afresh.
  if nxt ~= nil and not seq_text(nxt) then
    redis.log(redis.LOG_WARNING, 'fleetlink resume: ' .. sess .. ' had next "'
        .. tostring(nxt):sub(1, 40) .. '", not a seq; deleted')
    redis.call('DEL', sess)
    f, nxt = {}, nil
  end
  if type(nxt) ~= 'string' then
    nxt = '0'
  end
  local recall = ''
  if nxt ~= '0' and type(f['r']) == 'string' then
    recall = f['r']
  end
  local bad = {}
  local cmds = unacked(f, bad)
  for _, field in ipairs(bad) do
    redis.log(redis.LOG_WARNING, 'fleetlink resume: ' .. sess .. ' had field "'
        .. field:sub(1, 40) .. '", not a command; deleted')
    redis.call('HDEL', sess, field)
  end
  local rebooted, previous = 0, ''
  local prev = redis.pcall('GET', ptr)
  -- A record that names no boot is damage: which session it named is lost with it, and that
  -- session goes unreported. Said in Redis's log, since nothing else can tell.
  if prev ~= false and not (type(prev) == 'string' and prev:match(BOOT)) then
    redis.log(redis.LOG_WARNING, 'fleetlink resume: ' .. ptr
        .. ' named no boot; replaced (the session it named, if any, is not reported)')
  end
  -- The hello's own session a newer boot ended (a tombstone): this boot is back after it,
  -- its lease free (a stale process, or a rig whose clock went back). It goes on from the
  -- tombstone's "next", so no seq repeats; what the tombstone lists as reported stays listed.
  if f['gone'] ~= nil then
    redis.call('HDEL', sess, 'gone')
    -- A tombstone keeps no "from": Redis numbers the session again from its "next" on.
    if nxt ~= '0' then
      redis.call('HSET', sess, 'from', nxt)
    end
  end
  -- The rig's latest session on record is another boot's: this hello, which hello.lua let
  -- in, ends it, whichever boot is newer. Left alone when the older boot came back, that
  -- session would be the one a later hello reports, and this boot's commands never.
  if type(prev) == 'string' and prev:match(BOOT) and prev ~= boot then
    local prefix = 'sess:' .. rig .. ':'
    previous = prev
    local old = prefix .. prev
    local seqs
    rebooted, seqs = report(rig, boot, prev, old)
    -- What is left is a tombstone: the old session's next seq, the boot that ended it, and
    -- the seqs reported ("rep", with those of any report before). A broker still holding
    -- that session with commands Redis never kept (delivered while Redis was away) reports
    -- just those when it puts the session back (rekeep.lua), not the ones reported here a
    -- second time: a seq below "next" need not be one Redis held, when another broker
    -- numbered past it.
    local old_next = redis.pcall('HGET', old, 'next')
    local prior = redis.pcall('HGET', old, 'rep')
    -- Kept too: a seq below it is one Redis lost with the session, which the report above
    -- could not cover, and the broker holding a copy reports it (rekeep.lua, `settled`).
    local old_from = redis.pcall('HGET', old, 'from')
    if type(prior) == 'string' and prior ~= '' then
      seqs = seqs == '' and prior or (prior .. ',' .. seqs)
    end
    redis.call('DEL', old)
    if type(old_next) == 'string' then
      redis.call('HSET', old, 'next', old_next, 'gone', boot, 'rep', seqs)
      if type(old_from) == 'string' then
        redis.call('HSET', old, 'from', old_from)
      end
      redis.call('PEXPIRE', old, ttl)
    end
    redis.call('SET', ptr, boot, 'PX', ttl)
  else
    redis.call('SET', ptr, boot, 'PX', ttl)
  end
  if nxt == '0' then
    -- A new session: record it, so the same boot saying hello anywhere later resumes it
    -- ("from": Redis numbers it from 1, or from the rig's last_seq + 1, persist.lua). An
    -- "r" written after Redis had lost the session describes seqs of the session before: not
    -- this one's.
    if f['r'] ~= nil then
      redis.call('HDEL', sess, 'r')
    end
    redis.call('HSET', sess, 'next', '1', 't', ttl, 'from', '1')
  elseif f['t'] ~= ttl then
    -- The session lives by this broker's TTL from now on ("t": what a lapse report is timed
    -- by, lapse_end.lua); left at a longer one's, its new end could read as that one's last
    -- tenth and have what it holds reported while the rig is here.
    redis.call('HSET', sess, 't', ttl)
  end
  redis.call('PEXPIRE', sess, ttl)
  return { nxt, cmds, rebooted, previous, recall }
end

local out = {}
for i = 1, n do
  out[i] = resume(KEYS[2 * i - 1], KEYS[2 * i], ARGV[2 * i + 2], ARGV[2 * i + 3])
end
return out
