-- rekeep.lua: put a rig's session (its next seq and unacked commands) back into Redis after
-- Redis lost it or missed part of it (it restarted empty, or was away while commands were
-- delivered unkept). Run by EVALSHA from src/registry/sessions.rs (behind lua/before_event.lua,
-- which guards its events against a full Redis), one rig per call; rare
-- (only after a reconnect or a restored lease), so it favours checks over speed.
--
-- KEYS[1]  rig:<rig_id>               (the lease, read only)
-- KEYS[2]  sess:<rig_id>:<boot_id>    (hash: "next" -> next seq, "c:<seq>" -> command JSON,
--                                     "from" -> the first seq Redis numbered: resume.lua,
--                                     persist.lua)
-- KEYS[3]  sessof:<rig_id>            (the rig's latest boot)
-- ARGV[1]  ttl_ms of session keys: decimal integer, 1 to 15 digits
-- ARGV[2]  "<boot_id>|<broker_id>": this broker's lease tuple for the rig
-- ARGV[3]  next: the session's next seq as the broker has it, decimal integer
-- ARGV[4]  mode, which decides the fence:
--            "live"    a rig connected here: written only under our lease (as persist.lua)
--            "parked"  a rig that disconnected from here, whose session this broker still
--                      holds: its lease was released or lost, so written when no one else
--                      holds the rig: the lease is ours, or it is absent or names an older
--                      boot (which this one beats, as at a hello) and the session key does
--                      not exist; merged when the same boot holds it elsewhere, or no one
--                      newer does and the session key exists (another broker's copy, newer or
--                      older: see "merged"). When a newer boot of the rig is known (the
--                      lease or sessof names one, or the session is a tombstone), the session
--                      has ended instead (CONTRACT.md section 5), under our own lease too:
--                      its commands are reported, not replayed (see "reported")
--            "ended|<boot_id>"  a session parked here that the rig's boot <boot_id> ended
--                      (a newer one, or an older one welcomed after this one left): its
--                      hello was decided here while Redis was away. Whether a boot
--                      in between, on another broker, has reported the session already, only
--                      Redis knows (its tombstone), so this broker reports through here: what
--                      is left to report is, and the session becomes a tombstone (see
--                      "reported"). Never fenced: a report is owed whoever holds the rig,
--                      but the session's own boot on another broker: that boot said hello
--                      there since, through Redis, and goes on with the session, which this
--                      copy then joins as a parked one does ("merged")
-- ARGV[5]  the rig_rebooted events' "at": the broker's clock, RFC 3339
-- ARGV[6]  unkept_to: the highest seq of this session the broker delivered while Redis was
--          away and has not put back since, "0" when none
-- ARGV[7]  unkept_from: the lowest such seq ("0" when only the highest is known: every
--          command up to it counts). Every command outside the two Redis kept (persist.lua)
--          before the broker gave it, so a copy's command outside them that
--          Redis no longer holds, below the session's "next", was acked (or reported) since:
--          it is neither written back nor reported. One between them may never have reached
--          Redis, and only this copy can tell of it. Unless Redis numbered that seq itself
--          (at or above "from") and no longer holds it: a broker on Redis gave it to another
--          command, since acked, and this copy's command is published `lost` (below), never
--          written back under a seq the rig holds with another command
-- ARGV[8], ARGV[9], ...  seq, command JSON (exactly as sent), for each command not yet acked
--
-- Returns:
--   "ok"      written: every command HSET, "next" raised to at least ARGV[3] (never lowered:
--             commands kept since Redis came back may already be above these), "sessof" set
--             to this boot unless a newer boot is recorded there, TTLs set. Where that moves
--             "sessof" off an older boot whose session Redis holds and no report ended yet,
--             that session is ended here as this boot's hello would have (resume.lua): its
--             commands published rig_rebooted, the session cut to a tombstone, and the lease
--             deleted where it names that boot (a stale process of it is then closed 4410 at
--             its broker's next refresh, rather than adding to a tombstone). This boot's
--             hello was decided alone (one through Redis would have done so). A parked session
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
--             below its "next". So too when the newer boot is already the rig's latest on
--             record (its hello came first, and reported an older session) while this one is
--             no tombstone: no later hello would report it, so it is reported here, but the
--             settled commands, with what Redis holds numbered past it, and cut to a tombstone.
--             ended: every command this broker holds, and every one Redis holds numbered
--             past ARGV[3] (the same boot went on at another broker meanwhile) is
--             reported, but those a tombstone lists; the session is cut down to a tombstone
--             naming the ending boot and listing what was reported, and "sessof" names the
--             ending boot unless it names a newer one
--   "merged"  parked, and the lease names this same boot on another broker (the rig went on
--             with this session there while Redis was away from one of them), or there is
--             no lease (or an older boot's) and Redis holds the session (another broker's
--             copy, put back first
--             after an empty restart or left by a resume there). The commands
--             Redis never numbered (at or above its "next") are added (never over that
--             broker's), as are the unkept ones Redis never numbered, and those below its
--             "from" (Redis lost the session since, and started it again), and
--             "next" raised to ARGV[3], so that broker's next command
--             cannot take a seq the rig already holds. Where the lease names that broker,
--             {"type":"session_merged","rig_id","boot_id"} is published on its channel
--             (fleetlink:broker:<id>): it puts back its connection's copy, finds Redis's
--             "next" above it, and gives the rig what this copy added
--   "anew"    live, written as "ok" is, into a session key that did not exist: Redis lost the
--             whole session (again, where this call puts back an earlier loss). A command
--             the copy left to its own keep (in flight when the copy was made) may have been
--             kept into the key lost, so the broker sends the session once more
--   "fenced"  the fence above refused: nothing written
-- Writing ("ok", "merged"), a seq that holds another command in Redis (two brokers each gave
-- it while deciding alone) keeps one of the two, as above, and publishes the other on
-- fleetlink:events as {"type":"lost","rig_id","boot_id","seq","id","broker_id","at","detail"}.
-- So too a command of this copy under a seq Redis numbered that holds nothing now (see
-- ARGV[7]): the other command was acked there, and this one is not written; and one of this
-- copy's unkept commands under a seq forget.lua marked acked (sess:<rig>:<boot>:acked) with another
-- command (the rig acked that one, given by another broker, before this copy came back). Where one of
-- this copy's own commands was published so, or is settled (see ARGV[7]: acked elsewhere
-- since), "ok", "ok|<n>", "anew" and "merged" end in ";<seq>,<seq>...": the broker drops
-- them from its copy (its connected rig's session, or the parked one), which would
-- otherwise give them or report them again.
-- Errors "ERR fleetlink rekeep: ..." on malformed ARGV, before any write.

local function count(s)
  return type(s) == 'string' and #s <= 15 and s:match('^%d+$') ~= nil
end

local ttl, tuple, nxt, mode, at = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5]
local unkept, unkept_low = ARGV[6], ARGV[7]
if #KEYS ~= 3 or #ARGV < 7 or (#ARGV - 7) % 2 ~= 0 or not count(ttl) or ttl:match('^0')
    or type(tuple) ~= 'string' or not count(nxt) or not count(unkept)
    or not count(unkept_low) then
  return redis.error_reply('ERR fleetlink rekeep: expected KEYS lease, session, pointer; ARGV ttl_ms, tuple, next, mode, at, unkept_to, unkept_from, then seq/json pairs')
end
local unkept_to, unkept_from = tonumber(unkept), tonumber(unkept_low)
-- Whether this copy's command `seq` may never have reached Redis.
local function unkept_seq(seq)
  local s = tonumber(seq)
  return s >= unkept_from and s <= unkept_to
end
local ended = mode:match('^ended|(%x+%-%x+%-%x+%-%x+%-%x+)$')
if mode ~= 'live' and mode ~= 'parked' and not ended then
  return redis.error_reply('ERR fleetlink rekeep: mode must be live, parked or ended|<boot_id>')
end
local boot = tuple:match('^([^|]+)|')
if not boot then
  return redis.error_reply('ERR fleetlink rekeep: the tuple must be boot_id|broker_id')
end
for i = 8, #ARGV, 2 do
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

-- A session's "next" as a number, 0 when there is none or it is no count (damage: resume.lua
-- repairs it at the rig's next hello; "inf" or "1e400" must not read as a number here).
local function next_of(v)
  if count(v) then
    return tonumber(v)
  end
  return 0
end

-- Whether this copy's command `seq` is one Redis kept, and has since forgotten although its
-- session `f` (field -> value, or nil when Redis has none) numbers past it: acked, or
-- reported, since this copy was made (see unkept_to). Not below the session's "from": Redis
-- lost the session since, and a command kept after made it anew, so only the copy holds it.
local function settled(f, seq)
  return f ~= nil and not unkept_seq(seq) and tonumber(seq) < next_of(f['next'])
      and not (count(f['from']) and tonumber(seq) < tonumber(f['from']))
      and f['c:' .. seq] == nil
end

-- Cuts session `key`, whose fields were `f`, to a tombstone: its next seq `next_text`, the boot
-- `by` that ended it, and the seqs reported (`rep`). Its "from" stays, for `settled` above.
local function tombstone(key, f, next_text, by, rep)
  redis.call('DEL', key)
  if count(f['from']) then
    redis.call('HSET', key, 'next', next_text, 'gone', by, 'rep', rep, 'from', f['from'])
  else
    redis.call('HSET', key, 'next', next_text, 'gone', by, 'rep', rep)
  end
  redis.call('PEXPIRE', key, ttl)
end

-- The session's fields (nil when Redis has no such hash).
local function fields_of(sess)
  local all = redis.pcall('HGETALL', sess)
  if type(all) ~= 'table' or all.err or #all == 0 then
    return nil
  end
  local f = {}
  for i = 1, #all, 2 do
    f[all[i]] = all[i + 1]
  end
  return f
end

-- Publishes the rig_rebooted event of boot `of`'s command `seq` (its text as written, so a
-- large seq is not rounded) sent as `json`, the session ended by boot `by`.
local function publish_rebooted(rig, of, by, seq, json)
  local decoded, cmd = pcall(cjson.decode, json)
  local id = (decoded and type(cmd) == 'table' and type(cmd.id) == 'string') and cmd.id or nil
  before_event()
  redis.call('PUBLISH', 'fleetlink:events', '{"type":"rig_rebooted","rig_id":'
      .. cjson.encode(rig) .. ',"boot_id":' .. cjson.encode(of) .. ',"new_boot_id":'
      .. cjson.encode(by) .. ',"seq":' .. seq .. ',"id":'
      .. (id and cjson.encode(id) or 'null') .. ',"broker_id":'
      .. cjson.encode(tuple:match('|(.*)$')) .. ',"at":' .. cjson.encode(at) .. '}')
end

-- Publishes a rig_rebooted event for each command with a seq at or above `from`, in seq
-- order, as resume.lua does for the ones Redis kept; returns how many and the highest seq.
local function report(rig, ended_by, from, skip)
  local order = {}
  for i = 8, #ARGV, 2 do
    if tonumber(ARGV[i]) >= from and not (skip and skip[ARGV[i]]) then
      order[#order + 1] = i
    end
  end
  table.sort(order, function(a, b) return tonumber(ARGV[a]) < tonumber(ARGV[b]) end)
  local top = 0
  for _, i in ipairs(order) do
    publish_rebooted(rig, boot, ended_by, ARGV[i], ARGV[i + 1])
    top = math.max(top, tonumber(ARGV[i]))
  end
  local seqs = {}
  for _, i in ipairs(order) do
    seqs[#seqs + 1] = ARGV[i]
  end
  return #order, top, table.concat(seqs, ',')
end

-- Reports this copy against its session in Redis, `f` (nil or empty: none): every command
-- the copy holds but the settled, and those Redis holds numbered past the copy (the same boot
-- went on at another broker while each decided alone).
local function report_copy(rig, ended_by, f)
  local mine, skip = {}, {}
  for i = 8, #ARGV, 2 do
    mine[ARGV[i]] = true
    if settled(f, ARGV[i]) then
      skip[ARGV[i]] = true
    end
  end
  for field, value in pairs(f or {}) do
    local seq = field:match('^c:(%d+)$')
    if seq and #seq <= 15 and not mine[seq] and tonumber(seq) >= tonumber(nxt) then
      ARGV[#ARGV + 1] = seq
      ARGV[#ARGV + 1] = value
    end
  end
  return report(rig, ended_by, 0, skip)
end

-- The report owed past a tombstone `f` (its "gone"): where it lists the seqs reported
-- ("rep"), every command not among them and not settled (one Redis kept was reported by
-- that report, or acked before it); else, from an older tombstone, those at or above its
-- "next".
local function tombstone_report(rig, ended_by, f)
  local rep = f['rep']
  if type(rep) ~= 'string' then
    return report(rig, ended_by, next_of(f['next']))
  end
  local skip = {}
  for seq in rep:gmatch('%d+') do
    skip[seq] = true
  end
  for i = 8, #ARGV, 2 do
    if settled(f, ARGV[i]) then
      skip[ARGV[i]] = true
    end
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

local H = '[0-9a-f]'
local BOOT = '^' .. H:rep(8) .. '%-' .. H:rep(4) .. '%-' .. H:rep(4) .. '%-' .. H:rep(4)
    .. '%-' .. H:rep(12) .. '$'

-- Ends the session of the rig's older boot `prev` that Redis holds, as the hello of `by`
-- would have (resume.lua): each unacked command is published rig_rebooted, in seq order, and
-- the session is cut down to a tombstone naming `by` and listing what was reported. Needed
-- where `by`'s hello was decided by a broker alone: no resume.lua ran for it, and once the
-- record names `by`, no later hello would report `prev`. A tombstone already, or no
-- session: nothing owed here. Returns how many were reported.
local function end_displaced(prev, by)
  local rig = KEYS[1]:match('^rig:(.+)$') or ''
  local key = 'sess:' .. rig .. ':' .. prev
  local f = fields_of(key)
  if f == nil or f['gone'] ~= nil or f['next'] == nil then
    return 0
  end
  local order = {}
  for field in pairs(f) do
    local seq = field:match('^c:(%d+)$')
    if seq and #seq <= 15 and (seq == '0' or seq:sub(1, 1) ~= '0') then
      order[#order + 1] = seq
    end
  end
  -- Digit strings: shorter first, then by text (cjson would round a large seq).
  table.sort(order, function(x, y)
    if #x ~= #y then
      return #x < #y
    end
    return x < y
  end)
  for _, seq in ipairs(order) do
    publish_rebooted(rig, prev, by, seq, f['c:' .. seq])
  end
  local seqs = table.concat(order, ',')
  local next_text = f['next']
  -- Its lease goes with it: a stale process of that boot still connected somewhere would
  -- otherwise go on adding commands to a tombstone no report reads. Without the lease its
  -- broker's next refresh finds the newer boot on record and closes it 4410.
  local lease = redis.pcall('GET', KEYS[1])
  if type(lease) == 'string' and lease:match('^([^|]+)|') == prev then
    redis.call('DEL', KEYS[1])
  end
  tombstone(key, f, next_text, by, rep_with(f['rep'], seqs))
  return #order
end

-- The rig's record of its latest boot names `b`, unless it names a newer one already: a
-- later hello must find the newer boot's session to report, not this ended one. The older
-- boot it named, when not this copy's own (whose caller settles it), has its session ended
-- by `b` here: moving the record past it unreported would leave it to no one.
local function raise_pointer(b)
  local cur = redis.pcall('GET', KEYS[3])
  if type(cur) ~= 'string' or (#cur == #b and newer(b, cur)) then
    if type(cur) == 'string' and cur ~= boot and cur:match(BOOT) then
      end_displaced(cur, b)
    end
    redis.call('SET', KEYS[3], b, 'PX', ttl)
  end
end

-- Mode "ended": the report this broker owes, made once whoever reported first.
local function report_ended(sess)
  -- The record names the session ending here: it names the ending boot now, even an older
  -- one (a stale process welcomed once this boot left), as its hello's resume.lua would
  -- have; left on this boot, the ending boot's refresh would find a newer boot on record
  -- and close it. Otherwise raised as any copy raises it.
  if redis.pcall('GET', KEYS[3]) == boot then
    redis.call('SET', KEYS[3], ended, 'PX', ttl)
  else
    raise_pointer(ended)
  end
  local rig = KEYS[1]:match('^rig:(.+)$') or ''
  local found = fields_of(sess)
  local fields = found or {}
  local kept_next = next_of(fields['next'])
  local gone = fields['gone']
  if type(gone) == 'string' then
    local n, top, seqs = tombstone_report(rig, gone, fields)
    redis.call('HSET', sess, 'next', string.format('%.0f', math.max(kept_next, top + 1)),
        'rep', rep_with(fields['rep'], seqs))
    redis.call('PEXPIRE', sess, ttl)
    return 'reported|' .. n
  end
  -- Commands Redis holds numbered past what this broker holds: the same boot went on at
  -- another broker while each decided alone. Below that, one Redis holds and this broker
  -- does not was acked here (its removal may not have reached Redis yet). Every one this
  -- broker holds is reported, but those settled: one absent from Redis below its "next"
  -- that Redis never kept (delivered while this broker could not reach it, and numbered
  -- past by another broker) only a report tells control of.
  local n, top, seqs = report_copy(rig, ended, found)
  tombstone(sess, found or {},
      string.format('%.0f', math.max(kept_next, tonumber(nxt), top + 1)), ended, seqs)
  return 'reported|' .. n
end

-- Writes the commands, raises "next" to ARGV[3] (never lowers it) and sets the TTL; returns
-- "next" as it was. `merge`: into a session another broker holds, only the commands Redis
-- never numbered (at or above its "next": delivered while this broker could not reach it)
-- and the unkept ones (Redis may never have had them, or lost them), and never
-- over one there; another below "next" that Redis no longer holds was acked. Either way
-- none under a seq `taken` says another command had.
-- A parked copy's settled commands are not written back either: acked meanwhile, they would
-- be delivered or reported again. `found`: the session's fields, read already (nil for a
-- connected rig's copy, which is written whole and needs only Redis's "next").
-- Where a seq of this copy holds another command in Redis, one broker gave it to a command
-- while another had given it to this one, each deciding alone: only one of the two can stay,
-- and the rig holds at most one of them under that seq. The one that goes is published as
-- `lost`, so control hears of it (and may send it again once no result for it came) rather
-- than the command vanishing: it was answered ok, and no resume or report would name it.
local function id_of(json)
  local decoded, cmd = pcall(cjson.decode, json)
  return (decoded and type(cmd) == 'table' and type(cmd.id) == 'string') and cmd.id or nil
end

-- A put-back whose answer a broken connection took goes again, the same copy, at the broker's
-- next reconnect, and would report the same command again: each report is recorded beside
-- forget.lua's marks ("l<seq>:<id>", the id "" for none; forget.lua's acked marks are bare
-- seqs, and it records its own reports the same way), and lapses with them.
local function publish_lost(seq, json)
  local id = id_of(json)
  local marks = KEYS[2] .. ':acked'
  local record = 'l' .. seq .. ':' .. (id or '')
  if redis.pcall('HEXISTS', marks, record) == 1 then
    return
  end
  before_event()
  redis.call('PUBLISH', 'fleetlink:events', '{"type":"lost","rig_id":'
      .. cjson.encode(KEYS[1]:match('^rig:(.+)$') or '') .. ',"boot_id":' .. cjson.encode(boot)
      .. ',"seq":' .. seq .. ',"id":' .. (id and cjson.encode(id) or 'null')
      .. ',"broker_id":' .. cjson.encode(tuple:match('|(.*)$')) .. ',"at":' .. cjson.encode(at)
      .. ',"detail":"its seq went to another command while the rig\'s brokers could not reach '
      .. 'Redis; the rig may not have run it: send it again if no result for it came"}')
  -- pcall: a key of another type there holds no marks of ours (forget.lua deletes it).
  if type(redis.pcall('HSET', marks, record, '1')) == 'number' then
    redis.call('PEXPIRE', marks, ttl)
  end
end

local function other_command(a, b)
  if a == b then
    return false
  end
  local x, y = id_of(a), id_of(b)
  return x == nil or y == nil or x ~= y
end

-- Whether this copy's command `seq`, given while this broker could not reach Redis, finds
-- its seq taken by a command a broker on Redis gave and the rig has since acked (or that was
-- reported): the field is empty, but Redis numbered that seq itself (at or above "from",
-- below "next" `have`). Written back there it would be stranded: below every broker's next
-- seq, never given again, and never reported while the rig stays. Below "from" an empty seq
-- is one Redis never numbered (it lost the session, or the rig's last_seq skipped it), which
-- the rig may hold: that one is written back.
local function taken(seq, have, from)
  local s = tonumber(seq)
  return unkept_seq(seq) and s < have and from ~= nil and s >= from
end

-- This copy's commands write() found gone from Redis for good: published `lost` (another
-- command took the seq), or settled (Redis kept it, and forgot it below its "next": acked
-- or reported since, elsewhere). Seq texts, in ARGV order.
local dropped = {}

local function write(sess, merge, found)
  local have, from
  if mode == 'live' then
    local f = redis.call('HMGET', sess, 'next', 'from')
    have, from = next_of(f[1]), f[2]
  else
    have, from = next_of(found and found['next']), found and found['from']
  end
  from = count(from) and tonumber(from) or nil
  for i = 8, #ARGV, 2 do
    local field = 'c:' .. ARGV[i]
    local there = redis.call('HGET', sess, field)
    -- The rig acked another broker's command under this seq, which that broker also gave
    -- while Redis was away from one of them (forget.lua's marker): this one lost the seq.
    local acked_as = unkept_seq(ARGV[i]) and redis.pcall('HGET', sess .. ':acked', ARGV[i])
    if type(acked_as) ~= 'string' then
      acked_as = false
    end
    -- Settled (see dropped); a connected rig's copy too: the rig acked it on another broker
    -- during the outage, and written back it was reported `expired` or `rig_rebooted` later.
    -- Only at or above "from": below it Redis never numbered the seq in this session, which
    -- it lost (its copy's command was kept before Redis lost its data, and a command kept
    -- since created the session anew), and only this copy holds the command.
    local settled_here = not there and not unkept_seq(ARGV[i]) and tonumber(ARGV[i]) < have
        and from ~= nil and tonumber(ARGV[i]) >= from
    if acked_as then
      if acked_as ~= id_of(ARGV[i + 1]) then
        publish_lost(ARGV[i], ARGV[i + 1])
      end
      dropped[#dropped + 1] = ARGV[i]
    elseif settled_here then
      dropped[#dropped + 1] = ARGV[i]
    elseif not merge then
      if there and other_command(there, ARGV[i + 1]) then
        publish_lost(ARGV[i], there)
      end
      if there or not taken(ARGV[i], have, from) then
        redis.call('HSET', sess, field, ARGV[i + 1])
      else
        publish_lost(ARGV[i], ARGV[i + 1])
        dropped[#dropped + 1] = ARGV[i]
      end
    elseif tonumber(ARGV[i]) >= have or unkept_seq(ARGV[i])
        or (from ~= nil and tonumber(ARGV[i]) < from) then
      -- Below "from", Redis lost the session since this copy's command was kept there (it
      -- lapsed while a partition kept its broker from extending it, or Redis lost its data),
      -- and another broker started it again from the rig's last_seq: only this copy holds
      -- the command, which the rig has and has not acked.
      -- Never over that broker's own command: the copy's is the one that goes.
      if there then
        if other_command(there, ARGV[i + 1]) then
          publish_lost(ARGV[i], ARGV[i + 1])
          dropped[#dropped + 1] = ARGV[i]
        end
      elseif taken(ARGV[i], have, from) then
        publish_lost(ARGV[i], ARGV[i + 1])
        dropped[#dropped + 1] = ARGV[i]
      else
        redis.call('HSET', sess, field, ARGV[i + 1])
      end
    end
  end
  if tonumber(nxt) > have then
    redis.call('HSET', sess, 'next', nxt)
    -- Redis had numbered none of this session itself: the seqs below this copy's next are
    -- the copy's broker's, not Redis's (see taken).
    if from == nil or from >= have then
      redis.call('HSET', sess, 'from', nxt)
    end
  end
  redis.call('PEXPIRE', sess, ttl)
  return have
end

-- ";<seq>,<seq>..." naming this copy's commands write() dropped, "" for none: the broker
-- drops them from its copy too, which would otherwise give or report them again.
local function dropped_suffix()
  if #dropped == 0 then
    return ''
  end
  return ';' .. table.concat(dropped, ',')
end

-- A key of another type where the session belongs is damage (nothing of ours writes one): it
-- holds no command, and left there it would fail this call at every reconnect.
local kind = redis.call('TYPE', KEYS[2]).ok
if kind ~= 'none' and kind ~= 'hash' then
  redis.log(redis.LOG_WARNING, 'fleetlink rekeep: ' .. KEYS[2] .. ' was a ' .. kind
      .. ', not a session; deleted')
  redis.call('DEL', KEYS[2])
end
-- pcall: a lease key of another type answers WRONGTYPE as a table: someone else's.
local lease = redis.pcall('GET', KEYS[1])
if ended then
  -- The session's own boot holds the rig on another broker: it said hello there once Redis
  -- was back, before this report, and goes on with the session (its unacked commands given
  -- again). The hello decided here alone lost to it, in Redis's order: reported now, those
  -- commands would be both given and reported, and the live session cut to a tombstone
  -- (review bb150). This copy goes back as a parked one does, merged into that session.
  local held = type(lease) == 'string' and lease:match('^([^|]+)|') or nil
  if held ~= boot or lease == tuple then
    return report_ended(KEYS[2])
  end
  mode = 'parked'
end
local sess = KEYS[2]
if lease ~= tuple and mode == 'live' then
  return 'fenced'
end
-- What Redis holds of a parked copy's session (nil: none), read once for every check below.
local found = mode ~= 'live' and fields_of(sess) or nil
-- A parked copy under its own lease too: the broker could not release it while Redis was
-- away, and meanwhile a newer boot may have ended the session (its tombstone, or the record
-- naming it). Written back there, the copy's unkept commands would sit in a tombstone that
-- nothing reports.
if mode == 'parked' then
  local rig = KEYS[1]:match('^rig:(.+)$') or ''
  local f = found or {}
  local gone, kept_next, rep = f['gone'], next_of(f['next']), f['rep']
  local latest = redis.pcall('GET', KEYS[3])
  local ended_by = (type(gone) == 'string' and gone)
      or newer_boot(lease) or newer_boot(latest)
  -- A session is there when it numbers seqs: a key holding only what a broker remembered at
  -- a release ("r", written after Redis restarted empty) is no one's newer truth.
  local exists = f['next'] ~= nil
  -- The newer boot is the rig's latest on record, yet this session is no tombstone: that
  -- boot's hello came first and reported another (the record named an older boot then, this
  -- broker having decided this one's hello alone), and no later hello will report this one.
  local orphaned = ended_by and not gone and exists and latest == ended_by
  if ended_by and (gone or not exists or orphaned) then
    -- Reported already, what the tombstone lists (gone), or Redis lost the session (none),
    -- or no one will (orphaned): what only this broker holds is reported here, once.
    local n, top, seqs
    if gone then
      n, top, seqs = tombstone_report(rig, ended_by, f)
    else
      n, top, seqs = report_copy(rig, ended_by, f)
    end
    if orphaned then
      redis.call('DEL', sess)
    end
    redis.call('HSET', sess, 'gone', ended_by, 'next',
        string.format('%.0f', math.max(kept_next, top + 1)), 'rep', rep_with(rep, seqs))
    redis.call('PEXPIRE', sess, ttl)
    return 'reported|' .. n
  end
  -- The same boot leased to another broker: the rig went on with this session there while
  -- each broker decided alone (a Redis outage). What this copy holds that Redis lacks was
  -- delivered meanwhile: added, never over the other broker's own, and "next" raised past
  -- it, so that no seq the rig holds goes to another command (persist.lua refuses one). So
  -- too where no one holds the rig and Redis has the session: another broker's copy of it,
  -- newer or older than this one (put back first after an empty restart, say). Fenced, this
  -- copy's commands Redis never kept would be lost, and the rig's seqs numbered again.
  local leased = type(lease) == 'string' and lease:match('^([^|]+)|') or nil
  local same = leased == boot and lease ~= tuple
  -- An older boot's lease holds that boot's session, not this one: by hello's rule this
  -- newer boot beats it, so it fences nothing here (the lease is often this broker's own,
  -- its release waiting for the older boot's copy to go back first). Fenced, this copy was
  -- never written anywhere, and its commands were lost to a resume elsewhere.
  local older = leased ~= nil and #leased == #boot and newer(boot, leased)
  if not ended_by and (same or ((lease == false or older) and exists)) then
    write(sess, true, found)
    if same then
      -- That broker's connection has the session as Redis had it at the rig's hello (after
      -- an empty restart, a new one): told, it puts its copy back and is answered with what
      -- this one added, which it gives the rig then, not at its next command.
      local holder = lease:match('^[^|]+|(.+)$')
      if holder then
        before_event()
        redis.call('PUBLISH', 'fleetlink:broker:' .. holder, '{"type":"session_merged","rig_id":'
            .. cjson.encode(rig) .. ',"boot_id":' .. cjson.encode(boot) .. '}')
      end
    end
    return 'merged' .. dropped_suffix()
  end
  if not ended_by and lease ~= false and lease ~= tuple and not older then
    return 'fenced'
  end
end
-- A connected rig's key gone before this call: Redis lost it again since the broker's core
-- made this copy, which left out the commands whose keep was in flight. One of those kept in
-- between went with the key, and only the broker can put it back (see "anew").
local anew = mode == 'live' and redis.call('EXISTS', sess) == 0
local have = write(sess, false, found)
-- Raised, not only set where absent: after an empty restart an older boot's copy may have
-- been put back first, and a later hello would report that session, not this one.
raise_pointer(boot)
if have > tonumber(nxt) then
  return 'ok|' .. string.format('%.0f', have) .. dropped_suffix()
end
if anew then
  return 'anew' .. dropped_suffix()
end
return 'ok' .. dropped_suffix()
