-- rekeep.lua: put a rig's session (its next seq and unacked commands) back into Redis after
-- Redis lost it or missed part of it (it restarted empty, or was away while commands were
-- delivered unkept). Run by EVALSHA from src/registry/sessions.rs, one rig per call; rare
-- (only after a reconnect or a restored lease), so it favours checks over speed.
--
-- KEYS[1]  rig:<rig_id>               (the lease, read only)
-- KEYS[2]  sess:<rig_id>:<boot_id>    (hash: "next" -> next seq, "c:<seq>" -> command JSON)
-- KEYS[3]  sessof:<rig_id>            (the rig's latest boot)
-- ARGV[1]  ttl_ms of session keys: decimal integer, 1 to 15 digits
-- ARGV[2]  "<boot_id>|<broker_id>": this broker's lease tuple for the rig
-- ARGV[3]  next: the session's next seq as the broker has it, decimal integer
-- ARGV[4]  mode, which decides the fence:
--            "live"    a rig connected here: written only under our lease (as persist.lua)
--            "parked"  a rig that disconnected from here, whose session this broker still
--                      holds: its lease was released or lost, so written when no one else
--                      holds the rig: the lease is ours, or it is absent and the session key
--                      does not exist (if it does, another broker or the rig's new connection
--                      wrote a newer truth there). When a newer boot of the rig is known (the
--                      lease or sessof names one), the session has ended instead (CONTRACT.md
--                      section 5): its commands are reported, not replayed (see "reported")
--            "ended|<boot_id>"  a session parked here that the rig's newer boot <boot_id>
--                      ended: its hello was decided here while Redis was away. Whether a boot
--                      in between, on another broker, has reported the session already, only
--                      Redis knows (its tombstone), so this broker reports through here: what
--                      is left to report is, and the session becomes a tombstone (see
--                      "reported"). Never fenced: a report is owed whoever holds the rig
-- ARGV[5]  the rig_rebooted events' "at": the broker's clock, RFC 3339
-- ARGV[6], ARGV[7], ...  seq, command JSON (exactly as sent), for each command not yet acked
--
-- Returns:
--   "ok"      written: every command HSET, "next" raised to at least ARGV[3] (never lowered:
--             commands kept since Redis came back may already be above these), "sessof" set
--             to this boot unless another boot is recorded there, TTLs set. A parked session
--             whose newer boot has not been reported yet is written this way too: that boot's
--             broker reports it (refresh.lua's "taken" and "restored|", or the hello's
--             resume.lua), these commands with it
--   "ok|<n>"  the same, where the session's "next" was already n, above ARGV[3]: another
--             broker numbered commands of this session while Redis was away from this one
--             (the rig connected to both, each deciding alone). The caller must number the
--             rig's next command n or above, or it would reuse a seq the rig already has
--   "reported|<n>"  parked, and a newer boot ended this session: resume.lua already reported
--             it (its tombstone: "gone" -> that boot, "rep" -> the seqs it reported) and
--             these commands, not among them, were never kept (delivered while Redis was
--             away; below the tombstone's "next" too, when another broker numbered past them),
--             or Redis lost the session altogether and all of them were never reported. Each
--             of those n is published as a rig_rebooted event, in seq order, and added to
--             "rep" ("next" raised past them), so a second call reports nothing twice. A
--             tombstone with no "rep" (written before it existed) counts as listing every seq
--             below its "next".
--             ended: every command this broker holds, and every one Redis holds numbered
--             past ARGV[3] (the same boot went on at another broker meanwhile) is
--             reported, but those a tombstone lists; the session is cut down to a tombstone
--             naming the ending boot and listing what was reported, and "sessof" names the
--             ending boot unless it names a newer one
--   "merged"  parked, and the lease names this same boot on another broker: the rig went on
--             with this session there while Redis was away from one of them. The commands
--             Redis never numbered (at or above its "next") are added (HSETNX: never over
--             that broker's) and "next" raised to ARGV[3], so that broker's next command
--             cannot take a seq the rig already holds
--   "fenced"  the fence above refused: nothing written
-- Errors "ERR fleetlink rekeep: ..." on malformed ARGV, before any write.

local function count(s)
  return type(s) == 'string' and #s <= 15 and s:match('^%d+$') ~= nil
end

local ttl, tuple, nxt, mode, at = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5]
if #KEYS ~= 3 or #ARGV < 5 or (#ARGV - 5) % 2 ~= 0 or not count(ttl) or ttl:match('^0')
    or type(tuple) ~= 'string' or not count(nxt) then
  return redis.error_reply('ERR fleetlink rekeep: expected KEYS lease, session, pointer; ARGV ttl_ms, tuple, next, mode, at, then seq/json pairs')
end
local ended = mode:match('^ended|(%x+%-%x+%-%x+%-%x+%-%x+)$')
if mode ~= 'live' and mode ~= 'parked' and not ended then
  return redis.error_reply('ERR fleetlink rekeep: mode must be live, parked or ended|<boot_id>')
end
local boot = tuple:match('^([^|]+)|')
if not boot then
  return redis.error_reply('ERR fleetlink rekeep: the tuple must be boot_id|broker_id')
end
for i = 6, #ARGV, 2 do
  if not count(ARGV[i]) then
    return redis.error_reply('ERR fleetlink rekeep: seq must be a decimal integer')
  end
end

-- a > b for canonical boot ids, byte by byte (Lua's '<' follows the locale; see hello.lua).
local function newer(a, b)
  for i = 1, #a do
    local x, y = a:byte(i), b:byte(i)
    if x ~= y then
      return x > y
    end
  end
  return false
end

-- The boot `v` names ("<boot>|<broker>" or a bare boot) when it is newer than ours, else nil.
local function newer_boot(v)
  if type(v) ~= 'string' then
    return nil
  end
  local b = v:match('^([^|]+)') or ''
  if #b == #boot and newer(b, boot) then
    return b
  end
  return nil
end

-- Publishes a rig_rebooted event for each command with a seq at or above `from`, in seq
-- order, as resume.lua does for the ones Redis kept; returns how many and the highest seq.
local function report(rig, ended_by, from, skip)
  local order = {}
  for i = 6, #ARGV, 2 do
    if tonumber(ARGV[i]) >= from and not (skip and skip[ARGV[i]]) then
      order[#order + 1] = i
    end
  end
  table.sort(order, function(a, b) return tonumber(ARGV[a]) < tonumber(ARGV[b]) end)
  local broker = tuple:match('|(.*)$')
  local top = 0
  for _, i in ipairs(order) do
    local decoded, cmd = pcall(cjson.decode, ARGV[i + 1])
    local id = (decoded and type(cmd) == 'table' and type(cmd.id) == 'string') and cmd.id or nil
    redis.call('PUBLISH', 'fleetlink:events', '{"type":"rig_rebooted","rig_id":'
        .. cjson.encode(rig) .. ',"boot_id":' .. cjson.encode(boot) .. ',"new_boot_id":'
        .. cjson.encode(ended_by) .. ',"seq":' .. ARGV[i] .. ',"id":'
        .. (id and cjson.encode(id) or 'null') .. ',"broker_id":' .. cjson.encode(broker)
        .. ',"at":' .. cjson.encode(at) .. '}')
    top = math.max(top, tonumber(ARGV[i]))
  end
  local seqs = {}
  for _, i in ipairs(order) do
    seqs[#seqs + 1] = ARGV[i]
  end
  return #order, top, table.concat(seqs, ',')
end

-- The report owed past a tombstone (its "gone"): where it lists the seqs reported ("rep"),
-- every command not among them; else, from an older tombstone, those at or above its "next".
local function tombstone_report(rig, ended_by, kept_next, rep)
  if type(rep) ~= 'string' then
    return report(rig, ended_by, kept_next)
  end
  local skip = {}
  for seq in rep:gmatch('%d+') do
    skip[seq] = true
  end
  return report(rig, ended_by, 0, skip)
end

-- "rep" with `seqs` added: what the tombstone has seen reported.
local function rep_with(rep, seqs)
  if type(rep) ~= 'string' or rep == '' then
    return seqs
  end
  if seqs == '' then
    return rep
  end
  return rep .. ',' .. seqs
end

-- The rig's record of its latest boot names `b`, unless it names a newer one already: a
-- later hello must find the newer boot's session to report, not this ended one.
local function raise_pointer(b)
  local cur = redis.pcall('GET', KEYS[3])
  if type(cur) ~= 'string' or (#cur == #b and newer(b, cur)) then
    redis.call('SET', KEYS[3], b, 'PX', ttl)
  end
end

-- Mode "ended": the report this broker owes, made once whoever reported first.
local function report_ended(sess)
  raise_pointer(ended)
  local rig = KEYS[1]:match('^rig:(.+)$') or ''
  local f = redis.pcall('HGETALL', sess)
  local fields = {}
  if type(f) == 'table' and not f.err then
    for i = 1, #f, 2 do
      fields[f[i]] = f[i + 1]
    end
  end
  local kept_next = tonumber(fields['next'] or '0') or 0
  local gone = fields['gone']
  if type(gone) == 'string' then
    local n, top, seqs = tombstone_report(rig, gone, kept_next, fields['rep'])
    redis.call('HSET', sess, 'next', string.format('%.0f', math.max(kept_next, top + 1)),
        'rep', rep_with(fields['rep'], seqs))
    redis.call('PEXPIRE', sess, ttl)
    return 'reported|' .. n
  end
  -- Commands Redis holds numbered past what this broker holds: the same boot went on at
  -- another broker while each decided alone. Below that, one Redis holds and this broker
  -- does not was acked here (its removal may not have reached Redis yet). Every one this
  -- broker holds is reported, even below the session's next in Redis and absent there: it
  -- may have been acked elsewhere since this copy was parked, or never kept, numbered past
  -- by another broker while this one could not reach Redis. Only a report tells control of
  -- the second; an ack of the first wins over its report.
  local mine = {}
  for i = 6, #ARGV, 2 do
    mine[ARGV[i]] = true
  end
  for field, value in pairs(fields) do
    local seq = field:match('^c:(%d+)$')
    if seq and #seq <= 15 and not mine[seq] and tonumber(seq) >= tonumber(nxt) then
      ARGV[#ARGV + 1] = seq
      ARGV[#ARGV + 1] = value
    end
  end
  local n, top, seqs = report(rig, ended, 0)
  redis.call('DEL', sess)
  redis.call('HSET', sess, 'gone', ended, 'next',
      string.format('%.0f', math.max(kept_next, tonumber(nxt), top + 1)), 'rep', seqs)
  redis.call('PEXPIRE', sess, ttl)
  return 'reported|' .. n
end

-- Writes the commands, raises "next" to ARGV[3] (never lowers it) and sets the TTL; returns
-- "next" as it was. `merge`: into a session another broker holds, only the commands Redis
-- never numbered (at or above its "next": delivered while this broker could not reach it),
-- and never over one there; a command below "next" that Redis no longer holds was acked.
local function write(sess, merge)
  local have = tonumber(redis.call('HGET', sess, 'next') or '0') or 0
  for i = 6, #ARGV, 2 do
    if not merge then
      redis.call('HSET', sess, 'c:' .. ARGV[i], ARGV[i + 1])
    elseif tonumber(ARGV[i]) >= have then
      redis.call('HSETNX', sess, 'c:' .. ARGV[i], ARGV[i + 1])
    end
  end
  if tonumber(nxt) > have then
    redis.call('HSET', sess, 'next', nxt)
  end
  redis.call('PEXPIRE', sess, ttl)
  return have
end

if ended then
  return report_ended(KEYS[2])
end
-- pcall: a lease key of another type answers WRONGTYPE as a table: someone else's.
local lease = redis.pcall('GET', KEYS[1])
local sess = KEYS[2]
if lease ~= tuple then
  if mode == 'live' then
    return 'fenced'
  end
  local rig = KEYS[1]:match('^rig:(.+)$') or ''
  local f = redis.pcall('HMGET', sess, 'gone', 'next', 'rep')
  local gone, kept_next, rep = nil, 0, nil
  if type(f) == 'table' and not f.err then
    gone, kept_next, rep = f[1], tonumber(f[2] or '0') or 0, f[3]
  end
  local ended_by = (type(gone) == 'string' and gone)
      or newer_boot(lease) or newer_boot(redis.pcall('GET', KEYS[3]))
  local exists = redis.call('EXISTS', sess) == 1
  if ended_by and (gone or not exists) then
    -- Reported already, what the tombstone lists (gone), or Redis lost the session (none):
    -- what only this broker holds is reported here, once.
    local n, top, seqs
    if gone then
      n, top, seqs = tombstone_report(rig, ended_by, kept_next, rep)
    else
      n, top, seqs = report(rig, ended_by, 0)
    end
    redis.call('HSET', sess, 'gone', ended_by, 'next',
        string.format('%.0f', math.max(kept_next, top + 1)), 'rep', rep_with(rep, seqs))
    redis.call('PEXPIRE', sess, ttl)
    return 'reported|' .. n
  end
  -- The same boot leased to another broker: the rig went on with this session there while
  -- each broker decided alone (a Redis outage). What this copy holds that Redis lacks was
  -- delivered meanwhile: added, never over the other broker's own, and "next" raised past
  -- it, so that no seq the rig holds goes to another command (persist.lua refuses one).
  local same = type(lease) == 'string' and lease:match('^([^|]+)|') == boot
  if same and not ended_by then
    write(sess, true)
    return 'merged'
  end
  if not ended_by and (lease ~= false or exists) then
    return 'fenced'
  end
end
local have = write(sess, false)
redis.call('SET', KEYS[3], boot, 'PX', ttl, 'NX')
if have > tonumber(nxt) then
  return 'ok|' .. string.format('%.0f', have)
end
return 'ok'
