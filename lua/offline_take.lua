-- offline_take.lua: take commands from the head of a rig's hold for its connection, as many
-- as it has room for (CONTRACT.md section 5): at most ARGV[1] of them and ARGV[2] bytes, but
-- always the first, however big, so that a rig with room for one is never stuck behind it.
-- Run by EVALSHA from src/registry/offline.rs, for a connection whose rig came back to more
-- held commands than it could take at once (offline_return.lua put the rest back).
--
-- KEYS[1]  offline:<rig_id>   (list of command entries, oldest first)
-- ARGV[1]  most entries: decimal integer, 1 or more
-- ARGV[2]  most bytes of entries: decimal integer
--
-- Returns {left, entry, entry, ...}: how many stay held, then those taken, oldest first.

local max, bytes = tonumber(ARGV[1]), tonumber(ARGV[2])
if #KEYS ~= 1 or #ARGV ~= 2 or not max or max < 1 or not bytes then
  return redis.error_reply('ERR fleetlink offline_take: expected KEYS list; ARGV max, max_bytes')
end
local head = redis.call('LRANGE', KEYS[1], 0, max - 1)
local taken, size = {}, 0
for i = 1, #head do
  size = size + #head[i]
  if i > 1 and size > bytes then
    break
  end
  taken[i] = head[i]
end
if #taken > 0 then
  redis.call('LTRIM', KEYS[1], #taken, -1)
end
local out = {redis.call('LLEN', KEYS[1])}
for i = 1, #taken do
  out[i + 1] = taken[i]
end
return out
