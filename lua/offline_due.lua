-- offline_due.lua: report the held commands whose deadlines an exiting broker handed to Redis
-- (CONTRACT.md section 5, docs/protocol.md "Commands for offline rigs"). Run by EVALSHA from
-- src/registry/offline.rs by every broker, once a second, behind lua/before_event.lua (which
-- guards its events against a full Redis).
--
-- The broker that held a command for an offline rig keeps its deadline, to report it
-- `expired` if the rig has not taken it by then. A broker that exits (a drain) before its
-- deadlines come hands them to Redis instead (the sorted set below, by deadline), where any
-- broker still running reports each as it comes due, as the holder would: removed from the
-- rig's list and published `expired` when it is still there; nothing when it is gone. Gone,
-- a hello took it (delivered, and reported so), or another broker that keeps a deadline for
-- the very same entry (one that put it back into the hold) expired and reported it. No mark is
-- read or left here: a mark says only that someone removed the entry, and the broker that
-- put it back, expiring it after this script, reads its answer 0 (taken) and reports nothing;
-- reading marks here reported such a command twice (review bb110). Each member is taken once:
-- the first broker to run this after its deadline has it.
--
-- KEYS[1]  offline:due:handed   (sorted set: score the deadline, unix ms; member
--                               "<rig_id>\n<entry>", the entry byte for byte as held in
--                               offline:<rig_id>)
-- ARGV[1]  this broker's id (the events' broker_id)
-- ARGV[2]  the events' "at": the broker's clock, RFC 3339
-- ARGV[3]  most members taken in this call: decimal integer, 1 to 15 digits
--
-- Returns {taken, reported}: the members taken, and how many of them were published
-- `expired`. A full `taken` means more may be due: the caller asks again at once.
-- Errors "ERR fleetlink offline_due: ..." on malformed ARGV, before any write.

local most = ARGV[3]
if #KEYS ~= 1 or #ARGV ~= 3 or not most:match('^[1-9]%d*$') or #most > 15 then
  return redis.error_reply('ERR fleetlink offline_due: expected KEYS due; ARGV broker_id, at, most')
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, tonumber(most))
local reported = 0
for _, member in ipairs(due) do
  redis.call('ZREM', KEYS[1], member)
  local cut = string.find(member, '\n', 1, true)
  if cut then
    local rig, entry = string.sub(member, 1, cut - 1), string.sub(member, cut + 1)
    -- pcall: a key of another type is none of ours; the command is then not there.
    local gone = redis.pcall('LREM', 'offline:' .. rig, 1, entry)
    if type(gone) == 'number' and gone > 0 then
      local decoded, cmd = pcall(cjson.decode, entry)
      local id = (decoded and type(cmd) == 'table' and type(cmd.id) == 'string') and cmd.id or nil
      before_event()
      redis.call('PUBLISH', 'fleetlink:events', '{"type":"expired","rig_id":' .. cjson.encode(rig)
          .. ',"id":' .. (id and cjson.encode(id) or 'null') .. ',"broker_id":'
          .. cjson.encode(ARGV[1]) .. ',"at":' .. cjson.encode(ARGV[2]) .. '}')
      reported = reported + 1
    end
  end
end
return { #due, reported }
