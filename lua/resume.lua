-- resume.lua: what a rig's hello finds of its sessions (CONTRACT.md section 5). Run right after
-- hello.lua said this boot owns the rig, by EVALSHA from src/registry/sessions.rs.
--
-- KEYS[1]  sess:<rig_id>:<boot_id>   this boot's session (hash: "next", "c:<seq>" -> JSON,
--                                    "r" -> what its last broker remembered of it)
-- KEYS[2]  sessof:<rig_id>           the boot_id of the rig's latest session
-- ARGV[1]  boot_id: canonical lowercase UUID text
-- ARGV[2]  ttl_ms of session keys: decimal integer, 1 to 15 digits
-- ARGV[3]  "sess:<rig_id>:", the prefix of the rig's session keys
-- ARGV[4]  broker_id of the broker running the hello (named in the rig_rebooted events)
-- ARGV[5]  rig_id
-- ARGV[6]  the events' "at": the broker's clock, RFC 3339
--
-- Returns { next, cmds, rebooted, previous_boot, recall }:
--   next           this session's next seq as text, "0" when the session is new (it is
--                  then recorded with next = 1, so a later hello of the same boot resumes it)
--   cmds           { seq1, json1, seq2, json2, ... }: its unacked commands (any order)
--   rebooted       how many unacked commands the previous, older boot's session had: each is
--                  published here as a rig_rebooted event on fleetlink:events, and the session
--                  is deleted, in this one atomic call (never replayed). Reported by the
--                  broker instead, a reply lost after this ran would lose the reports with the
--                  session.
--   previous_boot  that older boot_id, or ""
--   recall         the session's "r" field as its last broker wrote it when the rig
--                  disconnected (acked commands' ids awaiting results, the last ack's time),
--                  or "" (a new session, or none written)
-- Sets KEYS[2] to this boot (unless a newer boot is recorded there) and refreshes KEYS[1]'s TTL.
-- The previous session's key is derived from ARGV[3] (single-instance Redis; not cluster-safe).

local H = '[0-9a-f]'
local BOOT = '^' .. H:rep(8) .. '%-' .. H:rep(4) .. '%-' .. H:rep(4) .. '%-' .. H:rep(4)
    .. '%-' .. H:rep(12) .. '$'

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

local sess, ptr = KEYS[1], KEYS[2]
local boot, ttl, prefix = ARGV[1], ARGV[2], ARGV[3]
local broker, rig, at = ARGV[4], ARGV[5], ARGV[6]
if #KEYS ~= 2 or #ARGV ~= 6 or type(boot) ~= 'string' or not boot:match(BOOT)
    or type(ttl) ~= 'string' or #ttl > 15 or not ttl:match('^[1-9]%d*$') then
  return redis.error_reply('ERR fleetlink resume: expected KEYS session, pointer; ARGV boot_id, ttl_ms, prefix, broker_id, rig_id, at')
end

-- { seq1, json1, seq2, json2, ... } of a session's unacked commands.
local function unacked(key)
  local out = {}
  local all = redis.pcall('HGETALL', key)
  if type(all) ~= 'table' or all.err then
    return out
  end
  for i = 1, #all, 2 do
    local field = all[i]
    if field:sub(1, 2) == 'c:' then
      out[#out + 1] = field:sub(3)
      out[#out + 1] = all[i + 1]
    end
  end
  return out
end

-- Publishes one rig_rebooted event per unacked command of the older session `key`, in seq
-- order (control need not sort them); returns how many. The seq is the field's own text
-- (cjson would round a large one), so seqs compare as digit strings: shorter first, then by
-- text. The id comes from the command as sent.
local function report(prev, key)
  local cmds, n = unacked(key), 0
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
    local ok, cmd = pcall(cjson.decode, cmds[i + 1])
    local id = (ok and type(cmd) == 'table' and type(cmd.id) == 'string') and cmd.id or nil
    redis.call('PUBLISH', 'fleetlink:events', '{"type":"rig_rebooted","rig_id":'
        .. cjson.encode(rig) .. ',"boot_id":' .. cjson.encode(prev) .. ',"new_boot_id":'
        .. cjson.encode(boot) .. ',"seq":' .. seq .. ',"id":'
        .. (id and cjson.encode(id) or 'null') .. ',"broker_id":' .. cjson.encode(broker)
        .. ',"at":' .. cjson.encode(at) .. '}')
  end
  return n
end

local nxt = redis.pcall('HGET', sess, 'next')
if type(nxt) ~= 'string' then
  nxt = '0'
end
local recall = ''
if nxt ~= '0' then
  local r = redis.pcall('HGET', sess, 'r')
  if type(r) == 'string' then
    recall = r
  end
end
local cmds = unacked(sess)
local rebooted, previous = 0, ''
local prev = redis.pcall('GET', ptr)
if type(prev) == 'string' and prev:match(BOOT) and prev ~= boot then
  if newer(boot, prev) then
    previous = prev
    rebooted = report(prev, prefix .. prev)
    redis.call('DEL', prefix .. prev)
    redis.call('SET', ptr, boot, 'PX', ttl)
  end
else
  redis.call('SET', ptr, boot, 'PX', ttl)
end
if nxt == '0' then
  -- A new session: record it, so the same boot saying hello anywhere later resumes it. An "r"
  -- written after Redis had lost the session describes seqs of the session before: not this.
  redis.call('HSET', sess, 'next', '1')
  redis.call('HDEL', sess, 'r')
end
redis.call('PEXPIRE', sess, ttl)
return { nxt, cmds, rebooted, previous, recall }
