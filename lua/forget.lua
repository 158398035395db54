-- forget.lua: remove acked commands from their sessions where the seq may name another
-- command in Redis (CONTRACT.md section 5). Run by EVALSHA from src/registry/sessions.rs (behind
-- lua/before_event.lua, which guards its events against a full Redis), one
-- batch per call; rare: only for commands a broker delivered while it could not reach Redis,
-- and for commands it read back from Redis (a resume, or those another broker gave the rig),
-- since a copy put back later needs their marks (below); every other ack's removal is a plain
-- HDEL (fleet/writes.rs).
--
-- Such a command was numbered by its broker alone. Another broker that held the rig on Redis
-- meanwhile (the rig's other connection during a partition) may have kept a command of its
-- own under the same seq, which the rig never read: the rig holds this broker's command
-- there. A plain HDEL of the seq would delete that other command unreported, though control
-- was answered ok for it. Here it is published `lost` (as rekeep.lua does when a copy meets
-- it) and removed, so no resume gives it under a seq the rig holds with another command and
-- no later report names it again. The same command (same id) is removed without a word.
--
-- The seq is then marked acked, in "sess:<rig_id>:<boot_id>:acked" (a hash, seq -> the id of
-- this broker's command, kept for --session-ttl from the last mark): another broker's copy
-- of the session, put back after this removal (rekeep.lua, once Redis takes writes again),
-- may hold a command of its own under the seq, which no one would report while the rig stays
-- (review bb117). rekeep.lua publishes that one `lost` instead of writing it. Or the copy
-- holds this very command, as one it could not confirm Redis kept (the keep ran, its answer
-- was lost), found empty here: the mark tells rekeep.lua the rig acked it (review bb140).
-- The marks live
-- apart from the session, so they need no session (a boot whose hellos were all decided
-- while Redis was away has none yet: review bb118), and they lapse on their own rather than
-- growing the session for as long as its rig stays.
--
-- KEYS[i]       sess:<rig_id>:<boot_id>
-- ARGV[1]       this broker's id (the events' broker_id)
-- ARGV[2]       the events' "at": the broker's clock, RFC 3339
-- ARGV[3]       ttl_ms of the marks: decimal integer, 1 to 15 digits
-- ARGV[5i-1]    rig_id
-- ARGV[5i]      boot_id
-- ARGV[5i+1]    seq: decimal integer
-- ARGV[5i+2]    the id of the command this broker delivered under that seq
-- ARGV[5i+3]    "acked", or "doubtful": the rig acked the seq on another connection than the
--               one that wrote this command, so the ack may be another broker's command's
--               (the broker reported this one `lost`). Only this very command is removed then;
--               another there is left as it is, and the seq is not marked.
--
-- Returns the number of commands published `lost`.
-- Errors "ERR fleetlink forget: ..." on malformed ARGV, before any write.

local ttl = ARGV[3]
if #ARGV ~= 3 + 5 * #KEYS or type(ttl) ~= 'string' or #ttl > 15
    or not ttl:match('^[1-9]%d*$') then
  return redis.error_reply('ERR fleetlink forget: expected broker_id, at, ttl_ms, then rig_id, boot_id, seq, id, acked|doubtful per key')
end
for i = 1, #KEYS do
  local seq, how = ARGV[5 * i + 1], ARGV[5 * i + 3]
  if #seq > 15 or not seq:match('^%d+$') then
    return redis.error_reply('ERR fleetlink forget: seq must be a decimal integer')
  end
  if how ~= 'acked' and how ~= 'doubtful' then
    return redis.error_reply('ERR fleetlink forget: expected acked or doubtful')
  end
end

local function id_of(json)
  local decoded, cmd = pcall(cjson.decode, json)
  return (decoded and type(cmd) == 'table' and type(cmd.id) == 'string') and cmd.id or nil
end

local lost = 0
-- Marks keys this call checked, to set their TTL once at the end: a resume's acks of one
-- session come in one call, and TYPE and PEXPIRE per command were two of its five calls.
local marked = {}
for i = 1, #KEYS do
  local sess, seq, id = KEYS[i], ARGV[5 * i + 1], ARGV[5 * i + 2]
  local acked = ARGV[5 * i + 3] == 'acked'
  local field = 'c:' .. seq
  -- pcall: a key of another type is no session of ours (persist.lua deletes it at the next
  -- keep); there is nothing here to remove.
  local there = redis.pcall('HGET', sess, field)
  local reported = nil
  if type(there) == 'string' then
    local other = id_of(there)
    if other ~= id and acked then
      reported = other or ''
      lost = lost + 1
      before_event()
      redis.call('PUBLISH', 'fleetlink:events', '{"type":"lost","rig_id":'
          .. cjson.encode(ARGV[5 * i - 1]) .. ',"boot_id":' .. cjson.encode(ARGV[5 * i])
          .. ',"seq":' .. seq .. ',"id":' .. (other and cjson.encode(other) or 'null')
          .. ',"broker_id":' .. cjson.encode(ARGV[1]) .. ',"at":' .. cjson.encode(ARGV[2])
          .. ',"detail":"its seq went to another command, which the rig holds, while the rig\'s '
          .. 'brokers could not reach Redis; the rig may not have run it: send it again if no '
          .. 'result for it came"}')
    end
    if other == id or acked then
      redis.call('HDEL', sess, field)
    end
  end
  if acked then
    -- A key of another type where the marks belong holds none of ours: it goes.
    local marks = sess .. ':acked'
    if not marked[marks] then
      local kind = redis.call('TYPE', marks).ok
      if kind ~= 'none' and kind ~= 'hash' then
        redis.call('DEL', marks)
      end
      marked[marks] = true
    end
    redis.call('HSET', marks, seq, id)
    -- The report too, as rekeep.lua records its own: a copy of the other broker's holding
    -- that command, put back later, would report it a second time.
    if reported then
      redis.call('HSET', marks, 'l' .. seq .. ':' .. reported, '1')
    end
  end
end
for marks in pairs(marked) do
  redis.call('PEXPIRE', marks, ttl)
end
return lost
