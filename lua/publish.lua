-- publish.lua: a broker's queued publishes (replies to control, events), sent so that a batch
-- reaches the channels once even when the connection that carried it is lost before its
-- answer. Run by EVALSHA from src/registry/fleet/once.rs.
--
-- Why: a Redis that hangs (SIGSTOP, a stalled disk) keeps a batch the broker gave up on in its
-- socket buffer and runs it when it wakes, while the broker sends the batch again on its next
-- connection: control saw the same reply twice (CONTRACT.md section 4 says once). So every
-- batch leaves a mark, and the broker asks for the mark before sending a batch again; and
-- every batch is fenced by the connection it came on, so one still waiting in Redis's buffer
-- when the broker asks never runs afterwards.
--
-- KEYS[1]  sentinel:<broker_id>|published   ("<instance>|<gen>|<n>": the process, its
--          connection count, its last batch to run; "|" is not allowed in a broker id, so
--          no broker's sentinel can be this key)
-- ARGV[1]  "publish" or "check"
-- ARGV[2]  instance: the broker process's random token
-- ARGV[3]  gen: decimal, this process's connection count, one more at each reconnect
-- ARGV[4]  n: decimal; publish: this batch's number; check: the number of the batch in doubt
-- ARGV[5]  ttl_ms of the mark: decimal integer, 1 to 15 digits
-- ARGV[6], ARGV[7], ... (publish only) channel, payload pairs, published in order
--
-- publish returns the number of publishes Redis refused (an ACL that does not let this user
-- publish to a reply_to, say): those are dropped, the rest went out. It returns -1, and
-- publishes nothing, when the mark names a later connection of this process: this batch was
-- given up on, and the broker has asked whether it ran and sent it again if not.
-- check returns 1 when batch n ran (the mark is this process's, at n or later), else 0; in
-- both cases it moves the mark to this connection, which fences every batch still on an
-- older one. If the mark cannot be written (Redis full: SET is refused for want of memory)
-- the batch still goes out; only the mark is missing, and a batch in doubt then is sent again.

local mode, instance, gen, n, ttl = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5]
local function count(s)
  return type(s) == 'string' and #s <= 15 and s:match('^%d+$') ~= nil
end
if (mode ~= 'publish' and mode ~= 'check') or type(instance) ~= 'string'
    or instance:find('|', 1, true) or not count(gen) or not count(n) or not count(ttl)
    or not ttl:match('^[1-9]') or (mode == 'check' and #ARGV ~= 5)
    or (mode == 'publish' and (#ARGV - 5) % 2 ~= 0) then
  return redis.error_reply('ERR fleetlink publish: expected mode, instance, gen, n, ttl_ms[, channel, payload...]')
end

-- The mark, if it is this process's: its gen and n. Anything else (none, another process's,
-- damage) counts as none.
local mark_gen, mark_n
local mark = redis.pcall('GET', KEYS[1])
if type(mark) == 'string' then
  local i, g, m = mark:match('^([^|]*)|(%d+)|(%d+)$')
  if i == instance and #g <= 15 and #m <= 15 then
    mark_gen, mark_n = tonumber(g), tonumber(m)
  end
end

if mode == 'check' then
  local ran = mark_n ~= nil and mark_n >= tonumber(n)
  local keep = mark_n or 0
  redis.pcall('SET', KEYS[1], instance .. '|' .. gen .. '|' .. string.format('%.0f', keep), 'PX', ttl)
  if ran then
    return 1
  end
  return 0
end

if mark_gen ~= nil and mark_gen > tonumber(gen) then
  return -1
end
redis.pcall('SET', KEYS[1], instance .. '|' .. gen .. '|' .. n, 'PX', ttl)
local refused = 0
for i = 6, #ARGV, 2 do
  local r = redis.pcall('PUBLISH', ARGV[i], ARGV[i + 1])
  if type(r) == 'table' and r.err then
    refused = refused + 1
  end
end
return refused
